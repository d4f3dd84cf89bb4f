#!/usr/bin/env bash
# Sampler throughput on a lent GPU (see gpu_sampler.py). Runs from the source tree, no install:
#   bash benchmarks/gpu_sampler.sh [--batch 64 --new 512]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH=. exec python3 benchmarks/gpu_sampler.py "$@"
