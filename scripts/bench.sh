#!/usr/bin/env bash
# Benchmark harness: scripts/bench.sh [--quick] [--backend host|cuda|all] [--out DIR] [--only LIST]
# Starts its own daemons, measures each scenario beside its baseline (same run),
# prints a markdown table, writes DIR/results.json and DIR/results.md.
# `--only ollama` is the capacity scenario on a real Ollama (bench/ollama_capacity.py:
# stock vs kvcached `ollama serve`, needs scripts/test-ollama.sh's builds); it writes
# DIR/ollama.json and DIR/ollama.md. See docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}

# Split "ollama" out of --only: it is not a per-backend scenario.
args=() only="" ollama=0 quick=() out=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --only) only="$2"; shift 2 ;;
    --only=*) only="${1#--only=}"; shift ;;
    --quick) quick=(--quick); args+=("$1"); shift ;;
    --out) out=(--out "$2"); args+=("$1" "$2"); shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
rest=()
IFS=',' read -ra names <<<"$only"
for n in "${names[@]}"; do
  if [[ "$n" == ollama ]]; then ollama=1; elif [[ -n "$n" ]]; then rest+=("$n"); fi
done
if [[ $ollama == 0 ]]; then
  exec "$PY" -m bench "${args[@]}" ${only:+--only "$only"}
fi
status=0
if [[ ${#rest[@]} -gt 0 ]]; then
  "$PY" -m bench "${args[@]}" --only "$(IFS=,; echo "${rest[*]}")" || status=$?
fi
"$PY" -m bench.ollama_capacity "${quick[@]}" "${out[@]}" || status=$?
exit $status
