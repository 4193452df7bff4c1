#!/usr/bin/env bash
# Time from a fresh clone to the first chat completion answered through `make run` (installs included).
# Usage: benchmarks/foundation/make_run_time.sh [REPO]   (default: this checkout). Prints one line and
# appends it to benchmarks/results/make_run_time.txt.
set -euo pipefail
repo=${1:-$(git -C "$(dirname "$0")" rev-parse --show-toplevel)}
work=$(mktemp -d)
port=${VLLM_STACK_PORT:-18181}
git clone -q "$repo" "$work/clone"
cd "$work/clone"
start=$(date +%s)
VLLM_STACK_PORT=$port make run > "$work/run.log" 2>&1 &
runner=$!
body='{"model": "tiny-llama", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}'
until curl -sf "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' -d "$body" >/dev/null; do
  if ! kill -0 "$runner" 2>/dev/null; then echo "make run exited early:"; tail -30 "$work/run.log"; exit 1; fi
  sleep 1
done
elapsed=$(( $(date +%s) - start ))
pkill -INT -P "$runner" || true  # make's child: vllm-stack up (it stops every part)
wait "$runner" || true
line="$(date -u +%FT%TZ) fresh clone to first chat completion through make run: ${elapsed} s (load average $(cut -d' ' -f1 /proc/loadavg))"
echo "$line"
mkdir -p "$repo/benchmarks/results" && echo "$line" >> "$repo/benchmarks/results/make_run_time.txt"
rm -rf "$work"
