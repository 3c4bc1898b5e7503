{{/* llm-d's EndpointPickerConfig for a pool of nanoserve replicas: queue, KV-cache and prefix-cache
     scorers (llm-d's defaults), the metrics scraped from each pod's /metrics (the gateway's port, the
     pool's target port) and read through nanoserve's engine mapping, shipped in deploy/llm-d/. */}}
{{- define "nanoserve.eppConfig" -}}
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: metrics-data-source
  parameters:
    scheme: http
    path: /metrics
{{- list (.Files.Get "files/llm-d-engine.yaml" | fromYaml) | toYaml | nindent 0 }}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
{{- end -}}
