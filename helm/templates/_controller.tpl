{{/* ---------------------------------------------------------------------------------------------
LMCache's controller (`lmcache_controller`, LMCache 0.5): the engines' LMCache workers report the chunks
they hold to it, and the router's kvaware routing asks it (`POST /lookup`) which engine holds the longest
prefix of a prompt. production-stack's router hosts one in its own process; here it is a Deployment of its own.
--------------------------------------------------------------------------------------------- */}}

{{- define "vllm-stack.controller.fullname" -}}
{{- printf "%s-lmcache-controller" (include "vllm-stack.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "vllm-stack.controller.selectorLabels" -}}
{{ include "vllm-stack.selectorLabels" . }}
app.kubernetes.io/component: lmcache-controller
{{- end -}}

{{- define "vllm-stack.controller.labels" -}}
{{ include "vllm-stack.labels" . }}
app.kubernetes.io/component: lmcache-controller
{{- end -}}

{{/* "true" when the chart deploys the controller: routingLogic kvaware (the router asks it), or
     lmcacheControllerSpec.enabled: true (the engines report to it, for your own tools). */}}
{{- define "vllm-stack.controller.enabled" -}}
{{- $c := .Values.lmcacheControllerSpec -}}
{{- if eq (toString $c.enabled) "true" -}}true
{{- else if and (ne (toString $c.enabled) "false") (eq (include "vllm-stack.router.kvAware" .) "true") -}}true
{{- end -}}
{{- end -}}

{{/* "true" when the router (or the endpoint pickers, which take its routing logic) routes by LMCache
     controller lookups. */}}
{{- define "vllm-stack.router.kvAware" -}}
{{- if and (include "vllm-stack.scheduler.enabled" .) (eq .Values.routerSpec.routingLogic "kvaware") -}}true{{- end -}}
{{- end -}}

{{/* The controller's ports as YAML: pull, reply, heartbeat (the workers' ZMQ sockets, production-stack's
     routerSpec.lmcacheController*Port) and api (its HTTP API, which the router asks). */}}
{{- define "vllm-stack.controller.ports" -}}
{{- $r := .Values.routerSpec -}}
pull: {{ include "vllm-stack.str" ($r.lmcacheControllerPort | default 9000) | int }}
reply: {{ include "vllm-stack.str" ($r.lmcacheControllerReplyPort | default 9001) | int }}
heartbeat: {{ include "vllm-stack.str" ($r.lmcacheControllerHeartbeatPort | default 9002) | int }}
api: {{ include "vllm-stack.str" .Values.lmcacheControllerSpec.apiPort | int }}
{{- end -}}

{{/* The router's --lmcache-controller-url. */}}
{{- define "vllm-stack.controller.url" -}}
{{- printf "http://%s:%d" (include "vllm-stack.controller.fullname" .) (int (include "vllm-stack.controller.ports" . | fromYaml).api) -}}
{{- end -}}

{{/* The first deployed model with LMCache (its image runs the controller), as YAML: index, or nothing. */}}
{{- define "vllm-stack.controller.imageModel" -}}
{{- $root := . -}}
{{- $found := "" -}}
{{- range $i, $m := .Values.servingEngineSpec.modelSpec -}}
{{- $ctx := dict "root" $root "model" $m -}}
{{- if and (eq $found "") (eq (include "vllm-stack.model.enabled" $ctx) "true") (eq (include "vllm-stack.model.lmcacheEnabled" $ctx) "true") -}}
{{- $found = toString $i -}}
{{- end -}}
{{- end -}}
{{- $found -}}
{{- end -}}

{{/* The controller's image: lmcacheControllerSpec.repository/tag, else the image of the first model with
     LMCache (the controller hashes token chunks as that LMCache does: the same LMCache and vLLM), else the
     chart's LMCache image. */}}
{{- define "vllm-stack.controller.image" -}}
{{- $c := .Values.lmcacheControllerSpec -}}
{{- $i := include "vllm-stack.controller.imageModel" . -}}
{{- if $c.repository -}}
{{- printf "%s:%s" $c.repository (toString ($c.tag | default (include "vllm-stack.defaultLMCacheTag" .))) -}}
{{- else if ne $i "" -}}
{{- include "vllm-stack.model.image" (dict "root" . "model" (index .Values.servingEngineSpec.modelSpec (int $i))) -}}
{{- else -}}
{{- printf "%s:%s" (include "vllm-stack.defaultLMCacheRepository" .) (include "vllm-stack.defaultLMCacheTag" .) -}}
{{- end -}}
{{- end -}}

{{/* "true" when this model's engines report to the chart's controller: the controller is deployed, the model
     runs LMCache, names no controller of its own (controllerPullUrl) and does not turn it off
     (enableController: false). Call with (dict "root" $ "model" M). */}}
{{- define "vllm-stack.model.chartController" -}}
{{- $lc := .model.lmcacheConfig | default dict -}}
{{- if and (eq (include "vllm-stack.controller.enabled" .root) "true") (eq (include "vllm-stack.model.enabled" .) "true") (eq (include "vllm-stack.model.lmcacheEnabled" .) "true") (ne (toString $lc.enableController) "false") (not $lc.controllerPullUrl) -}}true{{- end -}}
{{- end -}}

{{/* The engine's LMCACHE_LMCACHE_WORKER_PORTS: lmcacheConfig.workerPorts, else (with a controller) one port
     per GPU worker from 8001 (LMCache needs one per tensor/pipeline-parallel worker). Call with
     (dict "root" $ "model" M "controller" BOOL). */}}
{{- define "vllm-stack.model.workerPorts" -}}
{{- $lc := .model.lmcacheConfig | default dict -}}
{{- $vc := .model.vllmConfig | default dict -}}
{{- if $lc.workerPorts -}}
{{- include "vllm-stack.portList" $lc.workerPorts -}}
{{- else if .controller -}}
{{- $workers := mul (int ($vc.tensorParallelSize | default 1)) (int ($vc.pipelineParallelSize | default 1)) -}}
{{- $ports := list -}}
{{- range $w := until (int $workers) }}{{ $ports = append $ports (add 8001 $w) }}{{ end -}}
{{- include "vllm-stack.portList" $ports -}}
{{- end -}}
{{- end -}}

{{/* Checks of the controller's settings; renders nothing. */}}
{{- define "vllm-stack.controller.validate" -}}
{{- $r := .Values.routerSpec -}}
{{- $root := . -}}
{{- if and (eq (include "vllm-stack.router.kvAware" .) "true") (eq (toString .Values.lmcacheControllerSpec.enabled) "false") }}{{ fail "lmcacheControllerSpec.enabled: false, but routerSpec.routingLogic: kvaware asks the chart's LMCache controller which engine holds a prompt's prefix; remove enabled: false, or use routingLogic: prefixaware" }}{{ end -}}
{{- if eq (include "vllm-stack.router.kvAware" .) "true" -}}
{{- $any := false -}}
{{- range $m := .Values.servingEngineSpec.modelSpec }}{{ if eq (include "vllm-stack.model.chartController" (dict "root" $root "model" $m)) "true" }}{{ $any = true }}{{ end }}{{ end -}}
{{- if not $any }}{{ fail "routerSpec.routingLogic: kvaware needs LMCache engines: it routes by what the engines' LMCache reports to the LMCache controller, and no deployed model has lmcacheConfig.enabled: true (without enableController: false or a controllerPullUrl of its own); turn LMCache on for a model, or use routingLogic: prefixaware (KV-cache events, no LMCache needed)" }}{{ end -}}
{{- end -}}
{{- if eq (include "vllm-stack.controller.enabled" .) "true" -}}
{{- $ports := include "vllm-stack.controller.ports" . | fromYaml -}}
{{- $seen := dict -}}
{{- range $pair := list (list "pull" "routerSpec.lmcacheControllerPort") (list "reply" "routerSpec.lmcacheControllerReplyPort") (list "heartbeat" "routerSpec.lmcacheControllerHeartbeatPort") (list "api" "lmcacheControllerSpec.apiPort") -}}
{{- $key := index $pair 1 -}}
{{- $p := toString (get $ports (index $pair 0)) -}}
{{- if hasKey $seen $p }}{{ fail (printf "%s and %s are both %s: the LMCache controller needs four different ports (pull, reply, heartbeat, HTTP API)" (get $seen $p) $key $p) }}{{ end -}}
{{- $_ := set $seen $p $key -}}
{{- end -}}
{{- range $i, $m := .Values.servingEngineSpec.modelSpec -}}
{{- $ctx := dict "root" $root "model" $m -}}
{{- if eq (include "vllm-stack.model.chartController" $ctx) "true" -}}
{{- $where := printf "servingEngineSpec.modelSpec[%d] (%s)" $i $m.name -}}
{{- $lc := $m.lmcacheConfig -}}
{{- /* production-stack names the controller's ports twice, on the router and on each engine: they must agree. */ -}}
{{- range $key, $v := dict "controllerPort" (list "pull" "routerSpec.lmcacheControllerPort") "controllerReplyPort" (list "reply" "routerSpec.lmcacheControllerReplyPort") -}}
{{- $given := get $lc $key -}}
{{- if and (not (empty $given)) (ne (include "vllm-stack.str" $given | int) (int (get $ports (index $v 0)))) }}{{ fail (printf "%s: lmcacheConfig.%s %s differs from %s (%d): both name the LMCache controller's %s port, where the chart's controller (%s) listens; give them the same value, or leave lmcacheConfig.%s out" $where $key (include "vllm-stack.str" $given) (index $v 1) (int (get $ports (index $v 0))) (index $v 0) (include "vllm-stack.controller.fullname" $root) $key) }}{{ end -}}
{{- end -}}
{{- /* LMCache 0.5.6's controller hashes a lookup's tokens in 256-token chunks (ChunkedTokenDatabase's default). */ -}}
{{- if and (not (kindIs "invalid" $lc.chunkSize)) (ne (int $lc.chunkSize) 256) }}{{ fail (printf "%s: lmcacheConfig.chunkSize %d with the chart's LMCache controller: its lookups (LMCache 0.5.6) hash prompts in 256-token chunks, so engines storing %d-token chunks would never match; remove chunkSize (LMCache's default is 256) or set it to 256" $where (int $lc.chunkSize) (int $lc.chunkSize)) }}{{ end -}}
{{- $vc := $m.vllmConfig | default dict -}}
{{- $workers := mul (int ($vc.tensorParallelSize | default 1)) (int ($vc.pipelineParallelSize | default 1)) -}}
{{- $wp := splitList "," (include "vllm-stack.model.workerPorts" (dict "root" $root "model" $m "controller" true)) -}}
{{- if lt (len $wp) (int $workers) }}{{ fail (printf "%s: lmcacheConfig.workerPorts gives %d port(s) for %d GPU workers (tensorParallelSize x pipelineParallelSize): each worker's LMCache binds its own port for the controller; give %d ports" $where (len $wp) (int $workers) (int $workers)) }}{{ end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
