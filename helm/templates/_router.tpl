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
{{- if $r.config }}{{ $args = concat $args (list "--config" "/etc/vllm-stack/router/config.yaml") }}{{ end -}}
{{- if $r.apiKeysSecret }}{{ $args = concat $args (list "--api-keys-file" "/etc/vllm-stack/api-keys/keys") }}{{ end -}}
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
