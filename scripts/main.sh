#!/usr/bin/env bash
# The main job on a fresh machine: set-up, fetch the default models, then answer one request.
# With the serving stack: start the Ray Serve gRPC server, wait until it is ready, send one
# request with the client, print the answer and its statistics, and stop the server again.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
specinfer models fetch
PROMPT=${1:-"def quicksort(arr):"}
specinfer generate --config configs/default.yaml --prompt "$PROMPT" --max-new-tokens 64
