{{/* The router's command line: exactly the flags of docs/contracts.md. */}}
{{- define "vllm-stack.router.args" -}}
{{- include "vllm-stack.scheduler.args" (dict "root" . "pool" "") -}}
{{- end -}}

{{/*
The command line of the router, or (with "pool", an InferencePool's name) of the endpoint picker of that
pool (inference-extension-epp.yaml): `vllm-stack router` with --ext-proc-port, which is `vllm-stack epp`.
The picker takes the router's scheduling (routing logic, kvaware's controller, session key, tokenizers,
intervals, limits, tracing, --config, client and priority keys) but finds its engines through the pool
(its selector and port, read from the API server), relays nothing (no disaggregated prefill: validate.yaml
refuses it), serves no adapter loading (no admin keys) and takes inferenceExtension.epp.extraArgs
instead of routerSpec.extraArgs. Call with (dict "root" $ "pool" NAME-or-"").
*/}}
{{- define "vllm-stack.scheduler.args" -}}
{{- $root := .root -}}
{{- $pool := .pool -}}
{{- $r := $root.Values.routerSpec -}}
{{- $args := list "--host" "0.0.0.0" "--port" (include "vllm-stack.str" $r.containerPort) -}}
{{- if $pool -}}
{{- $args = concat $args (list "--ext-proc-port" (include "vllm-stack.str" $root.Values.inferenceExtension.epp.grpcPort) "--service-discovery" "k8s" "--k8s-namespace" $root.Release.Namespace "--inference-pool" $pool) -}}
{{- else if eq $r.serviceDiscovery "k8s" -}}
{{- $args = concat $args (list "--service-discovery" "k8s" "--k8s-namespace" $root.Release.Namespace "--k8s-label-selector" (include "vllm-stack.engine.discoverySelector" $root) "--k8s-port" (include "vllm-stack.str" $root.Values.servingEngineSpec.containerPort)) -}}
{{- else if eq $r.serviceDiscovery "external-only" -}}
{{- $args = concat $args (list "--service-discovery" "external-only") -}}
{{- else -}}
{{- $args = concat $args (list "--service-discovery" "static" "--static-backends" (required "routerSpec.staticBackends is required with serviceDiscovery: static" $r.staticBackends)) -}}
{{- with $r.staticModels }}{{ $args = concat $args (list "--static-models" .) }}{{ end -}}
{{- end -}}
{{- $args = concat $args (list "--routing-logic" (include "vllm-stack.router.routingLogic" $root)) -}}
{{- /* kvaware: the chart's LMCache controller answers which engine holds a prompt's longest prefix. */ -}}
{{- if eq (include "vllm-stack.router.kvAware" $root) "true" -}}
{{- $args = concat $args (list "--lmcache-controller-url" (include "vllm-stack.controller.url" $root)) -}}
{{- if not (kindIs "invalid" $r.kvAwareThreshold) }}{{ $args = concat $args (list "--kv-aware-threshold" (include "vllm-stack.str" $r.kvAwareThreshold)) }}{{ end -}}
{{- end -}}
{{- if not $pool -}}
{{- /* Disaggregated prefill (_disagg.tpl): on with prefill-role engines, or production-stack's enablePD. */ -}}
{{- if or (eq (toString $r.enablePD) "true") (include "vllm-stack.disagg.prefill" $root) }}{{ $args = append $args "--disaggregation" }}{{ end -}}
{{- if include "vllm-stack.disagg.lmcache" $root -}}
{{- $ports := include "vllm-stack.disagg.ports" $root | fromYaml -}}
{{- $args = concat $args (list "--disagg-protocol" "lmcache" "--disagg-receiver-init-port" (include "vllm-stack.str" $ports.initPort) "--disagg-receiver-alloc-port" (include "vllm-stack.str" $ports.allocPort) "--disagg-notify-port" (include "vllm-stack.str" $ports.notifyPort)) -}}
{{- end -}}
{{- end -}}
{{- with $r.sessionKey }}{{ $args = concat $args (list "--session-key" .) }}{{ end -}}
{{- /* production-stack's rootPath: every route under it as well as at / (the probes use it: router-deployment.yaml). */ -}}
{{- with $r.rootPath }}{{ $args = concat $args (list "--root-path" .) }}{{ end -}}
{{- /* A stream whose engine breaks is continued elsewhere unless turned off (the picker relays nothing). */ -}}
{{- if and (not $pool) (eq (toString $r.streamContinuation) "false") }}{{ $args = append $args "--no-stream-continuation" }}{{ end -}}
{{- /* production-stack's prefixaware minimum match, in its unit (characters): 0 renders nothing, as there. */ -}}
{{- if $r.prefixMinMatchLength }}{{ $args = concat $args (list "--prefix-min-match-length" (include "vllm-stack.str" $r.prefixMinMatchLength)) }}{{ end -}}
{{- with (include "vllm-stack.router.tokenizers" $root) }}{{ $args = concat $args (list "--tokenizers" .) }}{{ end -}}
{{- $args = concat $args (list "--engine-scrape-interval" (include "vllm-stack.str" $r.engineScrapeInterval) "--health-check-interval" (include "vllm-stack.str" $r.healthCheckInterval) "--request-timeout" (include "vllm-stack.str" $r.requestTimeout) "--max-body-bytes" (include "vllm-stack.str" $r.maxBodyBytes) "--log-level" $r.logLevel) -}}
{{- /* What is left of the pod's grace period after the preStop sleep, minus 5 s to exit cleanly. */}}
{{- $grace := max 1 (sub (sub (int $r.terminationGracePeriodSeconds) (int $r.preStopSleepSeconds)) 5) -}}
{{- $args = concat $args (list "--shutdown-grace" (toString $grace)) -}}
{{- /* Tracing: production-stack's routerSpec.otel, rendered as its chart does (serviceName vllm-router by default);
     the endpoint pickers' spans under that name with -epp. */ -}}
{{- with ($r.otel | default dict) }}{{ if .endpoint }}
{{- $args = concat $args (list "--otel-endpoint" .endpoint "--otel-service-name" (printf "%s%s" (.serviceName | default "vllm-router") (ternary "-epp" "" (not (empty $pool))))) -}}
{{- if .secure }}{{ $args = append $args "--otel-secure" }}{{ end -}}
{{- with .protocol }}{{ $args = concat $args (list "--otlp-traces-protocol" .) }}{{ end -}}
{{- if not (kindIs "invalid" .sampleRatio) }}{{ $args = concat $args (list "--trace-sample-ratio" (toString .sampleRatio)) }}{{ end -}}
{{- end }}{{ end -}}
{{- /* The Batch API (routerSpec.batch): the router's, never a picker's; its volume at the batch dir. */ -}}
{{- if and (not $pool) (include "vllm-stack.router.batch" $root) -}}
{{- $args = concat $args (list "--batch-api" "--batch-dir" (include "vllm-stack.router.batchDir" $root)) -}}
{{- $b := $r.batch -}}
{{- range $key, $flag := dict "completionWindowSeconds" "--batch-completion-window" "maxFileBytes" "--batch-max-file-bytes" "concurrency" "--batch-concurrency" "reserveSlots" "--batch-reserve-slots" "leaseSeconds" "--batch-lease-seconds" -}}
{{- $v := get $b $key -}}
{{- if not (kindIs "invalid" $v) }}{{ $args = concat $args (list $flag (include "vllm-stack.str" $v)) }}{{ end -}}
{{- end -}}
{{- end -}}
{{- if (include "vllm-stack.router.config" $root) }}{{ $args = concat $args (list "--config" "/etc/vllm-stack/router/config.yaml") }}{{ end -}}
{{- if $r.apiKeysSecret }}{{ $args = concat $args (list "--api-keys-file" "/etc/vllm-stack/api-keys/keys") }}{{ end -}}
{{- if and $r.adminApiKeysSecret (not $pool) }}{{ $args = concat $args (list "--admin-api-keys-file" "/etc/vllm-stack/admin-keys/keys") }}{{ end -}}
{{- if ($r.priority | default dict).apiKeysSecret }}{{ $args = concat $args (list "--priority-api-keys-file" "/etc/vllm-stack/priority-keys/keys") }}{{ end -}}
{{- if $pool -}}
{{- $args = concat $args (include "vllm-stack.epp.extraArgs" $root | fromYamlArray) -}}
{{- else -}}
{{- $args = concat $args (include "vllm-stack.router.extraArgs" $root | fromYaml).args -}}
{{- end -}}
{{- toYaml $args -}}
{{- end -}}

{{/* inferenceExtension.epp.extraArgs: flags of this router (files/router-flags.yaml `ours`) as given, a value
after the flag that takes one; anything else fails the render (the picker would exit on it). A YAML list. */}}
{{- define "vllm-stack.epp.extraArgs" -}}
{{- $ours := (.Files.Get "files/router-flags.yaml" | fromYaml).ours -}}
{{- $args := list -}}
{{- $value := false -}}
{{- range .Values.inferenceExtension.epp.extraArgs -}}
{{- $w := include "vllm-stack.str" . -}}
{{- if $value }}{{ $value = false }}{{ $args = append $args $w }}{{ continue }}{{ end -}}
{{- $name := regexReplaceAll "=.*$" $w "" -}}
{{- if not (hasKey $ours $name) }}{{ fail (printf "inferenceExtension.epp.extraArgs: %q is not a flag of vllm-stack router (vllm-stack router --help lists them; a value must follow the flag that takes it)" $w) }}{{ end -}}
{{- if hasPrefix "--batch-" $name }}{{ fail (printf "inferenceExtension.epp.extraArgs: %s: an endpoint picker serves no Batch API; the router does (routerSpec.batch)" $name) }}{{ end -}}
{{- $args = append $args $w -}}
{{- if and (eq (get $ours $name) "value") (eq $name $w) }}{{ $value = true }}{{ end -}}
{{- end -}}
{{- if $value }}{{ fail "inferenceExtension.epp.extraArgs: the last flag takes a value and has none" }}{{ end -}}
{{- toYaml $args -}}
{{- end -}}

{{- define "vllm-stack.router.serviceAccountName" -}}
{{- .Values.routerSpec.serviceAccountName | default (include "vllm-stack.router.objectName" (dict "root" . "kind" "ServiceAccount")) -}}
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
(hot / warm / cold, default warm) and `criticality` (critical / standard / sheddable: its requests'
default priority; none: its base model's). The adapter's client-visible name is `adapterSource.adapterName`
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
{{- $entry := dict "name" $name "source" $source "base_model" $base "tier" ($a.tier | default "warm") -}}
{{- with $a.criticality }}{{ $_ := set $entry "criticality" (include "vllm-stack.criticality" (dict "value" . "where" $where)) }}{{ end -}}
{{- $out = append $out $entry -}}
{{- end -}}
{{- end -}}
{{- with $out }}{{ toYaml . }}{{ end -}}
{{- end -}}

{{/* A criticality (critical / standard / sheddable) as given, or a failure naming `where`.
Call with (dict "value" V "where" "servingEngineSpec.modelSpec[0] (m)"). */}}
{{- define "vllm-stack.criticality" -}}
{{- $v := toString .value -}}
{{- if not (has $v (list "critical" "standard" "sheddable")) }}{{ fail (printf "%s: criticality must be critical, standard or sheddable (got %q)" .where $v) }}{{ end -}}
{{- $v -}}
{{- end -}}

{{/* The --scheduling-policy given in the model's vllmConfig.extraArgs (`--scheduling-policy X` or
`--scheduling-policy=X`; the last one, as vLLM's parser reads them), or nothing. Call with (dict "root" $ "model" M). */}}
{{- define "vllm-stack.model.extraArgsSchedulingPolicy" -}}
{{- $words := list -}}
{{- range (.model.vllmConfig | default dict).extraArgs }}{{ $words = append $words (include "vllm-stack.str" .) }}{{ end -}}
{{- $policy := "" -}}
{{- range $i, $w := $words -}}
{{- $w = replace "_" "-" $w -}}
{{- if and (eq $w "--scheduling-policy") (lt (add1 $i) (len $words)) }}{{ $policy = index $words (add1 $i) }}
{{- else if hasPrefix "--scheduling-policy=" $w }}{{ $policy = trimPrefix "--scheduling-policy=" $w }}{{ end -}}
{{- end -}}
{{- $policy -}}
{{- end -}}

{{/* The vLLM scheduling policy of the model's engines: `priority`, `fcfs`, or nothing (vLLM's default,
fcfs). From modelSpec.schedulingPolicy, or vllmConfig.extraArgs (production-stack files write it there);
both given and different: a failure. Call with (dict "root" $ "model" M). */}}
{{- define "vllm-stack.model.schedulingPolicy" -}}
{{- $key := toString (.model.schedulingPolicy | default "") -}}
{{- $given := include "vllm-stack.model.extraArgsSchedulingPolicy" . -}}
{{- $where := printf "servingEngineSpec.modelSpec (%s)" (toString .model.name) -}}
{{- if and $key (not (has $key (list "fcfs" "priority"))) }}{{ fail (printf "%s: schedulingPolicy must be fcfs or priority (got %q)" $where $key) }}{{ end -}}
{{- if and $key $given (ne $key $given) }}{{ fail (printf "%s: schedulingPolicy %s and --scheduling-policy %s in vllmConfig.extraArgs disagree: give one of them" $where $key $given) }}{{ end -}}
{{- $given | default $key -}}
{{- end -}}

{{/*
The router's `models`: one entry per deployed modelSpec entry, by served name, with its `criticality`
(the requests' default priority), `engine_priority: true` when its engines run vLLM with
`--scheduling-policy priority` (the router then writes each request's priority into the body), and
`engine_kind` when its engines are not vLLM (_sglang.tpl). Entries that
serve the same name become one, and must agree. Renders a YAML list, or nothing.
*/}}
{{- define "vllm-stack.router.models" -}}
{{- $out := list -}}
{{- $seen := dict -}}
{{- range $i, $m := .Values.servingEngineSpec.modelSpec -}}
{{- $ctx := dict "root" $ "model" $m -}}
{{- if include "vllm-stack.model.enabled" $ctx -}}
{{- $where := printf "servingEngineSpec.modelSpec[%d] (%s)" $i (toString $m.name) -}}
{{- $served := include "vllm-stack.model.servedName" $ctx -}}
{{- $entry := dict "name" $served -}}
{{- with $m.criticality }}{{ $_ := set $entry "criticality" (include "vllm-stack.criticality" (dict "value" . "where" $where)) }}{{ end -}}
{{- if eq (include "vllm-stack.model.schedulingPolicy" $ctx) "priority" }}{{ $_ := set $entry "engine_priority" true }}{{ end -}}
{{- with (include "vllm-stack.model.kindLabel" $ctx) }}{{ $_ := set $entry "engine_kind" (include "vllm-stack.model.engineKind" $ctx) }}{{ end -}}
{{- if hasKey $seen $served -}}
{{- if ne (toJson (get $seen $served)) (toJson $entry) }}{{ fail (printf "%s: serves %q like another modelSpec entry, but with another criticality or scheduling policy: give them the same" $where $served) }}{{ end -}}
{{- else -}}
{{- $_ := set $seen $served $entry -}}
{{- $out = append $out $entry -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- with $out }}{{ toYaml . }}{{ end -}}
{{- end -}}

{{/* routerSpec.priority as router settings: only those that differ from the router's defaults. */}}
{{- define "vllm-stack.router.prioritySettings" -}}
{{- $p := .Values.routerSpec.priority | default dict -}}
{{- $sat := $p.saturation | default dict -}}
{{- $queue := $p.queue | default dict -}}
{{- $eviction := $p.eviction | default dict -}}
{{- $out := dict -}}
{{- if eq (toString $p.enabled) "false" }}{{ $_ := set $out "priority_scheduling" false }}{{ end -}}
{{- if eq (toString $eviction.enabled) "true" }}{{ $_ := set $out "eviction_enabled" true }}{{ end -}}
{{- with $p.header }}{{ if ne (lower (toString .)) "x-request-priority" }}{{ $_ := set $out "priority_header" (toString .) }}{{ end }}{{ end -}}
{{- range $key, $v := dict "saturation_max_waiting" (list $sat.maxWaiting 5.0) "saturation_max_kv_cache_usage" (list $sat.maxKvCacheUsage 0.8) "critical_max_waiting" (list $p.criticalMaxWaiting 50.0) "critical_reserve_slots" (list $p.criticalReserveSlots 0.0) "queue_max_per_model" (list $queue.maxPerModel 1000.0) "queue_max_per_band" (list $queue.maxPerBand 0.0) "queue_timeout" (list $queue.timeoutSeconds 60.0) "eviction_after" (list $eviction.afterSeconds 2.0) -}}
{{- $given := index $v 0 -}}
{{- if and (not (kindIs "invalid" $given)) (ne (float64 $given) (index $v 1)) }}{{ $_ := set $out $key $given }}{{ end -}}
{{- end -}}
{{- with $out }}{{ toYaml . }}{{ end -}}
{{- end -}}

{{/* The router's configuration file: routerSpec.config with the models, the priority settings, the adapters
and the weighted names added. A key routerSpec.config gives itself (`models`, a priority setting) is kept. */}}
{{- define "vllm-stack.router.config" -}}
{{- $r := .Values.routerSpec -}}
{{- $config := deepCopy ($r.config | default dict) -}}
{{- if not (hasKey $config "models") }}{{ with (include "vllm-stack.router.models" .) }}{{ $_ := set $config "models" (fromYamlArray .) }}{{ end }}{{ end -}}
{{- range $key, $v := (include "vllm-stack.router.prioritySettings" . | fromYaml) }}{{ if not (hasKey $config $key) }}{{ $_ := set $config $key $v }}{{ end }}{{ end -}}
{{- with (include "vllm-stack.router.loraAdapters" .) }}{{ $_ := set $config "lora_adapters" (concat ($config.lora_adapters | default list) (fromYamlArray .)) }}{{ end -}}
{{- with $r.weightedModels }}{{ $_ := set $config "weighted_models" . }}{{ end -}}
{{- /* routerSpec.tenants: the declaration beside config.yaml in the same ConfigMap (router-configmap.yaml) */ -}}
{{- if and $r.tenants (not (hasKey $config "tenants_file")) }}{{ $_ := set $config "tenants_file" "/etc/vllm-stack/router/tenants.yaml" }}{{ end -}}
{{- if and $r.tenantHeader (ne $r.tenantHeader "x-llm-d-inference-fairness-id") (not (hasKey $config "tenant_header")) }}{{ $_ := set $config "tenant_header" $r.tenantHeader }}{{ end -}}
{{- if and (not (kindIs "invalid" $r.tenantHeadroomSlots)) (ne (float64 $r.tenantHeadroomSlots) 1.0) (not (hasKey $config "tenant_headroom_slots")) }}{{ $_ := set $config "tenant_headroom_slots" $r.tenantHeadroomSlots }}{{ end -}}
{{- if and (not (kindIs "invalid" $r.tenantShareSeconds)) (ne (float64 $r.tenantShareSeconds) 5.0) (not (hasKey $config "tenant_share_seconds")) }}{{ $_ := set $config "tenant_share_seconds" $r.tenantShareSeconds }}{{ end -}}
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

{{/*
routerSpec.batch: the OpenAI Batch API (/v1/files, /v1/batches) in the router. "true" when the router runs
and serves it. The batch volume (router-batch-pvc.yaml, or storage.existingClaim) is mounted at the batch dir;
without a database (storage of the batches' state in SQLite there) one router owns it (validate.yaml).
*/}}
{{- define "vllm-stack.router.batch" -}}
{{- $b := .Values.routerSpec.batch | default dict -}}
{{- if and .Values.routerSpec.enableRouter (eq (toString $b.enabled) "true") }}true{{ end -}}
{{- end -}}

{{- define "vllm-stack.router.batchDir" -}}
/var/lib/vllm-stack/batch
{{- end -}}

{{/* The claim mounted at the batch dir: storage.existingClaim, or the chart's. */}}
{{- define "vllm-stack.router.batchClaim" -}}
{{- (.Values.routerSpec.batch.storage | default dict).existingClaim | default (include "vllm-stack.router.objectName" (dict "root" . "kind" "PersistentVolumeClaim")) -}}
{{- end -}}

{{/* "true" when the router Deployment must be Recreated: batch without a database (one router owns the SQLite
file: two must not run at once) or on a volume that is not ReadWriteMany (the new pod could not mount it while
the old one holds it, and the old one is not stopped before the new one is ready). */}}
{{- define "vllm-stack.router.batchRecreate" -}}
{{- if include "vllm-stack.router.batch" . -}}
{{- $b := .Values.routerSpec.batch -}}
{{- if or (not ($b.database | default dict).secretName) (ne (toString ($b.storage | default dict).accessMode) "ReadWriteMany") }}true{{ end -}}
{{- end -}}
{{- end -}}

{{/* The router container's env for the Batch API: the database URL from its Secret (it holds a password:
never a flag, never a literal). A YAML list, or nothing. */}}
{{- define "vllm-stack.router.batchEnv" -}}
{{- if include "vllm-stack.router.batch" . -}}
{{- with (.Values.routerSpec.batch.database | default dict) -}}
{{- if .secretName }}
- name: VLLM_STACK_BATCH_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ .secretName }}
      key: {{ .secretKey | default "url" }}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The router container's env for the rate limits' shared store: the Redis URL from its Secret (it may
hold a password: never a flag, never a literal). A YAML list, or nothing. */}}
{{- define "vllm-stack.router.rateLimitEnv" -}}
{{- with .Values.routerSpec.rateLimitStore -}}
- name: VLLM_STACK_RATE_LIMIT_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .secretName }}
      key: {{ .secretKey | default "url" }}
{{- end -}}
{{- end -}}

{{/* The router container's env before routerSpec.env (vllm-stack.env.merged: one entry per name). */}}
{{- define "vllm-stack.router.chartEnv" -}}
- name: TMPDIR
  value: /tmp
{{- with (include "vllm-stack.router.vllmApiKeyRef" .) }}
- name: VLLM_API_KEY
  valueFrom:
    secretKeyRef:
      {{- . | nindent 6 }}
{{- end }}
{{- if contains "=hf:" (include "vllm-stack.router.tokenizers" .) }}
{{- /* Tokenizer files fetched from the Hub for prefix routing (vllm_stack.scheduling.index.tokenizer_source). */}}
- name: VLLM_STACK_CACHE_DIR
  value: /tmp/vllm-stack
{{- with (include "vllm-stack.router.hfTokenRef" .) }}
- name: HF_TOKEN
  valueFrom:
    {{- . | nindent 4 }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
routerSpec.extraArgs as this router takes them (files/router-flags.yaml): a flag of this router passes as
given; production-stack's router flags are rendered as ours (`as`), dropped with a reason (`drop`, a
deviation NOTES lists) or refused (`refuse`, the render fails with the reason); anything else is refused as
unknown, since the router would exit on it (argparse). Renders {args: [...], dropped: ["FLAG: reason"]}.
*/}}
{{- define "vllm-stack.router.extraArgs" -}}
{{- $table := .Files.Get "files/router-flags.yaml" | fromYaml -}}
{{- $words := list -}}
{{- range .Values.routerSpec.extraArgs }}{{ $words = append $words (include "vllm-stack.str" .) }}{{ end -}}
{{- $args := list -}}
{{- $dropped := list -}}
{{- $skip := false -}}
{{- range $i, $w := $words -}}
{{- if $skip }}{{ $skip = false }}{{ continue }}{{ end -}}
{{- if not (hasPrefix "--" $w) }}{{ fail (printf "routerSpec.extraArgs: %q is not a flag (a value must follow the flag that takes it)" $w) }}{{ end -}}
{{- $name := regexReplaceAll "=.*$" $w "" -}}
{{- $inline := ne $name $w -}}
{{- $ours := get $table.ours $name -}}
{{- $ps := get $table.productionStack $name | default dict -}}
{{- if and $ours (hasPrefix "--batch-" $name) }}{{ fail (printf "routerSpec.extraArgs: %s: give the Batch API's settings in routerSpec.batch instead (enabled, completionWindowSeconds, maxFileBytes, concurrency, reserveSlots, leaseSeconds): the chart then mounts the batch volume at --batch-dir and passes the database URL from its Secret" $name) }}{{ end -}}
{{- $takes := $ours | default ($ps.takes | default "") -}}
{{- $value := "" -}}
{{- $words2 := list $w -}}
{{- if $inline }}{{ $value = trimPrefix (printf "%s=" $name) $w }}
{{- else if and (eq $takes "value") (lt (add1 $i) (len $words)) (not (hasPrefix "--" (index $words (add1 $i)))) }}{{ $value = index $words (add1 $i) }}{{ $words2 = append $words2 $value }}{{ $skip = true }}{{ end -}}
{{- $said := printf "%s%s" $name (ternary (printf " %s" $value) "" (ne $value "")) -}}
{{- if $ps.as }}{{ $args = concat $args (ternary (list (printf "%s=%s" $ps.as $value)) (list $ps.as $value) $inline) }}
{{- else if hasKey ($ps.refuseValues | default dict) $value }}{{ fail (printf "routerSpec.extraArgs: %s is production-stack's router flag: %s" $said (get $ps.refuseValues $value)) }}
{{- else if hasKey ($ps.dropValues | default dict) $value }}{{ $dropped = append $dropped (printf "%s not rendered: %s" $said (get $ps.dropValues $value)) }}
{{- else if $ps.refuse }}{{ fail (printf "routerSpec.extraArgs: %s is production-stack's router flag, not this router's: %s" $said $ps.refuse) }}
{{- else if $ps.drop }}{{ $dropped = append $dropped (printf "%s not rendered: %s" $said $ps.drop) }}
{{- else if $ours }}{{ $args = concat $args $words2 }}
{{- else }}{{ fail (printf "routerSpec.extraArgs: %s is not a flag of this router (vllm-stack router --help lists them) nor one of production-stack's router that the chart knows; the router would exit on it: remove it" $name) }}
{{- end -}}
{{- end -}}
{{- toYaml (dict "args" $args "dropped" $dropped) -}}
{{- end -}}
