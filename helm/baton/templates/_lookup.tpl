{{/*
The chart's one read of the cluster: a Secret as JSON ({} when there is none, and
always when rendering offline, e.g. `helm template`). In a file of its own so that
tests can stand in for the cluster.
*/}}
{{- define "baton.lookupSecret" -}}
{{- lookup "v1" "Secret" .namespace .name | toJson -}}
{{- end -}}
