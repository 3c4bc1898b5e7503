{{/* Names, labels and the small values every template shares. */}}

{{- define "nanoserve.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-nanoserve, or the release name alone when it already says nanoserve. */}}
{{- define "nanoserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "nanoserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "nanoserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "nanoserve.labels" -}}
{{ include "nanoserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The pods that serve the APIs (a Deployment pod, a LeaderWorkerSet leader): what the Services,
     SMG's discovery and the InferencePool select. */}}
{{- define "nanoserve.serverSelectorLabels" -}}
{{ include "nanoserve.selectorLabels" . }}
app.kubernetes.io/component: server
{{- end -}}

{{/* Labels of every nanoserve pod: llm-d's endpoint picker reads the engine type to know the
     metric names of the pod's /metrics. */}}
{{- define "nanoserve.podLabels" -}}
{{ include "nanoserve.labels" . }}
llm-d.ai/engine-type: nanoserve
{{- with .Values.podLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* repository:tag of an image's values (`image`); an empty tag is the chart's appVersion. */}}
{{- define "nanoserve.image" -}}
{{- printf "%s:%s" .image.repository (.image.tag | default .root.Chart.AppVersion) -}}
{{- end -}}

{{- define "nanoserve.modelDir" -}}
/models/{{ .Values.model.name }}
{{- end -}}

{{- define "nanoserve.modelClaim" -}}
{{- .Values.modelCache.persistentVolumeClaim.existingClaim | default (printf "%s-models" (include "nanoserve.fullname" .)) -}}
{{- end -}}

{{- define "nanoserve.workerTokenSecret" -}}
{{- .Values.workerToken.existingSecret | default (printf "%s-worker-token" (include "nanoserve.fullname" .)) -}}
{{- end -}}

{{/* SIGTERM starts the drain; the kubelet's SIGKILL must come after it has had its time. */}}
{{- define "nanoserve.terminationGracePeriodSeconds" -}}
{{- add .Values.shutdownTimeout .Values.terminationMarginSeconds -}}
{{- end -}}

{{/* Ports, fixed inside the pod: nanoserve's defaults (proto/nanoserve/flags.py). */}}
{{- define "nanoserve.workerPort" -}}50061{{- end -}}
{{- define "nanoserve.schedulerPort" -}}50051{{- end -}}
{{- define "nanoserve.openaiPort" -}}8000{{- end -}}
{{/* llm-d's endpoint picker: the ext-proc gRPC port gateways call. */}}
{{- define "nanoserve.eppPort" -}}9002{{- end -}}

{{/* Maps of flags as command-line words, one list item a word: {maxNumSeqs: 64, enforceEager: true}
     gives --max-num-seqs 64 --enforce-eager; false gives --no-<flag>. Keys come out sorted. */}}
{{- define "nanoserve.flagArgs" -}}
{{- range $flags := . }}
{{- range $name, $value := $flags }}
{{- if kindIs "bool" $value }}
- {{ printf "--%s%s" (ternary "" "no-" $value) (kebabcase $name) | quote }}
{{- else }}
- {{ printf "--%s" (kebabcase $name) | quote }}
- {{ include "nanoserve.number" $value | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Helm reads every number as a float: whole ones print as integers (8388608, not 8.388608e+06). */}}
{{- define "nanoserve.number" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) -}}
{{- int64 . -}}
{{- else -}}
{{- toString . -}}
{{- end -}}
{{- end -}}
