{{/* ---------------------------------------------------------------------------------------------
Engine kinds (the router's vllm_stack.engines.kinds): a model's `engineKind` is `vllm` (the default) or
`sglang`. An SGLang model runs SGLang's own server, `python3 -m sglang.launch_server`, with the flags of
sglang 0.5.23 (sglang/srt/arg_groups/fields/*.py: a field foo_bar is the flag --foo-bar); its pods carry
the label vllm-stack.io/engine-kind, which the router's Kubernetes discovery reads, and the router's
`models` entry says `engine_kind: sglang` (the sense of the priority field it sends).
Call with (dict "root" $ "model" $modelSpec).
--------------------------------------------------------------------------------------------- */}}

{{- define "vllm-stack.model.engineKind" -}}
{{- $kind := .model.engineKind | default "vllm" -}}
{{- if not (has $kind (list "vllm" "sglang")) }}{{ fail (printf "servingEngineSpec.modelSpec (%s): engineKind must be vllm or sglang (got %q)" (toString .model.name) $kind) }}{{ end -}}
{{- /* The router hands a prompt's KV from prefill to decode as vLLM's connectors do (sequential legs);
     SGLang's bootstrap hand-over (both engines at once) is declared by its kind but not driven yet. */ -}}
{{- if and (eq $kind "sglang") (include "vllm-stack.model.givenRole" .) }}{{ fail (printf "servingEngineSpec.modelSpec (%s): engineKind sglang cannot take a prefill/decode role yet (the router drives vLLM's hand-over only); serve it without a role" (toString .model.name)) }}{{ end -}}
{{- $kind -}}
{{- end -}}

{{/* The Pod label naming a kind other than vLLM's (vLLM's pods carry none: the router's default). */}}
{{- define "vllm-stack.model.kindLabel" -}}
{{- $kind := include "vllm-stack.model.engineKind" . -}}
{{- if ne $kind "vllm" }}vllm-stack.io/engine-kind: {{ $kind }}{{ end -}}
{{- end -}}

{{- define "vllm-stack.sglang.image" -}}
{{- printf "%s:%s" (.model.repository | default "lmsysorg/sglang") (toString (.model.tag | default "v0.5.23")) -}}
{{- end -}}

{{/* The engine's probes: vLLM's /health; SGLang's /health generates a token, so readiness and start-up
     ask /ready (the tokenizer manager is up) and liveness /health (the scheduler answers). */}}
{{- define "vllm-stack.engine.probePath" -}}
{{- if and (eq (include "vllm-stack.model.engineKind" .) "sglang") (ne .probe "liveness") }}/ready{{ else }}/health{{ end -}}
{{- end -}}

{{- define "vllm-stack.sglang.args" -}}
{{- $root := .root -}}
{{- $m := .model -}}
{{- $sc := $m.sglangConfig | default dict -}}
{{- $spec := $root.Values.servingEngineSpec -}}
{{- $args := list "--model-path" ($m.modelURL | default $m.name) "--host" "0.0.0.0" "--port" (toString $spec.containerPort) "--served-model-name" (include "vllm-stack.model.servedName" .) "--enable-metrics" -}}
{{- /* One KV block per page: SGLang's default page is 1 token, which makes every token a KV event and a
     block of the router's prefix index. */ -}}
{{- $args = concat $args (list "--page-size" (include "vllm-stack.str" ($sc.pageSize | default 16))) -}}
{{- with $sc.tpSize }}{{ $args = concat $args (list "--tp-size" (include "vllm-stack.str" .)) }}{{ end -}}
{{- with $sc.device }}{{ $args = concat $args (list "--device" .) }}{{ end -}}
{{- with $m.modelRevision }}{{ $args = concat $args (list "--revision" .) }}{{ end -}}
{{- with (include "vllm-stack.vllmApiKeyRef" $root) }}{{ $args = concat $args (list "--api-key" "$(VLLM_API_KEY)") }}{{ end -}}
{{- if eq (include "vllm-stack.kvEvents.enabled" $root) "true" -}}
{{- $kv := dict "publisher" "zmq" "endpoint" (printf "tcp://*:%d" (int $spec.kvEvents.port)) -}}
{{- with $spec.kvEvents.replayPort }}{{ $_ := set $kv "replay_endpoint" (printf "tcp://*:%d" (int .)) }}{{ end -}}
{{- $args = concat $args (list "--kv-events-config" (toJson $kv)) -}}
{{- end -}}
{{- if or $sc.enableLora (include "vllm-stack.model.hasAdapters" .) -}}
{{- $args = append $args "--enable-lora" -}}
{{- with $sc.maxLorasPerBatch }}{{ $args = concat $args (list "--max-loras-per-batch" (include "vllm-stack.str" .)) }}{{ end -}}
{{- end -}}
{{- if eq ($m.schedulingPolicy | default "") "priority" }}{{ $args = append $args "--enable-priority-scheduling" }}{{ end -}}
{{- range ($sc.extraArgs | default list) }}{{ $args = append $args (include "vllm-stack.str" .) }}{{ end -}}
{{- toYaml $args -}}
{{- end -}}
