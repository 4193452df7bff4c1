{{/* ---------------------------------------------------------------------------------------------
Engine sizing: memory and CPU an engine holds from the moment it starts, and the resources rendered
from it (README "Engine memory and CPU"). Call with (dict "root" $ "model" $modelSpec).
--------------------------------------------------------------------------------------------- */}}

{{/* A memory quantity (Kubernetes notation, or a plain number of bytes) in MiB, rounded up. */}}
{{- define "vllm-stack.mebibytes" -}}
{{- $q := include "vllm-stack.str" . | trim -}}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" $q -}}
{{- $unit := trimPrefix $num $q -}}
{{- $per := dict "" (divf 1 1048576) "Ki" (divf 1 1024) "Mi" 1.0 "Gi" 1024.0 "Ti" 1048576.0 "k" (divf 1000 1048576) "M" (divf 1000000 1048576) "G" (divf 1000000000 1048576) "T" (divf 1000000000000 1048576) -}}
{{- if or (not $num) (not (hasKey $per $unit)) }}{{ fail (printf "memory quantity %q is not understood (use Mi, Gi, M, G, ...)" $q) }}{{ end -}}
{{- ceil (mulf (float64 $num) (get $per $unit)) | int64 -}}
{{- end -}}

{{/* MiB as a quantity: whole GiB as Gi, else Mi. */}}
{{- define "vllm-stack.quantityMi" -}}
{{- $mi := int64 . -}}
{{- if eq (mod $mi 1024) 0 }}{{ div $mi 1024 }}Gi{{ else }}{{ $mi }}Mi{{ end -}}
{{- end -}}

{{/* A CPU quantity ("500m", "4", 4, 0.5) in millicores. */}}
{{- define "vllm-stack.millicores" -}}
{{- $q := include "vllm-stack.str" . | trim -}}
{{- if hasSuffix "m" $q }}{{ trimSuffix "m" $q | int64 }}{{ else }}{{ ceil (mulf (float64 $q) 1000) | int64 }}{{ end -}}
{{- end -}}

{{- define "vllm-stack.quantityMillicores" -}}
{{- $m := int64 . -}}
{{- if eq (mod $m 1000) 0 }}{{ div $m 1000 }}{{ else }}{{ $m }}m{{ end -}}
{{- end -}}

{{/* GPUs as the whole number Kubernetes accepts: production-stack's fractions (0.5) round up. */}}
{{- define "vllm-stack.engine.gpus" -}}
{{- $g := .model.requestGPU | default 0 -}}
{{- ceil (float64 (include "vllm-stack.str" $g)) | int64 -}}
{{- end -}}

{{/* The GPUs the pod gets: requestGPU (whole), or with a full `resources` block its GPU resource (a key naming
     a GPU or MIG slice, not HAMi's gpumem/gpucores), limits before requests. */}}
{{- define "vllm-stack.engine.gpuCount" -}}
{{- if .model.resources -}}
{{- $count := 0 -}}
{{- range $side := list "requests" "limits" -}}
{{- range $k, $v := (get ($.model.resources | default dict) $side | default dict) -}}
{{- if and (regexMatch "(^|/)(gpu|mig-.*)$" $k) }}{{ $count = ceil (float64 (include "vllm-stack.str" $v)) | int }}{{ end -}}
{{- end -}}
{{- end -}}
{{- $count -}}
{{- else -}}
{{- include "vllm-stack.engine.gpus" . -}}
{{- end -}}
{{- end -}}

{{/* LMCache's max_local_cpu_size (GiB) as rendered: lmcacheConfig.cpuOffloadingBufferSize, else "0" for
     production-stack's PD engines (lmcacheConfig.enablePD, which it renders with LMCACHE_MAX_LOCAL_CPU_SIZE=0:
     their KV caches go to the peer, not to a CPU buffer), else empty (LMCache's default, 5). */}}
{{- define "vllm-stack.model.cpuBuffer" -}}
{{- $lc := .model.lmcacheConfig | default dict -}}
{{- if and (not (kindIs "invalid" $lc.cpuOffloadingBufferSize)) (ne (toString $lc.cpuOffloadingBufferSize) "") -}}
{{- include "vllm-stack.str" $lc.cpuOffloadingBufferSize -}}
{{- else if eq (toString $lc.enablePD) "true" -}}0
{{- end -}}
{{- end -}}

{{/* The values vllmConfig.extraArgs gives the flags named in .flags (the last one wins; `--flag value`,
     `--flag=value` and vLLM's underscore spelling), as YAML: flag -> value. */}}
{{- define "vllm-stack.model.extraArgValues" -}}
{{- $words := list -}}
{{- range (.model.vllmConfig | default dict).extraArgs }}{{ $words = append $words (include "vllm-stack.str" .) }}{{ end -}}
{{- $out := dict -}}
{{- range $i, $w := $words -}}
{{- $name := regexReplaceAll "=.*$" $w "" | replace "_" "-" -}}
{{- if has $name $.flags -}}
{{- if contains "=" $w }}{{ $_ := set $out $name (regexReplaceAll "^[^=]*=" $w "") }}
{{- else if lt (add1 $i) (len $words) }}{{ $_ := set $out $name (index $words (add1 $i)) }}{{ end -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* "true" when the engine runs vLLM's V0 engine: production-stack's v0 where the release has it, or a
     release before 0.8.0 (V0 by default) unless vllmConfig.v1 asks for V1. */}}
{{- define "vllm-stack.model.runsV0" -}}
{{- if or (include "vllm-stack.model.v0" .) (and (semverCompare "<0.8.0" (include "vllm-stack.model.vllmRelease" . | fromYaml).version) (not (include "vllm-stack.model.v1" .))) }}true{{ end -}}
{{- end -}}

{{/*
The sizing of one engine as YAML: what it holds at start and the requests/limits rendered.
  bufferMi     LMCache's pinned CPU buffer: LMCache 0.5.6 allocates max_local_cpu_size GiB (default 5)
               whenever the connector runs, whether or not local_cpu is on, in every GPU worker (TP x PP);
               plus a PD buffer on the CPU
  shm          the memory-backed /dev/shm size (tmpfs pages count against the container's memory)
  vllmMi       what vLLM's own flags in vllmConfig.extraArgs pin in host memory: --cpu-offload-gb (weights,
               per GPU worker), V0's --swap-space (per GPU worker, default 4 GiB; V1 allocates none) and
               --kv-offloading-size (the KV offload buffer, all ranks together)
  unknownWhy   set when a flag pins host memory the chart cannot size (an OffloadingConnector in
               --kv-transfer-config: its CPU blocks depend on the model): no memory limit is rendered
  footprintMi  servingEngineSpec.engineMemoryFootprint: the vLLM processes themselves
  needMi       their sum: the smallest memory limit that does not OOM-kill the engine
  busyCores    processes that each keep a core busy: API server + engine core, plus one worker per
               GPU when tensor/pipeline parallel (> 1)
*/}}
{{- define "vllm-stack.engine.sizing" -}}
{{- $root := .root -}}
{{- $m := .model -}}
{{- $spec := $root.Values.servingEngineSpec -}}
{{- $vc := $m.vllmConfig | default dict -}}
{{- $lm := eq (include "vllm-stack.model.lmcacheEnabled" .) "true" -}}
{{- $parallel := mul (int ($vc.tensorParallelSize | default 1)) (int ($vc.pipelineParallelSize | default 1)) -}}
{{- $bufferMi := 0 -}}
{{- $bufferWhat := list -}}
{{- if $lm -}}
{{- $lc := $m.lmcacheConfig -}}
{{- $gib := 5.0 -}}
{{- with (include "vllm-stack.model.cpuBuffer" .) }}{{ $gib = float64 . }}{{ end -}}
{{- /* Each GPU worker (tensor x pipeline parallel rank) runs its own LMCache engine with its own buffer. */ -}}
{{- $bufferMi = mul (ceil (mulf $gib 1024) | int64) $parallel -}}
{{- $source := printf "lmcacheConfig.cpuOffloadingBufferSize%s" (ternary "" ", LMCache's default 5" (ne (include "vllm-stack.model.cpuBuffer" .) "")) -}}
{{- if gt $parallel 1 }}{{ $source = printf "%s, %s per GPU worker x %d workers" $source (include "vllm-stack.quantityMi" (ceil (mulf $gib 1024) | int64)) $parallel }}{{ end -}}
{{- if $bufferMi }}{{ $bufferWhat = append $bufferWhat (printf "%s LMCache CPU buffer (%s)" (include "vllm-stack.quantityMi" $bufferMi) $source) }}{{ end -}}
{{- with (include "vllm-stack.model.pd" . | fromYaml) }}{{ if and .role (eq (.bufferDevice | default "cuda") "cpu") -}}
{{- $pdMi := ceil (divf (float64 (.bufferSize | default 2147483648)) 1048576) | int64 -}}
{{- $bufferMi = add $bufferMi $pdMi -}}
{{- $bufferWhat = append $bufferWhat (printf "%s PD buffer on the CPU (lmcacheConfig.pd.bufferSize)" (include "vllm-stack.quantityMi" $pdMi)) -}}
{{- end }}{{ end -}}
{{- end -}}
{{- /* vLLM's own host memory, from the flags the engine runs with (vllmConfig.extraArgs). */ -}}
{{- $flags := include "vllm-stack.model.extraArgValues" (dict "model" $m "flags" (list "--cpu-offload-gb" "--swap-space" "--kv-offloading-size" "--kv-transfer-config")) | fromYaml -}}
{{- $perWorker := ternary (printf " per GPU worker x %d workers" $parallel) " per GPU worker" (gt $parallel 1) -}}
{{- with (get $flags "--cpu-offload-gb") }}{{ if gt (float64 .) 0.0 -}}
{{- $mi := mul (ceil (mulf (float64 .) 1024) | int64) $parallel -}}
{{- $bufferMi = add $bufferMi $mi -}}
{{- $bufferWhat = append $bufferWhat (printf "%s vLLM CPU weight offload (--cpu-offload-gb %s%s)" (include "vllm-stack.quantityMi" $mi) . $perWorker) -}}
{{- end }}{{ end -}}
{{- if include "vllm-stack.model.runsV0" . -}}
{{- $swap := get $flags "--swap-space" | default "4" -}}
{{- $mi := mul (ceil (mulf (float64 $swap) 1024) | int64) $parallel -}}
{{- if $mi }}{{ $bufferMi = add $bufferMi $mi }}{{ $bufferWhat = append $bufferWhat (printf "%s vLLM V0 swap space (--swap-space %s%s%s)" (include "vllm-stack.quantityMi" $mi) $swap (ternary ", vLLM's default" "" (not (hasKey $flags "--swap-space"))) $perWorker) }}{{ end -}}
{{- end -}}
{{- with (get $flags "--kv-offloading-size") }}{{ if gt (float64 .) 0.0 -}}
{{- $mi := ceil (mulf (float64 .) 1024) | int64 -}}
{{- $bufferMi = add $bufferMi $mi -}}
{{- $bufferWhat = append $bufferWhat (printf "%s vLLM KV offload buffer (--kv-offloading-size %s)" (include "vllm-stack.quantityMi" $mi) .) -}}
{{- end }}{{ end -}}
{{- $unknownWhy := "" -}}
{{- with (get $flags "--kv-transfer-config") }}{{ if contains "OffloadingConnector" . }}{{ $unknownWhy = "--kv-transfer-config's OffloadingConnector keeps KV blocks in host memory, as many as its kv_connector_extra_config asks for, whose size the chart cannot know (it depends on the model)" }}{{ end }}{{ end -}}
{{- $shm := $m.shmSize | default (ternary "20Gi" "2Gi" (gt $parallel 1)) -}}
{{- $shmMi := include "vllm-stack.mebibytes" $shm | int64 -}}
{{- $footMi := include "vllm-stack.mebibytes" $spec.engineMemoryFootprint | int64 -}}
{{- $needMi := add $bufferMi $shmMi $footMi -}}
{{- $why := join " + " (concat $bufferWhat (list (printf "%s /dev/shm (shmSize)" (include "vllm-stack.quantityMi" $shmMi)) (printf "%s engine footprint (servingEngineSpec.engineMemoryFootprint)" (include "vllm-stack.quantityMi" $footMi)))) -}}
{{- $why = printf "%s = %s" $why (include "vllm-stack.quantityMi" $needMi) -}}
{{- $busy := ternary (add 2 $parallel) 2 (gt $parallel 1) -}}
shm: {{ $shm | quote }}
bufferMi: {{ $bufferMi }}
needMi: {{ $needMi }}
need: {{ include "vllm-stack.quantityMi" $needMi | quote }}
memoryWhy: {{ $why | quote }}
busyCores: {{ $busy }}
cpuWhy: {{ printf "%d processes keep a core busy each (API server, engine core%s)" $busy (ternary (printf ", %d GPU workers" $parallel) "" (gt $parallel 1)) | quote }}
{{- if $m.resources }}
{{- $lim := ($m.resources.limits | default dict) }}
{{- with $lim.memory }}{{ if lt (include "vllm-stack.mebibytes" . | int64) $needMi }}
memoryError: {{ printf "resources.limits.memory %s is below what the engine holds: %s" (include "vllm-stack.str" .) $why | quote }}
{{- end }}{{ end }}
{{- with $lim.cpu }}{{ if lt (include "vllm-stack.millicores" . | int64) (mul $busy 1000 | int64) }}
cpuError: {{ printf "resources.limits.cpu %s is below %d: %s, and a CPU quota below them throttles the engine every 100 ms CFS period" (include "vllm-stack.str" .) $busy (printf "%d processes keep a core busy each" $busy) | quote }}
{{- end }}{{ end }}
{{- else }}
{{- $reqMi := include "vllm-stack.mebibytes" ($m.requestMemory | default "16Gi") | int64 }}
{{- if $m.limitMemory }}
{{- $limMi := include "vllm-stack.mebibytes" $m.limitMemory | int64 }}
memoryRequest: {{ include "vllm-stack.str" ($m.requestMemory | default $m.limitMemory) | quote }}
memoryLimit: {{ include "vllm-stack.str" $m.limitMemory | quote }}
{{- if lt $limMi $needMi }}
memoryError: {{ printf "limitMemory %s is below what the engine holds: %s; raise limitMemory (or lower the buffer / shmSize)" (include "vllm-stack.str" $m.limitMemory) $why | quote }}
{{- end }}
{{- else }}
{{- $mem := ternary (include "vllm-stack.str" ($m.requestMemory | default "16Gi")) (include "vllm-stack.quantityMi" $needMi) (ge $reqMi $needMi) }}
memoryRequest: {{ $mem | quote }}
{{- if $unknownWhy }}
{{- /* What the engine pins is not known here: a limit would be a guess that OOM-kills it at start. */}}
memoryUnlimited: {{ printf "no memory limit rendered (request %s%s): %s; give limitMemory once you know it" $mem (ternary (printf ", raised from %s: %s" (include "vllm-stack.str" ($m.requestMemory | default "16Gi")) $why) "" (lt $reqMi $needMi)) $unknownWhy | quote }}
{{- else }}
memoryLimit: {{ $mem | quote }}
{{- if lt $reqMi $needMi }}
memoryRaised: {{ printf "requestMemory %s raised to %s (request and limit): %s" (include "vllm-stack.str" ($m.requestMemory | default "16Gi")) $mem $why | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- $reqM := include "vllm-stack.millicores" ($m.requestCPU | default 4) | int64 }}
{{- if $m.limitCPU }}
{{- $limM := include "vllm-stack.millicores" $m.limitCPU | int64 }}
cpuRequest: {{ include "vllm-stack.str" ($m.requestCPU | default $m.limitCPU) | quote }}
cpuLimit: {{ include "vllm-stack.str" $m.limitCPU | quote }}
{{- if lt $limM (mul $busy 1000) }}
cpuError: {{ printf "limitCPU %s is below %d: %s, and a CPU quota below them throttles the engine every 100 ms CFS period; raise limitCPU" (include "vllm-stack.str" $m.limitCPU) $busy (printf "%d processes keep a core busy each" $busy) | quote }}
{{- end }}
{{- else }}
{{- $cpu := ternary (include "vllm-stack.str" ($m.requestCPU | default 4)) (toString $busy) (ge $reqM (mul $busy 1000)) }}
cpuRequest: {{ $cpu | quote }}
cpuLimit: {{ $cpu | quote }}
{{- if lt $reqM (mul $busy 1000) }}
cpuRaised: {{ printf "requestCPU %s raised to %s (request and limit): %s" (include "vllm-stack.str" ($m.requestCPU | default 4)) $cpu (printf "%d processes keep a core busy each" $busy) | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* HAMi's GPU-sharing resources (production-stack's requestGPUMem/... and limitGPUMem/...). */}}
{{- define "vllm-stack.engine.hamiResources" -}}
{{- $m := .model -}}
{{- $keys := ternary (list "requestGPUMem" "requestGPUMemPercentage" "requestGPUCores") (list "limitGPUMem" "limitGPUMemPercentage" "limitGPUCores") (eq .side "request") -}}
{{- range $i, $name := list "nvidia.com/gpumem" "nvidia.com/gpumem-percentage" "nvidia.com/gpucores" }}
{{- with (get $m (index $keys $i)) }}
{{ $name }}: {{ include "vllm-stack.str" . | quote }}
{{- end }}
{{- end }}
{{- end -}}
