{{/* ---------------------------------------------------------------------------------------------
Names, labels and selectors: production-stack's (README "Coming from production-stack"), so that
`helm upgrade <release> ./helm` from production-stack's chart keeps every Service, claim and Secret key,
and every Deployment's selector (immutable: an upgrade that changes it fails). This chart's own labels
are only added next to them (`vllm-stack.io/model`, `vllm-stack.io/role`, `helm.sh/chart`, ...), never
put in a selector. Objects production-stack does not have follow its pattern: `<release>-<what>`.
--------------------------------------------------------------------------------------------- */}}

{{- define "vllm-stack.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The prefix of every object name: the release name, as in production-stack (fullnameOverride replaces it). */}}
{{- define "vllm-stack.fullname" -}}
{{- .Values.fullnameOverride | default .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* `<prefix>-<suffix>`. Call with (dict "root" $ "suffix" S). */}}
{{- define "vllm-stack.objectName" -}}
{{- printf "%s-%s" (include "vllm-stack.fullname" .root) .suffix | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "vllm-stack.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels of this chart's own components (the LMCache controller, ...): stable across upgrades. */}}
{{- define "vllm-stack.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vllm-stack.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels every object of the release carries besides its selector labels. `managed-by` is spelt as
     production-stack spells it (its selectors have it), so that one value holds across the release. */}}
{{- define "vllm-stack.extraLabels" -}}
{{- $out := dict "helm.sh/chart" (include "vllm-stack.chart" .) "app.kubernetes.io/version" (toString .Chart.AppVersion) "app.kubernetes.io/managed-by" "helm" "app.kubernetes.io/part-of" .Chart.Name -}}
{{- toYaml (merge $out (.Values.commonLabels | default dict)) -}}
{{- end -}}

{{- define "vllm-stack.labels" -}}
{{ toYaml (merge (include "vllm-stack.selectorLabels" . | fromYaml) (include "vllm-stack.extraLabels" . | fromYaml)) }}
{{- end -}}

{{/* production-stack's standard labels of a component: (dict "root" $ "name" N "component" C "labels" L),
     L being the component's own labels (servingEngineSpec.labels, routerSpec.labels, ...), which
     production-stack puts into the selector too. */}}
{{- define "vllm-stack.psSelector" -}}
{{- $std := dict "app.kubernetes.io/name" (toString .name) "app.kubernetes.io/instance" .root.Release.Name "app.kubernetes.io/component" .component "app.kubernetes.io/part-of" .root.Chart.Name "app.kubernetes.io/managed-by" "helm" -}}
{{- $out := dict -}}
{{- range $k, $v := (.labels | default dict) }}{{ $_ := set $out $k (toString $v) }}{{ end -}}
{{- toYaml (merge $std (.extra | default dict) $out) -}}
{{- end -}}

{{/* Selector and labels with extras: the selector's values always win (a pod must match its Deployment). */}}
{{- define "vllm-stack.withExtras" -}}
{{- $out := deepCopy (.selector | fromYaml) -}}
{{- range $extra := .extras }}{{ range $k, $v := ($extra | default dict) }}{{ if not (hasKey $out $k) }}{{ $_ := set $out $k (toString $v) }}{{ end }}{{ end }}{{ end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* Engines: call with (dict "root" $ "model" $modelSpec [+ "kind" K]).
     production-stack's object names, by kind; the InferencePool/Objective and the pool's endpoint picker
     (EndpointPicker: its Deployment and Service, _epp.tpl) are this chart's own. */}}
{{- define "vllm-stack.engine.objectName" -}}
{{- $suffix := get (dict "Deployment" "deployment-vllm" "Service" "engine-service" "PersistentVolumeClaim" "storage-claim" "PodDisruptionBudget" "pdb-vllm" "ScaledObject" "scaledobject" "ConfigMap" "chat-templates" "InferencePool" "inference-pool" "InferenceObjective" "inference-objective" "EndpointPicker" "epp") .kind -}}
{{- printf "%s-%s-%s" (include "vllm-stack.fullname" .root) .model.name (required (printf "no engine object name for kind %s" .kind) $suffix) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The engine pods' selector: production-stack's `model` and `helm-release-name`, its standard labels
     (`app.kubernetes.io/name` is the model, the component `serving-engine`) and servingEngineSpec.labels. */}}
{{- define "vllm-stack.engine.selectorLabels" -}}
{{- include "vllm-stack.psSelector" (dict "root" .root "name" .model.name "component" "serving-engine" "labels" .root.Values.servingEngineSpec.labels "extra" (dict "model" (toString .model.name) "helm-release-name" .root.Release.Name)) -}}
{{- end -}}

{{/* Engine object labels: the selector, then this chart's (`vllm-stack.io/model`, chart, version, commonLabels). */}}
{{- define "vllm-stack.engine.labels" -}}
{{- include "vllm-stack.withExtras" (dict "selector" (include "vllm-stack.engine.selectorLabels" .) "extras" (list (dict "vllm-stack.io/model" (toString .model.name)) (include "vllm-stack.extraLabels" .root | fromYaml) (.more | default dict))) -}}
{{- end -}}

{{/* Every engine of this release (any model): what the router discovers, ServiceMonitors and NetworkPolicies select. */}}
{{- define "vllm-stack.engines.selectorLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: serving-engine
{{- end -}}

{{/* The label selector the router discovers engines with: this release's engines only. */}}
{{- define "vllm-stack.engine.discoverySelector" -}}
{{- printf "app.kubernetes.io/instance=%s,app.kubernetes.io/component=serving-engine" .Release.Name -}}
{{- end -}}

{{/* Router objects, by kind: production-stack's names; the ConfigMap, NetworkPolicy, test Pod and batch claim are this chart's. */}}
{{- define "vllm-stack.router.objectName" -}}
{{- $suffix := get (dict "Deployment" "deployment-router" "Service" "router-service" "ServiceAccount" "router-service-account" "Role" "reader" "RoleBinding" "deployment-access-binding" "HorizontalPodAutoscaler" "router-hpa" "PodDisruptionBudget" "pdb-router" "Ingress" "ingress-router" "HTTPRoute" "router" "ServiceMonitor" "router-servicemonitor" "ConfigMap" "router-config" "NetworkPolicy" "router" "Pod" "router-test" "PersistentVolumeClaim" "router-batch") .kind -}}
{{- include "vllm-stack.objectName" (dict "root" .root "suffix" (required (printf "no router object name for kind %s" .kind) $suffix)) -}}
{{- end -}}

{{/* The router Service's name: what clients, Ingresses, routes and the LMCache PD senders address. */}}
{{- define "vllm-stack.router.serviceName" -}}
{{- include "vllm-stack.router.objectName" (dict "root" . "kind" "Service") -}}
{{- end -}}

{{- define "vllm-stack.router.selectorLabels" -}}
{{- include "vllm-stack.psSelector" (dict "root" . "name" "router" "component" "router" "labels" .Values.routerSpec.labels) -}}
{{- end -}}

{{/* The router pods of this release, as a peer of NetworkPolicies. */}}
{{- define "vllm-stack.router.peerLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end -}}

{{- define "vllm-stack.router.labels" -}}
{{- include "vllm-stack.withExtras" (dict "selector" (include "vllm-stack.router.selectorLabels" .) "extras" (list (include "vllm-stack.extraLabels" . | fromYaml))) -}}
{{- end -}}

{{/* Cache server objects: production-stack's `<release>-deployment-cache-server` and `<release>-cache-server-service`. */}}
{{- define "vllm-stack.cacheserver.objectName" -}}
{{- $suffix := get (dict "Deployment" "deployment-cache-server" "Service" "cache-server-service" "NetworkPolicy" "cache-server") .kind -}}
{{- include "vllm-stack.objectName" (dict "root" .root "suffix" (required (printf "no cache server object name for kind %s" .kind) $suffix)) -}}
{{- end -}}

{{- define "vllm-stack.cacheserver.selectorLabels" -}}
{{- include "vllm-stack.psSelector" (dict "root" . "name" "cache-server" "component" "cache-server" "labels" .Values.cacheserverSpec.labels) -}}
{{- end -}}

{{- define "vllm-stack.cacheserver.labels" -}}
{{- include "vllm-stack.withExtras" (dict "selector" (include "vllm-stack.cacheserver.selectorLabels" .) "extras" (list (include "vllm-stack.extraLabels" . | fromYaml))) -}}
{{- end -}}

{{/* production-stack's one Secret (`<release>-secrets`), always rendered with the engines as there. */}}
{{- define "vllm-stack.secret.fullname" -}}
{{- include "vllm-stack.objectName" (dict "root" . "suffix" "secrets") -}}
{{- end -}}

{{/* Keys of that Secret: production-stack's `hf_token_<model>`; the router's token (production-stack
     renders it as a plain env value) under `router_hf_token`. */}}
{{- define "vllm-stack.secret.hfTokenKey" -}}
{{- printf "hf_token_%s" . -}}
{{- end -}}

{{/* ---------------------------------------------------------------------------------------------
Decisions shared by several templates.
--------------------------------------------------------------------------------------------- */}}

{{/* Image pins (README "Images"): the vLLM release the project tests against, and LMCache on it. */}}
{{- define "vllm-stack.defaultEngineRepository" -}}vllm/vllm-openai{{- end -}}
{{- define "vllm-stack.defaultEngineTag" -}}v0.32.0{{- end -}}
{{- define "vllm-stack.defaultLMCacheRepository" -}}lmcache/vllm-openai{{- end -}}
{{- define "vllm-stack.defaultLMCacheTag" -}}v0.5.6{{- end -}}

{{/* "true" when the model is deployed: engines on and the entry not disabled. */}}
{{- define "vllm-stack.model.enabled" -}}
{{- if and .root.Values.servingEngineSpec.enableEngine (ne (toString .model.enabled) "false") -}}true{{- end -}}
{{- end -}}

{{- define "vllm-stack.model.lmcacheEnabled" -}}
{{- if and .model.lmcacheConfig .model.lmcacheConfig.enabled -}}true{{- end -}}
{{- end -}}

{{/* "true" when the model gets a ScaledObject: it has a keda block that is not `enabled: false`. */}}
{{- define "vllm-stack.model.kedaEnabled" -}}
{{- /* production-stack's meaning: a keda block is off unless enabled: true (a ScaledObject needs KEDA's CRDs). */ -}}
{{- if and .model.keda (eq (toString .model.keda.enabled) "true") -}}true{{- end -}}
{{- end -}}

{{/* The model name clients use and vLLM reports in `model_name`. */}}
{{- define "vllm-stack.model.servedName" -}}
{{- $vc := .model.vllmConfig | default dict -}}
{{- $vc.servedModelName | default .model.modelURL | default .model.name -}}
{{- end -}}

{{- define "vllm-stack.model.image" -}}
{{- $lm := include "vllm-stack.model.lmcacheEnabled" . -}}
{{- $repo := .model.repository | default (ternary (include "vllm-stack.defaultLMCacheRepository" .) (include "vllm-stack.defaultEngineRepository" .) (eq $lm "true")) -}}
{{- $tag := .model.tag | default (ternary (include "vllm-stack.defaultLMCacheTag" .) (include "vllm-stack.defaultEngineTag" .) (eq $lm "true")) -}}
{{- printf "%s:%s" $repo (toString $tag) -}}
{{- end -}}

{{- define "vllm-stack.cacheserver.enabled" -}}
{{- $c := .Values.cacheserverSpec -}}
{{- if eq (toString $c.enabled) "true" -}}true
{{- else if and (eq (toString $c.enabled) "<nil>") (or $c.repository ($c.image | default dict).repository) -}}true
{{- end -}}
{{- end -}}

{{- define "vllm-stack.cacheserver.image" -}}
{{- $c := .Values.cacheserverSpec -}}
{{- $img := $c.image | default dict -}}
{{- $repo := $c.repository | default $img.repository | default (include "vllm-stack.defaultLMCacheRepository" .) -}}
{{- $tag := $c.tag | default $img.tag | default (include "vllm-stack.defaultLMCacheTag" .) -}}
{{- printf "%s:%s" $repo (toString $tag) -}}
{{- end -}}

{{/* "true" when engines publish KV events (the router subscribes for prefix-aware routing). */}}
{{- define "vllm-stack.kvEvents.enabled" -}}
{{- $e := .Values.servingEngineSpec.kvEvents.enabled -}}
{{- if eq (toString $e) "true" -}}true
{{- else if and (eq (toString $e) "<nil>") (include "vllm-stack.scheduler.enabled" .) (eq .Values.routerSpec.routingLogic "prefixaware") -}}true
{{- end -}}
{{- end -}}

{{/* "true" when the router routes by prompt prefix (and so wants KV events, tokenizers and the
     engines' cached-token counts). */}}
{{- define "vllm-stack.router.prefixAware" -}}
{{- if and (include "vllm-stack.scheduler.enabled" .) (eq .Values.routerSpec.routingLogic "prefixaware") -}}true{{- end -}}
{{- end -}}

{{/* "true" when the router tokenizes prompts: prefixaware (its token blocks) and kvaware (the tokens it
     asks the LMCache controller about). */}}
{{- define "vllm-stack.router.tokenizes" -}}
{{- if and (include "vllm-stack.scheduler.enabled" .) (has .Values.routerSpec.routingLogic (list "prefixaware" "kvaware")) -}}true{{- end -}}
{{- end -}}

{{/* The router's --tokenizers value: model=source pairs, comma-separated (empty: none), for prefixaware and
     kvaware routing. Given routerSpec.tokenizers first; with fetchTokenizers, every enabled model whose
     modelURL is a Hub repository (ORG/NAME, not a path) gets hf:ORG/NAME[@modelRevision]. */}}
{{- define "vllm-stack.router.tokenizers" -}}
{{- $r := .Values.routerSpec -}}
{{- $pairs := dict -}}
{{- if eq (include "vllm-stack.router.tokenizes" .) "true" -}}
{{- $root := . -}}
{{- if $r.fetchTokenizers -}}
{{- range $m := .Values.servingEngineSpec.modelSpec -}}
{{- $url := $m.modelURL | default "" -}}
{{- if and (eq (include "vllm-stack.model.enabled" (dict "root" $root "model" $m)) "true") (regexMatch "^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$" $url) -}}
{{- $_ := set $pairs (include "vllm-stack.model.servedName" (dict "root" $root "model" $m)) (printf "hf:%s%s" $url (ternary (printf "@%s" (toString $m.modelRevision)) "" (not (empty $m.modelRevision)))) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $k, $v := $r.tokenizers }}{{ $_ := set $pairs $k $v }}{{ end -}}
{{- end -}}
{{- $out := list -}}
{{- range $k, $v := $pairs }}{{ $out = append $out (printf "%s=%s" $k $v) }}{{ end -}}
{{- join "," $out -}}
{{- end -}}

{{/* The Hugging Face token the router fetches tokenizers with: a secretKeyRef body, or empty. */}}
{{- define "vllm-stack.router.hfTokenRef" -}}
{{- $r := .Values.routerSpec -}}
{{- if $r.hf_token -}}
{{- include "vllm-stack.secretKeyRef" (dict "root" . "value" $r.hf_token "key" "router_hf_token") -}}
{{- else -}}
{{- $root := . -}}
{{- $found := "" -}}
{{- range $m := .Values.servingEngineSpec.modelSpec -}}
{{- if and (not $found) $m.hf_token (eq (include "vllm-stack.model.enabled" (dict "root" $root "model" $m)) "true") (or (kindIs "string" $m.hf_token) $m.hf_token.secretName) -}}
{{- $found = include "vllm-stack.secretKeyRef" (dict "root" $root "value" $m.hf_token "key" (include "vllm-stack.secret.hfTokenKey" $m.name)) -}}
{{- end -}}
{{- end -}}
{{- $found -}}
{{- end -}}
{{- end -}}

{{/* Secret holding VLLM_API_KEY: (dict name key) or empty when no key is configured. */}}
{{- define "vllm-stack.vllmApiKeyRef" -}}
{{- $k := .Values.servingEngineSpec.vllmApiKey -}}
{{- if kindIs "string" $k -}}
{{- if $k }}name: {{ include "vllm-stack.secret.fullname" . }}
key: vllmApiKey{{ end -}}
{{- else if and (kindIs "map" $k) $k.secretName -}}
name: {{ $k.secretName }}
key: {{ required "servingEngineSpec.vllmApiKey.secretKey is required with secretName" $k.secretKey }}
{{- end -}}
{{- end -}}

{{/* Resource quantities given as numbers in production-stack files (requestCPU: 10). */}}
{{/* A scalar as text; whole floats (YAML numbers) without exponent: 1000000 -> "1000000", not "1e+06". */}}
{{- define "vllm-stack.str" -}}
{{- if and (kindIs "float64" .) (eq (float64 (int64 .)) .) -}}{{ int64 . }}{{- else -}}{{ . }}{{- end -}}
{{- end -}}

{{/* Pod affinity: an explicit `affinity` wins, else required node affinity from production-stack
     `nodeSelectorTerms`. Call with (dict "affinity" A "terms" T). */}}
{{- define "vllm-stack.nodeAffinity" -}}
{{- if .affinity }}
affinity:
  {{- toYaml .affinity | nindent 2 }}
{{- else if .terms }}
affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms:
        {{- toYaml .terms | nindent 8 }}
{{- end }}
{{- end -}}

{{/* An HTTP probe from values: timing fields as given, `httpGet.path` (default `def`), always the named port. */}}
{{- define "vllm-stack.httpProbe" -}}
httpGet:
  path: {{ (.probe.httpGet | default dict).path | default .path }}
  port: {{ .port }}
{{ toYaml (omit .probe "httpGet") }}
{{- end -}}

{{/* Pull secrets: chart-wide names plus an optional per-component name. */}}
{{- define "vllm-stack.imagePullSecrets" -}}
{{- $names := list -}}
{{- range .root.Values.imagePullSecrets }}{{ if kindIs "map" . }}{{ $names = append $names .name }}{{ else }}{{ $names = append $names . }}{{ end }}{{ end -}}
{{- range .more }}{{ if kindIs "map" . }}{{ $names = append $names .name }}{{ else }}{{ $names = append $names . }}{{ end }}{{ end -}}
{{- with .extra }}{{ $names = append $names . }}{{ end -}}
{{- if $names -}}
imagePullSecrets:
{{- range $names | uniq }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The key the router sends to engines: routerSpec.vllmApiKey when it names a Secret, else the engines' key. */}}
{{- define "vllm-stack.router.vllmApiKeyRef" -}}
{{- $k := .Values.routerSpec.vllmApiKey -}}
{{- if and (kindIs "map" $k) $k.secretName -}}
name: {{ $k.secretName }}
key: {{ required "routerSpec.vllmApiKey.secretKey is required with secretName" $k.secretKey }}
{{- else -}}
{{- include "vllm-stack.vllmApiKeyRef" . -}}
{{- end -}}
{{- end -}}

{{/* Router HPA settings: `hpa`, or production-stack's `autoscaling` when that one is enabled. */}}
{{- define "vllm-stack.router.hpa" -}}
{{- $r := .Values.routerSpec -}}
{{- if and $r.autoscaling $r.autoscaling.enabled -}}
{{- /* production-stack's defaults for what its block leaves out (min 1, max 3, 80% CPU) */ -}}
{{- toYaml (merge (dict) $r.autoscaling (dict "minReplicas" 1 "maxReplicas" 3 "targetCPUUtilizationPercentage" 80 "targetMemoryUtilizationPercentage" nil)) -}}
{{- else -}}
{{- toYaml $r.hpa -}}
{{- end -}}
{{- end -}}

{{/* An IntOrString as YAML: "1" and 1 -> 1, "25%" -> "25%". */}}
{{- define "vllm-stack.intOrPercent" -}}
{{- $v := include "vllm-stack.str" . -}}
{{- if regexMatch "^[0-9]+$" $v }}{{ $v }}{{ else }}{{ $v | quote }}{{ end -}}
{{- end -}}

{{/* production-stack's shared claim, `<release>-shared-pvc-storage-claim`, and its PersistentVolume `<release>-shared-pvc-storage`. */}}
{{- define "vllm-stack.sharedPvc.fullname" -}}
{{- include "vllm-stack.objectName" (dict "root" . "suffix" "shared-pvc-storage-claim") -}}
{{- end -}}

{{- define "vllm-stack.sharedPv.fullname" -}}
{{- include "vllm-stack.objectName" (dict "root" . "suffix" "shared-pvc-storage") -}}
{{- end -}}

{{/* One env entry per name (Helm 4's server-side apply refuses a container with two): the chart's entries
     first, then the user's (`env` lists, in order), a later entry of a name replacing the earlier one in
     its place. Call with a list of env lists; renders a YAML list. */}}
{{- define "vllm-stack.env.merged" -}}
{{- $order := list -}}
{{- $byName := dict -}}
{{- range $entries := . -}}
{{- range $e := ($entries | default list) -}}
{{- $name := toString $e.name -}}
{{- if not (hasKey $byName $name) }}{{ $order = append $order $name }}{{ end -}}
{{- $_ := set $byName $name $e -}}
{{- end -}}
{{- end -}}
{{- $out := list -}}
{{- range $order }}{{ $out = append $out (get $byName .) }}{{ end -}}
{{- with $out }}{{ toYaml . }}{{ end -}}
{{- end -}}

{{/* What `helm test` asks a model (tests/test-router-models.yaml): its helmTestRequest; else an embedding
     (embed) or a listing (pooling) for pooling runners; a chat completion when it has a chatTemplate; a
     completion when its modelURL is a base model without a chat template (helmTest.completionModels: the
     engine would answer a chat request with 400); else a chat completion. */}}
{{- define "vllm-stack.model.testRequest" -}}
{{- $m := .model -}}
{{- $vc := $m.vllmConfig | default dict -}}
{{- $given := get (dict "chat" "chat" "completion" "completion" "embedding" "embed" "list" "pooling") (toString ($m.helmTestRequest | default "")) -}}
{{- $url := toString ($m.modelURL | default $m.name) -}}
{{- $base := false -}}
{{- range (.root.Values.helmTest.completionModels | default list) }}{{ if regexMatch . $url }}{{ $base = true }}{{ end }}{{ end -}}
{{- if $given }}{{ $given }}
{{- else if eq (toString $vc.runner) "pooling" }}{{ ternary "embed" "pooling" (has (toString $vc.convert) (list "embed" "token_embed" "<nil>")) }}
{{- else if $m.chatTemplate }}chat
{{- else if $base }}completion
{{- else }}chat
{{- end -}}
{{- end -}}
