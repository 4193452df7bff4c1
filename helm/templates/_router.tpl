{{/* The router's command line: exactly the flags of docs/contracts.md. */}}
{{- define "vllm-stack.router.args" -}}
{{- $r := .Values.routerSpec -}}
{{- $args := list "--host" "0.0.0.0" "--port" (include "vllm-stack.str" $r.containerPort) -}}
{{- if eq $r.serviceDiscovery "k8s" -}}
{{- $args = concat $args (list "--service-discovery" "k8s" "--k8s-namespace" .Release.Namespace "--k8s-label-selector" (include "vllm-stack.engine.discoverySelector" .) "--k8s-port" (include "vllm-stack.str" .Values.servingEngineSpec.containerPort)) -}}
{{- else -}}
{{- $args = concat $args (list "--service-discovery" "static" "--static-backends" (required "routerSpec.staticBackends is required with serviceDiscovery: static" $r.staticBackends)) -}}
{{- with $r.staticModels }}{{ $args = concat $args (list "--static-models" .) }}{{ end -}}
{{- end -}}
{{- $args = concat $args (list "--routing-logic" $r.routingLogic) -}}
{{- with $r.sessionKey }}{{ $args = concat $args (list "--session-key" .) }}{{ end -}}
{{- with (include "vllm-stack.router.tokenizers" .) }}{{ $args = concat $args (list "--tokenizers" .) }}{{ end -}}
{{- $args = concat $args (list "--engine-scrape-interval" (include "vllm-stack.str" $r.engineScrapeInterval) "--health-check-interval" (include "vllm-stack.str" $r.healthCheckInterval) "--request-timeout" (include "vllm-stack.str" $r.requestTimeout) "--max-body-bytes" (include "vllm-stack.str" $r.maxBodyBytes) "--log-level" $r.logLevel) -}}
{{- /* What is left of the pod's grace period after the preStop sleep, minus 5 s to exit cleanly. */}}
{{- $grace := max 1 (sub (sub (int $r.terminationGracePeriodSeconds) (int $r.preStopSleepSeconds)) 5) -}}
{{- $args = concat $args (list "--shutdown-grace" (toString $grace)) -}}
{{- if (include "vllm-stack.router.config" .) }}{{ $args = concat $args (list "--config" "/etc/vllm-stack/router/config.yaml") }}{{ end -}}
{{- if $r.apiKeysSecret }}{{ $args = concat $args (list "--api-keys-file" "/etc/vllm-stack/api-keys/keys") }}{{ end -}}
{{- if $r.adminApiKeysSecret }}{{ $args = concat $args (list "--admin-api-keys-file" "/etc/vllm-stack/admin-keys/keys") }}{{ end -}}
{{- range $r.extraArgs }}{{ $args = append $args (toString .) }}{{ end -}}
{{- toYaml $args -}}
{{- end -}}

{{- define "vllm-stack.router.serviceAccountName" -}}
{{- .Values.routerSpec.serviceAccountName | default (include "vllm-stack.router.fullname" .) -}}
{{- end -}}

{{/*
The router image. The chart renders this project's router command line (production-stack's flag names,
this router's semantics); another router image, production-stack's (`lmcache/lmstack-router`) or a
build of it (`git-act-router` in its CI), would crash on it or misread it. So a repository is used as
given only when it is this project's router: the default, a mirror of it (the image name, the last path
segment, is `router`), or any repository with `routerSpec.vllmStackImage: true`. Anything else is
replaced by the default image and NOTES.txt says so (`vllmStackImage: false` replaces even a `router`).
*/}}
{{- define "vllm-stack.router.foreignImage" -}}
{{- $r := .Values.routerSpec -}}
{{- $own := ternary (eq (toString $r.vllmStackImage) "true") (eq (last (splitList "/" $r.repository)) "router") (ne (toString $r.vllmStackImage) "<nil>") -}}
{{- if not $own }}true{{ end -}}
{{- end -}}

{{- define "vllm-stack.router.image" -}}
{{- $r := .Values.routerSpec -}}
{{- if include "vllm-stack.router.foreignImage" . -}}
{{- printf "%s:%s" "ghcr.io/vllm-stack/router" .Chart.AppVersion -}}
{{- else -}}
{{- printf "%s:%s" $r.repository (toString ($r.tag | default .Chart.AppVersion)) -}}
{{- end -}}
{{- end -}}

{{/*
Registered LoRA adapters for the router (its `lora_adapters`), from production-stack's `loraAdapters`
layout: `name`, `baseModel` (a modelSpec's `name`, or a served model name), `adapterSource`
(`type: local` with `adapterPath`, or `type: huggingface` with `repository`), and our `tier`
(hot / warm / cold, default warm). The adapter's client-visible name is `adapterSource.adapterName`
(what production-stack loads it as), else `name`. Renders a YAML list, or nothing.
*/}}
{{- define "vllm-stack.router.loraAdapters" -}}
{{- $out := list -}}
{{- $names := list -}}
{{- range $i, $a := .Values.loraAdapters -}}
{{- if ne (toString $a.enabled) "false" -}}
{{- $src := $a.adapterSource | default dict -}}
{{- $where := printf "loraAdapters[%d] (%s)" $i ($a.name | default "") -}}
{{- with $src.pattern }}{{ fail (printf "%s: adapterSource.pattern (production-stack's operator finds several adapters by a pattern) is not implemented: register each adapter as its own entry" $where) }}{{ end -}}
{{- $base := "" -}}
{{- range $m := $.Values.servingEngineSpec.modelSpec -}}
{{- $ctx := dict "root" $ "model" $m -}}
{{- $served := include "vllm-stack.model.servedName" $ctx -}}
{{- if and (include "vllm-stack.model.enabled" $ctx) (or (eq $m.name (toString $a.baseModel)) (eq $served (toString $a.baseModel))) }}{{ $base = $served }}{{ end -}}
{{- end -}}
{{- if not $base }}{{ fail (printf "%s: baseModel %q is no deployed modelSpec's name or served model name" $where (toString $a.baseModel)) }}{{ end -}}
{{- $source := "" -}}
{{- if eq (toString $src.type) "huggingface" -}}
{{- $source = printf "hf:%s" (required (printf "%s: adapterSource.repository is required with type huggingface" $where) $src.repository) -}}
{{- else if eq (toString $src.type) "local" -}}
{{- $source = required (printf "%s: adapterSource.adapterPath is required with type local" $where) $src.adapterPath -}}
{{- else -}}
{{- fail (printf "%s: adapterSource.type must be local or huggingface (got %q)" $where (toString $src.type)) -}}
{{- end -}}
{{- $name := $src.adapterName | default $a.name | required (printf "%s: a name or adapterSource.adapterName is required" $where) -}}
{{- if has $name $names }}{{ fail (printf "%s: the adapter name %q is registered twice" $where $name) }}{{ end -}}
{{- if eq $name $base }}{{ fail (printf "%s: the adapter name %q is its base model's name" $where $name) }}{{ end -}}
{{- $names = append $names $name -}}
{{- $out = append $out (dict "name" $name "source" $source "base_model" $base "tier" ($a.tier | default "warm")) -}}
{{- end -}}
{{- end -}}
{{- with $out }}{{ toYaml . }}{{ end -}}
{{- end -}}

{{/* The router's configuration file: routerSpec.config with the adapters and weighted names added. */}}
{{- define "vllm-stack.router.config" -}}
{{- $r := .Values.routerSpec -}}
{{- $config := deepCopy ($r.config | default dict) -}}
{{- with (include "vllm-stack.router.loraAdapters" .) }}{{ $_ := set $config "lora_adapters" (concat ($config.lora_adapters | default list) (fromYamlArray .)) }}{{ end -}}
{{- with $r.weightedModels }}{{ $_ := set $config "weighted_models" . }}{{ end -}}
{{- with $config }}{{ toYaml . }}{{ end -}}
{{- end -}}

{{/* "true" when a registered adapter has this model as its base: the engine loads adapters at run time.
The registry's own resolution of baseModel (vllm-stack.router.loraAdapters), not a second matching. */}}
{{- define "vllm-stack.model.hasAdapters" -}}
{{- $served := include "vllm-stack.model.servedName" . -}}
{{- if include "vllm-stack.model.enabled" . -}}
{{- range (include "vllm-stack.router.loraAdapters" .root | fromYamlArray) -}}
{{- if eq .base_model $served }}true{{ end -}}
{{- end -}}
{{- end -}}
{{- end -}}
