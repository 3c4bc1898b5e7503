{{/* The containers of a replica and the pod settings around them, shared by the Deployment and the
     LeaderWorkerSet. Each service runs in a container of its own (the images docker/ builds), so
     the kubelet probes and restarts each one alone: a worker that dies restarts while the
     scheduler beside it holds its requests. */}}

{{- define "nanoserve.tlsDir" -}}/etc/nanoserve/tls{{- end -}}

{{/* The Secret-backed token both ends of the Worker API read (--worker-token). */}}
{{- define "nanoserve.workerTokenEnv" -}}
- name: NANOSERVE_WORKER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "nanoserve.workerTokenSecret" . }}
      key: {{ .Values.workerToken.key }}
{{- end -}}

{{- define "nanoserve.modelMount" -}}
- name: models
  mountPath: /models
  readOnly: true
{{- if .Values.tls.workerSecret }}
- name: tls
  mountPath: {{ include "nanoserve.tlsDir" . }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* Fetches the model into the cache before the services start (hf download skips files it has). */}}
{{- define "nanoserve.downloadInitContainer" -}}
- name: download
  image: {{ include "nanoserve.image" (dict "root" . "image" .Values.image.worker) }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: [hf, download]
  args:
    - {{ .Values.model.name | quote }}
    - --local-dir
    - {{ include "nanoserve.modelDir" . | quote }}
    {{- with .Values.model.revision }}
    - --revision
    - {{ . | quote }}
    {{- end }}
  env:
    - name: HF_HOME   # the Hub's cache and lock files, on the volume the download writes
      value: /models/.hf-home
    {{- with .Values.model.download.hfTokenSecret.name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $.Values.model.download.hfTokenSecret.key }}
    {{- end }}
  volumeMounts:
    - name: models
      mountPath: /models
{{- end -}}

{{/* A gRPC health probe of a worker: the kubelet's own, or the nanoserve probe where the port
     serves TLS (the kubelet's gRPC probe speaks plaintext only). */}}
{{- define "nanoserve.workerProbe" -}}
{{- if .Values.tls.workerSecret -}}
exec:
  command: [python, -m, nanoserve.healthcheck, --address, "127.0.0.1:{{ include "nanoserve.workerPort" . }}",
            --tls-ca-file, {{ include "nanoserve.tlsDir" . }}/ca.crt,
            --tls-cert-file, {{ include "nanoserve.tlsDir" . }}/tls.crt,
            --tls-key-file, {{ include "nanoserve.tlsDir" . }}/tls.key]
timeoutSeconds: 5
{{- else -}}
grpc:
  port: {{ include "nanoserve.workerPort" . }}
{{- end -}}
{{- end -}}

{{/* One tensor-parallel rank. In a LeaderWorkerSet its rank, group size and meeting point come from
     the variables the LeaderWorkerSet controller sets in every container. */}}
{{- define "nanoserve.workerContainer" -}}
{{- $root := .root -}}
{{- $values := $root.Values -}}
- name: worker
  image: {{ include "nanoserve.image" (dict "root" $root "image" $values.image.worker) }}
  imagePullPolicy: {{ $values.image.pullPolicy }}
  args:
    - worker
    - --host
    - 0.0.0.0
    - --port
    - {{ include "nanoserve.workerPort" $root | quote }}
    - --model
    - {{ include "nanoserve.modelDir" $root | quote }}
    # on SIGTERM the rank stays until its scheduler lets go of it (the scheduler drains meanwhile)
    - --shutdown-timeout
    - {{ $values.shutdownTimeout | quote }}
    {{- if .multiHost }}
    - --rank
    - $(LWS_WORKER_INDEX)
    - --tensor-parallel-size
    - $(LWS_GROUP_SIZE)
    - --dist-init-addr
    - $(LWS_LEADER_ADDRESS):{{ $values.leaderWorkerSet.distInitPort }}
    {{- end }}
    {{- if $values.tls.workerSecret }}
    - --tls-cert-file
    - {{ include "nanoserve.tlsDir" $root }}/tls.crt
    - --tls-key-file
    - {{ include "nanoserve.tlsDir" $root }}/tls.key
    - --tls-ca-file
    - {{ include "nanoserve.tlsDir" $root }}/ca.crt
    {{- end }}
    {{- with include "nanoserve.flagArgs" (list $values.engine $values.worker.flags) | trim }}
    {{- . | nindent 4 }}
    {{- end }}
  env:
    {{- include "nanoserve.workerTokenEnv" $root | nindent 4 }}
    {{- with $values.worker.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: worker
      containerPort: {{ include "nanoserve.workerPort" $root }}
    {{- if .multiHost }}
    - name: dist-init
      containerPort: {{ $values.leaderWorkerSet.distInitPort }}
    {{- end }}
  # SERVING once the rank has loaded its shard; loading a large model takes minutes.
  startupProbe:
    {{- include "nanoserve.workerProbe" $root | nindent 4 }}
    periodSeconds: 10
    failureThreshold: {{ div $values.worker.startupSeconds 10 }}
  livenessProbe:
    {{- include "nanoserve.workerProbe" $root | nindent 4 }}
    periodSeconds: 10
    failureThreshold: 3
  resources:
    {{- toYaml $values.worker.resources | nindent 4 }}
  volumeMounts:
    {{- include "nanoserve.modelMount" $root | nindent 4 }}
    - name: dshm
      mountPath: /dev/shm
{{- end -}}

{{/* The scheduler: the public gRPC API, driving `workers` (host:port, comma-separated, in rank order). */}}
{{- define "nanoserve.schedulerContainer" -}}
{{- $root := .root -}}
{{- $values := $root.Values -}}
{{- $port := include "nanoserve.schedulerPort" $root -}}
- name: scheduler
  image: {{ include "nanoserve.image" (dict "root" $root "image" $values.image.server) }}
  imagePullPolicy: {{ $values.image.pullPolicy }}
  args:
    - scheduler
    - --host
    - 0.0.0.0
    - --port
    - {{ $port | quote }}
    - --workers
    - {{ .workers | quote }}
    # wait for the workers as long as the kubelet waits for them to load
    - --worker-connect-timeout
    - {{ $values.worker.startupSeconds | quote }}
    - --metrics-port
    - {{ $values.scheduler.metricsPort | quote }}
    - --shutdown-timeout
    - {{ $values.shutdownTimeout | quote }}
    {{- if $values.tls.workerSecret }}
    - --worker-tls-ca-file
    - {{ include "nanoserve.tlsDir" $root }}/ca.crt
    - --worker-tls-cert-file
    - {{ include "nanoserve.tlsDir" $root }}/tls.crt
    - --worker-tls-key-file
    - {{ include "nanoserve.tlsDir" $root }}/tls.key
    {{- end }}
    {{- with include "nanoserve.flagArgs" (list $values.engine $values.scheduler.flags) | trim }}
    {{- . | nindent 4 }}
    {{- end }}
  env:
    {{- include "nanoserve.workerTokenEnv" $root | nindent 4 }}
    {{- with .env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: grpc
      containerPort: {{ $port }}
    {{- if $values.scheduler.metricsPort }}
    - name: scheduler-metrics
      containerPort: {{ $values.scheduler.metricsPort }}
    {{- end }}
  # SERVING once every worker rank has connected.
  startupProbe:
    grpc:
      port: {{ $port }}
    periodSeconds: 10
    failureThreshold: {{ div $values.worker.startupSeconds 10 }}
  # Ready only while SERVING: a replica whose worker group is being rebuilt, or that is draining,
  # leaves the Services while it holds or finishes its requests.
  readinessProbe:
    grpc:
      port: {{ $port }}
    periodSeconds: 5
  # Alive while the process answers: "liveness" stays SERVING through a worker recovery and a drain.
  livenessProbe:
    grpc:
      port: {{ $port }}
      service: liveness
    periodSeconds: 10
    failureThreshold: 3
  resources:
    {{- toYaml $values.scheduler.resources | nindent 4 }}
  volumeMounts:
    {{- include "nanoserve.modelMount" $root | nindent 4 }}
{{- end -}}

{{/* The OpenAI-compatible HTTP API in front of the scheduler beside it. */}}
{{- define "nanoserve.gatewayContainer" -}}
{{- $port := include "nanoserve.openaiPort" . -}}
- name: gateway
  image: {{ include "nanoserve.image" (dict "root" . "image" .Values.image.server) }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args:
    - gateway
    - --host
    - 0.0.0.0
    - --port
    - {{ $port | quote }}
    - --scheduler
    - 127.0.0.1:{{ include "nanoserve.schedulerPort" . }}
    - --served-model-name
    - {{ .Values.model.servedModelName | default .Values.model.name | quote }}
    - --shutdown-timeout
    - {{ .Values.shutdownTimeout | quote }}
    {{- with include "nanoserve.flagArgs" (list .Values.gateway.flags) | trim }}
    {{- . | nindent 4 }}
    {{- end }}
  ports:
    - name: http
      containerPort: {{ $port }}
  # 200 while the gateway is up and its scheduler SERVING (no liveness probe: /health follows the
  # scheduler, and restarting the gateway would not bring a worker back).
  readinessProbe:
    httpGet:
      path: /health
      port: http
    periodSeconds: 5
  resources:
    {{- toYaml .Values.gateway.resources | nindent 4 }}
  volumeMounts:
    {{- include "nanoserve.modelMount" . | nindent 4 }}
{{- end -}}

{{/* Pod-level settings of every nanoserve pod; the images run as user 10001. */}}
{{- define "nanoserve.podSettings" -}}
automountServiceAccountToken: false
terminationGracePeriodSeconds: {{ include "nanoserve.terminationGracePeriodSeconds" . }}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  - name: models
    {{- if eq .Values.modelCache.type "persistentVolumeClaim" }}
    persistentVolumeClaim:
      claimName: {{ include "nanoserve.modelClaim" . }}
    {{- else }}
    emptyDir:
      sizeLimit: {{ .Values.modelCache.emptyDir.sizeLimit }}
    {{- end }}
  - name: dshm
    emptyDir:
      medium: Memory
      sizeLimit: {{ .Values.worker.shmSizeLimit }}
  {{- with .Values.tls.workerSecret }}
  - name: tls
    secret:
      secretName: {{ . }}
      defaultMode: 0440
  {{- end }}
{{- end -}}
