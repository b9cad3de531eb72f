#!/usr/bin/env bash
# Benchmark harness: scripts/bench.sh [--quick] [--backend host|cuda|all] [--out DIR]
# Starts its own daemons, measures each scenario beside its baseline (same run),
# prints a markdown table, writes DIR/results.json and DIR/results.md.
# See docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec "$PY" -m bench "$@"
