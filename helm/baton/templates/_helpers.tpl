{{/* The operator's resource names: <release>-baton-operator, cut to 63 characters. */}}
{{- define "baton.operatorName" -}}
{{- printf "%s-baton-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "baton.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "baton.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "baton.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Namespaces the operator acts in; the release namespace when none are listed. */}}
{{- define "baton.watchNamespaces" -}}
{{- if .Values.operator.watchNamespaces -}}
{{- join "," .Values.operator.watchNamespaces -}}
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{- define "baton.labels" -}}
app.kubernetes.io/name: baton
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The restricted Pod Security profile, shared by every container the chart runs. */}}
{{- define "baton.containerSecurityContext" -}}
runAsNonRoot: true
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* A NetworkPolicy peer: pods of one role of the default BatonService. */}}
{{- define "baton.rolePeer" -}}
- podSelector:
    matchLabels:
      baton.dev/service: {{ .service }}
      baton.dev/role: {{ .role }}
{{- end -}}
