#!/usr/bin/env bash
# Runs the agent benchmarks against ../shared/peers/torchrun; see launch_bench.py.
set -euo pipefail
cd "$(dirname "$0")/.."
exec /usr/bin/python3 bench/launch_bench.py "${1:-build}"
