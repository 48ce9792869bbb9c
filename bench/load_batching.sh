#!/usr/bin/env bash
# Load benchmark of issue 8: the default pair served on this machine, ShareGPT prompts,
# concurrency 1, 2, 4, 8; tree and incremental on the engine loop (the default), then with a step
# loop per request (--no-engine-loop, continuous batching by the timed batcher), tree without batching.
#   bash bench/load_batching.sh [OUT_ROOT]        (about 20 minutes on a 2-core CPU)
#   LOAD_CONFIG (default configs/serve.yaml), LOAD_CONCURRENCY (1,2,4,8), LOAD_PROMPTS, LOAD_TOKENS.
set -euo pipefail
out=${1:-bench/out/load}
config=${LOAD_CONFIG:-configs/serve.yaml}
levels=${LOAD_CONCURRENCY:-1,2,4,8}
prompts=${LOAD_PROMPTS:-8}
tokens=${LOAD_TOKENS:-64}
port=9000

serve_and_bench() {  # $1: label, $2: methods, $3...: extra `specinfer serve` flags
  local label=$1 methods=$2
  shift 2
  specinfer serve --config "$config" --grpc-port "$port" "$@" > "/tmp/specinfer-load-$label.log" 2>&1 &
  local server=$!
  trap 'kill -TERM $server 2>/dev/null || true' EXIT
  specinfer client --address "127.0.0.1:$port" --prompt "warm up" --max-new-tokens 4 --wait-ready 900 > /dev/null
  specinfer bench --config "$config" --via grpc "127.0.0.1:$port" --dataset sharegpt \
    --num-prompts "$prompts" --max-new-tokens "$tokens" --methods "$methods" --concurrency "$levels" \
    --load-only --label "$label" --out "$out/$label"
  kill -TERM "$server"
  wait "$server" || true
  trap - EXIT
}

[ "${LOAD_SKIP_LOOP:-0}" = 1 ] || serve_and_bench engine-loop tree,incremental
[ "${LOAD_SKIP_BATCHING:-0}" = 1 ] || serve_and_bench batching tree,incremental --no-engine-loop
[ "${LOAD_SKIP_NO_BATCHING:-0}" = 1 ] || serve_and_bench no-batching tree --no-batching --no-engine-loop
