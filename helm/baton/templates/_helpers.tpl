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

{{/* The roles whose pods speak baton's internal gRPC (baton_operator.spec.MTLS_ROLES). */}}
{{- define "baton.mtls.roles" -}}
gateway prefill decode
{{- end -}}

{{/*
Where the internal certificates come from: insecure, secret (mtls.secretName),
certManager, or generated (the default, when none is set). Two at once fail.
*/}}
{{- define "baton.mtls.source" -}}
{{- $chosen := list -}}
{{- if .Values.mtls.insecure -}}{{- $chosen = append $chosen "insecure" -}}{{- end -}}
{{- if .Values.mtls.secretName -}}{{- $chosen = append $chosen "secret" -}}{{- end -}}
{{- if dig "certManager" "enabled" false .Values.mtls -}}{{- $chosen = append $chosen "certManager" -}}{{- end -}}
{{- if gt (len $chosen) 1 -}}
{{- fail (printf "mtls: set one of insecure, secretName and certManager.enabled, not %s" (join " and " $chosen)) -}}
{{- end -}}
{{- default "generated" (first $chosen) -}}
{{- end -}}

{{/* The Secret a role's pods mount when the chart issues the certificates. */}}
{{- define "baton.mtls.roleSecret" -}}
{{- printf "%s-baton-mtls-%s" .top.Release.Name .role -}}
{{- end -}}

{{/* spec.mtls of the BatonService the chart creates. */}}
{{- define "baton.mtls.spec" -}}
{{- $source := include "baton.mtls.source" . -}}
{{- if eq $source "insecure" -}}
insecure: true
{{- else if eq $source "secret" -}}
secretName: {{ .Values.mtls.secretName }}
{{- else -}}
secretNames:
{{- range $role := splitList " " (include "baton.mtls.roles" .) }}
  {{ $role }}: {{ include "baton.mtls.roleSecret" (dict "top" $ "role" $role) }}
{{- end }}
{{- end -}}
{{- end -}}
