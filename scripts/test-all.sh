#!/usr/bin/env bash
# Every test suite, one after another, even when one fails; then a summary.
# This is what `make test` and CI run. Each suite also runs alone:
#   scripts/test-python.sh  scripts/test-go.sh  scripts/test-c.sh  scripts/test-packaging.sh
#   scripts/test-llama.sh  scripts/test-ollama.sh (after test-llama.sh: it reuses its llama.cpp builds)
#   scripts/test-gpu-bundle.sh (the offline GPU bundle's dry run; reuses build/c and the Go build cache)
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

suites=(python go c packaging llama ollama gpu-bundle)
declare -A result seconds
failed=0
for s in "${suites[@]}"; do
  printf '\n\033[1m==== %s suite ====\033[0m\n' "$s"
  t0=$(date +%s)
  if "scripts/test-$s.sh"; then result[$s]=passed; else result[$s]=FAILED; failed=$((failed + 1)); fi
  seconds[$s]=$(( $(date +%s) - t0 ))
done
printf '\n==== summary ====\n'
for s in "${suites[@]}"; do
  printf '  %-10s %-7s %5ss\n' "$s" "${result[$s]}" "${seconds[$s]}"
done
printf 'suites: %d passed, %d failed\n' $(( ${#suites[@]} - failed )) "$failed"
[ "$failed" -eq 0 ]
