#!/usr/bin/env bash
# Stage 5 of the offline GPU bundle (issue 44; docs/gpu-check.md, "Stage 5:
# capacity"): how many 8B models this GPU keeps resident at Ollama's own
# defaults, stock llama-server against the patched one with kvcached-serve.
# verify.sh runs it with BUNDLE, REPO, PYTHON, STAGE_OUT, STAGE_DEADLINE,
# KVCACHED_LIBCUDA, VERIFY_DRIVER and JOBS set; it writes $STAGE_OUT/rows.jsonl
# (kind "capacity"), $STAGE_OUT/figures.json (names "stage5.*") and
# $STAGE_OUT/checks/capacity.json (every runner's record).
#
# 1. The two llama-servers with ggml's CUDA backend: STAGE5_BUILD=prebuilt:DIR
#    (DIR/build-{orig,kvc}/bin/llama-server, DIR/ggml/lib), else the ones
#    stage 3 recorded in ${BUNDLE}/work/llama/servers.json, else the bundle's
#    prebuilt part llama-cuda when it lists CUDA0 here (its CUDA libraries
#    found as stage 3 finds them). Stage 5 builds nothing: without one of
#    these every row is a skip row saying so.
# 2. tests/helpers/gpu_capacity.py run: one GGUF of Llama-3.1-8B's shape with
#    random q4_0 weights (4.5 GB, written in seconds into ${BUNDLE}/work/capacity,
#    removed at the end), then runners one after another as Ollama v0.34.4
#    starts them, stock until Ollama's rule says the next does not fit, then
#    patched ones on the daemon (cuda backend, budget the free memory) until
#    one fails to load or the daemon refuses; a round robin of requests over
#    every resident model; 1 slot, then 4 slots if time is left.
#
# Time: it starts no runner after its own deadline: STAGE_DEADLINE less
# STAGE5_LEAVE s (default 60 when stage 4 comes after it in VERIFY_STAGES,
# else 10), and at most STAGE5_BUDGET s (default 270) after it started, so
# that `verify.sh --stages 5` ends in under 5 minutes.
#
# Device: STAGE5_DEVICE=cuda (default with VERIFY_DRIVER=real) or cpu: the
# same scenario scaled for a CPU (the "scaled" shape, the daemon on the host
# backend, an emulated device of STAGE5_CPU_DEVICE_MIB, default 256, -b/-ub
# STAGE5_CPU_BATCH, default 64) against
# CPU builds (STAGE5_BUILD, default $REPO/build/llama: scripts/test-llama.sh's).
# With VERIFY_DRIVER=testdriver and no STAGE5_DEVICE every row is a skip row:
# "no CUDA runtime". STAGE5_PARALLEL (default "1,4"), STAGE5_MAX_MODELS
# (default 64) and STAGE5_KEEP_MODEL=1 (leave the GGUF) are passed on.
set -uo pipefail

REPO="${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
cd "$REPO"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
STAGE_OUT="${STAGE_OUT:?STAGE_OUT: the output directory of the stage}"
STAGE_DEADLINE="${STAGE_DEADLINE:-$(($(date +%s) + 600))}"
VERIFY_DRIVER="${VERIFY_DRIVER:-real}"
BUNDLE="${BUNDLE:-}"
ROWS="$STAGE_OUT/rows.jsonl"
DRIVER="$REPO/tests/helpers/gpu_capacity.py"
PARALLEL="${STAGE5_PARALLEL:-1,4}"
mkdir -p "$STAGE_OUT"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

T0="$(date +%s)"
LEAVE="${STAGE5_LEAVE:-}"
if [[ -z "$LEAVE" ]]; then
  LEAVE=10 seen5=0
  for s in ${VERIFY_STAGES:-1 2 3 5 4}; do  # stage 4 after stage 5 in this run: leave it its minute
    [[ "$s" == 5 ]] && seen5=1
    [[ "$s" == 4 && $seen5 == 1 ]] && LEAVE=60
  done
fi
DEADLINE=$((STAGE_DEADLINE - LEAVE))
CAP=$((T0 + ${STAGE5_BUDGET:-270}))
((CAP < DEADLINE)) && DEADLINE=$CAP

row() { # check expected seen verdict
  "$PYTHON" -c 'import json, sys; print(json.dumps(dict(zip(("check", "expected", "seen", "verdict"), sys.argv[1:5]), kind="capacity")))' \
    "$@" >>"$ROWS"
  printf '%-5s %s: %s\n' "$4" "$1" "$3"
}
skip_all() { "$PYTHON" "$DRIVER" skip --out "$STAGE_OUT" --rows "$ROWS" --parallel "$PARALLEL" --reason "$1"; }

DEVICE="${STAGE5_DEVICE:-}"
if [[ -z "$DEVICE" ]]; then
  if [[ "$VERIFY_DRIVER" == real ]]; then DEVICE=cuda; else DEVICE=none; fi
fi
echo "stage5: device $DEVICE, driver $VERIFY_DRIVER, $((DEADLINE - T0)) s to its deadline (${LEAVE} s before the stage deadline, at most ${STAGE5_BUDGET:-270} s)"

if [[ "$DEVICE" == none ]]; then
  skip_all "no CUDA runtime"
  exit 0
fi
if [[ "$DEVICE" == cpu && "$VERIFY_DRIVER" != real ]]; then
  row "capacity on a GPU (8B shape, Ollama's defaults)" "runs on a GPU" \
    "skip: no CUDA runtime (the rows below: the same scenario scaled, CPU builds, daemon on the host backend)" skip
fi

# ---------------------------------------------------------------- the two servers
ORIG_BIN="" KVC_BIN="" LIBDIR="" WHERE=""
BUILD="${STAGE5_BUILD:-}"
[[ "$DEVICE" == cpu && -z "$BUILD" ]] && BUILD="prebuilt:$REPO/build/llama"
RECORD="${BUNDLE:+$BUNDLE/work/llama/servers.json}"
PREBUILT="${STAGE5_PREBUILT_PART:-$BUNDLE/parts/llama-cuda}"
if [[ "$BUILD" == prebuilt:* ]]; then
  DIR="${BUILD#prebuilt:}"
  ORIG_BIN="$DIR/build-orig/bin/llama-server" KVC_BIN="$DIR/build-kvc/bin/llama-server"
  [[ -d "$DIR/ggml/lib" ]] && LIBDIR="$DIR/ggml/lib"
  WHERE="prebuilt: $DIR"
elif [[ -n "$BUILD" ]]; then
  row "STAGE5_BUILD" "prebuilt:DIR" "$BUILD" FAIL
  exit 1
elif [[ -n "$RECORD" && -f "$RECORD" ]] && \
     [[ "$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["device"])' "$RECORD" 2>/dev/null)" == "$DEVICE" ]]; then
  read -r ORIG_BIN KVC_BIN LIBDIR < <("$PYTHON" -c 'import json, sys; r = json.load(open(sys.argv[1])); print(r["orig"], r["kvc"], r["libdir"] or "")' "$RECORD")
  WHERE="stage 3's ($RECORD)"
elif [[ "$DEVICE" == cuda && -f "$PREBUILT/MANIFEST.json" ]]; then
  if "$PYTHON" "$REPO/tests/helpers/cuda_libs.py" --lib "$PREBUILT/ggml/lib/libggml-cuda.so" --json "$STAGE_OUT/cuda-libs.json" >"$STAGE_OUT/cuda-libs.txt"; then
    CUDA_LIB_PATH="$("$PYTHON" -c 'import json, sys; print(":".join(json.load(open(sys.argv[1]))["dirs"]))' "$STAGE_OUT/cuda-libs.json")"
    LIBDIR="$PREBUILT/ggml/lib${CUDA_LIB_PATH:+:$CUDA_LIB_PATH}"
    LIST="$(LD_LIBRARY_PATH="$LIBDIR:${LD_LIBRARY_PATH:-}" timeout 120 "$PREBUILT/build-orig/bin/llama-server" --list-devices 2>&1)"
    if grep -qE '^ *CUDA0: ' <<<"$LIST"; then
      ORIG_BIN="$PREBUILT/build-orig/bin/llama-server" KVC_BIN="$PREBUILT/build-kvc/bin/llama-server"
      WHERE="the bundle's prebuilt part llama-cuda ($(grep -m1 -E '^ *CUDA0: ' <<<"$LIST" | sed 's/^ *//'))"
    else
      row "llama-server builds" "the bundle's part llama-cuda lists CUDA0" "$(tr '\n' ' ' <<<"$LIST" | cut -c1-300)" FAIL
      skip_all "no llama-server with ggml-cuda that runs here"
      exit 1
    fi
  else
    row "llama-server builds" "the CUDA libraries of the part llama-cuda" "$(cat "$STAGE_OUT/cuda-libs.txt")" FAIL
    skip_all "ggml-cuda's CUDA libraries are missing on this host"
    exit 1
  fi
fi
if [[ -z "$ORIG_BIN" ]]; then
  skip_all "no llama-server builds: stage 3 records them (run stages 3 and 5), or a bundle made --with llama-cuda"
  exit 0
fi
if [[ ! -x "$ORIG_BIN" || ! -x "$KVC_BIN" ]]; then
  row "llama-server builds" "$ORIG_BIN and $KVC_BIN" "missing ($WHERE)" FAIL
  skip_all "no llama-server builds"
  exit 1
fi
row "llama-server builds (unpatched and patched)" "two llama-servers" "$WHERE" info
[[ -n "$LIBDIR" ]] && export LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# the gguf package (writes the model): the bundle's wheel when python lacks it
if ! "$PYTHON" -c 'import gguf' 2>/dev/null; then
  W="$(ls "$BUNDLE"/parts/llama/wheels/gguf-*.whl 2>/dev/null | head -1)"
  if [[ -z "$W" ]]; then
    row "gguf (writes the model)" "importable or in the bundle" "neither" FAIL
    skip_all "no gguf to write the model"
    exit 1
  fi
  "$PYTHON" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$W" "$STAGE_OUT/pylib"
  export PYTHONPATH="$PYTHONPATH:$STAGE_OUT/pylib"
fi

WORK="${BUNDLE:+$BUNDLE/work/capacity}"
WORK="${WORK:-$STAGE_OUT/work}"
ARGS=(run --device "$DEVICE" --orig "$ORIG_BIN" --kvc "$KVC_BIN" --out "$STAGE_OUT/checks" --rows "$ROWS"
      --figures "$STAGE_OUT/figures.json" --deadline "$DEADLINE" --parallel "$PARALLEL" --work "$WORK"
      --max-models "${STAGE5_MAX_MODELS:-64}")
[[ "$DEVICE" == cpu ]] && ARGS+=(--device-mib "${STAGE5_CPU_DEVICE_MIB:-256}" --batch "${STAGE5_CPU_BATCH:-64}")
[[ "${STAGE5_KEEP_MODEL:-0}" == 1 ]] && ARGS+=(--keep-model)
"$PYTHON" "$DRIVER" "${ARGS[@]}"
