#!/usr/bin/env bash
# Stage 3 of the offline GPU bundle (issue 24; docs/gpu-check.md, "Stages 3
# and 4"): the llama.cpp hook on a GPU. verify.sh runs it with BUNDLE, REPO,
# PYTHON, STAGE_OUT, STAGE_DEADLINE, KVCACHED_LIBCUDA, VERIFY_DRIVER and JOBS
# set; it writes $STAGE_OUT/rows.jsonl (kind "llama.cpp").
#
# 1. Gets an unpatched and a patched llama-server with ggml's CUDA backend:
#    - the bundle's prebuilt part "llama-cuda" (scripts/gpu-bundle.sh --with
#      llama-cuda; STAGE3_PREBUILT_PART overrides its path) when it is for
#      device 0's architecture (nvidia-smi or torch; STAGE3_CUDA_ARCH
#      overrides) and its llama-server lists CUDA0 here;
#    - else built on the host by scripts/gpu-bundle/llama-build.sh from the
#      part "llama" (the pinned llama.cpp source, the hook applied by
#      integrations/llama.cpp/apply.py, the C client's static archive) for that
#      architecture only, with all JOBS cores. The build lives in a cache
#      (STAGE3_CACHE, default ~/.cache/kvcached-gpu-bundle/llama-<input hash>):
#      a build the deadline stopped resumes there on the next run (ninja), and a
#      finished one is reused. Its time is a row; when it cannot finish before
#      the stage's own deadline (leaving STAGE3_CHECK_RESERVE s, default 60,
#      for the checks) the row says so and the checks are skip rows. The
#      stage's own deadline is STAGE_DEADLINE less STAGE3_LEAVE s (default 75)
#      so that stage 4 still starts before verify.sh's deadline.
#    STAGE3_BUILD=host forces the host build; STAGE3_BUILD=prebuilt:DIR uses
#    DIR/build-{orig,kvc}/bin/llama-server and DIR/ggml/lib (a cache dir of an
#    earlier run, or scripts/test-llama.sh's build/llama for the CPU mode).
#    The CUDA libraries libggml-cuda.so needs are found on the host
#    (tests/helpers/cuda_libs.py) and put on LD_LIBRARY_PATH, one row.
# 2. Runs tests/helpers/gpu_llama.py checks: greedy identity against the
#    unpatched server (2 models, flash attention on/off, 1 and 4 slots), the
#    KV buffer in daemon pages, pages following the context, a SIGKILLed
#    server's pages, two servers over one budget with a reclaim; a real 8B
#    model's KV shape (32 layers, 8 KV heads of 128; random q4_0 weights from
#    tests/helpers/q4_gguf.py, FFN and vocabulary cut: 1.0 GiB) at a 32k
#    context over 4 slots: tokens identical, KV held against stock's KV buffer,
#    pages back after slot erase and SIGKILL, two such servers over one
#    budget (--device cpu: 4 layers, 16k); device memory back at the end; the
#    long ones last, stopped at STAGE_DEADLINE.
# 3. Records the two servers for stage 4 in ${BUNDLE}/work/llama/servers.json.
#
# Device: STAGE3_DEVICE=cuda (default with VERIFY_DRIVER=real) or cpu (the same
# checks against CPU builds, daemon on the host backend: how the driver is
# exercised without a GPU). With VERIFY_DRIVER=testdriver and no STAGE3_DEVICE
# every check is a skip row: "skip: no CUDA runtime".
#
#   STAGE3_PREBUILD=1 scripts/gpu-bundle/stage3.sh   (verify.sh, at its start on a real driver: the build
#                                                     only, in the background, so it overlaps stages 1-2)
set -uo pipefail

REPO="${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
cd "$REPO"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
JOBS="${JOBS:-$(nproc)}"
BUILDER="$REPO/scripts/gpu-bundle/llama-build.sh"

# ---------------------------------------------------------------- the stage
STAGE_OUT="${STAGE_OUT:?STAGE_OUT: the output directory of the stage}"
STAGE_DEADLINE="${STAGE_DEADLINE:-$(($(date +%s) + 600))}"
VERIFY_DRIVER="${VERIFY_DRIVER:-real}"
DEADLINE=$((STAGE_DEADLINE - ${STAGE3_LEAVE:-75}))  # stage 4 must still start before STAGE_DEADLINE
BUNDLE="${BUNDLE:-}"
PART="${STAGE3_PART:-$BUNDLE/parts/llama}"
RECORD="${BUNDLE:-$STAGE_OUT}/work/llama/servers.json"
ROWS="$STAGE_OUT/rows.jsonl"
DRIVER="$REPO/tests/helpers/gpu_llama.py"
mkdir -p "$STAGE_OUT"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

row() { # check expected seen verdict
  "$PYTHON" -c 'import json, sys; print(json.dumps(dict(zip(("check", "expected", "seen", "verdict"), sys.argv[1:5]), kind="llama.cpp")))' \
    "$@" >>"$ROWS"
  printf '%-5s %s: %s\n' "$4" "$1" "$3"
}
skip_all() { "$PYTHON" "$DRIVER" skip --out "$STAGE_OUT" --rows "$ROWS" --reason "$1"; }

DEVICE="${STAGE3_DEVICE:-}"
if [[ -z "$DEVICE" ]]; then
  if [[ "$VERIFY_DRIVER" == real ]]; then DEVICE=cuda; else DEVICE=none; fi
fi
echo "stage3: device $DEVICE, driver $VERIFY_DRIVER, build ${STAGE3_BUILD:-prebuilt part or host}, $JOBS jobs, $((DEADLINE - $(date +%s))) s to its deadline (${STAGE3_LEAVE:-75} s before the stage deadline, for stage 4)"

if [[ "$DEVICE" == none ]]; then
  row "llama.cpp with ggml-cuda: host build" "builds with the host's nvcc" "skip: no CUDA runtime" skip
  skip_all "no CUDA runtime"
  exit 0
fi
if [[ "$DEVICE" == cpu && "$VERIFY_DRIVER" != real ]]; then
  row "llama.cpp with ggml-cuda on a GPU" "runs on a GPU" \
    "skip: no CUDA runtime (the rows below: the same checks on CPU builds, daemon on the host backend)" skip
fi

# The CUDA architecture of device 0: the bundle's prebuilt part is for one, the
# host build compiles for it alone.
ARCH=""
if [[ "$DEVICE" == cuda ]]; then
  ARCH="${STAGE3_CUDA_ARCH:-}"
  if [[ -z "$ARCH" ]] && command -v nvidia-smi >/dev/null; then
    ARCH="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader -i 0 2>/dev/null | head -1 | tr -d ' .')"
  fi
  if [[ -z "$ARCH" ]]; then
    ARCH="$("$PYTHON" -c 'import torch; a, b = torch.cuda.get_device_capability(0); print(f"{a}{b}")' 2>/dev/null || true)"
  fi
  if [[ ! "$ARCH" =~ ^[0-9]+[a-z]?$ ]]; then
    row "CUDA architecture of device 0" "from nvidia-smi or torch" "unknown ('$ARCH'); set STAGE3_CUDA_ARCH" FAIL
    skip_all "unknown CUDA architecture"
    exit 1
  fi
fi

# cuda_libs LIBDIR: finds what libggml-cuda.so in LIBDIR needs (cuBLAS, the CUDA
# runtime, libcuda) on this host (the toolkit of nvcc, /usr/local/cuda*, the
# python's nvidia wheels), exports LD_LIBRARY_PATH with those dirs first, and
# writes one row; non-zero when something stays missing.
CUDA_LIB_PATH=""
CUDA_LIBS_OF=""
cuda_libs() {
  local info
  CUDA_LIBS_OF="$1"
  info="$("$PYTHON" "$REPO/tests/helpers/cuda_libs.py" --lib "$1/libggml-cuda.so" --json "$STAGE_OUT/cuda-libs.json")"
  local rc=$?
  CUDA_LIB_PATH="$("$PYTHON" -c 'import json, sys; print(":".join(json.load(open(sys.argv[1]))["dirs"]))' "$STAGE_OUT/cuda-libs.json" 2>/dev/null)"
  [[ -n "$CUDA_LIB_PATH" ]] && export LD_LIBRARY_PATH="$CUDA_LIB_PATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if [[ $rc == 0 ]]; then
    row "CUDA libraries of ggml-cuda" "all found" "$info" info
  else
    row "CUDA libraries of ggml-cuda" "all found" "$info" FAIL
  fi
  return $rc
}

# Which build: STAGE3_BUILD (host, or prebuilt:DIR) when set; on a GPU, the
# bundle's prebuilt part "llama-cuda" (scripts/gpu-bundle.sh --with llama-cuda)
# when it is for this architecture and runs here, else the host build.
BUILD="${STAGE3_BUILD:-}"
[[ "$DEVICE" == cpu && -z "$BUILD" ]] && BUILD="prebuilt:$REPO/build/llama"
PREBUILT="${STAGE3_PREBUILT_PART:-$BUNDLE/parts/llama-cuda}"
if [[ -z "$BUILD" && "$DEVICE" == cuda && -f "$PREBUILT/MANIFEST.json" ]]; then
  WHAT="$("$PYTHON" -c 'import json, sys; m = json.load(open(sys.argv[1])); print(m["cuda_arch"], "CUDA %(cuda)s, llama.cpp %(llama_cpp)s, built %(built)s" % m)' \
    "$PREBUILT/MANIFEST.json" 2>/dev/null)"
  PARCH="${WHAT%% *}"
  if [[ -z "$WHAT" ]]; then
    row "the bundle's prebuilt llama.cpp (part llama-cuda)" "a readable MANIFEST.json" "unreadable: building on this host" FAIL
  elif [[ "$PARCH" != "$ARCH" ]]; then
    row "the bundle's prebuilt llama.cpp (part llama-cuda)" "for sm_$ARCH (device 0)" \
      "for sm_$PARCH: not usable on this device, building on this host" info
  elif ! cuda_libs "$PREBUILT/ggml/lib"; then
    row "the bundle's prebuilt llama.cpp (part llama-cuda)" "runs here" "its CUDA libraries are missing (row above): building on this host" FAIL
  else
    LIST="$(LD_LIBRARY_PATH="$PREBUILT/ggml/lib:${LD_LIBRARY_PATH:-}" timeout 120 "$PREBUILT/build-orig/bin/llama-server" --list-devices 2>&1)"
    if grep -qE '^ *CUDA0: ' <<<"$LIST"; then
      BUILD="prebuilt:$PREBUILT"
      row "the bundle's prebuilt llama.cpp (part llama-cuda)" "runs here and lists CUDA0" \
        "sm_$PARCH, ${WHAT#* }; $(grep -m1 -E '^ *CUDA0: ' <<<"$LIST" | sed 's/^ *//')" pass
    else
      row "the bundle's prebuilt llama.cpp (part llama-cuda)" "runs here and lists CUDA0" \
        "llama-server --list-devices: $(tr '\n' ' ' <<<"$LIST" | cut -c1-300); building on this host" FAIL
    fi
  fi
fi
BUILD="${BUILD:-host}"
if [[ -n "${STAGE3_PREBUILD:-}" && "$BUILD" != host ]]; then
  exit 0  # verify.sh's background build: nothing to build
fi

LIBDIR=""
if [[ "$BUILD" == prebuilt:* ]]; then
  DIR="${BUILD#prebuilt:}"
  ORIG_BIN="$DIR/build-orig/bin/llama-server"
  KVC_BIN="$DIR/build-kvc/bin/llama-server"
  [[ -d "$DIR/ggml/lib" ]] && LIBDIR="$DIR/ggml/lib"
  if [[ ! -x "$ORIG_BIN" || ! -x "$KVC_BIN" ]]; then
    row "llama.cpp builds (prebuilt)" "$DIR/build-{orig,kvc}/bin/llama-server" "missing" FAIL
    skip_all "no llama-server builds"
    exit 1
  fi
  row "llama.cpp builds" "two llama-servers" "prebuilt: $DIR (no build here)" info
elif [[ "$BUILD" == host ]]; then
  # tools
  NVCC=""
  missing=()
  for tool in cmake ninja c++ xz; do command -v "$tool" >/dev/null || missing+=("$tool"); done
  if [[ "$DEVICE" == cuda ]]; then
    NVCC="${CUDACXX:-$(command -v nvcc || true)}"
    [[ -z "$NVCC" && -x /usr/local/cuda/bin/nvcc ]] && NVCC=/usr/local/cuda/bin/nvcc
    [[ -z "$NVCC" ]] && missing+=(nvcc)
  fi
  if [[ ! -f "$PART/llama.cpp.tar.xz" ]]; then missing+=("the bundle's part llama ($PART)"); fi
  if ((${#missing[@]})); then
    row "llama.cpp host build: tools" "cmake, ninja, c++, xz${NVCC:+, nvcc}, the part" "missing: ${missing[*]}" FAIL
    skip_all "cannot build llama.cpp here"
    exit 1
  fi
  if [[ "$DEVICE" == cuda ]]; then
    row "llama.cpp host build: toolchain" "nvcc, cmake, ninja" \
      "nvcc $("$NVCC" --version | grep -o 'V[0-9.]*' | head -1) ($NVCC), sm_$ARCH, cmake $(cmake --version | head -1 | awk '{print $3}'), $JOBS jobs" info
  fi
  KEY="$(cat "$PART/MANIFEST.json" "$REPO/integrations/llama.cpp/apply.py" $(ls "$REPO"/integrations/llama.cpp/kvcached_kv* | LC_ALL=C sort) \
    "$BUILDER" 2>/dev/null | sha256sum | cut -c1-16)"
  KEY="$DEVICE${ARCH:+-sm$ARCH}-$KEY"
  C="${STAGE3_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcached-gpu-bundle}/llama-$KEY"
  mkdir -p "$C"
  # One build at a time per cache dir: verify.sh starts this stage early in the
  # background with STAGE3_PREBUILD=1 (only the build, niced, while stages 1
  # and 2 run); the stage itself then waits for that build instead of
  # starting its own. The lock (fd 9) is held by whoever builds, its timeout
  # and the builder's children included, and goes with them.
  exec 9>"$C/lock"
  if ! flock -n 9; then
    [[ -n "${STAGE3_PREBUILD:-}" ]] && exit 0  # the stage itself got there first
    WAIT=$((DEADLINE - $(date +%s) - ${STAGE3_CHECK_RESERVE:-60}))
    echo "stage3: waiting up to ${WAIT} s for the background build in $C"
    if ((WAIT < 1)) || ! flock -w "$WAIT" 9; then
      row "llama.cpp host build (ggml ${DEVICE}${ARCH:+ sm_$ARCH}, both llama-servers)" "finishes before the deadline" \
        "skip: the background build (started by verify.sh) had not finished; it resumes from $C on the next run, or run verify.sh with a larger VERIFY_DEADLINE" skip
      skip_all "the llama.cpp host build did not finish before the deadline"
      exit 0
    fi
  fi
  if [[ -f "$C/.done" ]]; then
    row "llama.cpp host build (ggml ${DEVICE}${ARCH:+ sm_$ARCH}, both llama-servers)" "built" \
      "reused from $C (built earlier in $(cat "$C/.done") s)" info
  else
    RESERVE="${STAGE3_CHECK_RESERVE:-60}"
    BUDGET=$((DEADLINE - $(date +%s) - RESERVE))
    PRIOR="$(awk '{s += $1} END {print s + 0}' "$C/runs.txt" 2>/dev/null || echo 0)"  # earlier runs' seconds
    if ((BUDGET < 10)); then
      row "llama.cpp host build" "finishes before the deadline, $RESERVE s left for the checks" \
        "skip: only $((BUDGET + RESERVE)) s left at the start; rerun verify.sh with a larger VERIFY_DEADLINE (the build resumes from $C)" skip
      skip_all "the llama.cpp host build did not run (deadline)"
      exit 0
    fi
    T=$SECONDS
    PART="$PART" DEVICE="$DEVICE" ARCH="$ARCH" NVCC="$NVCC" PYTHON="$PYTHON" JOBS="$JOBS" REPO="$REPO" \
      timeout -k 10 "$BUDGET" bash "$BUILDER" "$C" >"$STAGE_OUT/build.log" 2>&1
    RC=$?
    TOOK=$((SECONDS - T))
    echo "$TOOK" >>"$C/runs.txt"
    tail -5 "$STAGE_OUT/build.log"
    cp "$C"/*.log "$STAGE_OUT/" 2>/dev/null
    STEPS="$(awk '{printf "%s%s %d s", sep, $1, $2; sep = ", "}' "$C/times.txt" 2>/dev/null)"
    if [[ $RC == 0 ]]; then
      TOTAL=$((PRIOR + TOOK))
      echo "$TOTAL" >"$C/.done"
      row "llama.cpp host build (ggml ${DEVICE}${ARCH:+ sm_$ARCH}, both llama-servers)" \
        "finishes before the deadline, $RESERVE s left for the checks" \
        "built in $TOOK s this run ($TOTAL s in all runs; steps: $STEPS) with $JOBS jobs" info
    elif [[ $RC == 124 || $RC == 137 ]]; then
      row "llama.cpp host build (ggml ${DEVICE}${ARCH:+ sm_$ARCH}, both llama-servers)" \
        "finishes before the deadline, $RESERVE s left for the checks" \
        "skip: not finished after $TOOK s this run ($((PRIOR + TOOK)) s in all so far; $BUDGET s were left); it resumes from $C on the next run, or run verify.sh with a larger VERIFY_DEADLINE" skip
      skip_all "the llama.cpp host build did not finish before the deadline"
      exit 0
    else
      row "llama.cpp host build (ggml ${DEVICE}${ARCH:+ sm_$ARCH}, both llama-servers)" "builds" \
        "failed (exit $RC) after $TOOK s: $(grep -m1 -iE 'error|fatal' "$STAGE_OUT/build.log" | cut -c1-300) (log: build.log)" FAIL
      skip_all "the llama.cpp host build failed"
      exit 1
    fi
  fi
  [[ -n "${STAGE3_PREBUILD:-}" ]] && exit 0  # the background build: the stage itself runs the checks
  ORIG_BIN="$C/build-orig/bin/llama-server"
  KVC_BIN="$C/build-kvc/bin/llama-server"
  LIBDIR="$C/ggml/lib"
else
  row "STAGE3_BUILD" "host or prebuilt:DIR" "$BUILD" FAIL
  exit 1
fi

if [[ "$DEVICE" == cuda && -n "$LIBDIR" && "$CUDA_LIBS_OF" != "$LIBDIR" ]] && ! cuda_libs "$LIBDIR"; then
  skip_all "ggml-cuda's CUDA libraries are missing on this host"
  exit 1
fi
LIBDIR="$LIBDIR${CUDA_LIB_PATH:+:$CUDA_LIB_PATH}"   # the servers' library path (stage 4 reads it from servers.json)
[[ -n "$LIBDIR" ]] && export LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# the gguf package (for the test models): the bundle's wheel when python lacks it
if ! "$PYTHON" -c 'import gguf' 2>/dev/null; then
  W="$(ls "$PART"/wheels/gguf-*.whl 2>/dev/null | head -1)"
  if [[ -z "$W" ]]; then
    row "gguf (writes the test models)" "importable or in the bundle" "neither: no $PART/wheels/gguf-*.whl" FAIL
    skip_all "no gguf to write the test models"
    exit 1
  fi
  "$PYTHON" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$W" "$STAGE_OUT/pylib"
  export PYTHONPATH="$PYTHONPATH:$STAGE_OUT/pylib"
fi

mkdir -p "$(dirname "$RECORD")"
PYLIB=""
[[ -d "$STAGE_OUT/pylib" ]] && PYLIB="$STAGE_OUT/pylib"
"$PYTHON" -c 'import json, sys; json.dump(dict(zip(("device", "orig", "kvc", "libdir", "pylib"), sys.argv[1:6])), open(sys.argv[6], "w"))' \
  "$DEVICE" "$ORIG_BIN" "$KVC_BIN" "$LIBDIR" "$PYLIB" "$RECORD"
"$PYTHON" "$DRIVER" checks --device "$DEVICE" --orig "$ORIG_BIN" --kvc "$KVC_BIN" --out "$STAGE_OUT/checks" \
  --rows "$ROWS" --deadline "$DEADLINE"
