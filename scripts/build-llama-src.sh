#!/usr/bin/env bash
# The pinned llama.cpp source: vendor/llama.cpp of the llama-cpp-python sdist
# ($LLAMA_CPP_PYTHON_VERSION, default 0.3.36), downloaded with pip and
# unpacked. scripts/test-llama.sh, scripts/build-hook-cuda.sh, the GPU
# bundle's part llama and integrations/ollama/build.sh take it from here.
#
#   scripts/build-llama-src.sh DIR          prints DIR/src/llama_cpp_python-<v>/vendor/llama.cpp
#   scripts/build-llama-src.sh DIR --sdist  the sdist only; prints DIR/llama_cpp_python-<v>.tar.gz
#
# Recovers from its own failures: the sdist is downloaded into a folder of
# its own and renamed to DIR/llama_cpp_python-<v>.tar.gz once whole, and the
# tree is unpacked into DIR/src.tmp, marked (.kvc-unpacked-<v>) and renamed
# to DIR/src, so a download or unpack that failed or was stopped is never
# taken for done: the next run does it again. Tar keeps the archive's mtimes,
# so unpacking again rebuilds nothing in a build of the tree.
# Needs the venv's pip ($PIP overrides: a command, split on spaces).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
D="${1:?usage: build-llama-src.sh DIR [--sdist]}"
V="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PIP="${PIP:-$REPO/.venv/bin/pip}"
mkdir -p "$D"
SDIST="$D/llama_cpp_python-$V.tar.gz"
if [[ ! -f "$SDIST" ]]; then
  rm -rf "$D/download.tmp"
  $PIP download -q --no-deps --no-binary :all: "llama-cpp-python==$V" -d "$D/download.tmp" >&2 \
    || { echo "build-llama-src: pip download llama-cpp-python==$V failed" >&2; exit 1; }
  mv "$D/download.tmp/$(basename "$SDIST")" "$SDIST"
  rm -rf "$D/download.tmp"
fi
if [[ "${2:-}" == --sdist ]]; then echo "$SDIST"; exit 0; fi
TREE="$D/src/llama_cpp_python-$V/vendor/llama.cpp"
if [[ ! -f "$D/src/.kvc-unpacked-$V" ]]; then
  rm -rf "$D/src.tmp" && mkdir -p "$D/src.tmp"
  tar xzf "$SDIST" -C "$D/src.tmp" || { echo "build-llama-src: $SDIST does not unpack (removed: the next run downloads it again)" >&2; rm -f "$SDIST"; exit 1; }
  test -f "$D/src.tmp/llama_cpp_python-$V/vendor/llama.cpp/src/llama-kv-cache.cpp" \
    || { echo "build-llama-src: $SDIST has no vendor/llama.cpp" >&2; exit 1; }
  touch "$D/src.tmp/.kvc-unpacked-$V"
  rm -rf "$D/src" && mv "$D/src.tmp" "$D/src"
fi
echo "$TREE"
