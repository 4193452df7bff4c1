{{/* ---------------------------------------------------------------------------------------------
The deviations: every key the chart honours differently from what it asks (or from production-stack),
substitutes or ignores, one line each: "<key path>[, <key path>...]: <what was done>". A path names the
key and everything under it. Computed here once, as a YAML list: NOTES.txt prints it, `strict: true`
(validate.yaml) refuses a render with any, and `vllm-stack check` prints it (from NOTES);
tests/helm/test_production_stack_files.py reads these lines.
--------------------------------------------------------------------------------------------- */}}
{{- define "vllm-stack.deviations" -}}
{{- $v := .Values -}}
{{- $r := $v.routerSpec -}}
{{- $n := list -}}
{{- /* ---- router ---- */ -}}
{{- if and $r.enableRouter (include "vllm-stack.router.foreignImage" .) -}}
{{- $n = append $n (printf "routerSpec.repository, routerSpec.tag: %s%s is not this project's router (its command line differs; these args would crash or be misread); %s is deployed instead. Set routerSpec.vllmStackImage: true if it is your build of engine-image/router.Dockerfile" $r.repository (ternary (printf ":%s" (toString $r.tag)) "" (not (empty $r.tag))) (include "vllm-stack.router.image" .)) -}}
{{- end -}}
{{- if eq (toString $r.routingLogic) "disaggregated_prefill_orchestrated" }}{{ $n = append $n "routerSpec.routingLogic: disaggregated_prefill_orchestrated rendered as disaggregated_prefill: this router orchestrates every disaggregated request itself (the prefill leg on a prefill engine, then the decode leg on a decode engine)" }}{{ end -}}
{{- if and $r.enableRouter (eq (toString $r.enablePD) "true") }}{{ $n = append $n (printf "routerSpec.enablePD: the router runs with --disaggregation%s" (ternary " (the prefill-role models would turn it on anyway)" "" (eq (include "vllm-stack.disagg.prefill" .) "true"))) }}{{ end -}}
{{- if $r.enableRouter }}{{ range (include "vllm-stack.router.extraArgs" . | fromYaml).dropped }}{{ $n = append $n (printf "routerSpec.extraArgs: %s" .) }}{{ end }}{{ end -}}
{{- if hasKey $r "requestStatsWindow" }}{{ $n = append $n "routerSpec.requestStatsWindow: ignored: the vllm-stack router takes its load signals from the engines' /metrics every engineScrapeInterval, not from a window of its own requests" }}{{ end -}}
{{- with $r.lmcacheConfig }}{{ $n = append $n "routerSpec.lmcacheConfig: ignored: production-stack's router embeds LMCache for kvaware routing; this router embeds none (with kvaware it asks the chart's lmcache_controller)" }}{{ end -}}
{{- if and $r.hf_token (not (has $r.routingLogic (list "prefixaware" "kvaware"))) }}{{ $n = append $n (printf "routerSpec.hf_token: unused with routingLogic %s: the vllm-stack router fetches tokenizers only for prefixaware and kvaware routing" $r.routingLogic) }}{{ end -}}
{{- $ctlPorts := list -}}
{{- range list "lmcacheControllerPort" "lmcacheControllerReplyPort" "lmcacheControllerHeartbeatPort" }}{{ if not (empty (get $r .)) }}{{ $ctlPorts = append $ctlPorts (printf "routerSpec.%s" .) }}{{ end }}{{ end -}}
{{- if ne (include "vllm-stack.controller.enabled" .) "true" }}{{ with $ctlPorts }}{{ $n = append $n (printf "%s: production-stack's router hosts an LMCache controller there for kvaware routing only; with routingLogic %s this chart deploys none, so nothing uses them (routingLogic kvaware, or lmcacheControllerSpec.enabled, deploys %s on these ports)" (join ", " .) $r.routingLogic (include "vllm-stack.controller.fullname" $)) }}{{ end }}{{ end -}}
{{- $probePorts := list -}}
{{- range $spec := list "servingEngineSpec" "routerSpec" }}{{ range $probe := list "startupProbe" "livenessProbe" "readinessProbe" }}
{{- with (get (get $v $spec) $probe) }}{{ with .httpGet }}{{ if hasKey . "port" }}{{ $probePorts = append $probePorts (printf "%s.%s.httpGet.port" $spec $probe) }}{{ end }}{{ end }}{{ end }}
{{- end }}{{ end -}}
{{- with $probePorts }}{{ $n = append $n (printf "%s: not used: the probes always use the container's named port (http, the containerPort)" (join ", " .)) }}{{ end -}}
{{- with $v.sharedPvcStorage }}{{ with .image }}{{ $n = append $n "sharedPvcStorage.image: not used: production-stack runs it in its LoRA controller only, which this chart does not ship" }}{{ end }}{{ end -}}
{{- /* ---- engines ---- */ -}}
{{- $ownRuntime := true -}}
{{- $anyModel := false -}}
{{- range $v.servingEngineSpec.modelSpec }}{{ if eq (include "vllm-stack.model.enabled" (dict "root" $ "model" .)) "true" }}{{ $anyModel = true }}{{ if not .runtimeClassName }}{{ $ownRuntime = false }}{{ end }}{{ end }}{{ end -}}
{{- if and $anyModel $ownRuntime $v.servingEngineSpec.runtimeClassName }}{{ $n = append $n "servingEngineSpec.runtimeClassName: not used: every deployed model sets its own runtimeClassName, which wins" }}{{ end -}}
{{- with $v.servingEngineSpec.sidecar }}{{ $n = append $n "servingEngineSpec.sidecar: production-stack's LoRA sidecar is not shipped: register adapters in loraAdapters (the router loads them where they are requested) or use vllmConfig.loraModules" }}{{ end -}}
{{- $csc := $v.servingEngineSpec.containerSecurityContext | default dict -}}
{{- $pdNixl := false -}}
{{- range $v.servingEngineSpec.modelSpec }}{{ $c := dict "root" $ "model" . }}{{ if and (eq (include "vllm-stack.model.enabled" $c) "true") (include "vllm-stack.model.pd" $c) }}{{ $pdNixl = true }}{{ end }}{{ end -}}
{{- if and $pdNixl (has "ALL" ((($csc.capabilities | default dict).drop) | default list)) (not (has "IPC_LOCK" ((($csc.capabilities | default dict).add) | default list))) }}{{ $n = append $n "servingEngineSpec.containerSecurityContext: the engines drop every Linux capability (this chart's default; production-stack keeps the runtime's): NIXL over RDMA pins memory and needs IPC_LOCK, so add it (capabilities.add: [IPC_LOCK]) where the KV caches move over InfiniBand or RoCE" }}{{ end -}}
{{- $deployed := false -}}
{{- range $v.servingEngineSpec.modelSpec }}{{ if eq (include "vllm-stack.model.enabled" (dict "root" $ "model" .)) "true" }}{{ $deployed = true }}{{ end }}{{ end -}}
{{- if and $v.servingEngineSpec.modelSpec (not $deployed) }}{{ $n = append $n "servingEngineSpec: no model is deployed (every modelSpec entry is disabled), so its engine-wide settings render nothing" }}{{ end -}}
{{- range $i, $m := $v.servingEngineSpec.modelSpec }}
{{- $p := printf "servingEngineSpec.modelSpec[%d]" $i -}}
{{- $ctx := dict "root" $ "model" $m -}}
{{- if ne (include "vllm-stack.model.enabled" $ctx) "true" -}}
{{- $n = append $n (printf "%s: %s is not deployed (%s), so none of its settings is rendered" $p $m.name (ternary "servingEngineSpec.enableEngine: false" "enabled: false" (not $v.servingEngineSpec.enableEngine))) -}}
{{- else -}}
{{- $vc := $m.vllmConfig | default dict -}}
{{- $size := include "vllm-stack.engine.sizing" $ctx | fromYaml -}}
{{- if and (hasKey $m "replicaCount") (eq (include "vllm-stack.model.kedaEnabled" $ctx) "true") }}{{ $n = append $n (printf "%s.replicaCount: not rendered: the keda block is on, so KEDA owns the replica count (between minReplicaCount and maxReplicaCount), as in production-stack" $p) }}{{ end -}}
{{- if and $m.keda (not (hasKey $m.keda "enabled")) }}{{ $n = append $n (printf "%s.keda: off: the block has no enabled: true, so no ScaledObject is rendered and replicaCount stays, as in production-stack (give keda.enabled: true to autoscale; KEDA's CRDs must be installed)" $p) }}{{ end -}}
{{- if eq (include "vllm-stack.model.kedaEnabled" $ctx) "true" -}}
{{- $given := $m.keda.triggers | default $v.keda.triggers -}}
{{- if kindIs "map" $given }}{{ $given = list $given }}{{ end -}}
{{- range $t := $given }}{{ with ($t.metadata | default dict).query }}{{ if and (eq (toString $t.type) "prometheus") (regexMatch "^[a-zA-Z_:][a-zA-Z0-9_:]*$" (toString .)) }}{{ $n = append $n (printf "%s.keda.triggers: the query %s is rendered as sum(%s{model_name=%q,namespace=%q}): a bare metric name would add up every model's series (and KEDA wants one element)" $p . . (include "vllm-stack.model.servedName" $ctx) $.Release.Namespace) }}{{ end }}{{ end }}{{ end -}}
{{- end -}}
{{- $sel := include "vllm-stack.engine.selectorLabels" $ctx | fromYaml -}}
{{- range $block := list "labels" "podLabels" }}{{ range $k, $val := (get $m $block | default dict) }}{{ if and (hasKey $sel $k) (ne (toString $val) (get $sel $k)) -}}
{{- $n = append $n (printf "%s.%s.%s: not rendered: %s is a selector label (production-stack's), whose value stays %s: the Deployment's selector cannot change" $p $block $k $k (get $sel $k)) -}}
{{- end }}{{ end }}{{ end -}}
{{- with $size.memoryRaised }}{{ $n = append $n (printf "%s.requestMemory: %s" $p .) }}{{ end -}}
{{- with $size.memoryUnlimited }}{{ $n = append $n (printf "%s.limitMemory: %s" $p .) }}{{ end -}}
{{- with $size.cpuRaised }}{{ $n = append $n (printf "%s.requestCPU: %s; a CPU quota below them throttles the engine every 100 ms CFS period" $p .) }}{{ end -}}
{{- $g := include "vllm-stack.str" ($m.requestGPU | default 0) -}}
{{- if ne $g (include "vllm-stack.engine.gpus" $ctx) -}}
{{- $n = append $n (printf "%s.requestGPU: %s rendered as %s: %s (extended resources are whole numbers; production-stack requests no GPU for a fraction). Several engines share a GPU only where the device plugin shares GPUs (NVIDIA time-slicing or MPS replicas), each nvidia.com/gpu then being a share; keep vllmConfig.gpuMemoryUtilization (or --gpu-memory-utilization) within it" $p $g ($m.requestGPUType | default "nvidia.com/gpu") (include "vllm-stack.engine.gpus" $ctx)) -}}
{{- end -}}
{{- $gated := include "vllm-stack.engine.gated" $ctx | fromYaml -}}
{{- if eq $gated.source "unknown" }}{{ $n = append $n (printf "%s.tag: the vLLM release of %s is unknown (only vllm/vllm-openai tags name theirs), so it counts as the newest the chart knows, %s: its flags are rendered for that; give vllmVersion (the model's, or servingEngineSpec.vllmVersion) if the image runs another" $p $gated.image $gated.version) }}{{ end -}}
{{- $oldest := (include "vllm-stack.vllm.table" $ | fromYaml).releases.oldest -}}
{{- if semverCompare (printf "<%s" $oldest) $gated.version }}{{ $n = append $n (printf "%s.%s: vLLM %s is older than the oldest release the chart's flag table reads (%s, files/vllm-flags.yaml): the flags %s parses are rendered, taken to be older, and those that came later are left out" $p (ternary "vllmVersion" "tag" (eq $gated.source "vllmVersion")) $gated.version $oldest $oldest) }}{{ end -}}
{{- range $gated.notes }}{{ $n = append $n (printf "%s.%s: %s" $p (ternary "vllmVersion" "tag" (eq $gated.source "vllmVersion")) .) }}{{ end -}}
{{- if and (include "vllm-stack.model.asksV0" $ctx) (not (include "vllm-stack.model.v0" $ctx)) }}{{ $n = append $n (printf "%s.vllmConfig.%s: ignored: vLLM %s has only the V1 engine (V0 was removed in 0.11.0), which runs; production-stack would set VLLM_USE_V1=0, which that vLLM refuses at start" $p (ternary "v0" "v1" (hasKey $vc "v0")) $gated.version) }}{{ end -}}
{{- /* V0 engines leave prefix caching off by default, as production-stack's --no-enable-prefix-caching: nothing differs. */ -}}
{{- if and $m.vllmConfig (not (hasKey $vc "enablePrefixCaching")) (not (include "vllm-stack.model.runsV0" $ctx)) }}{{ $n = append $n (printf "%s.vllmConfig.enablePrefixCaching: not given, so vLLM's default (on); production-stack renders --no-enable-prefix-caching here" $p) }}{{ end -}}
{{- if and (hasKey $vc "v1") (not (has (toString $vc.v1) (list "0" "false"))) (not (include "vllm-stack.model.v1" $ctx)) }}{{ $n = append $n (printf "%s.vllmConfig.v1: nothing to set: vLLM %s runs the V1 engine by default" $p $gated.version) }}{{ end -}}
{{- if and $vc.maxLoras (not (or $vc.enableLoRA $m.enableLoRA)) }}{{ $n = append $n (printf "%s.vllmConfig.maxLoras: --enable-lora added (vLLM ignores --max-loras without it; production-stack passes --max_loras alone)" $p) }}{{ end -}}
{{- if and $m.enableLoRA $m.pvcStorage }}{{ $n = append $n (printf "%s.enableLoRA: --enable-lora; production-stack would also add its LoRA sidecar here (enableLoRA with pvcStorage), which is not shipped: register adapters in loraAdapters (the router loads them) or use vllmConfig.loraModules" $p) }}{{ end -}}
{{- with ($m.lmcacheConfig | default dict).cudaVisibleDevices }}{{ if ne (include "vllm-stack.engine.gpuCount" $ctx) "0" }}{{ $n = append $n (printf "%s.lmcacheConfig.cudaVisibleDevices: not set as CUDA_VISIBLE_DEVICES (%q): the pod gets its own GPUs from the device plugin (requestGPU), numbered from 0 inside the pod, so a node-wide index such as \"1\" would hide a one-GPU pod's only GPU" $p (toString .)) }}{{ end }}{{ end -}}
{{- if and $m.pvcStorage $m.pvcExistingClaimName }}{{ $n = append $n (printf "%s.pvcStorage: not used: pvcExistingClaimName (%s) is the claim the model cache is on, so no claim of this size is created" $p $m.pvcExistingClaimName) }}{{ end -}}
{{- $sleep := false }}{{ range ($vc.extraArgs | default list) }}{{ if eq (regexReplaceAll "=.*$" (include "vllm-stack.str" . | replace "_" "-") "") "--enable-sleep-mode" }}{{ $sleep = true }}{{ end }}{{ end -}}
{{- $devMode := false }}{{ range ($m.env | default list) }}{{ if and (eq (toString .name) "VLLM_SERVER_DEV_MODE") (eq (toString .value) "1") }}{{ $devMode = true }}{{ end }}{{ end -}}
{{- if and $r.enableRouter $sleep (not $devMode) }}{{ $n = append $n (printf "%s.vllmConfig.extraArgs: --enable-sleep-mode without VLLM_SERVER_DEV_MODE=1 in env: vLLM then serves no /sleep, /wake_up or /is_sleeping, so the router's answer 404 engine_refused" $p) }}{{ end -}}
{{- if and $r.enableRouter $sleep $devMode }}{{ $n = append $n (printf "%s.vllmConfig.extraArgs: --enable-sleep-mode: the router forwards /sleep, /wake_up and /is_sleeping by engine id as production-stack's does, reads the state from the engines and puts no sleeping=true label on the pods (production-stack's router patches them)" $p) }}{{ end -}}
{{- with $m.pvcMatchLabels }}{{ $n = append $n (printf "%s.pvcMatchLabels: the model's PVC selects a pre-provisioned PersistentVolume labelled %s" $p (toJson .)) }}{{ end -}}
{{- if and $m.chatTemplate (not $m.chatTemplateConfigMap) (hasPrefix "/" $m.chatTemplate) (not (hasPrefix "/templates/" $m.chatTemplate)) }}{{ $n = append $n (printf "%s.chatTemplate: --chat-template %s as given; the file must be in the image or a volume you mount (extraVolumes); production-stack would look for it under /templates on a PVC named vllm-templates-pvc" $p $m.chatTemplate) }}{{ end -}}
{{- if eq (include "vllm-stack.model.lmcacheEnabled" $ctx) "true" -}}
{{- $lc := $m.lmcacheConfig -}}
{{- if eq (include "vllm-stack.model.chartController" $ctx) "true" -}}
{{- $paths := list }}{{ range list "enableController" "controllerPort" "controllerReplyPort" }}{{ if hasKey $lc . }}{{ $paths = append $paths (printf "%s.lmcacheConfig.%s" $p .) }}{{ end }}{{ end -}}
{{- $ports := include "vllm-stack.controller.ports" $ | fromYaml -}}
{{- with $paths }}{{ $n = append $n (printf "%s: the engines report to the chart's LMCache controller, %s (pull port %d, reply port %d: routerSpec.lmcacheControllerPort and lmcacheControllerReplyPort, which these name too), as instance id their pod name" (join ", " .) (include "vllm-stack.controller.fullname" $) (int $ports.pull) (int $ports.reply)) }}{{ end -}}
{{- else if and $lc.enableController $lc.controllerPort (not $lc.controllerPullUrl) -}}
{{- $keys := list "enableController" "controllerPort" -}}
{{- range list "controllerReplyPort" "workerHeartbeatTime" }}{{ if hasKey $lc . }}{{ $keys = append $keys . }}{{ end }}{{ end -}}
{{- $paths := list }}{{ range $keys }}{{ $paths = append $paths (printf "%s.lmcacheConfig.%s" $p .) }}{{ end -}}
{{- $n = append $n (printf "%s: these point the engine at an LMCache controller on production-stack's router, which hosts one for kvaware routing only; with routingLogic %s this chart deploys no controller, so it stays off (routingLogic kvaware or lmcacheControllerSpec.enabled deploys one the engines report to; or give controllerPullUrl and controllerReplyUrl of your own lmcache_controller)" (join ", " $paths) (toString $r.routingLogic)) -}}
{{- end -}}
{{- with (include "vllm-stack.model.lmcacheBefore05" $ctx) }}{{ if (include "vllm-stack.model.pd" $ctx) }}{{ $n = append $n (printf "%s.tag: %s runs %s, older than LMCache 0.5, whose names the chart renders: it reads disaggregated prefill as LMCACHE_ENABLE_NIXL and LMCACHE_NIXL_* (production-stack's enableNixl and nixl* keys), so it ignores LMCACHE_ENABLE_PD, LMCACHE_PD_*, LMCACHE_TRANSFER_CHANNEL and LMCACHE_NIXL_BACKENDS and runs without disaggregated prefill; use an LMCache 0.5 image (lmcache/vllm-openai:%s, the chart's pin)" $p (include "vllm-stack.model.image" $ctx) . (include "vllm-stack.defaultLMCacheTag" $)) }}{{ end }}{{ end -}}
{{- if eq (include "vllm-stack.model.nixlPD" $ctx) "true" -}}
{{- $pd := include "vllm-stack.model.pd" $ctx | fromYaml -}}
{{- $moved := list (printf "pd.role %s" $pd.role) -}}
{{- range $old, $new := dict "nixlBufferSize" "pd.bufferSize" "nixlBufferDevice" "pd.bufferDevice" }}{{ if not (empty (get $lc $old)) }}{{ $moved = append $moved (printf "%s as %s" $old $new) }}{{ end }}{{ end -}}
{{- if eq $pd.role "receiver" }}{{ range $old, $new := dict "nixlPeerHost" "pd.peerHost" "nixlPeerPort" "pd.peerInitPort" }}{{ if not (empty (get $lc $old)) }}{{ $moved = append $moved (printf "%s as %s" $old $new) }}{{ end }}{{ end }}{{ end -}}
{{- $n = append $n (printf "%s.lmcacheConfig.enableNixl, %s.lmcacheConfig.nixlRole: production-stack's pre-0.5 PD keys, rendered in LMCache 0.5's names: %s (LMCACHE_ENABLE_PD, LMCACHE_PD_*)" $p $p (join ", " $moved)) -}}
{{- if eq $pd.role "sender" -}}
{{- $paths := list }}{{ range list "nixlPeerHost" "nixlPeerPort" }}{{ if not (empty (get $lc .)) }}{{ $paths = append $paths (printf "%s.lmcacheConfig.%s" $p .) }}{{ end }}{{ end -}}
{{- with $paths }}{{ $n = append $n (printf "%s: not used: an LMCache 0.5 sender is told its receiver per request (the router names the chosen decode engine's pod IP and ports in each prefill request's disagg_spec)" (join ", " .)) }}{{ end -}}
{{- end -}}
{{- if hasKey $lc "nixlEnableGc" }}{{ $n = append $n (printf "%s.lmcacheConfig.nixlEnableGc: ignored: LMCache 0.5 has no such setting" $p) }}{{ end -}}
{{- end -}}
{{- if and (hasKey $lc "workerHeartbeatTime") (not (or (eq (include "vllm-stack.model.chartController" $ctx) "true") $lc.enableController)) }}{{ $n = append $n (printf "%s.lmcacheConfig.workerHeartbeatTime: not rendered: without an LMCache controller the engine's LMCache worker sends no heartbeats (routingLogic kvaware, or enableController with controllerPullUrl, gives it one)" $p) }}{{ end -}}
{{- if eq (toString $lc.enablePD) "true" -}}
{{- if not $m.hostIPC }}{{ $n = append $n (printf "%s.lmcacheConfig.enablePD: production-stack runs this engine with hostIPC and hostPID and UCX_TLS=cuda_ipc,cuda_copy,tcp (CUDA IPC between pods on one node); here the pod keeps its own IPC and PID namespaces and UCX picks among the transports it finds; give the model hostIPC: true (and UCX_TLS in its env) for CUDA IPC between pods" $p) }}{{ end -}}
{{- $role := include "vllm-stack.model.role" $ctx -}}
{{- $n = append $n (printf "%s.lmcacheConfig.enablePD: implied by the model's role (%s: the vllm-stack.io/role label, kv_role %s%s); not a setting of its own" $p $role (get (dict "prefill" "kv_producer" "decode" "kv_consumer" "both" "kv_both") $role) (ternary (printf ", LMCache pd_role %s" ((include "vllm-stack.model.pd" $ctx | fromYaml).role | default "")) "" (not (empty (include "vllm-stack.model.pd" $ctx))))) -}}
{{- end -}}
{{- if and (not $lc.enableP2P) (or $lc.p2pHost $lc.p2pInitPorts $lc.p2pLookupPorts) -}}
{{- $paths := list }}{{ range list "p2pHost" "p2pInitPorts" "p2pLookupPorts" }}{{ if hasKey $lc . }}{{ $paths = append $paths (printf "%s.lmcacheConfig.%s" $p .) }}{{ end }}{{ end -}}
{{- $n = append $n (printf "%s: rendered (LMCACHE_P2P_*) as production-stack does, but enableP2P is not true, so LMCache does not use them" (join ", " $paths)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end }}
{{- /* ---- production-stack components this chart does not bundle ---- */ -}}
{{- range $key := list "kube-prometheus-stack" "prometheus-adapter" }}
{{- with (get $v $key) }}{{ $n = append $n (printf "%s: not bundled%s: install prometheus-community/%s yourself; this chart's ServiceMonitors (monitoring.serviceMonitor.enabled) and KEDA triggers work with it" $key (ternary " (enabled: true asks for it)" "" (eq (toString .enabled) "true")) $key) }}{{ end -}}
{{- end -}}
{{- range $i, $a := $v.loraAdapters }}{{ if eq (toString $a.enabled) "false" }}{{ $n = append $n (printf "loraAdapters[%d] (%s): enabled: false, not registered with the router" $i (toString $a.name)) }}{{ end }}{{ if ne (toString $a.enabled) "false" -}}
{{- with $a.loraAdapterDeploymentConfig }}{{ $n = append $n (printf "loraAdapters[%d].loraAdapterDeploymentConfig: not used: the router places adapters where they are requested (tier hot loads one on every engine of its base model)" $i) }}{{ end -}}
{{- with ($a.adapterSource | default dict).credentials }}{{ $n = append $n (printf "loraAdapters[%d].adapterSource.credentials: not used: the engine downloads the adapter with its model's hf_token" $i) }}{{ end -}}
{{- if eq (toString ($a.adapterSource | default dict).type) "local" }}{{ $n = append $n (printf "loraAdapters[%d].adapterSource.adapterPath: read by the engines, so it must be on their file system (a volume of the model's pods)" $i) }}{{ end -}}
{{- end }}{{ end -}}
{{- if and (include "vllm-stack.router.loraAdapters" $) (not $v.servingEngineSpec.vllmApiKey) (not (and $v.networkPolicy $v.networkPolicy.enabled)) }}{{ $n = append $n "loraAdapters: their base models' engines accept POST /v1/load_lora_adapter (runtime LoRA updating) from anything that reaches them; set servingEngineSpec.vllmApiKey or networkPolicy.enabled so only the router can load adapters" }}{{ end -}}
{{- with $v.loraController }}{{ $n = append $n "loraController: not deployed: the router loads, places and unloads the adapters of loraAdapters itself" }}{{ end -}}
{{- toYaml $n -}}
{{- end -}}
