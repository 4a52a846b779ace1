{{/* Hand-written. The other templates are generated from deploy/base (scripts/generate_helm_chart.py). */}}

{{- define "gpupool.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}
{{- end -}}

{{- define "gpupool.natsImage" -}}
{{- if .Values.nats.image.digest -}}
{{ .Values.nats.image.repository }}@{{ .Values.nats.image.digest }}
{{- else -}}
{{ .Values.nats.image.repository }}:{{ .Values.nats.image.tag }}
{{- end -}}
{{- end -}}

{{/* The services' NATS: the bundled cluster, or the existing one (its URL or a Secret's). */}}
{{- define "gpupool.natsUrl" -}}
{{- if .Values.nats.bundled -}}
tls://gpupool-nats:4222
{{- else if .Values.nats.existing.url -}}
{{ .Values.nats.existing.url }}
{{- else if .Values.nats.existing.urlSecret.name -}}
nats://from-secret.invalid:4222
{{- else -}}
{{ fail "nats.bundled is false: set nats.existing.url or nats.existing.urlSecret.name" }}
{{- end -}}
{{- end -}}

{{/* Part of the settings ConfigMap's name: a change of settings rolls the pods (as kustomize's hash does). */}}
{{- define "gpupool.settingsHash" -}}
{{- printf "%s|%s|%v|%s" (include "gpupool.natsUrl" .) .Values.stream .Values.nats.streamReplicas .Values.policy.defaultQosConfig | sha256sum | trunc 10 -}}
{{- end -}}
