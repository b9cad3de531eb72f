#!/usr/bin/env bash
# kvcached-service on this GPU host, in one command, offline (the bundle made
# by scripts/gpu-bundle.sh; docs/gpu-check.md "The offline GPU bundle"):
#
#   ./verify.sh                 [--stages "5"]   (one or more stages only)
#
# Unpacks the bundle into a work dir, makes a python venv there (this host's
# python3.12 and its site-packages: torch, grpcio, protobuf, numpy, pytest...;
# plus the bundle's wheels: pydantic, pydantic-settings, gguf...), then runs
# the stages, each its own process, each adding rows to one table:
#   1  scripts/gpu-check.sh: driver probe, the daemon end to end, the CUDA
#      behaviour tests, the CUDA bench (about 4 minutes)
#   2  the Go and C clients' tests against daemons on the CUDA backend
#   3  the llama.cpp hook on this GPU
#   5  capacity: 8B models resident at Ollama's defaults, stock against
#      kvcached (before stage 4: the figures come last)
#   4  figures for the docs
# After every stage $VERIFY_OUT holds table.md, results.json (rows, figures,
# host facts), verify.log and logs.tar.gz: send back logs.tar.gz (it holds
# the rest). The last line is PASS, PASS with N DIFF rows, or FAIL.
#
# Environment (all optional):
#   VERIFY_OUT        where the results go (default: a new /tmp/kvcached-verify.*)
#   VERIFY_DEADLINE   seconds from the start (default 540): a stage that would
#                     start later is reported as skipped, not run; one still
#                     running VERIFY_GRACE seconds (default 60) after it is stopped
#   VERIFY_STAGES     the stages to run, in order (default "1 2 3 5 4"; --stages
#                     on the command line wins)
#   PYTHON            the host's python (default python3.12, else python3)
#   KVCACHED_LIBCUDA  the driver library (default: the libcuda.so.1 the
#                     dynamic loader finds)
#   VERIFY_DRIVER     real (default) or testdriver (the dry run on a CPU machine)
#   VERIFY_WORK       the work dir (default: a new temp dir, removed at the end
#                     unless VERIFY_KEEP=1)
#   VERIFY_EXTRA_SITE a directory of python packages to use as well (the dry
#                     run's stand-in for a GPU host's site-packages)
#   JOBS              cores for builds (default: all)
set -u
T0="$(date +%s)"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --stages) VERIFY_STAGES="${2:?verify: --stages needs a list, e.g. --stages 5}"; shift 2 ;;
        --stages=*) VERIFY_STAGES="${1#--stages=}"; shift ;;
        *) echo "verify: unknown argument $1 (--stages \"N ...\"; the rest are variables: see the top of this file)"; echo FAIL; exit 2 ;;
    esac
done
export VERIFY_STAGES="${VERIFY_STAGES:-1 2 3 5 4}"
VERIFY_STAGES="${VERIFY_STAGES//,/ }"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

if [[ -z "${PYTHON:-}" ]]; then
    for c in python3.12 python3; do
        if command -v "$c" >/dev/null; then PYTHON="$(command -v "$c")"; break; fi
    done
fi
[[ -n "${PYTHON:-}" ]] || { echo "verify: no python3.12 or python3 on PATH (set PYTHON)"; echo FAIL; exit 1; }

VERIFY_OUT="${VERIFY_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/kvcached-verify.XXXXXX")}"
mkdir -p "$VERIFY_OUT" && VERIFY_OUT="$(cd "$VERIFY_OUT" && pwd)"
if [[ -n "${VERIFY_WORK:-}" ]]; then
    mkdir -p "$VERIFY_WORK" && WORK="$(cd "$VERIFY_WORK" && pwd)"
else
    WORK="$(mktemp -d "${TMPDIR:-/tmp}/kvcached-bundle.XXXXXX")"
    [[ "${VERIFY_KEEP:-}" == 1 ]] || trap 'rm -rf "$WORK"' EXIT
fi
LOG="$VERIFY_OUT/verify.log"
echo "kvcached GPU bundle: results in $VERIFY_OUT (work dir $WORK, python $PYTHON)" | tee -a "$LOG"

"$PYTHON" "$HERE/tools/prepare.py" unpack "$HERE" "$WORK" 2>&1 | tee -a "$LOG"
EXTRA=()
[[ -n "${VERIFY_EXTRA_SITE:-}" ]] && EXTRA=(--extra-site "$VERIFY_EXTRA_SITE")
"$PYTHON" "$HERE/tools/prepare.py" venv "$WORK/repo" "$WORK/parts/wheels" "$VERIFY_OUT/prepare-rows.jsonl" "${EXTRA[@]}" 2>&1 | tee -a "$LOG"

if [[ -z "${KVCACHED_LIBCUDA:-}" ]]; then
    # the file the dynamic loader picks for libcuda.so.1 (the daemon and the clients load it by that name)
    KVCACHED_LIBCUDA="$("$PYTHON" -c '
import ctypes
try:
    ctypes.CDLL("libcuda.so.1")
except OSError:
    raise SystemExit
for line in open("/proc/self/maps"):
    if "libcuda.so" in line:
        print(line.split()[-1]); break
' 2>/dev/null)"
    [[ -n "$KVCACHED_LIBCUDA" ]] || KVCACHED_LIBCUDA="libcuda.so.1"  # not found: the stages say so
fi
echo "driver library: $KVCACHED_LIBCUDA (${VERIFY_DRIVER:-real})" | tee -a "$LOG"

"$PYTHON" "$HERE/tools/runner.py" --bundle "$WORK" --repo "$WORK/repo" --python "$WORK/repo/.venv/bin/python" \
    --out "$VERIFY_OUT" --stages "$VERIFY_STAGES" --deadline "${VERIFY_DEADLINE:-540}" \
    --grace "${VERIFY_GRACE:-60}" --driver "${VERIFY_DRIVER:-real}" --libcuda "$KVCACHED_LIBCUDA" \
    --jobs "${JOBS:-$(nproc)}" --prepare-rows "$VERIFY_OUT/prepare-rows.jsonl" --start "$T0"
