#!/usr/bin/env bash
# The whole test suite on a fresh machine: set-up, the model fetch the slow tests need, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
specinfer models fetch --jobs 2  # two models converted at once (each on one core)
python3 -m pytest -q "$@"
