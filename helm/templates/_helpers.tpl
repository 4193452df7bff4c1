{{/* ---------------------------------------------------------------------------------------------
Names, labels and selectors (Bitnami / prometheus-community style).
--------------------------------------------------------------------------------------------- */}}

{{- define "vllm-stack.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "vllm-stack.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "vllm-stack.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels shared by every component: stable across upgrades. */}}
{{- define "vllm-stack.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vllm-stack.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "vllm-stack.labels" -}}
helm.sh/chart: {{ include "vllm-stack.chart" . }}
{{ include "vllm-stack.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: vllm-stack
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Engines: call with (dict "root" $ "model" $modelSpec). */}}
{{- define "vllm-stack.engine.fullname" -}}
{{- printf "%s-%s" (include "vllm-stack.fullname" .root) .model.name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "vllm-stack.engine.selectorLabels" -}}
{{ include "vllm-stack.selectorLabels" .root }}
app.kubernetes.io/component: engine
vllm-stack.io/model: {{ .model.name }}
{{- end -}}

{{- define "vllm-stack.engine.labels" -}}
{{ include "vllm-stack.labels" .root }}
app.kubernetes.io/component: engine
vllm-stack.io/model: {{ .model.name }}
{{- end -}}

{{/* The label selector the router discovers engines with: this release's engines only. */}}
{{- define "vllm-stack.engine.discoverySelector" -}}
{{- printf "app.kubernetes.io/instance=%s,app.kubernetes.io/component=engine" .Release.Name -}}
{{- end -}}

{{- define "vllm-stack.router.fullname" -}}
{{- printf "%s-router" (include "vllm-stack.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "vllm-stack.router.selectorLabels" -}}
{{ include "vllm-stack.selectorLabels" . }}
app.kubernetes.io/component: router
{{- end -}}

{{- define "vllm-stack.router.labels" -}}
{{ include "vllm-stack.labels" . }}
app.kubernetes.io/component: router
{{- end -}}

{{- define "vllm-stack.cacheserver.fullname" -}}
{{- printf "%s-cache-server" (include "vllm-stack.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "vllm-stack.cacheserver.selectorLabels" -}}
{{ include "vllm-stack.selectorLabels" . }}
app.kubernetes.io/component: cache-server
{{- end -}}

{{- define "vllm-stack.cacheserver.labels" -}}
{{ include "vllm-stack.labels" . }}
app.kubernetes.io/component: cache-server
{{- end -}}

{{- define "vllm-stack.secret.fullname" -}}
{{- printf "%s-secrets" (include "vllm-stack.fullname" .) | trunc 63 | trimSuffix "-" -}}
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
{{- if and .model.keda (ne (toString .model.keda.enabled) "false") -}}true{{- end -}}
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
{{- else if and (eq (toString $e) "<nil>") .Values.routerSpec.enableRouter (eq .Values.routerSpec.routingLogic "prefixaware") -}}true
{{- end -}}
{{- end -}}

{{/* "true" when the router routes by prompt prefix (and so wants KV events, tokenizers and the
     engines' cached-token counts). */}}
{{- define "vllm-stack.router.prefixAware" -}}
{{- if and .Values.routerSpec.enableRouter (eq .Values.routerSpec.routingLogic "prefixaware") -}}true{{- end -}}
{{- end -}}

{{/* "true" when the router tokenizes prompts: prefixaware (its token blocks) and kvaware (the tokens it
     asks the LMCache controller about). */}}
{{- define "vllm-stack.router.tokenizes" -}}
{{- if and .Values.routerSpec.enableRouter (has .Values.routerSpec.routingLogic (list "prefixaware" "kvaware")) -}}true{{- end -}}
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
{{- include "vllm-stack.secretKeyRef" (dict "root" . "value" $r.hf_token "key" "hfToken-router") -}}
{{- else -}}
{{- $root := . -}}
{{- $found := "" -}}
{{- range $m := .Values.servingEngineSpec.modelSpec -}}
{{- if and (not $found) $m.hf_token (eq (include "vllm-stack.model.enabled" (dict "root" $root "model" $m)) "true") (or (kindIs "string" $m.hf_token) $m.hf_token.secretName) -}}
{{- $found = include "vllm-stack.secretKeyRef" (dict "root" $root "value" $m.hf_token "key" (printf "hfToken-%s" $m.name)) -}}
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
{{- toYaml (merge (dict) $r.autoscaling (dict "targetMemoryUtilizationPercentage" nil)) -}}
{{- else -}}
{{- toYaml $r.hpa -}}
{{- end -}}
{{- end -}}

{{/* An IntOrString as YAML: "1" and 1 -> 1, "25%" -> "25%". */}}
{{- define "vllm-stack.intOrPercent" -}}
{{- $v := include "vllm-stack.str" . -}}
{{- if regexMatch "^[0-9]+$" $v }}{{ $v }}{{ else }}{{ $v | quote }}{{ end -}}
{{- end -}}

{{- define "vllm-stack.sharedPvc.fullname" -}}
{{- printf "%s-shared-pvc-storage" (include "vllm-stack.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
