{{/* ---------------------------------------------------------------------------------------------
This project's endpoint picker for the Gateway API Inference Extension (inferenceExtension.epp,
inference-extension-epp.yaml): `vllm-stack epp`, the router's scheduling served to an inference gateway
over Envoy's ext_proc (docs/inference-extension.md). It reads one InferencePool, so each model's pool
gets a Deployment and Service of its own, `<release>-<model>-epp`; the ServiceAccount and its Role are
one per release.
--------------------------------------------------------------------------------------------- */}}

{{/* "true" when the chart deploys the endpoint pickers: the InferencePools and inferenceExtension.epp. */}}
{{- define "vllm-stack.epp.enabled" -}}
{{- $ie := .Values.inferenceExtension -}}
{{- if and $ie.enabled ($ie.epp | default dict).enabled -}}true{{- end -}}
{{- end -}}

{{/* "true" when a scheduler of the chart runs: the router, or the endpoint pickers. What the scheduling
     needs of the rest of the release (the engines' KV events, tokenizers, the LMCache controller for
     kvaware, the router's ConfigMap) follows from either. */}}
{{- define "vllm-stack.scheduler.enabled" -}}
{{- if or .Values.routerSpec.enableRouter (include "vllm-stack.epp.enabled" .) -}}true{{- end -}}
{{- end -}}

{{/* The InferencePools (one per deployed model) that get an endpoint picker: a YAML list of names. */}}
{{- define "vllm-stack.epp.pools" -}}
{{- $out := list -}}
{{- if include "vllm-stack.epp.enabled" . -}}
{{- range $m := .Values.servingEngineSpec.modelSpec -}}
{{- if eq (include "vllm-stack.model.enabled" (dict "root" $ "model" $m)) "true" -}}
{{- $out = append $out (include "vllm-stack.engine.objectName" (dict "root" $ "model" $m "kind" "InferencePool")) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* The endpoint picker of a model's pool: Deployment and Service name. Call with (dict "root" $ "model" M). */}}
{{- define "vllm-stack.epp.objectName" -}}
{{- include "vllm-stack.engine.objectName" (dict "root" .root "model" .model "kind" "EndpointPicker") -}}
{{- end -}}

{{/* The release's endpoint picker ServiceAccount, Role and RoleBinding. */}}
{{- define "vllm-stack.epp.serviceAccountName" -}}
{{- include "vllm-stack.objectName" (dict "root" . "suffix" "epp") -}}
{{- end -}}

{{/* Every endpoint picker pod of the release, as a peer of NetworkPolicies. */}}
{{- define "vllm-stack.epp.peerLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: endpoint-picker
{{- end -}}

{{/* The pods of one model's endpoint picker. Call with (dict "root" $ "model" M). */}}
{{- define "vllm-stack.epp.selectorLabels" -}}
{{ include "vllm-stack.selectorLabels" .root }}
app.kubernetes.io/component: endpoint-picker
vllm-stack.io/model: {{ .model.name | toString | quote }}
{{- end -}}

{{- define "vllm-stack.epp.labels" -}}
{{- include "vllm-stack.withExtras" (dict "selector" (include "vllm-stack.epp.selectorLabels" .) "extras" (list (include "vllm-stack.extraLabels" .root | fromYaml))) -}}
{{- end -}}

{{/* Labels of the release-wide objects (ServiceAccount, Role, RoleBinding). */}}
{{- define "vllm-stack.epp.releaseLabels" -}}
{{ include "vllm-stack.labels" . }}
app.kubernetes.io/component: endpoint-picker
{{- end -}}

{{/* A pool's endpointPickerRef: this chart's picker of the model (its Service, the gRPC port) with
     inferenceExtension.epp.enabled, else inferenceExtension.endpointPickerRef as given. Call with
     (dict "root" $ "model" M). */}}
{{- define "vllm-stack.epp.ref" -}}
{{- $ie := .root.Values.inferenceExtension -}}
{{- if include "vllm-stack.epp.enabled" .root -}}
{{- $ref := dict "name" (include "vllm-stack.epp.objectName" .) "port" (dict "number" (int $ie.epp.grpcPort)) -}}
{{- with $ie.endpointPickerRef.failureMode }}{{ $_ := set $ref "failureMode" . }}{{ end -}}
{{- toYaml $ref -}}
{{- else -}}
{{- toYaml $ie.endpointPickerRef -}}
{{- end -}}
{{- end -}}
