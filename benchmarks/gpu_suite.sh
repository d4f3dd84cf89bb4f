#!/usr/bin/env bash
# The GPU checks of the scale issue in one run and one table (see gpu_suite.py). Runs from the
# source tree, no install; on an H200 it takes under 8 minutes:
#   bash benchmarks/gpu_suite.sh [--preset tiny]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH=. exec python3 benchmarks/gpu_suite.py "$@"
