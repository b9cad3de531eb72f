#!/usr/bin/env bash
# Stage 4 of the offline GPU bundle (issue 24; docs/gpu-check.md, "Stages 3
# and 4"): the figures for the docs, as info rows (kind "figures") and
# $STAGE_OUT/figures.json, measured by tests/helpers/gpu_figures.py:
#   cuMemCreate / Map / SetAccess / Unmap per 2 MiB page (p50/p99); warm
#   Allocate(64) through the daemon against in-process create+map; the
#   one-page round trip with 1 and 16 clients; reclaim of most of a 4 GiB
#   budget from an idle session to a new one, at 2 MiB and at 32 MiB pages;
#   decode tokens/s of the patched
#   llama-server against the unpatched one (the builds stage 3 recorded in
#   ${BUNDLE}/work/llama/servers.json); then what decides issue 42's design
#   (tests/helpers/gpu_design_probe.py, a few seconds each): imported handles
#   (import from a dup'ed fd, release, close of the last fd), set-access and
#   unmap over runs of 1-64 pages, per-call costs at 2-128 MiB pages, calls
#   from 1-8 threads and 2-4 processes, asynchronous memset latency, kernel
#   memory per held exported fd, and decode under a zeroing process.
# On the test driver (VERIFY_DRIVER=testdriver) the same figures are the test
# driver's, marked so (reclaim at the bench's quick size, 256 MiB); the decode
# figure is a skip row ("no CUDA runtime") unless stage 3 ran its CPU mode;
# the design figures run with small counts (decode under zeroing: a skip row).
# STAGE4_FULL=1: bench.suite's full sizes for allocate64 and roundtrip.
set -uo pipefail

REPO="${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
cd "$REPO"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
STAGE_OUT="${STAGE_OUT:?STAGE_OUT: the output directory of the stage}"
STAGE_DEADLINE="${STAGE_DEADLINE:-$(($(date +%s) + 600))}"
VERIFY_DRIVER="${VERIFY_DRIVER:-real}"
SERVERS="${BUNDLE:-$STAGE_OUT}/work/llama/servers.json"
mkdir -p "$STAGE_OUT"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

STATE=""
if [[ "$VERIFY_DRIVER" == testdriver ]]; then
  # the test driver's simulated machine for this stage (as bench/run.py sets it up)
  STATE="$(mktemp -d "$([[ -d /dev/shm ]] && echo /dev/shm || echo "${TMPDIR:-/tmp}")/kvc-stage4-XXXXXX")"
  export KVCACHED_TESTDRV_STATE="$STATE" KVCACHED_TESTDRV_MEMORY=$((2 << 30))
  trap 'rm -rf "$STATE"' EXIT
fi
ARGS=(--out "$STAGE_OUT" --driver "$VERIFY_DRIVER" --deadline "$STAGE_DEADLINE" --servers "$SERVERS")
[[ "${STAGE4_FULL:-0}" == 1 ]] && ARGS+=(--full)
echo "stage4: driver $VERIFY_DRIVER, $((STAGE_DEADLINE - $(date +%s))) s to the deadline, llama-server builds: $SERVERS"
"$PYTHON" "$REPO/tests/helpers/gpu_figures.py" "${ARGS[@]}"
