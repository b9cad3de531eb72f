#!/usr/bin/env bash
# A CUDA toolkit for building (not running: there is no GPU here) from
# NVIDIA's wheels on PyPI, pinned: nvcc with its crt headers and cicc, the
# runtime, CCCL and cuBLAS (headers and libraries).
#
#   scripts/cuda-toolkit.sh DIR [--cuda 13.0]     prints DIR/bin/nvcc's version
#
# DIR gets the wheels' nvidia/cu13 tree, made usable by CMake's FindCUDAToolkit
# and nvcc: lib64 -> lib, the unversioned library names (libcudart.so, ...),
# and lib/stubs/libcuda.so, a stub with the soname libcuda.so.1 that defines
# the driver functions ggml-cuda calls (the real one comes with the driver).
# Wheels are cached in build/wheels; DIR is rebuilt only when the pins change
# (DIR/.stamp). --cuda picks a pinned set: 13.0 (default; what a GPU host
# with CUDA 13.0 runs) or 13.2.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TK="${1:?usage: scripts/cuda-toolkit.sh DIR [--cuda 13.0|13.2]}"
CUDA=13.0
[[ "${2:-}" == --cuda ]] && CUDA="${3:?--cuda VERSION}"
case "$CUDA" in
  13.0) PINS=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96
              nvidia-cuda-cccl==13.0.85 nvidia-cublas==13.0.2.14) ;;
  13.2) PINS=(nvidia-cuda-nvcc==13.2.86 nvidia-cuda-crt==13.2.86 nvidia-nvvm==13.2.86 nvidia-cuda-runtime==13.2.86
              nvidia-cuda-cccl==13.2.86 nvidia-cublas==13.4.1.3) ;;
  *) echo "cuda-toolkit: no pinned set for CUDA $CUDA (13.0 or 13.2)" >&2; exit 2 ;;
esac
PY="$REPO/.venv/bin/python"
[[ -x "$PY" ]] || PY=python3
WHEELS="$REPO/build/wheels"
mkdir -p "$WHEELS"
if [[ -f "$TK/.stamp" && "$(cat "$TK/.stamp")" == "${PINS[*]}" && -x "$TK/bin/nvcc" ]]; then
  "$TK/bin/nvcc" --version | tail -1
  exit 0
fi
wheel_of() { local n="${1%%==*}" v="${1##*==}"; ls "$WHEELS/${n//-/_}-$v-"*.whl 2>/dev/null | head -1; }
for p in "${PINS[@]}"; do
  if [[ -z "$(wheel_of "$p")" ]]; then
    echo "cuda-toolkit: downloading $p" >&2
    "$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
      --platform manylinux_2_27_x86_64 --python-version 3.11 -d "$WHEELS" "$p"
  fi
done
rm -rf "$TK" && mkdir -p "$TK"
XT="$(mktemp -d)"
trap 'rm -rf "$XT"' EXIT
for p in "${PINS[@]}"; do
  "$PY" - "$(wheel_of "$p")" "$XT" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for n in z.namelist():
        if n.startswith("nvidia/cu13/"):
            z.extract(n, sys.argv[2])
EOF
done
cp -r "$XT/nvidia/cu13/." "$TK/"
chmod +x "$TK"/bin/* "$TK"/nvvm/bin/*
ln -sfn lib "$TK/lib64"
for l in cudart cublas cublasLt; do   # the wheels ship only the versioned names
  so="$(ls "$TK/lib/lib$l.so."* 2>/dev/null | grep -E "lib$l\.so\.[0-9]+$" | head -1)"
  [[ -n "$so" ]] && ln -sf "$(basename "$so")" "$TK/lib/lib$l.so"
done
# CMake's CUDA::cuda_driver links against a libcuda.so: a stub of the functions
# ggml-cuda calls (its VMM pool), soname libcuda.so.1 as the driver's.
mkdir -p "$TK/lib/stubs"
for f in cuDeviceGet cuDeviceGetAttribute cuGetErrorString cuMemAddressFree cuMemAddressReserve cuMemCreate \
         cuMemGetAllocationGranularity cuMemMap cuMemRelease cuMemSetAccess cuMemUnmap; do
  echo "int $f(void) { return 999; }"
done | cc -x c -shared -o "$TK/lib/stubs/libcuda.so" -Wl,-soname,libcuda.so.1 -
echo "${PINS[*]}" >"$TK/.stamp"
"$TK/bin/nvcc" --version | tail -1
