#!/usr/bin/env bash
# Run one test command N times in a row, optionally beside a CPU-bound load,
# and say how many runs passed; the output of every failed run is kept.
#
#   scripts/loop-tests.sh [-n 50] [--stress 2] [--out DIR] -- COMMAND...
#
# Examples (docs/reliability.md "Suite stability"):
#   scripts/loop-tests.sh -n 50 --stress 2 -- .venv/bin/python -m pytest -q -p no:cacheprovider \
#       tests/test_killstorm.py::test_kill_storm_1000_host
#   scripts/loop-tests.sh -n 50 --stress 2 -- bash -c 'cd clients/go && go test -count=1 -run TestChannel ./internal/chanmux'
#
# --stress N starts `stress-ng --cpu N` (apt-get install stress-ng) for the
# whole loop. Exit status: 0 when every run passed.
set -uo pipefail
n=50 stress=0 out=""
while (($#)); do
  case "$1" in
    -n) n="$2"; shift 2 ;;
    --stress) stress="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "loop-tests: unknown argument $1 (the command goes after --)" >&2; exit 2 ;;
  esac
done
(($#)) || { echo "loop-tests: no command given (put it after --)" >&2; exit 2; }
[[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "loop-tests: -n wants a positive count, got $n" >&2; exit 2; }
out="${out:-$(mktemp -d -t kvc-loop-XXXXXX)}"
mkdir -p "$out"
spid=""
if ((stress > 0)); then
  command -v stress-ng >/dev/null || { echo "loop-tests: stress-ng is not installed (apt-get install stress-ng)" >&2; exit 2; }
  stress-ng --cpu "$stress" --timeout 0 >/dev/null 2>&1 &
  spid=$!
  trap 'kill $spid 2>/dev/null; wait $spid 2>/dev/null' EXIT
  sleep 2
fi
echo "loop-tests: $n runs of: $*" | tee "$out/summary.txt"
echo "  started $(date -u +%FT%TZ), load average $(cut -d' ' -f1-3 /proc/loadavg), stress-ng --cpu $stress" | tee -a "$out/summary.txt"
pass=0 fail=0 t0=$(date +%s)
for ((i = 1; i <= n; i++)); do
  if "$@" >"$out/run.log" 2>&1; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
    mv "$out/run.log" "$out/failed-$i.log"
    echo "  run $i FAILED: $out/failed-$i.log" | tee -a "$out/summary.txt"
  fi
  printf '\r  %d/%d runs, %d failed' "$i" "$n" "$fail" >&2
done
echo >&2
rm -f "$out/run.log"
echo "  $pass of $n passed, $fail failed, $(( $(date +%s) - t0 )) s, load average at end $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/summary.txt"
((fail == 0))
