#!/usr/bin/env bash
# Stage 3 of the offline GPU bundle (issue 24; docs/gpu-check.md, "Stages 3
# and 4"): the llama.cpp hook on a GPU. verify.sh runs it with BUNDLE, REPO,
# PYTHON, STAGE_OUT, STAGE_DEADLINE, KVCACHED_LIBCUDA, VERIFY_DRIVER and JOBS
# set; it writes $STAGE_OUT/rows.jsonl (kind "llama.cpp").
#
# 1. Builds, on the host, an unpatched and a patched llama-server (the bundle's
#    part "llama": the pinned llama.cpp source, integrations/llama.cpp/apply.py
#    from the repository copy, the C client's self-contained static archive)
#    with ggml's CUDA backend for the host's architecture only
#    (-DCMAKE_CUDA_ARCHITECTURES=<arch>-real, arch from nvidia-smi or torch,
#    STAGE3_CUDA_ARCH overrides), with all JOBS cores. The hook does not touch
#    ggml, so ggml (CUDA backend included) is built once and installed, and
#    both llama.cpp trees use it (LLAMA_USE_SYSTEM_GGML); only libllama, common,
#    mtmd and the server are compiled twice. The build lives in a cache
#    (STAGE3_CACHE, default ~/.cache/kvcached-gpu-bundle/llama-<input hash>):
#    a build the deadline stopped resumes there on the next run (ninja), and a
#    finished one is reused. Its time is a row; when it cannot finish before
#    the stage's own deadline (leaving STAGE3_CHECK_RESERVE s, default 60, for
#    the checks) the row says so and the checks are skip rows. The stage's own
#    deadline is STAGE_DEADLINE less STAGE3_LEAVE s (default 75) so that
#    stage 4 still starts before verify.sh's deadline.
#    STAGE3_BUILD=prebuilt:DIR uses DIR/build-orig/bin/llama-server and
#    DIR/build-kvc/bin/llama-server instead (a cache dir of an earlier run, or
#    scripts/test-llama.sh's build/llama for the CPU mode). A prebuilt
#    CUDA build carried inside the bundle is not done (size: libggml-cuda for
#    one architecture alone is tens of MiB).
# 2. Runs tests/helpers/gpu_llama.py checks: greedy identity against the
#    unpatched server (2 models, flash attention on/off, 1 and 4 slots), the
#    KV buffer in daemon pages, pages following the context, a SIGKILLed
#    server's pages, two servers over one budget with a reclaim, device memory
#    back at the end; the long ones last, stopped at STAGE_DEADLINE.
# 3. Records the two servers for stage 4 in ${BUNDLE}/work/llama/servers.json.
#
# Device: STAGE3_DEVICE=cuda (default with VERIFY_DRIVER=real) or cpu (the same
# checks against CPU builds, daemon on the host backend: how the driver is
# exercised without a GPU). With VERIFY_DRIVER=testdriver and no STAGE3_DEVICE
# every check is a skip row: "skip: no CUDA runtime".
#
#   scripts/gpu-bundle/stage3.sh __build DIR   (internal: the build steps, run under timeout)
#   STAGE3_PREBUILD=1 scripts/gpu-bundle/stage3.sh   (verify.sh, at its start on a real driver: the build
#                                                     only, in the background, so it overlaps stages 1-2)
set -uo pipefail

REPO="${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
cd "$REPO"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
JOBS="${JOBS:-$(nproc)}"
SELF="$REPO/scripts/gpu-bundle/stage3.sh"
COMMON_FLAGS=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON -DCMAKE_INSTALL_LIBDIR=lib)
LLAMA_FLAGS=(-DLLAMA_USE_SYSTEM_GGML=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
             -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF)

# ---------------------------------------------------------------- the build steps (under timeout)
if [[ "${1:-}" == __build ]]; then
  # env: C (cache dir), PART, DEVICE, ARCH, NVCC; resumable: every step skips what is done
  set -e
  C="$2"
  step() { printf '[stage3 build %(%H:%M:%S)T] %s\n' -1 "$*"; }
  mkdir -p "$C"
  if [[ ! -f "$C/src/.ok" ]]; then
    step "unpack llama.cpp"
    rm -rf "$C/src" && mkdir -p "$C/src"
    tar -C "$C/src" -xJf "$PART/llama.cpp.tar.xz"
    mv "$C/src/llama.cpp" "$C/src/orig"
    # the sdist lacks ggml.pc.in, which a standalone ggml (GGML_STANDALONE) configures
    [[ -f "$C/src/orig/ggml/ggml.pc.in" ]] || printf '%s\n' 'prefix=@CMAKE_INSTALL_PREFIX@' 'includedir=${prefix}/include' \
      'libdir=${prefix}/lib' '' 'Name: ggml' 'Description: ggml' 'Version: @GGML_VERSION@' 'Cflags: -I${includedir}' \
      'Libs: -L${libdir} -lggml' >"$C/src/orig/ggml/ggml.pc.in"
    cp -a "$C/src/orig" "$C/src/kvc"
    "$PYTHON" "$REPO/integrations/llama.cpp/apply.py" "$C/src/kvc" >/dev/null
    rm -rf "$C/kvcached-prefix" && cp -a "$PART/kvcached-prefix" "$C/kvcached-prefix"
    xz -d "$C/kvcached-prefix/lib/libkvcached_embed.a.xz"
    touch "$C/src/.ok"
  fi
  t() { # label command...: the seconds of each step (this run) go to times.txt
    local label=$1 s=$SECONDS; shift
    "$@"
    echo "$label $((SECONDS - s))" >>"$C/times.txt"
  }
  GGML_DEV=(-DGGML_CUDA=OFF)
  if [[ "$DEVICE" == cuda ]]; then
    GGML_DEV=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${ARCH}-real" "-DCMAKE_CUDA_COMPILER=$NVCC"
              "-DCUDAToolkit_ROOT=$(dirname "$(dirname "$NVCC")")")
  fi
  ggml() {
    if [[ ! -f "$C/ggml/.ok" ]]; then
      step "ggml (${GGML_DEV[*]}), $JOBS jobs"
      cmake -S "$C/src/orig/ggml" -B "$C/build-ggml" "${COMMON_FLAGS[@]}" "${GGML_DEV[@]}" -DGGML_BUILD_TESTS=OFF \
        -DGGML_BUILD_EXAMPLES=OFF "-DCMAKE_INSTALL_PREFIX=$C/ggml" '-DCMAKE_INSTALL_RPATH=$ORIGIN' >"$C/ggml-configure.log" 2>&1 \
        || { tail -30 "$C/ggml-configure.log"; return 1; }
      cmake --build "$C/build-ggml" -j"$JOBS" >"$C/ggml-build.log" 2>&1 || { tail -40 "$C/ggml-build.log"; return 1; }
      cmake --install "$C/build-ggml" >"$C/ggml-install.log" 2>&1 || { tail -20 "$C/ggml-install.log"; return 1; }
      touch "$C/ggml/.ok"
    fi
  }
  server() { # name [extra cmake args]
    local n=$1; shift
    if [[ ! -x "$C/build-$n/bin/llama-server" || ! -f "$C/build-$n/.ok" ]]; then
      step "llama-server ($n), $JOBS jobs"
      cmake -S "$C/src/$n" -B "$C/build-$n" "${COMMON_FLAGS[@]}" "${LLAMA_FLAGS[@]}" "-Dggml_DIR=$C/ggml/lib/cmake/ggml" \
        "${GGML_DEV[@]}" "$@" >"$C/$n-configure.log" 2>&1 || { tail -30 "$C/$n-configure.log"; return 1; }
      cmake --build "$C/build-$n" --target llama-server -j"$JOBS" >"$C/$n-build.log" 2>&1 \
        || { tail -40 "$C/$n-build.log"; return 1; }
      touch "$C/build-$n/.ok"
    fi
  }
  t ggml ggml
  t unpatched server orig
  t patched server kvc "-DCMAKE_PREFIX_PATH=$C/kvcached-prefix"
  grep -q "kvcached: KV-cache hook on" "$C/kvc-configure.log" \
    || { echo "stage3: the patched build did not find the C client ($C/kvc-configure.log)"; exit 3; }
  exit 0
fi

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
echo "stage3: device $DEVICE, driver $VERIFY_DRIVER, build ${STAGE3_BUILD:-host}, $JOBS jobs, $((DEADLINE - $(date +%s))) s to its deadline (${STAGE3_LEAVE:-75} s before the stage deadline, for stage 4)"

if [[ "$DEVICE" == none ]]; then
  row "llama.cpp with ggml-cuda: host build" "builds with the host's nvcc" "skip: no CUDA runtime" skip
  skip_all "no CUDA runtime"
  exit 0
fi
if [[ "$DEVICE" == cpu && "$VERIFY_DRIVER" != real ]]; then
  row "llama.cpp with ggml-cuda on a GPU" "runs on a GPU" \
    "skip: no CUDA runtime (the rows below: the same checks on CPU builds, daemon on the host backend)" skip
fi

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

BUILD="${STAGE3_BUILD:-host}"
[[ "$DEVICE" == cpu && -z "${STAGE3_BUILD:-}" ]] && BUILD="prebuilt:$REPO/build/llama"
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
    row "llama.cpp host build: toolchain" "nvcc, cmake, ninja" \
      "nvcc $("$NVCC" --version | grep -o 'V[0-9.]*' | head -1) ($NVCC), sm_$ARCH, cmake $(cmake --version | head -1 | awk '{print $3}'), $JOBS jobs" info
  fi
  KEY="$(cat "$PART/MANIFEST.json" "$REPO/integrations/llama.cpp/apply.py" $(ls "$REPO"/integrations/llama.cpp/kvcached_kv* | LC_ALL=C sort) \
    "$SELF" 2>/dev/null | sha256sum | cut -c1-16)"
  KEY="$DEVICE${ARCH:+-sm$ARCH}-$KEY"
  C="${STAGE3_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcached-gpu-bundle}/llama-$KEY"
  mkdir -p "$C"
  # One build at a time per cache dir: verify.sh starts this stage early in the
  # background with STAGE3_PREBUILD=1 (only the build, niced, while stages 1
  # and 2 run); the stage itself then waits for that build instead of
  # starting its own. The lock (fd 9) is held by whoever builds, its timeout
  # and __build children included, and goes with them.
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
    C="$C" PART="$PART" DEVICE="$DEVICE" ARCH="$ARCH" NVCC="$NVCC" PYTHON="$PYTHON" JOBS="$JOBS" \
      timeout -k 10 "$BUDGET" bash "$SELF" __build "$C" >"$STAGE_OUT/build.log" 2>&1
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

[[ -n "$LIBDIR" ]] && export LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
mkdir -p "$(dirname "$RECORD")"
PYLIB=""
[[ -d "$STAGE_OUT/pylib" ]] && PYLIB="$STAGE_OUT/pylib"
"$PYTHON" -c 'import json, sys; json.dump(dict(zip(("device", "orig", "kvc", "libdir", "pylib"), sys.argv[1:6])), open(sys.argv[6], "w"))' \
  "$DEVICE" "$ORIG_BIN" "$KVC_BIN" "$LIBDIR" "$PYLIB" "$RECORD"
"$PYTHON" "$DRIVER" checks --device "$DEVICE" --orig "$ORIG_BIN" --kvc "$KVC_BIN" --out "$STAGE_OUT/checks" \
  --rows "$ROWS" --deadline "$DEADLINE"
