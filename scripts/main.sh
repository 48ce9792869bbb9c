#!/usr/bin/env bash
# The main job on a fresh machine: set-up, fetch the default models, then start the Ray Serve
# gRPC server (Ray bound to 127.0.0.1), wait until it is ready, send one request with the
# client, print the answer and its statistics, and stop the server again.
#   bash scripts/main.sh ["your prompt"]
# To keep a server running instead: `specinfer serve --config configs/serve.yaml` (Ctrl-C stops
# it) and, in another shell, `specinfer client --address 127.0.0.1:9000 --prompt "..."`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
specinfer models fetch --jobs 2  # two models converted at once (each on one core)
PROMPT=${1:-"def quicksort(arr):"}
specinfer demo --config configs/serve.yaml --prompt "$PROMPT" --max-new-tokens 64
