#!/usr/bin/env bash
# Part "llama-cuda" of the offline GPU bundle, optional (issue 24;
# docs/gpu-check.md "Stage 3"): stage 3's two llama-servers prebuilt here,
# with ggml's CUDA backend for one architecture, so that a GPU host runs the
# checks at once instead of compiling ggml-cuda first.
#
#   scripts/gpu-bundle.sh OUTDIR --with llama-cuda [--cuda-arch 90]
#   (gpu-bundle.sh calls: scripts/gpu-bundle/build-llama-cuda.sh PARTDIR,
#    with GPU_BUNDLE_PARTS=OUTDIR/parts holding the part "llama" already)
#
# The build is stage 3's host build (scripts/gpu-bundle/llama-build.sh, the
# same source, hook and flags), run here with nvcc 13.0 from PyPI
# (scripts/cuda-toolkit.sh) for sm_$GPU_BUNDLE_CUDA_ARCH, in
# build/gpu-bundle/llama-cuda-sm<arch> (resumable and incremental: a change
# of the hook or the C client rebuilds the servers, not ggml). On 2 cores
# ggml-cuda takes over an hour; see docs/gpu-check.md for the figures.
# PARTDIR gets:
#   ggml/lib/              libggml*.so with libggml-cuda.so, and libcudart.so.13
#                          from the toolkit (cuBLAS and libcuda come from the host)
#   build-{orig,kvc}/bin/  llama-server, libllama.so, libmtmd.so (RUNPATH
#                          $ORIGIN:$ORIGIN/../../ggml/lib), stripped
#   MANIFEST.json          cuda_arch, cuda, llama_cpp, built, the
#                          seconds of every build step this directory ran
#                          (times.txt: a step that had nothing to do is 0), files
# gpu-bundle-optional
# gpu-bundle-xz: 9   (the two servers' libraries are near copies: a 64 MiB dictionary finds them; 30.5 -> 25.6 MB)
# gpu-bundle-inputs: scripts/gpu-bundle/llama-build.sh scripts/gpu-bundle/build-llama.sh scripts/cuda-toolkit.sh clients/c integrations/llama.cpp
set -euo pipefail

PART="${1:?usage: build-llama-cuda.sh PARTDIR}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
PY="$REPO/.venv/bin/python"
JOBS="${JOBS:-2}"
ARCH="${GPU_BUNDLE_CUDA_ARCH:-90}"
CUDA=13.0
LLAMA_TAR="${GPU_BUNDLE_PARTS:?GPU_BUNDLE_PARTS: the bundle parts dir (scripts/gpu-bundle.sh sets it)}/llama.tar.xz"
[[ -f "$LLAMA_TAR" ]] || { echo "build-llama-cuda: no part llama ($LLAMA_TAR): it is built first" >&2; exit 1; }
TK="$REPO/build/cuda-toolkit-$CUDA"
C="$REPO/build/gpu-bundle/llama-cuda-sm$ARCH"
T0=$SECONDS

echo "build-llama-cuda: CUDA toolkit $CUDA (PyPI wheels) -> $TK"
bash "$REPO/scripts/cuda-toolkit.sh" "$TK" --cuda "$CUDA"

# the part "llama" as stage 3 sees it on a host
SRC="$(mktemp -d)"
trap 'rm -rf "$SRC"' EXIT
tar -C "$SRC" -xJf "$LLAMA_TAR"
# What each build step depends on: ggml on the source and the toolkit; the
# servers also on the hook and the C client. A change clears the markers of
# what it invalidates (ninja then recompiles only what changed).
mkdir -p "$C"
GGML_KEY="$(cat "$SRC/llama.cpp.tar.xz" "$REPO/scripts/gpu-bundle/llama-build.sh" "$TK/.stamp" | sha256sum | cut -c1-16)-sm$ARCH"
SERVER_KEY="$(cat "$SRC/MANIFEST.json" "$REPO/integrations/llama.cpp/apply.py" \
  $(ls "$REPO"/integrations/llama.cpp/kvcached_kv* | LC_ALL=C sort) | sha256sum | cut -c1-16)"
if [[ "$(cat "$C/.ggml-key" 2>/dev/null)" != "$GGML_KEY" ]]; then
  [[ -f "$C/.ggml-key" ]] && echo "build-llama-cuda: the source, toolkit or build script changed: ggml again"
  rm -f "$C/src/.ok" "$C/ggml/.ok" "$C/build-orig/.ok" "$C/build-kvc/.ok" "$C/.server-key"
  echo "$GGML_KEY" >"$C/.ggml-key"
fi
if [[ "$(cat "$C/.server-key" 2>/dev/null)" != "$SERVER_KEY" ]]; then
  rm -f "$C/src/.ok" "$C/build-orig/.ok" "$C/build-kvc/.ok"
  echo "$SERVER_KEY" >"$C/.server-key"
fi
echo "build-llama-cuda: ggml-cuda sm_$ARCH and two llama-servers in $C ($JOBS jobs; ggml-cuda alone takes over an hour on 2 cores)"
PART="$SRC" DEVICE=cuda ARCH="$ARCH" NVCC="$TK/bin/nvcc" JOBS="$JOBS" PYTHON="$PY" REPO="$REPO" \
  bash "$REPO/scripts/gpu-bundle/llama-build.sh" "$C"

# the part: the libraries and the two servers, stripped
mkdir -p "$PART/ggml/lib"
cp -a "$C"/ggml/lib/libggml*.so* "$PART/ggml/lib/"
cp -L "$TK/lib/libcudart.so.13" "$PART/ggml/lib/"
for n in orig kvc; do
  mkdir -p "$PART/build-$n/bin"
  cp -a "$C/build-$n/bin/llama-server" "$C/build-$n/bin/"lib*.so* "$PART/build-$n/bin/"
done
find "$PART" -type f \( -name '*.so*' -o -name llama-server \) -exec strip --strip-unneeded {} +
for n in orig kvc; do   # they must find their own libraries and ggml's wherever the part is unpacked
  RP="$(readelf -d "$PART/build-$n/bin/llama-server" | sed -n 's/.*(RUNPATH).*\[\(.*\)\]/\1/p')"
  [[ "$RP" == '$ORIGIN:$ORIGIN/../../ggml/lib' ]] || { echo "build-llama-cuda: build-$n/bin/llama-server RUNPATH is '$RP'" >&2; exit 1; }
done
"$PY" - "$PART" "$ARCH" "$CUDA" "$C/times.txt" "$SRC/MANIFEST.json" "$TK/.stamp" <<'EOF'
import datetime, hashlib, json, pathlib, sys
part, arch, cuda, times, llama_manifest, pins = sys.argv[1:7]
part = pathlib.Path(part)
steps = [[label, int(secs)] for label, _, secs in (line.strip().rpartition(" ") for line in open(times)) if label and int(secs) > 0]
files = {str(p.relative_to(part)): {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
         for p in sorted(part.rglob("*")) if p.is_file() and not p.is_symlink()}
json.dump({"cuda_arch": arch, "cuda": cuda, "toolkit": open(pins).read().split(),
           "llama_cpp": json.load(open(llama_manifest))["llama_cpp"],
           "built": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "build_steps_seconds": steps, "files": files}, open(part / "MANIFEST.json", "w"), indent=1)
EOF
echo "build-llama-cuda: $(du -sh "$PART" | cut -f1) in $PART ($((SECONDS - T0)) s this run; steps so far: $(tr '\n' ' ' <"$C/times.txt"))"
