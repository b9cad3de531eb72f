#!/usr/bin/env bash
# The llama.cpp build of the offline GPU bundle's stage 3 (issue 24;
# docs/gpu-check.md, "Stage 3"): an unpatched and a patched llama-server over
# one ggml, in one directory. Used by stage3.sh on the GPU host (the host
# build) and by build-llama-cuda.sh here (the prebuilt CUDA part), so that
# both are the same build.
#
#   PART=... DEVICE=cuda|cpu [ARCH=90 NVCC=/path/to/nvcc] JOBS=N PYTHON=... \
#       scripts/gpu-bundle/llama-build.sh DIR
#
# PART is the bundle's part "llama" unpacked (llama.cpp.tar.xz,
# kvcached-prefix/); DIR gets:
#   src/{orig,kvc}          the source, pristine and with the hook applied
#   ggml/                   ggml installed (lib/libggml*.so, CUDA backend with
#                           DEVICE=cuda: -DCMAKE_CUDA_ARCHITECTURES=<ARCH>-real)
#   build-{orig,kvc}/bin/   llama-server and its libllama.so / libmtmd.so; their
#                           RUNPATH is $ORIGIN:$ORIGIN/../../ggml/lib, so DIR can
#                           be moved (the bundle carries it)
#   times.txt               "<step> <seconds>" per step this directory ran
# Resumable: every step skips what a marker says is done (src/.ok, ggml/.ok,
# build-<n>/.ok) and ninja keeps what it compiled, so a build stopped by a
# timeout goes on where it was.
set -euo pipefail
C="${1:?usage: llama-build.sh DIR (env: PART, DEVICE, ARCH, NVCC, JOBS, PYTHON)}"
REPO="${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
PART="${PART:?PART: the bundle part llama, unpacked}"
DEVICE="${DEVICE:-cuda}"
JOBS="${JOBS:-$(nproc)}"
PYTHON="${PYTHON:-python3}"
COMMON_FLAGS=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON -DCMAKE_INSTALL_LIBDIR=lib)
LLAMA_FLAGS=(-DLLAMA_USE_SYSTEM_GGML=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
             -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF
             -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN;$ORIGIN/../../ggml/lib')
step() { printf '[llama-build %(%H:%M:%S)T] %s\n' -1 "$*"; }
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
SERVER_DEV=()
if [[ "$DEVICE" == cuda ]]; then
  : "${ARCH:?ARCH: the CUDA architecture (90 for H100/H200)}" "${NVCC:?NVCC: the nvcc to build with}"
  GGML_DEV=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${ARCH}-real" "-DCMAKE_CUDA_COMPILER=$NVCC"
            "-DCUDAToolkit_ROOT=$(dirname "$(dirname "$NVCC")")")
  # The installed libggml-cuda.so's RUNPATH is $ORIGIN: when the servers are
  # linked, ld cannot find the libcudart, cuBLAS and libcuda it needs unless
  # they are on the system's search path (a toolkit outside ld.so.conf, a
  # build machine without a driver), and fails on their symbols. They are
  # found at run time (stage 3 puts their dirs on LD_LIBRARY_PATH).
  SERVER_DEV=(-DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined)
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
      "${GGML_DEV[@]}" "${SERVER_DEV[@]}" "$@" >"$C/$n-configure.log" 2>&1 || { tail -30 "$C/$n-configure.log"; return 1; }
    cmake --build "$C/build-$n" --target llama-server -j"$JOBS" >"$C/$n-build.log" 2>&1 \
      || { tail -40 "$C/$n-build.log"; return 1; }
    touch "$C/build-$n/.ok"
  fi
}
t ggml ggml
t unpatched server orig
t patched server kvc "-DCMAKE_PREFIX_PATH=$C/kvcached-prefix"
grep -q "kvcached: KV-cache hook on" "$C/kvc-configure.log" \
  || { echo "llama-build: the patched build did not find the C client ($C/kvc-configure.log)"; exit 3; }
