{{/* ---------------------------------------------------------------------------------------------
The vLLM command line (vLLM 0.32 flag names) and the engine environment.
Call with (dict "root" $ "model" $modelSpec).
--------------------------------------------------------------------------------------------- */}}

{{- define "vllm-stack.engine.args" -}}
{{- $root := .root -}}
{{- $m := .model -}}
{{- $vc := $m.vllmConfig | default dict -}}
{{- $args := list ($m.modelURL | default $m.name) "--host" "0.0.0.0" "--port" (toString $root.Values.servingEngineSpec.containerPort) "--served-model-name" (include "vllm-stack.model.servedName" .) -}}
{{- range $key, $flag := dict "enablePrefixCaching" "enable-prefix-caching" "enableChunkedPrefill" "enable-chunked-prefill" "enforceEager" "enforce-eager" "trustRemoteCode" "trust-remote-code" -}}
{{- if hasKey $vc $key -}}
{{- $args = append $args (printf "--%s%s" (ternary "" "no-" (get $vc $key)) $flag) -}}
{{- end -}}
{{- end -}}
{{- range $key, $flag := dict "runner" "runner" "convert" "convert" "maxModelLen" "max-model-len" "dtype" "dtype" "tensorParallelSize" "tensor-parallel-size" "pipelineParallelSize" "pipeline-parallel-size" "maxNumSeqs" "max-num-seqs" "maxNumBatchedTokens" "max-num-batched-tokens" "gpuMemoryUtilization" "gpu-memory-utilization" "quantization" "quantization" "kvCacheDtype" "kv-cache-dtype" -}}
{{- if and (hasKey $vc $key) (not (kindIs "invalid" (get $vc $key))) -}}
{{- $args = append (append $args (printf "--%s" $flag)) (include "vllm-stack.str" (get $vc $key)) -}}
{{- end -}}
{{- end -}}
{{- /* LoRA: production-stack files give only maxLoras; vLLM ignores it without --enable-lora. */ -}}
{{- if or $vc.enableLoRA $m.enableLoRA $vc.maxLoras $vc.loraModules (include "vllm-stack.model.hasAdapters" .) -}}
{{- $args = append $args "--enable-lora" -}}
{{- with $vc.maxLoras }}{{ $args = append (append $args "--max-loras") (include "vllm-stack.str" .) }}{{ end -}}
{{- with $vc.maxLoraRank }}{{ $args = append (append $args "--max-lora-rank") (include "vllm-stack.str" .) }}{{ end -}}
{{- with $vc.maxCpuLoras }}{{ $args = append (append $args "--max-cpu-loras") (include "vllm-stack.str" .) }}{{ end -}}
{{- range $vc.loraModules }}{{ $args = append (append $args "--lora-modules") (printf "%s=%s" .name .path) }}{{ end -}}
{{- end -}}
{{- with $m.modelRevision }}{{ $args = append (append $args "--revision") . }}{{ end -}}
{{- if $m.enableTool }}{{ $args = append $args "--enable-auto-tool-choice" }}{{ end -}}
{{- with $m.toolCallParser }}{{ $args = append (append $args "--tool-call-parser") . }}{{ end -}}
{{- with (include "vllm-stack.engine.chatTemplatePath" .) }}{{ $args = append (append $args "--chat-template") . }}{{ end -}}
{{- if eq (include "vllm-stack.kvEvents.enabled" $root) "true" -}}
{{- $kv := dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (printf "tcp://*:%d" (int $root.Values.servingEngineSpec.kvEvents.port)) -}}
{{- with $root.Values.servingEngineSpec.kvEvents.replayPort }}{{ $_ := set $kv "replay_endpoint" (printf "tcp://*:%d" (int .)) }}{{ end -}}
{{- $args = append (append $args "--kv-events-config") (toJson $kv) -}}
{{- end -}}
{{- /* The engine's cached-token count per request: the router's predicted-versus-actual hit metric. */ -}}
{{- if and (eq (include "vllm-stack.router.prefixAware" $root) "true") (not (has "--enable-prompt-tokens-details" ($vc.extraArgs | default list))) -}}
{{- $args = append $args "--enable-prompt-tokens-details" -}}
{{- end -}}
{{- if eq (include "vllm-stack.model.lmcacheEnabled" .) "true" -}}
{{- /* kv_role follows the model's role (its pd.role, or production-stack's kvRole, when `role` is not given). */ -}}
{{- $role := get (dict "prefill" "kv_producer" "decode" "kv_consumer" "both" "kv_both") (include "vllm-stack.model.role" .) -}}
{{- $args = append (append $args "--kv-transfer-config") (toJson (dict "kv_connector" "LMCacheConnectorV1" "kv_role" $role)) -}}
{{- end -}}
{{- /* modelSpec.schedulingPolicy, unless extraArgs gives --scheduling-policy itself (then once, as written). */ -}}
{{- $policy := include "vllm-stack.model.schedulingPolicy" . -}}
{{- if and $policy (not (include "vllm-stack.model.extraArgsSchedulingPolicy" .)) -}}
{{- $args = append (append $args "--scheduling-policy") $policy -}}
{{- end -}}
{{- range $vc.extraArgs }}{{ $args = append $args (include "vllm-stack.str" .) }}{{ end -}}
{{- toYaml $args -}}
{{- end -}}

{{/* A Secret reference for a value that is either a literal (stored in the chart's Secret under
     `key`) or {secretName, secretKey}. Call with (dict "root" $ "value" V "key" K). */}}
{{- define "vllm-stack.secretKeyRef" -}}
{{- if kindIs "map" .value -}}
secretKeyRef:
  name: {{ .value.secretName }}
  key: {{ .value.secretKey }}
{{- else -}}
secretKeyRef:
  name: {{ include "vllm-stack.secret.fullname" .root }}
  key: {{ .key }}
{{- end -}}
{{- end -}}

{{- define "vllm-stack.engine.lmcacheEnv" -}}
{{- $root := .root -}}
{{- $lc := .model.lmcacheConfig -}}
- name: LMCACHE_TRACK_USAGE
  value: "false"
{{- with $lc.logLevel }}
- name: LMCACHE_LOG_LEVEL
  value: {{ . | quote }}
{{- end }}
{{- with $lc.chunkSize }}
- name: LMCACHE_CHUNK_SIZE
  value: {{ . | quote }}
{{- end }}
- name: LMCACHE_LOCAL_CPU
  value: {{ ternary "true" "false" (and (not (kindIs "invalid" $lc.cpuOffloadingBufferSize)) (ne (toString $lc.cpuOffloadingBufferSize) "0") (ne (toString $lc.cpuOffloadingBufferSize) "")) | quote }}
{{- with $lc.cpuOffloadingBufferSize }}
- name: LMCACHE_MAX_LOCAL_CPU_SIZE
  value: {{ include "vllm-stack.str" . | quote }}
{{- end }}
{{- with $lc.diskOffloadingBufferSize }}
- name: LMCACHE_LOCAL_DISK
  value: {{ printf "file://%s/" (trimSuffix "/" ($lc.diskPath | default "/lmcache/disk")) | quote }}
- name: LMCACHE_MAX_LOCAL_DISK_SIZE
  value: {{ include "vllm-stack.str" . | quote }}
{{- end }}
{{- $remote := $lc.remoteUrl -}}
{{- if and (not $remote) (eq (include "vllm-stack.cacheserver.enabled" $root) "true") -}}
{{- $remote = printf "lm://%s:%d" (include "vllm-stack.cacheserver.fullname" $root) (int $root.Values.cacheserverSpec.servicePort) -}}
{{- end }}
{{- with $remote }}
- name: LMCACHE_REMOTE_URL
  value: {{ . | quote }}
- name: LMCACHE_REMOTE_SERDE
  value: {{ $lc.remoteSerde | default $root.Values.cacheserverSpec.serde | quote }}
{{- end }}
{{- /* The LMCache controller: the chart's (lmcache-controller.yaml, deployed for routingLogic kvaware or
     lmcacheControllerSpec.enabled), or one of your own (controllerPullUrl / controllerReplyUrl). production-stack
     spells the chart's as ports on its own router (controllerPort / controllerReplyPort): without the chart's
     controller that spelling leaves the controller off (NOTES says so) instead of pointing the engines at an
     address nothing answers. */}}
{{- $own := eq (include "vllm-stack.model.chartController" .) "true" }}
{{- $ctlPorts := include "vllm-stack.controller.ports" $root | fromYaml }}
{{- $ctl := or $own (and $lc.enableController (or $lc.controllerPullUrl (not $lc.controllerPort))) }}
{{- if $ctl }}
- name: LMCACHE_ENABLE_CONTROLLER
  value: "true"
{{- /* The pod name: the engine name the router's Kubernetes discovery gives it, so the router maps the
     controller's answer (an instance id) to an engine. */}}
- name: LMCACHE_LMCACHE_INSTANCE_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- if $own }}
- name: LMCACHE_CONTROLLER_PULL_URL
  value: {{ printf "%s:%d" (include "vllm-stack.controller.fullname" $root) (int $ctlPorts.pull) | quote }}
- name: LMCACHE_CONTROLLER_REPLY_URL
  value: {{ printf "%s:%d" (include "vllm-stack.controller.fullname" $root) (int $ctlPorts.reply) | quote }}
{{- else }}
- name: LMCACHE_CONTROLLER_PULL_URL
  value: {{ required "lmcacheConfig.controllerPullUrl is required with enableController" $lc.controllerPullUrl | quote }}
- name: LMCACHE_CONTROLLER_REPLY_URL
  value: {{ required "lmcacheConfig.controllerReplyUrl is required with enableController" $lc.controllerReplyUrl | quote }}
{{- end }}
{{- with $lc.workerHeartbeatTime }}
- name: LMCACHE_LMCACHE_WORKER_HEARTBEAT_TIME
  value: {{ include "vllm-stack.str" . | quote }}
{{- end }}
{{- end }}
{{- with (include "vllm-stack.model.workerPorts" (dict "root" $root "model" .model "controller" $ctl)) }}
- name: LMCACHE_LMCACHE_WORKER_PORTS
  value: {{ . | quote }}
{{- end }}
{{- if $lc.enableP2P }}
- name: LMCACHE_ENABLE_P2P
  value: "true"
{{- end }}
{{- if $lc.p2pHost }}
- name: LMCACHE_P2P_HOST
  value: {{ $lc.p2pHost | quote }}
{{- else if $lc.enableP2P }}
- name: LMCACHE_P2P_HOST
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end }}
{{- if or $lc.enableP2P $lc.p2pInitPorts }}
- name: LMCACHE_P2P_INIT_PORTS
  value: {{ include "vllm-stack.portList" ($lc.p2pInitPorts | default (list 8200)) | quote }}
{{- end }}
{{- if or $lc.enableP2P $lc.p2pLookupPorts }}
- name: LMCACHE_P2P_LOOKUP_PORTS
  value: {{ include "vllm-stack.portList" ($lc.p2pLookupPorts | default (list 8201)) | quote }}
{{- end }}
{{- /* lmcacheConfig.pd, with production-stack's nixl* spelling translated (vllm-stack.model.pd). */}}
{{- with (include "vllm-stack.model.pd" . | fromYaml) }}
{{- if .role }}
- name: LMCACHE_ENABLE_PD
  value: "true"
- name: LMCACHE_PD_ROLE
  value: {{ .role | quote }}
- name: LMCACHE_TRANSFER_CHANNEL
  value: {{ .transferChannel | default "nixl" | quote }}
- name: LMCACHE_NIXL_BACKENDS
  value: {{ join "," (.nixlBackends | default (list "UCX")) | quote }}
- name: LMCACHE_PD_BUFFER_SIZE
  value: {{ .bufferSize | default 2147483648 | int64 | toString | quote }}
- name: LMCACHE_PD_BUFFER_DEVICE
  value: {{ .bufferDevice | default "cuda" | quote }}
{{- if eq .role "sender" }}
{{- /* The sender notifies the PD proxy when a KV cache is sent: this release's router, which orchestrates
     the hand-over (--disagg-protocol lmcache), unless proxyHost names another one. */}}
- name: LMCACHE_PD_PROXY_HOST
  value: {{ .proxyHost | default (ternary (include "vllm-stack.router.fullname" $root) "" (eq (toString $root.Values.routerSpec.enableRouter) "true")) | required "lmcacheConfig.pd.proxyHost is required for pd.role sender when the router is not deployed" | quote }}
- name: LMCACHE_PD_PROXY_PORT
  value: {{ include "vllm-stack.str" (.proxyPort | default 7500) | quote }}
{{- else }}
- name: LMCACHE_PD_PEER_HOST
  value: {{ .peerHost | default "0.0.0.0" | quote }}
- name: LMCACHE_PD_PEER_INIT_PORT
  value: {{ include "vllm-stack.str" (.peerInitPort | default 7300) | quote }}
- name: LMCACHE_PD_PEER_ALLOC_PORT
  value: {{ include "vllm-stack.str" (.peerAllocPort | default 7400) | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "vllm-stack.engine.env" -}}
{{- $root := .root -}}
{{- $m := .model -}}
{{- $vc := $m.vllmConfig | default dict -}}
- name: PYTHONHASHSEED
  value: {{ include "vllm-stack.str" $root.Values.servingEngineSpec.pythonHashSeed | quote }}
- name: HF_HOME
  value: {{ ternary "/data/shared-pvc-storage" $root.Values.servingEngineSpec.modelCacheMountPath (and $root.Values.sharedPvcStorage $root.Values.sharedPvcStorage.enabled) | quote }}
{{- with $m.hf_token }}{{ if or (kindIs "string" .) .secretName }}
- name: HF_TOKEN
  valueFrom:
    {{- include "vllm-stack.secretKeyRef" (dict "root" $root "value" . "key" (printf "hfToken-%s" $m.name)) | nindent 4 }}
{{- end }}{{ end }}
{{- with (include "vllm-stack.vllmApiKeyRef" $root) }}
- name: VLLM_API_KEY
  valueFrom:
    secretKeyRef:
      {{- . | nindent 6 }}
{{- end }}
{{- $ownEnv := list }}{{ range $m.env }}{{ $ownEnv = append $ownEnv (toString .name) }}{{ end }}
{{- if and (or $vc.allowRuntimeLoraUpdating (include "vllm-stack.model.hasAdapters" .)) (not (has "VLLM_ALLOW_RUNTIME_LORA_UPDATING" $ownEnv)) }}
- name: VLLM_ALLOW_RUNTIME_LORA_UPDATING
  value: "True"
{{- end }}
{{- if eq (include "vllm-stack.model.lmcacheEnabled" .) "true" }}
{{ include "vllm-stack.engine.lmcacheEnv" . }}
{{- end }}
{{- with $m.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Ports as LMCache's comma-separated list: a list, a number, or production-stack's "8001" / "8001,8002". */}}
{{- define "vllm-stack.portList" -}}
{{- if kindIs "slice" . -}}
{{- $out := list -}}{{- range . }}{{ $out = append $out (include "vllm-stack.str" .) }}{{ end -}}{{- join "," $out -}}
{{- else -}}
{{- include "vllm-stack.str" . | replace " " "" -}}
{{- end -}}
{{- end -}}

{{/* The --chat-template path: production-stack's file name in chatTemplateConfigMap (mounted at
     /templates), or an absolute path to a file in the image or a volume. */}}
{{- define "vllm-stack.engine.chatTemplatePath" -}}
{{- $m := .model -}}
{{- if $m.chatTemplateConfigMap -}}
{{- printf "/templates/%s" (base ($m.chatTemplate | default "chat-template.jinja")) -}}
{{- else if and $m.chatTemplate (hasPrefix "/" $m.chatTemplate) -}}
{{- $m.chatTemplate -}}
{{- end -}}
{{- end -}}
