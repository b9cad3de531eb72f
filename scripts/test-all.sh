#!/usr/bin/env bash
# Every test suite, one after another, even when one fails; then a summary.
# This is what `make test` and CI run. Each suite also runs alone:
#   scripts/test-python.sh  scripts/test-go.sh  scripts/test-c.sh  scripts/test-packaging.sh
#   scripts/test-llama.sh  scripts/test-ollama.sh (after test-llama.sh: it reuses its llama.cpp builds)
#   scripts/test-gpu-bundle.sh (the offline GPU bundle's dry run; reuses build/c and the Go build cache)
#   scripts/test-fuzz.sh (a short run of every decoder's coverage-guided fuzz target, docs/fuzzing.md)
# Meanwhile scripts/prebuild.sh makes the later suites' builds in the
# background at idle priority (KVC_PREBUILD=0: no prebuild); before a suite
# it feeds, this waits until the prebuild's step for that suite has ended.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

suites=(python go c packaging llama ollama gpu-bundle fuzz)
prebuilt=(go c packaging llama ollama gpu-bundle fuzz)   # scripts/prebuild.sh's steps, one per suite
declare -A result seconds
failed=0
T0=$SECONDS
prebuild_pid=""
if [[ "${KVC_PREBUILD:-1}" != 0 ]]; then
  mkdir -p build/prebuild
  rm -f build/prebuild/*.rc
  # its own process group, so that an interrupted run stops it and its builds
  setsid scripts/prebuild.sh "${prebuilt[@]}" >build/prebuild/prebuild.log 2>&1 &
  prebuild_pid=$!
  trap 'kill -0 "$prebuild_pid" 2>/dev/null && kill -TERM -- "-$prebuild_pid" 2>/dev/null' EXIT
  trap 'exit 130' INT TERM
  echo "prebuild: the builds of the ${prebuilt[*]} suites run in the background at idle priority (build/prebuild/)"
fi

wait_prebuild() { # suite: wait until the prebuild's step for it has ended (or the prebuild has)
  local s="$1" t=$SECONDS
  [[ -n "$prebuild_pid" && " ${prebuilt[*]} " == *" $s "* ]] || return 0
  while [[ ! -f "build/prebuild/$s.rc" ]] && kill -0 "$prebuild_pid" 2>/dev/null; do sleep 2; done
  local rc; rc="$(cat "build/prebuild/$s.rc" 2>/dev/null || echo "none: the prebuild ended before it")"
  printf 'prebuild: step %s ended (exit %s) at %d s; waited %d s for it\n' "$s" "$rc" "$((SECONDS - T0))" "$((SECONDS - t))"
  if [[ "$rc" != 0 ]]; then
    echo "prebuild: the suite builds again itself; the prebuild's log (build/prebuild/$s.log) ends:"
    tail -15 "build/prebuild/$s.log" 2>/dev/null | sed 's/^/  | /'
  fi
}

mkdir -p build/test-logs
for s in "${suites[@]}"; do
  printf '\n\033[1m==== %s suite ====\033[0m\n' "$s"
  wait_prebuild "$s"
  t0=$SECONDS
  # each suite's output is also kept in build/test-logs/<suite>.log; a failed
  # suite's failure lines are printed again after the summary (CI shows the end)
  if "scripts/test-$s.sh" 2>&1 | tee "build/test-logs/$s.log"; then result[$s]=passed; else result[$s]=FAILED; failed=$((failed + 1)); fi
  seconds[$s]=$((SECONDS - t0))
done
if [[ -n "$prebuild_pid" ]]; then
  wait "$prebuild_pid"
  printf '\n==== prebuild ====\n'
  grep '^prebuild:' build/prebuild/prebuild.log
fi
for s in "${suites[@]}"; do
  [[ ${result[$s]} == FAILED ]] || continue
  printf '\n==== why %s failed: its failure lines, then its last lines (build/test-logs/%s.log) ====\n' "$s" "$s"
  grep -aE '(FAILED|ERROR|Error|error:|MISSED|Traceback|panic:|^--- FAIL|^test-[a-z-]+: )' "build/test-logs/$s.log" | tail -15 | cut -c1-400
  echo '  ...'
  tail -12 "build/test-logs/$s.log" | cut -c1-400
done
printf '\n==== summary ====\n'
for s in "${suites[@]}"; do
  printf '  %-10s %-7s %5ss\n' "$s" "${result[$s]}" "${seconds[$s]}"
done
printf 'suites: %d passed, %d failed (%d s in all)\n' $(( ${#suites[@]} - failed )) "$failed" "$((SECONDS - T0))"
[ "$failed" -eq 0 ]
