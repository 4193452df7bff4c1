{{/* ---------------------------------------------------------------------------------------------
Which vLLM a model's engines run, and which flags that vLLM parses (files/vllm-flags.yaml: the first and
last release whose `vllm serve` parses each flag the chart can render, derived from vLLM's sources).
The release is the model's `vllmVersion`, else servingEngineSpec.vllmVersion, else the tag of a
vllm/vllm-openai image (vX.Y.Z, any registry). Other images (lmcache/vllm-openai tags are LMCache's
versions; latest, nightlies, digests, custom images) count as the newest release the table knows, and
NOTES says so; the chart's own default images are its pins: the vLLM of its default engine tag (LMCache's
image is pinned on it), without a word.
--------------------------------------------------------------------------------------------- */}}

{{- define "vllm-stack.vllm.table" -}}
{{- .Files.Get "files/vllm-flags.yaml" -}}
{{- end -}}

{{/* {version: X.Y.Z, source: vllmVersion|tag|pin|unknown, image}. Call with (dict "root" $ "model" M). */}}
{{- define "vllm-stack.model.vllmRelease" -}}
{{- $image := include "vllm-stack.model.image" . -}}
{{- $table := include "vllm-stack.vllm.table" .root | fromYaml -}}
{{- $given := toString (.model.vllmVersion | default .root.Values.servingEngineSpec.vllmVersion | default "") | trimPrefix "v" -}}
{{- $m := regexFind "(^|/)vllm/vllm-openai:v?[0-9]+\\.[0-9]+\\.[0-9]+((\\.post[0-9]+)|(\\.[0-9]+))?$" $image -}}
{{- if $given -}}
{{- toYaml (dict "version" $given "source" "vllmVersion" "image" $image) -}}
{{- else if $m -}}
{{- toYaml (dict "version" (regexFind "[0-9]+\\.[0-9]+\\.[0-9]+" (last (splitList ":" $m))) "source" "tag" "image" $image) -}}
{{- else if has $image (list (printf "%s:%s" (include "vllm-stack.defaultEngineRepository" .) (include "vllm-stack.defaultEngineTag" .)) (printf "%s:%s" (include "vllm-stack.defaultLMCacheRepository" .) (include "vllm-stack.defaultLMCacheTag" .))) -}}
{{- toYaml (dict "version" (trimPrefix "v" (include "vllm-stack.defaultEngineTag" .)) "source" "pin" "image" $image) -}}
{{- else -}}
{{- toYaml (dict "version" $table.releases.newest "source" "unknown" "image" $image) -}}
{{- end -}}
{{- end -}}

{{/* "true" when vLLM `version` parses `flag` (its dashed spelling too); a flag the table lacks passes.
     A flag the table's oldest release already has may be older still (the table reads no earlier
     release), so a release before the oldest is taken to parse it.
     Call with (dict "root" $ "version" V "flag" F). */}}
{{- define "vllm-stack.vllm.parses" -}}
{{- $table := include "vllm-stack.vllm.table" .root | fromYaml -}}
{{- $entry := get $table.flags .flag | default (get $table.flags (replace "_" "-" .flag)) -}}
{{- if not $entry -}}true
{{- else if and (include "vllm-stack.vllm.since" (dict "table" $table "entry" $entry "version" .version)) (or (not $entry.until) (semverCompare (printf "<=%s" $entry.until) .version)) -}}true
{{- end -}}
{{- end -}}

{{/* "true" when `version` is at or after the entry's first release, or that first release is the
     table's oldest (perhaps older). Call with (dict "table" T "entry" E "version" V). */}}
{{- define "vllm-stack.vllm.since" -}}
{{- if or (eq .entry.since .table.releases.oldest) (semverCompare (printf ">=%s" .entry.since) .version) -}}true{{- end -}}
{{- end -}}

{{/* The release a flag came with (or left after), for messages: "it came with 0.9.0" / "0.22.1 was the last with it". */}}
{{- define "vllm-stack.vllm.flagRange" -}}
{{- $table := include "vllm-stack.vllm.table" .root | fromYaml -}}
{{- $entry := get $table.flags .flag | default (get $table.flags (replace "_" "-" .flag)) | default dict -}}
{{- if and $entry.since (not (include "vllm-stack.vllm.since" (dict "table" $table "entry" $entry "version" .version))) -}}it came with vLLM {{ $entry.since }}
{{- else if $entry.until -}}vLLM {{ $entry.until }} was the last release with it
{{- end -}}
{{- end -}}

{{/* "true" when the model's vLLM still has the V0 engine (VLLM_USE_V1=0 selects it up to 0.10.2). */}}
{{- define "vllm-stack.vllm.hasV0" -}}
{{- if semverCompare "<0.11.0" .version }}true{{ end -}}
{{- end -}}
