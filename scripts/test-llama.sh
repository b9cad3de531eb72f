#!/usr/bin/env bash
# llama.cpp's KV cache in daemon pages, end to end (issue 8):
#   1. pip install gguf (tiny test models are written with it)
#   2. llama.cpp source: the pinned sdist of llama-cpp-python (vendor/llama.cpp)
#   3. the C client built and installed to build/llama/kvcached-prefix
#   4. build/llama/llama.cpp-kvc = that tree + integrations/llama.cpp/apply.py
#   5. llama-server built twice, unpatched (build/llama/build-orig) and patched
#      (build/llama/build-kvc); each build is skipped when the hash of its
#      inputs matches the stamp of the last good build (about 7-8 min each on
#      2 cores when cold)
#   6. pytest tests/llama
# Exits non-zero on any failure. Nothing from llama.cpp lands in the repository.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="$REPO/.venv/bin/python"
JOBS="${JOBS:-2}"
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"   # carries llama.cpp 0c1e570 (tools/server)
B="$REPO/build/llama"
SDIST="$B/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
ORIG="$B/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
KVC="$B/llama.cpp-kvc"
PREFIX="$B/kvcached-prefix"
CMAKE_FLAGS=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_OPENSSL=OFF
             -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF
             -DBUILD_SHARED_LIBS=OFF)
T0=$SECONDS
step() { printf '\n==== test-llama [%ds]: %s ====\n' "$((SECONDS - T0))" "$*"; }
mkdir -p "$B"

step "python deps (gguf)"
"$PY" -c 'import gguf' 2>/dev/null || "$REPO/.venv/bin/pip" install -q 'gguf>=0.10'

step "llama.cpp source (llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION sdist)"
if [[ ! -f "$SDIST" ]]; then
  "$REPO/.venv/bin/pip" download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$B"
fi
if [[ ! -f "$ORIG/src/llama-kv-cache.cpp" ]]; then
  rm -rf "$B/src" && mkdir -p "$B/src"
  tar xzf "$SDIST" -C "$B/src"
fi
test -d "$ORIG/tools/server" || { echo "test-llama: $ORIG has no tools/server" >&2; exit 1; }

step "C client -> $PREFIX"
if [[ ! -f "$REPO/build/c/CMakeCache.txt" ]]; then
  cmake -S clients/c -B build/c -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
cmake --build build/c -j"$JOBS" --target kvcached >/dev/null
cmake --install build/c --prefix "$PREFIX" >/dev/null

hash_of() { # files and strings -> one sha256
  { for x in "$@"; do if [[ -f "$x" ]]; then sha256sum "$x"; else echo "$x"; fi; done; } | sha256sum | cut -d' ' -f1
}
build_server() { # name srcdir key [extra cmake args...]
  local name=$1 src=$2 key=$3; shift 3
  local dir="$B/build-$name" bin="$B/build-$name/bin/llama-server"
  if [[ -x "$bin" && -f "$dir/.kvc-stamp" && "$(cat "$dir/.kvc-stamp")" == "$key" ]]; then
    echo "build-$name: up to date (stamp $key)"
    return
  fi
  local t=$SECONDS
  cmake -S "$src" -B "$dir" "${CMAKE_FLAGS[@]}" "$@" >"$B/$name-configure.log" 2>&1 \
    || { tail -30 "$B/$name-configure.log"; exit 1; }
  cmake --build "$dir" --target llama-server -j"$JOBS" >"$B/$name-build.log" 2>&1 \
    || { tail -50 "$B/$name-build.log"; exit 1; }
  echo "$key" >"$dir/.kvc-stamp"
  echo "build-$name: built in $((SECONDS - t)) s"
}

step "unpatched llama-server (build/llama/build-orig)"
ORIG_KEY=$(hash_of "$SDIST" "${CMAKE_FLAGS[*]}")
build_server orig "$ORIG" "$ORIG_KEY"

step "apply the hook -> build/llama/llama.cpp-kvc"
KVC_KEY=$(hash_of "$SDIST" "${CMAKE_FLAGS[*]}" integrations/llama.cpp/apply.py integrations/llama.cpp/kvcached_kv.h \
  integrations/llama.cpp/kvcached_kv.cpp clients/c/include/kvcached.h $(ls clients/c/src/* | sort))
if [[ ! -f "$B/build-kvc/.kvc-stamp" || "$(cat "$B/build-kvc/.kvc-stamp")" != "$KVC_KEY" || ! -d "$KVC" ]]; then
  if [[ ! -d "$KVC" ]]; then
    cp -a "$ORIG" "$KVC"
  else
    # back to pristine for the files the hook touches (mtimes kept: ninja rebuilds little)
    for f in $("$PY" integrations/llama.cpp/apply.py "$ORIG" --list); do
      rm -f "$KVC/$f"
      if [[ -f "$ORIG/$f" ]]; then cp -p "$ORIG/$f" "$KVC/$f"; fi
    done
  fi
  "$PY" integrations/llama.cpp/apply.py "$KVC"
fi
# the change in the form of Ollama's llama/compat/*.patch (git diff), generated
# from the pristine tree and checked with git apply (never committed)
"$PY" integrations/llama.cpp/apply.py "$ORIG" --emit-patch "$B/kvcached-llama-cpp.patch"
CHK="$(mktemp -d)"
for f in $("$PY" integrations/llama.cpp/apply.py "$ORIG" --list); do
  if [[ -f "$ORIG/$f" ]]; then mkdir -p "$CHK/$(dirname "$f")" && cp "$ORIG/$f" "$CHK/$f"; fi
done
(cd "$CHK" && git apply --check "$B/kvcached-llama-cpp.patch") || { echo "test-llama: emitted patch does not apply" >&2; exit 1; }
rm -rf "$CHK"
echo "emitted $B/kvcached-llama-cpp.patch (git apply --check: ok)"

step "patched llama-server (build/llama/build-kvc)"
build_server kvc "$KVC" "$KVC_KEY" -DCMAKE_PREFIX_PATH="$PREFIX"

step "pytest tests/llama"
export LLAMA_SERVER_ORIG="$B/build-orig/bin/llama-server"
export LLAMA_SERVER_KVC="$B/build-kvc/bin/llama-server"
status=0
"$PY" -m pytest -v -p no:cacheprovider tests/llama "$@" || status=$?
step "done (exit $status)"
exit $status
