#!/usr/bin/env bash
# The later suites' builds, made early, in the background, while the earlier
# suites run their tests. scripts/test-all.sh starts it (KVC_PREBUILD=0 turns
# that off) and, before each suite, waits until the step for that suite is
# done. It runs at idle CPU and I/O priority (SCHED_IDLE and ionice's idle
# class, or nice 19 where those are refused), so it takes only the CPU the
# running tests leave: the Python suite keeps 2 cores about half busy, which
# leaves room for most of llama.cpp's cold build. Each suite's own build
# steps then find their outputs up to date (cached by input hash, ninja or
# Go's build cache) and go straight to their tests; what a step here failed
# at, the suite builds again in the foreground and reports there.
#
#   scripts/prebuild.sh [STEP...]     steps, in this order by default:
#     go          the Go suite's tools, its packages compiled (test-go.sh --build-only)
#     c           build/c and build/c-asan (scripts/build-c.sh)       -> test-c.sh
#     packaging   sdist, wheel, images (test-packaging.sh --build-only)
#     llama       llama.cpp unpatched and patched, the hook's CUDA objects
#                 (test-llama.sh --build-only)
#     ollama      Ollama's Go binaries, its test packages compiled
#                 (test-ollama.sh --build-only)
#     gpu-bundle  the dry run's bundle (scripts/gpu-bundle.sh)         -> test-gpu-bundle.sh
#     fuzz        atheris, the C fuzz target, Go's fuzzing build
#                 (test-fuzz.sh --build-only)
#
# Each step's output goes to build/prebuild/STEP.log; build/prebuild/STEP.rc
# holds its exit status once it ended (test-all.sh waits for that file).
# Prints one line per step; exits with the first failing step's status, after
# running the others.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
S="$ROOT/build/prebuild"

chrt --idle -p 0 $$ 2>/dev/null || renice -n 19 -p $$ >/dev/null 2>&1 || true
ionice -c 3 -p $$ 2>/dev/null || true

steps=("$@")
[[ ${#steps[@]} -gt 0 ]] || steps=(go c packaging llama ollama gpu-bundle fuzz)
mkdir -p "$S"
for s in "${steps[@]}"; do rm -f "$S/$s.rc"; done

run_step() {
  case "$1" in
    go) scripts/test-go.sh --build-only ;;
    c) scripts/build-c.sh && scripts/build-c.sh --asan ;;
    packaging) scripts/test-packaging.sh --build-only ;;
    llama) scripts/test-llama.sh --build-only ;;
    ollama) scripts/test-ollama.sh --build-only ;;
    gpu-bundle) scripts/gpu-bundle.sh "$ROOT/build/gpu-bundle/dry-run/bundle" ;;
    fuzz) scripts/test-fuzz.sh --build-only ;;
    *) echo "prebuild: no step $1 (go, c, packaging, llama, ollama, gpu-bundle, fuzz)" >&2; return 2 ;;
  esac
}

first_rc=0
T0=$SECONDS
for s in "${steps[@]}"; do
  t=$SECONDS
  run_step "$s" >"$S/$s.log" 2>&1
  rc=$?
  echo "$rc" >"$S/$s.rc"
  printf 'prebuild: %-10s %s in %4d s (at %d s; log build/prebuild/%s.log)\n' "$s" \
    "$([[ $rc == 0 ]] && echo done || echo "FAILED ($rc)")" "$((SECONDS - t))" "$((SECONDS - T0))" "$s"
  [[ $rc == 0 || $first_rc != 0 ]] || first_rc=$rc
done
exit "$first_rc"
