{{/* The release's name for its objects, at most 63 characters. */}}
{{- define "prefixgate.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The labels of one component's objects (prefixgate, redis or vllm): its selector's and the release's. */}}
{{- define "prefixgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
app.kubernetes.io/part-of: prefixgate
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{ include "prefixgate.selector" . }}
{{- end -}}

{{/* Selector labels of one component: prefixgate, redis or vllm. */}}
{{- define "prefixgate.selector" -}}
app.kubernetes.io/name: {{ .component }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end -}}

{{- define "prefixgate.redisName" -}}{{ include "prefixgate.fullname" . | trunc 57 }}-redis{{- end -}}
{{- define "prefixgate.vllmName" -}}{{ include "prefixgate.fullname" . | trunc 58 }}-vllm{{- end -}}

{{/* The ranks prefixgate routes to: the in-chart vLLM pods, or .Values.ranks. */}}
{{- define "prefixgate.backends" -}}
{{- $backends := list -}}
{{- if .Values.vllm.enabled -}}
{{- $name := include "prefixgate.vllmName" . -}}
{{- range $i := until (int .Values.vllm.replicas) -}}
{{- $backends = append $backends (dict "name" (printf "vllm-%d" $i) "url" (printf "http://%s-%d.%s:%d" $name $i $name (int $.Values.vllm.port))) -}}
{{- end -}}
{{- else -}}
{{- $backends = .Values.ranks -}}
{{- end -}}
{{- if not $backends -}}
{{- fail "no ranks: list them in ranks, or set vllm.enabled" -}}
{{- end -}}
{{- toYaml $backends -}}
{{- end -}}

{{/* The kv_events setting, or nothing when the events are off. */}}
{{- define "prefixgate.kvEvents" -}}
{{- $mode := .Values.kvEvents.mode -}}
{{- $endpoints := .Values.kvEvents.endpoints -}}
{{- if and .Values.vllm.enabled (ne $mode "off") (not $endpoints) -}}
{{- $name := include "prefixgate.vllmName" . -}}
{{- $v := .Values.vllm -}}
{{- $specs := list -}}
{{- range $i := until (int $v.replicas) -}}
{{- $host := printf "%s-%d.%s" $name $i $name -}}
{{- $specs = append $specs (printf "vllm-%d=tcp://%s:%d|tcp://%s:%d" $i $host (int $v.kvEventsPort) $host (int $v.kvReplayPort)) -}}
{{- end -}}
{{- join "," $specs -}}
{{- else if eq $mode "auto" -}}
auto
{{- else if eq $mode "endpoints" -}}
{{- if not $endpoints -}}
{{- fail "kvEvents.mode endpoints needs kvEvents.endpoints (rank name -> tcp://HOST:PORT)" -}}
{{- end -}}
{{- $specs := list -}}
{{- range $rank, $endpoint := $endpoints -}}
{{- $specs = append $specs (printf "%s=%s" $rank $endpoint) -}}
{{- end -}}
{{- join "," $specs -}}
{{- end -}}
{{- end -}}

{{/* The Redis URL written in the config file (a URL from a Secret comes through the environment). */}}
{{- define "prefixgate.redisUrl" -}}
{{- if eq .Values.redis.mode "internal" -}}
{{- printf "redis://%s:6379/0" (include "prefixgate.redisName" .) -}}
{{- else if and (eq .Values.redis.mode "external") (not .Values.redis.urlSecret.name) -}}
{{- required "redis.mode external needs redis.url or redis.urlSecret.name" .Values.redis.url -}}
{{- end -}}
{{- end -}}
