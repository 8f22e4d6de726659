{{/*
Object names: DPF's contract wants {{ .Release.Name }} in every name, so that several
releases (versions) of the service can live in one namespace.
*/}}
{{- define "ctxmem.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ctxmem.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ctxmem.labels" -}}
{{ include "ctxmem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: context-memory
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "ctxmem.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-arm64" .Chart.AppVersion) -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{- define "ctxmem.keySecretName" -}}
{{- if .Values.masterKey.create -}}
{{- printf "%s-master-key" (include "ctxmem.fullname" .) -}}
{{- else -}}
{{- required "masterKey.existingSecret is required (or masterKey.create)" .Values.masterKey.existingSecret -}}
{{- end -}}
{{- end -}}

{{/*
Consistency checks between the service config and the pod spec; fail the render early
rather than ship a pod whose probes or key mount miss the service.
*/}}
{{- define "ctxmem.checks" -}}
{{- $cfg := .Values.config -}}
{{- $metrics := (($cfg.metrics | default dict).listen | default "") | toString -}}
{{- if not (hasSuffix (printf ":%v" .Values.ports.metrics) $metrics) -}}
{{- fail (printf "config.metrics.listen (%q) must use ports.metrics (%v): the probes and scrape annotations point there" $metrics .Values.ports.metrics) -}}
{{- end -}}
{{- $enc := $cfg.encryption | default dict -}}
{{- if and $enc.enabled $enc.key_file -}}
{{- if ne "/etc/ctxmem/keys/master.key" ($enc.key_file | toString) -}}
{{- fail (printf "config.encryption.key_file (%q) must be /etc/ctxmem/keys/master.key, where the Secret's key is mounted (a plain file: subPath)" $enc.key_file) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.masterKey.create (not .Values.masterKey.value) -}}
{{- fail "masterKey.create needs masterKey.value (64 hex characters)" -}}
{{- end -}}
{{- end -}}
