{{/* ---------------------------------------------------------------------------------------------
The vLLM command line and the engine environment, for the vLLM release the model's image runs
(_vllm_version.tpl): the chart's flags that release does not parse are left out (or given in the
spelling it has), said in NOTES; vllmConfig.extraArgs it cannot parse are refused.
Call with (dict "root" $ "model" $modelSpec).
--------------------------------------------------------------------------------------------- */}}

{{- define "vllm-stack.engine.args" -}}
{{- $gated := include "vllm-stack.engine.gated" . | fromYaml -}}
{{- $args := $gated.args -}}
{{- $where := printf "servingEngineSpec.modelSpec (%s)" (toString .model.name) -}}
{{- range ((.model.vllmConfig | default dict).extraArgs | default list) -}}
{{- $w := include "vllm-stack.str" . -}}
{{- if and (hasPrefix "--" $w) (not (include "vllm-stack.vllm.parses" (dict "root" $.root "version" $gated.version "flag" (regexReplaceAll "=.*$" $w "")))) -}}
{{- fail (printf "%s: vllmConfig.extraArgs %s: vLLM %s (%s) does not parse it (%s), so the engine would exit at start; remove it, or give the model's vllmVersion if its image runs another vLLM" $where $w $gated.version $gated.image (include "vllm-stack.vllm.flagRange" (dict "root" $.root "version" $gated.version "flag" (regexReplaceAll "=.*$" $w "")))) -}}
{{- end -}}
{{- $args = append $args $w -}}
{{- end -}}
{{- toYaml $args -}}
{{- end -}}

{{/* The chart's own flags for the model's vLLM: {args, version, image, source, notes: [what was left out or
     spelt otherwise, and why]}. */}}
{{- define "vllm-stack.engine.gated" -}}
{{- $root := .root -}}
{{- $rel := include "vllm-stack.model.vllmRelease" . | fromYaml -}}
{{- $v := $rel.version -}}
{{- $all := include "vllm-stack.engine.chartArgs" . | fromYamlArray -}}
{{- $args := list (first $all) -}}
{{- $notes := list -}}
{{- $skip := false -}}
{{- range $i, $w := rest $all -}}
{{- if $skip }}{{ $skip = false }}{{ continue }}{{ end -}}
{{- $next := "" -}}
{{- $hasValue := and (lt (add1 (add1 $i)) (len $all)) (not (hasPrefix "--" (index $all (add1 (add1 $i))))) -}}
{{- if $hasValue }}{{ $next = index $all (add1 (add1 $i)) }}{{ $skip = true }}{{ end -}}
{{- if or (not (hasPrefix "--" $w)) (include "vllm-stack.vllm.parses" (dict "root" $root "version" $v "flag" $w)) -}}
{{- $args = append $args $w -}}{{- if $hasValue }}{{ $args = append $args $next }}{{ end -}}
{{- else if eq $w "--no-enable-chunked-prefill" -}}
{{- /* before 0.8.5 the flag takes a value */ -}}
{{- $args = concat $args (list "--enable-chunked-prefill" "false") -}}
{{- else if has $w (list "--no-enable-prefix-caching" "--no-enforce-eager" "--no-trust-remote-code") -}}
{{- /* before these releases the positive flag is a switch, off unless given: leaving it out says no */ -}}
{{- else if eq $w "--kv-events-config" -}}
{{- $notes = append $notes (printf "--kv-events-config not rendered: vLLM %s does not parse it (%s), so its engines publish no KV events; prefixaware routing places this model's requests by the router's own record of the prompts it sent where (the model's tokenizer blocks, or prompt characters without one), which does not see evictions or other clients' requests" $v (include "vllm-stack.vllm.flagRange" (dict "root" $root "version" $v "flag" $w))) -}}
{{- else -}}
{{- $entry := get (include "vllm-stack.vllm.table" $root | fromYaml).flags $w | default dict -}}
{{- $notes = append $notes (printf "%s%s not rendered: vLLM %s does not parse it (%s%s)" $w (ternary (printf " %s" $next) "" $hasValue) $v (include "vllm-stack.vllm.flagRange" (dict "root" $root "version" $v "flag" $w)) (ternary (printf "; %s" $entry.note) "" (not (empty $entry.note)))) -}}
{{- end -}}
{{- end -}}
{{- toYaml (dict "args" $args "version" $v "image" $rel.image "source" $rel.source "notes" $notes) -}}
{{- end -}}

{{/* "true" when the model's engines publish KV events: the chart turns them on (prefixaware, or
     servingEngineSpec.kvEvents.enabled) and the model's vLLM parses --kv-events-config. */}}
{{- define "vllm-stack.model.kvEvents" -}}
{{- if eq (include "vllm-stack.kvEvents.enabled" .root) "true" -}}
{{- if include "vllm-stack.vllm.parses" (dict "root" .root "version" (include "vllm-stack.model.vllmRelease" . | fromYaml).version "flag" "--kv-events-config") }}true{{ end -}}
{{- end -}}
{{- end -}}

{{/* "true" when the values ask for vLLM's V0 engine (production-stack's vllmConfig.v0: "1", or v1: 0) and the
     model's vLLM has it: VLLM_USE_V1=0 and LMCache's V0 connector. */}}
{{- define "vllm-stack.model.v0" -}}
{{- if and (include "vllm-stack.model.asksV0" .) (include "vllm-stack.vllm.hasV0" (include "vllm-stack.model.vllmRelease" . | fromYaml)) }}true{{ end -}}
{{- end -}}

{{- define "vllm-stack.model.asksV0" -}}
{{- $vc := .model.vllmConfig | default dict -}}
{{- if or (and (hasKey $vc "v0") (eq (toString $vc.v0) "1")) (and (hasKey $vc "v1") (has (toString $vc.v1) (list "0" "false"))) }}true{{ end -}}
{{- end -}}

{{/* "true" when vllmConfig.v1 asks for the V1 engine of a vLLM that runs V0 by default (before 0.8.0). */}}
{{- define "vllm-stack.model.v1" -}}
{{- $vc := .model.vllmConfig | default dict -}}
{{- if and (hasKey $vc "v1") (not (has (toString $vc.v1) (list "0" "false"))) (semverCompare "<0.8.0" (include "vllm-stack.model.vllmRelease" . | fromYaml).version) }}true{{ end -}}
{{- end -}}

{{- define "vllm-stack.engine.chartArgs" -}}
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
{{- /* The gating drops it again where the model's vLLM does not parse it (vllm-stack.engine.gated). */ -}}
{{- $kv := dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (printf "tcp://*:%d" (int $root.Values.servingEngineSpec.kvEvents.port)) -}}
{{- with $root.Values.servingEngineSpec.kvEvents.replayPort }}{{ $_ := set $kv "replay_endpoint" (printf "tcp://*:%d" (int .)) }}{{ end -}}
{{- $args = append (append $args "--kv-events-config") (toJson $kv) -}}
{{- end -}}
{{- /* Tracing: vLLM's spans of each request join the router's trace (the router sends traceparent). */ -}}
{{- with ($root.Values.servingEngineSpec.tracing | default dict).endpoint }}{{ if not (has "--otlp-traces-endpoint" ($vc.extraArgs | default list)) }}
{{- $args = append (append $args "--otlp-traces-endpoint") . -}}
{{- end }}{{ end -}}
{{- /* The engine's cached-token count per request: the router's predicted-versus-actual hit metric. */ -}}
{{- if and (eq (include "vllm-stack.router.prefixAware" $root) "true") (not (has "--enable-prompt-tokens-details" ($vc.extraArgs | default list))) -}}
{{- $args = append $args "--enable-prompt-tokens-details" -}}
{{- end -}}
{{- if eq (include "vllm-stack.model.lmcacheEnabled" .) "true" -}}
{{- /* kv_role follows the model's role (its pd.role, or production-stack's kvRole, when `role` is not given). */ -}}
{{- $role := get (dict "prefill" "kv_producer" "decode" "kv_consumer" "both" "kv_both") (include "vllm-stack.model.role" .) -}}
{{- /* LMCache's V0 connector with vLLM's V0 engine (production-stack's vllmConfig.v0, where the model's vLLM has V0). */ -}}
{{- $args = append (append $args "--kv-transfer-config") (toJson (dict "kv_connector" (ternary "LMCacheConnector" "LMCacheConnectorV1" (eq (include "vllm-stack.model.v0" .) "true")) "kv_role" $role)) -}}
{{- end -}}
{{- /* modelSpec.schedulingPolicy, unless extraArgs gives --scheduling-policy itself (then once, as written). */ -}}
{{- $policy := include "vllm-stack.model.schedulingPolicy" . -}}
{{- if and $policy (not (include "vllm-stack.model.extraArgsSchedulingPolicy" .)) -}}
{{- $args = append (append $args "--scheduling-policy") $policy -}}
{{- end -}}
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
{{- $cpuBuffer := include "vllm-stack.model.cpuBuffer" . }}
- name: LMCACHE_LOCAL_CPU
  value: {{ ternary "true" "false" (and (ne $cpuBuffer "0") (ne $cpuBuffer "")) | quote }}
{{- with $cpuBuffer }}
- name: LMCACHE_MAX_LOCAL_CPU_SIZE
  value: {{ . | quote }}
{{- end }}
{{- with $lc.diskOffloadingBufferSize }}
- name: LMCACHE_LOCAL_DISK
  value: {{ printf "file://%s/" (trimSuffix "/" ($lc.diskPath | default "/lmcache/disk")) | quote }}
- name: LMCACHE_MAX_LOCAL_DISK_SIZE
  value: {{ include "vllm-stack.str" . | quote }}
{{- end }}
{{- $remote := $lc.remoteUrl -}}
{{- if and (not $remote) (eq (include "vllm-stack.cacheserver.enabled" $root) "true") -}}
{{- $remote = printf "lm://%s:%d" (include "vllm-stack.cacheserver.objectName" (dict "root" $root "kind" "Service")) (int $root.Values.cacheserverSpec.servicePort) -}}
{{- end }}
{{- with $remote }}
- name: LMCACHE_REMOTE_URL
  value: {{ . | quote }}
{{- /* An empty serde (production-stack's default cacheserverSpec.serde: "") is an unset one: LMCache 0.5.6
     keeps LMCACHE_REMOTE_SERDE="" as the serde and its remote backend fails at start ("Invalid type: "), so
     the variable is left out and LMCache's default (naive) applies, as production-stack's chart does. */}}
{{- with ($lc.remoteSerde | default $root.Values.cacheserverSpec.serde) }}
- name: LMCACHE_REMOTE_SERDE
  value: {{ . | quote }}
{{- end }}
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
{{- $missing := "servingEngineSpec.modelSpec (%s): lmcacheConfig.enableController needs lmcacheConfig.%s here: production-stack's router hosts an LMCache controller, this chart runs it as its own Deployment; set routingLogic kvaware (or lmcacheControllerSpec.enabled) to deploy it, or give controllerPullUrl and controllerReplyUrl of your own lmcache_controller" }}
- name: LMCACHE_CONTROLLER_PULL_URL
  value: {{ required (printf $missing (toString .model.name) "controllerPullUrl") $lc.controllerPullUrl | quote }}
- name: LMCACHE_CONTROLLER_REPLY_URL
  value: {{ required (printf $missing (toString .model.name) "controllerReplyUrl") $lc.controllerReplyUrl | quote }}
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
  value: {{ .proxyHost | default (ternary (include "vllm-stack.router.serviceName" $root) "" (eq (toString $root.Values.routerSpec.enableRouter) "true")) | required "lmcacheConfig.pd.proxyHost is required for pd.role sender when the router is not deployed" | quote }}
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

{{/* The engine container's env: the chart's entries (vllm-stack.engine.chartEnv), then production-stack's
     servingEngineSpec.env and the model's env, one entry per name (a user's entry replaces the chart's). */}}
{{- define "vllm-stack.engine.env" -}}
{{- include "vllm-stack.env.merged" (list (include "vllm-stack.engine.chartEnv" . | fromYamlArray) .root.Values.servingEngineSpec.env .model.env) -}}
{{- end -}}

{{- define "vllm-stack.engine.chartEnv" -}}
{{- $root := .root -}}
{{- $m := .model -}}
{{- $vc := $m.vllmConfig | default dict -}}
- name: PYTHONHASHSEED
  value: {{ include "vllm-stack.str" $root.Values.servingEngineSpec.pythonHashSeed | quote }}
- name: HF_HOME
  value: {{ ternary "/data/shared-pvc-storage" $root.Values.servingEngineSpec.modelCacheMountPath (and $root.Values.sharedPvcStorage $root.Values.sharedPvcStorage.enabled) | quote }}
{{- if include "vllm-stack.engine.scratchTmp" . }}
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: XDG_CONFIG_HOME
  value: /tmp/.config
{{- end }}
{{- /* production-stack's: the pod IP, for scripts and settings of the user's that name $(POD_IP) */}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- with $m.hf_token }}{{ if or (kindIs "string" .) .secretName }}
- name: HF_TOKEN
  valueFrom:
    {{- include "vllm-stack.secretKeyRef" (dict "root" $root "value" . "key" (include "vllm-stack.secret.hfTokenKey" $m.name)) | nindent 4 }}
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
{{- /* production-stack's CUDA_VISIBLE_DEVICES (its PD files pin the prefill engine to GPU 0 and the decode
     engine to GPU 1): kept where the model requests no GPU, whose pod sees the node's GPUs and needs it not to
     share GPU 0 with the other; a pod given GPUs by the device plugin sees only those, numbered from 0. */}}
{{- with ($m.lmcacheConfig | default dict).cudaVisibleDevices }}{{ if and (eq (include "vllm-stack.model.lmcacheEnabled" $) "true") (eq (include "vllm-stack.engine.gpuCount" $) "0") }}
- name: CUDA_VISIBLE_DEVICES
  value: {{ include "vllm-stack.str" . | quote }}
{{- end }}{{ end }}
{{- if eq (include "vllm-stack.model.v0" .) "true" }}
- name: VLLM_USE_V1
  value: "0"
{{- else if eq (include "vllm-stack.model.v1" .) "true" }}
- name: VLLM_USE_V1
  value: "1"
{{- end }}
{{- with $vc.prometheusMultiprocDir }}
- name: PROMETHEUS_MULTIPROC_DIR
  value: {{ . | quote }}
{{- end }}
{{- $tracing := $root.Values.servingEngineSpec.tracing | default dict }}
{{- if $tracing.endpoint }}
{{- if not (has "OTEL_SERVICE_NAME" $ownEnv) }}
- name: OTEL_SERVICE_NAME
  value: {{ $tracing.serviceName | default "vllm-engine" | quote }}
{{- end }}
{{- if and $tracing.protocol (not (has "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" $ownEnv)) }}
- name: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
  value: {{ $tracing.protocol | quote }}
{{- end }}
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
     /templates), a file name or a /templates/ path on production-stack's claim vllm-templates-pvc (mounted at
     /templates, vllm-stack.engine.chatTemplateClaim), or any other absolute path (a file in the image or a volume). */}}
{{- define "vllm-stack.engine.chatTemplatePath" -}}
{{- $m := .model -}}
{{- if $m.chatTemplateConfigMap -}}
{{- printf "/templates/%s" (base ($m.chatTemplate | default "chat-template.jinja")) -}}
{{- else if and $m.chatTemplate (hasPrefix "/" $m.chatTemplate) -}}
{{- $m.chatTemplate -}}
{{- else if $m.chatTemplate -}}
{{- printf "/templates/%s" $m.chatTemplate -}}
{{- end -}}
{{- end -}}

{{/* production-stack's claim for chat templates, vllm-templates-pvc, mounted at /templates when the template
     is read from there (chatTemplate without chatTemplateConfigMap: a file name, or a path under /templates/)
     and the model's extraVolumeMounts do not mount /templates themselves. */}}
{{- define "vllm-stack.engine.chatTemplateClaim" -}}
{{- $m := .model -}}
{{- if and $m.chatTemplate (not $m.chatTemplateConfigMap) (or (not (hasPrefix "/" $m.chatTemplate)) (hasPrefix "/templates/" $m.chatTemplate)) -}}
{{- $own := false -}}
{{- range $m.extraVolumeMounts }}{{ if eq (trimSuffix "/" (toString .mountPath)) "/templates" }}{{ $own = true }}{{ end }}{{ end -}}
{{- if not $own }}vllm-templates-pvc{{ end -}}
{{- end -}}
{{- end -}}


{{/* The LMCache of the model's image when it is older than 0.5, whose settings the chart renders, as text
     ("an LMCache build of 2025-05-27"), else nothing. lmcache/vllm-openai tags are LMCache releases (v0.5.6) or
     build dates (2025-05-27-v1); LMCache was at 0.3.x until November 2025 (0.3.9), so a build dated before
     2025-11-01 predates 0.5. Other images: unknown, taken to be 0.5. */}}
{{- define "vllm-stack.model.lmcacheBefore05" -}}
{{- $image := include "vllm-stack.model.image" . -}}
{{- $repo := regexReplaceAll ":[^:/]*$" $image "" -}}
{{- $tag := trimPrefix (printf "%s:" $repo) $image -}}
{{- if hasSuffix "lmcache/vllm-openai" $repo -}}
{{- $release := regexFind "^v?[0-9]+\\.[0-9]+\\.[0-9]+" $tag | trimPrefix "v" -}}
{{- $date := regexFind "^20[0-9][0-9]-[01][0-9]-[0-3][0-9]" $tag -}}
{{- if and $release (semverCompare "<0.5.0-0" $release) }}LMCache {{ $release }}
{{- else if and $date (lt $date "2025-11-01") }}an LMCache build of {{ $date }}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "true" when the engine container's root file system is read-only and the model's own mounts leave /tmp
     to the chart: vLLM, torch and Python's tempfile need a writable /tmp, and vLLM its cache and config roots
     (XDG_CACHE_HOME, XDG_CONFIG_HOME), which then live in an emptyDir there. */}}
{{- define "vllm-stack.engine.scratchTmp" -}}
{{- $m := .model -}}
{{- $sc := .root.Values.servingEngineSpec.containerSecurityContext | default dict -}}
{{- $own := false -}}
{{- range $m.extraVolumeMounts }}{{ if eq (trimSuffix "/" (toString .mountPath)) "/tmp" }}{{ $own = true }}{{ end }}{{ end -}}
{{- if and $sc.readOnlyRootFilesystem (not $own) }}true{{ end -}}
{{- end -}}
