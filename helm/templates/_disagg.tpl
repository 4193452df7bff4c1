{{/* ---------------------------------------------------------------------------------------------
Disaggregated prefill: a model's role (prefill / decode / both), its LMCache PD settings in LMCache 0.5's
terms, and what the router needs to orchestrate the pools (router/vllm_stack/director/disagg).
Model-level templates take (dict "root" $ "model" $modelSpec); the others take the root context.
--------------------------------------------------------------------------------------------- */}}

{{/* "true" when the model gives production-stack's pre-0.5 PD spelling: `enableNixl: true` with
`nixlRole: sender|receiver`. Only then do the other nixl* keys have a 0.5 meaning to translate to; elsewhere
validate.yaml refuses them (LMCache 0.5 would ignore them silently). */}}
{{- define "vllm-stack.model.nixlPD" -}}
{{- if eq (include "vllm-stack.model.lmcacheEnabled" .) "true" -}}
{{- $lc := .model.lmcacheConfig -}}
{{- if and (eq (toString $lc.enableNixl) "true") (has (toString $lc.nixlRole) (list "sender" "receiver")) -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{/* A port or byte count production-stack writes as a string ("55555"): the number, or a failure naming the key.
Call with (dict "value" V "key" "nixlPeerPort" "where" W). */}}
{{- define "vllm-stack.pd.number" -}}
{{- $v := include "vllm-stack.str" .value -}}
{{- if not (regexMatch "^[0-9]+$" $v) }}{{ fail (printf "%s: lmcacheConfig.%s must be a whole number (got %q)" .where .key $v) }}{{ end -}}
{{- $v -}}
{{- end -}}

{{/* The model's LMCache PD settings as lmcacheConfig.pd spells them (LMCache 0.5 enable_pd, pd_*), with
production-stack's nixl* keys translated: nixlRole -> role; a receiver's nixlPeerHost -> peerHost and
nixlPeerPort -> peerInitPort (a sender's are not needed: the router names the receiver in each request);
nixlBufferSize -> bufferSize; nixlBufferDevice -> bufferDevice. Keys given in `pd` win. YAML, or nothing
when the engines are no PD sender or receiver. */}}
{{- define "vllm-stack.model.pd" -}}
{{- if eq (include "vllm-stack.model.lmcacheEnabled" .) "true" -}}
{{- $lc := .model.lmcacheConfig -}}
{{- $pd := deepCopy ($lc.pd | default dict) -}}
{{- if eq (include "vllm-stack.model.nixlPD" .) "true" -}}
{{- $where := printf "servingEngineSpec.modelSpec (%s)" .model.name -}}
{{- $t := dict "role" (toString $lc.nixlRole) -}}
{{- if eq $t.role "receiver" -}}
{{- with $lc.nixlPeerHost }}{{ $_ := set $t "peerHost" (toString .) }}{{ end -}}
{{- with $lc.nixlPeerPort }}{{ $_ := set $t "peerInitPort" (include "vllm-stack.pd.number" (dict "value" . "key" "nixlPeerPort" "where" $where) | atoi) }}{{ end -}}
{{- end -}}
{{- with $lc.nixlBufferSize }}{{ $_ := set $t "bufferSize" (include "vllm-stack.pd.number" (dict "value" . "key" "nixlBufferSize" "where" $where) | int64) }}{{ end -}}
{{- with $lc.nixlBufferDevice -}}
{{- if not (has (toString .) (list "cuda" "cpu")) }}{{ fail (printf "%s: lmcacheConfig.nixlBufferDevice must be cuda or cpu (LMCache 0.5 pd_buffer_device; got %q)" $where (toString .)) }}{{ end -}}
{{- $_ := set $t "bufferDevice" (toString .) -}}
{{- end -}}
{{- if and $pd.role (ne (toString $pd.role) $t.role) }}{{ fail (printf "%s: lmcacheConfig.pd.role %s and nixlRole %s disagree: give one of them" $where $pd.role $t.role) }}{{ end -}}
{{- $pd = merge $pd $t -}}
{{- end -}}
{{- if $pd.role }}{{ toYaml $pd }}{{ end -}}
{{- end -}}
{{- end -}}

{{/* The role the model's values give: `role`, else its LMCache PD role (sender: prefill, receiver: decode),
else production-stack's lmcacheConfig.kvRole (kv_producer: prefill, kv_consumer: decode, kv_both: both);
nothing when none is given. Sources that are given must agree. */}}
{{- define "vllm-stack.model.givenRole" -}}
{{- $m := .model -}}
{{- $found := list -}}
{{- with $m.role }}{{ $found = append $found (list (toString .) (printf "role %s" .)) }}{{ end -}}
{{- if eq (include "vllm-stack.model.lmcacheEnabled" .) "true" -}}
{{- with (include "vllm-stack.model.pd" . | fromYaml).role -}}
{{- $key := ternary "pd.role" "nixlRole" (not (empty ($m.lmcacheConfig.pd | default dict).role)) -}}
{{- $found = append $found (list (ternary "prefill" "decode" (eq . "sender")) (printf "lmcacheConfig.%s %s" $key .)) -}}
{{- end -}}
{{- with $m.lmcacheConfig.kvRole -}}
{{- $found = append $found (list (get (dict "kv_producer" "prefill" "kv_consumer" "decode" "kv_both" "both") (toString .)) (printf "lmcacheConfig.kvRole %s" .)) -}}
{{- end -}}
{{- end -}}
{{- range $found -}}
{{- if ne (index . 0) (index (first $found) 0) }}{{ fail (printf "servingEngineSpec.modelSpec (%s): %s (a %s engine) and %s (a %s engine) disagree: a PD sender or kv_producer is a prefill engine, a receiver or kv_consumer a decode engine" $m.name (index (first $found) 1) (index (first $found) 0) (index . 1) (index . 0)) }}{{ end -}}
{{- end -}}
{{- with $found }}{{ index (first .) 0 }}{{ end -}}
{{- end -}}

{{/* prefill, decode or both (whole requests): the given role, else both. */}}
{{- define "vllm-stack.model.role" -}}
{{- include "vllm-stack.model.givenRole" . | default "both" -}}
{{- end -}}

{{/* The pods' role label, which the router's discovery reads (and which wins over production-stack's
--prefill-model-labels / --decode-model-labels). Rendered only when the values give a role: a label on
every engine would override those flags for files that rely on them, and would restart every engine of an
existing release on upgrade for nothing. */}}
{{- define "vllm-stack.model.roleLabel" -}}
{{- with (include "vllm-stack.model.givenRole" .) }}vllm-stack.io/role: {{ . }}{{ end -}}
{{- end -}}

{{/* "true" when a deployed model has prefill-role engines: the router serves disaggregated. */}}
{{- define "vllm-stack.disagg.prefill" -}}
{{- $root := . -}}
{{- range $m := .Values.servingEngineSpec.modelSpec -}}
{{- $ctx := dict "root" $root "model" $m -}}
{{- if and (eq (include "vllm-stack.model.enabled" $ctx) "true") (eq (include "vllm-stack.model.role" $ctx) "prefill") }}true{{ break }}{{ end -}}
{{- end -}}
{{- end -}}

{{/* "true" when the KV hand-over is LMCache 0.5's own PD protocol (the router's --disagg-protocol lmcache):
a deployed model's engines are LMCache PD senders. Otherwise roles use vLLM's kv_transfer_params (the
router's default protocol, vllm). */}}
{{- define "vllm-stack.disagg.lmcache" -}}
{{- $root := . -}}
{{- if .Values.routerSpec.enableRouter -}}
{{- range $m := .Values.servingEngineSpec.modelSpec -}}
{{- $ctx := dict "root" $root "model" $m -}}
{{- if and (eq (include "vllm-stack.model.enabled" $ctx) "true") (eq (toString (include "vllm-stack.model.pd" $ctx | fromYaml).role) "sender") }}true{{ break }}{{ end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The ports of the LMCache PD protocol, as the router needs them: the decode engines' pd_peer_init_port
and pd_peer_alloc_port (the router names them in each prefill request's disagg_spec, so every receiver
must use the same), and the port the router takes the senders' notifications on (their pd_proxy_port). */}}
{{- define "vllm-stack.disagg.ports" -}}
{{- $root := . -}}
{{- $seen := dict -}}
{{- range $m := .Values.servingEngineSpec.modelSpec -}}
{{- $ctx := dict "root" $root "model" $m -}}
{{- $pd := include "vllm-stack.model.pd" $ctx | fromYaml -}}
{{- if and (eq (include "vllm-stack.model.enabled" $ctx) "true") $pd.role -}}
{{- $mine := ternary (dict "notifyPort" (list ($pd.proxyPort | default 7500) "pd.proxyPort")) (dict "initPort" (list ($pd.peerInitPort | default 7300) (ternary "pd.peerInitPort" "nixlPeerPort" (hasKey ($m.lmcacheConfig.pd | default dict) "peerInitPort"))) "allocPort" (list ($pd.peerAllocPort | default 7400) "pd.peerAllocPort")) (eq $pd.role "sender") -}}
{{- range $key, $v := $mine -}}
{{- $port := include "vllm-stack.str" (index $v 0) -}}
{{- with (get $seen $key) -}}
{{- if ne (index . 0) $port }}{{ fail (printf "servingEngineSpec.modelSpec (%s): lmcacheConfig.%s %s differs from %s's %s: the router has one value for all %s (its --disagg-%s), so give them the same" $m.name (index $v 1) $port (index . 1) (index . 0) (ternary "senders" "receivers" (eq $key "notifyPort")) (get (dict "notifyPort" "notify-port" "initPort" "receiver-init-port" "allocPort" "receiver-alloc-port") $key)) }}{{ end -}}
{{- else -}}
{{- $_ := set $seen $key (list $port $m.name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
initPort: {{ (get $seen "initPort" | default (list "7300")) | first }}
allocPort: {{ (get $seen "allocPort" | default (list "7400")) | first }}
notifyPort: {{ (get $seen "notifyPort" | default (list "7500")) | first }}
{{- end -}}

{{/* The router's --routing-logic: production-stack's disaggregated_prefill_orchestrated is the router's
disaggregated_prefill, which orchestrates every disaggregated request (prefill leg, then decode) itself. */}}
{{- define "vllm-stack.router.routingLogic" -}}
{{- $l := .Values.routerSpec.routingLogic -}}
{{- ternary "disaggregated_prefill" $l (eq $l "disaggregated_prefill_orchestrated") -}}
{{- end -}}
