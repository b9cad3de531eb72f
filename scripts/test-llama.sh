#!/usr/bin/env bash
# llama.cpp's KV cache in daemon pages, end to end (issues 8, 13, 19):
#   1. pip install gguf (tiny test models are written with it)
#   2. llama.cpp source: the pinned sdist of llama-cpp-python (vendor/llama.cpp)
#   3. the C client built (shared, static and the self-contained embed
#      archive) and installed to build/llama/kvcached-prefix
#   4. build/llama/llama.cpp-kvc (a link to build/llama/kvc/src/...: below) =
#      that tree + integrations/llama.cpp/apply.py;
#      the Ollama compat form (apply.py --emit-compat) and the one-file patch
#      are emitted from the pristine tree and checked with git apply
#   5. llama-server and llama-quantize built twice, unpatched
#      (build/llama/build-orig) and patched (build/llama/build-kvc), shared
#      libraries as Ollama builds them (bin/ holds the programs and lib*.so);
#      each build is skipped when the hash of its inputs matches the stamp of
#      the last good build (about 7-8 min on 2 cores when cold); a configure
#      or build that failed or was stopped left no stamp and is redone (a
#      configure from a new cache unless the last one finished). Both compile
#      through ccache (build/ccache) with base_dir build/llama, and the
#      patched tree and its build dir sit in build/llama/kvc/ at the same
#      relative place as the unpatched ones in build/llama/ (build-kvc and
#      llama.cpp-kvc are links there): every source the hook leaves alone
#      is a cache hit, so the patched build compiles only what the hook
#      touches
#   6. the patched sources compiled without the C client (pass-throughs), also
#      cached by hash
#   7. scripts/build-hook-cuda.sh: the hook compiled with GGML_CUDA=ON (NVIDIA's PyPI wheels)
#   8. pytest tests/llama (extra arguments go to pytest)
# With --build-only (first argument) it stops after 7: scripts/prebuild.sh
# runs that in the background while the earlier suites run.
# Exits non-zero on any failure. Nothing from llama.cpp lands in the repository.
set -euo pipefail
BUILD_ONLY=0
if [[ "${1:-}" == --build-only ]]; then BUILD_ONLY=1; shift; fi

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="$REPO/.venv/bin/python"
JOBS="${JOBS:-2}"
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"   # carries llama.cpp 0c1e570 (tools/server)
B="$REPO/build/llama"
SDIST="$B/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
ORIG="$B/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
# the patched tree and build: build/llama/kvc/{src/...,build-kvc}, at the same
# place relative to each other as the unpatched ones in build/llama (ccache)
KVC="$B/kvc/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
KVC_BUILD="$B/kvc/build-kvc"
PREFIX="$B/kvcached-prefix"
TARGETS=(llama-server llama-quantize)
CMAKE_FLAGS=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_OPENSSL=OFF
             -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF
             -DBUILD_SHARED_LIBS=ON)
if command -v ccache >/dev/null; then  # scripts/setup.sh --dev installs it
  export CCACHE_DIR="${CCACHE_DIR:-$REPO/build/ccache}" CCACHE_BASEDIR="$B" CCACHE_NOHASHDIR=1 CCACHE_MAXSIZE=2G
  CMAKE_FLAGS+=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
T0=$SECONDS
step() { printf '\n==== test-llama [%ds]: %s ====\n' "$((SECONDS - T0))" "$*"; }
mkdir -p "$B"

step "python deps (gguf)"
"$PY" -c 'import gguf' 2>/dev/null || "$REPO/.venv/bin/pip" install -q 'gguf>=0.10'

step "llama.cpp source (llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION sdist)"
LLAMA_CPP_PYTHON_VERSION="$LLAMA_CPP_PYTHON_VERSION" scripts/build-llama-src.sh "$B" >/dev/null
test -d "$ORIG/tools/server" || { echo "test-llama: $ORIG has no tools/server" >&2; exit 1; }

step "C client -> $PREFIX"
# the hook's static link needs libkvcached_embed.a (built from Debian's static gRPC,
# protobuf and abseil archives: libgrpc++-dev and libprotobuf-dev ship them)
# (.kvc-installed marks an install that finished: build-hook-cuda.sh takes the prefix only then)
rm -rf "$PREFIX"
scripts/build-c.sh --install "$PREFIX" kvcached kvcached_static kvcached_embed kvc_kv_region >/dev/null
test -f "$PREFIX/lib/libkvcached_embed.a" || { echo "test-llama: no libkvcached_embed.a in $PREFIX/lib" >&2; exit 1; }
touch "$PREFIX/.kvc-installed"

hash_of() { # files and strings -> one sha256
  { for x in "$@"; do if [[ -f "$x" ]]; then sha256sum "$x"; else echo "$x"; fi; done; } | sha256sum | cut -d' ' -f1
}
build_llama() { # name srcdir builddir key [extra cmake args...]
  local name=$1 src=$2 dir=$3 key=$4 ok=1; shift 4
  for t in "${TARGETS[@]}"; do [[ -x "$dir/bin/$t" ]] || ok=0; done
  if [[ $ok == 1 && -f "$dir/.kvc-stamp" && "$(cat "$dir/.kvc-stamp")" == "$key" ]]; then
    echo "build-$name: up to date (stamp $key)"
    return
  fi
  local t=$SECONDS
  # a configure that failed or was stopped (no .kvc-configured) may have
  # cached what it did not find: configure from a new cache (ninja keeps
  # what it compiled, and redoes whatever a stopped build left half done)
  [[ -f "$dir/.kvc-configured" ]] || rm -f "$dir/CMakeCache.txt"
  rm -f "$dir/.kvc-stamp" "$dir/.kvc-configured"
  cmake -S "$src" -B "$dir" "${CMAKE_FLAGS[@]}" "$@" >"$B/$name-configure.log" 2>&1 \
    || { tail -30 "$B/$name-configure.log"; exit 1; }
  touch "$dir/.kvc-configured"
  cmake --build "$dir" --target "${TARGETS[@]}" -j"$JOBS" >"$B/$name-build.log" 2>&1 \
    || { tail -50 "$B/$name-build.log"; exit 1; }
  echo "$key" >"$dir/.kvc-stamp"
  echo "build-$name: built in $((SECONDS - t)) s$(command -v ccache >/dev/null && ccache --print-stats 2>/dev/null \
    | awk -F'\t' '$1 == "direct_cache_hit" || $1 == "preprocessed_cache_hit" {h += $2} $1 == "cache_miss" {m = $2}
                  END {printf " (ccache so far: %d hits, %d misses)", h, m}')"
}
C_CLIENT_FILES=(clients/c/CMakeLists.txt clients/c/kvcached.pc.in $(ls clients/c/cmake/* clients/c/include/* clients/c/src/* | sort))
HOOK_FILES=(integrations/llama.cpp/apply.py $(ls integrations/llama.cpp/kvcached_kv* | LC_ALL=C sort))

step "unpatched llama.cpp (build/llama/build-orig: ${TARGETS[*]})"
ORIG_KEY=$(hash_of "$SDIST" "${CMAKE_FLAGS[*]}" "${TARGETS[*]}")
build_llama orig "$ORIG" "$B/build-orig" "$ORIG_KEY"

# the patched tree's old places (before build/llama/kvc) become links to the new ones
for l in "$B/llama.cpp-kvc:${KVC#"$B/"}" "$B/build-kvc:${KVC_BUILD#"$B/"}"; do
  path="${l%%:*}" target="${l#*:}"
  if [[ ! -L "$path" || "$(readlink "$path")" != "$target" ]]; then rm -rf "$path"; ln -s "$target" "$path"; fi
done

step "apply the hook -> build/llama/llama.cpp-kvc"
# the installed client itself too (the prelinked libkvcached_embed.a is deterministic):
# the build links what is in $PREFIX now, whatever the sources said when it started
KVC_KEY=$(hash_of "$SDIST" "${CMAKE_FLAGS[*]}" "${TARGETS[*]}" "${HOOK_FILES[@]}" "${C_CLIENT_FILES[@]}" \
  "$PREFIX/lib/libkvcached_embed.a" "$PREFIX/include/kvcached.h")
if [[ ! -f "$KVC_BUILD/.kvc-stamp" || "$(cat "$KVC_BUILD/.kvc-stamp")" != "$KVC_KEY" || ! -d "$KVC" ]]; then
  if [[ ! -d "$KVC" ]]; then
    # copied whole or not at all (a copy stopped half way is a .tmp)
    mkdir -p "$(dirname "$KVC")"
    rm -rf "$KVC.tmp" && cp -a "$ORIG" "$KVC.tmp" && mv "$KVC.tmp" "$KVC"
  else
    # back to pristine for the files the hook touches (mtimes kept: ninja rebuilds little)
    for f in $("$PY" integrations/llama.cpp/apply.py "$ORIG" --list); do
      rm -f "$KVC/$f"
      if [[ -f "$ORIG/$f" ]]; then cp -p "$ORIG/$f" "$KVC/$f"; fi
    done
  fi
  "$PY" integrations/llama.cpp/apply.py "$KVC"
fi

step "the change as a patch and in Ollama's compat form, checked with git apply"
# one git-style patch (new files included), and the compat form: the hook's sources
# plus 010-kvcached-kv-cache.patch holding only call sites (never committed)
"$PY" integrations/llama.cpp/apply.py "$ORIG" --emit-patch "$B/kvcached-llama-cpp.patch"
rm -rf "$B/compat" && mkdir -p "$B/compat"
"$PY" integrations/llama.cpp/apply.py "$ORIG" --emit-compat "$B/compat" 2>/dev/null
CHK="$(mktemp -d)"
trap 'rm -rf "$CHK"' EXIT
for f in $("$PY" integrations/llama.cpp/apply.py "$ORIG" --list); do
  if [[ -f "$ORIG/$f" ]]; then mkdir -p "$CHK/$(dirname "$f")" && cp "$ORIG/$f" "$CHK/$f"; fi
done
(cd "$CHK" && git init -q . && git apply --check "$B/kvcached-llama-cpp.patch" && git apply --check "$B/compat/010-kvcached-kv-cache.patch") \
  || { echo "test-llama: an emitted patch does not apply to $ORIG" >&2; exit 1; }
if grep -q '^new file' "$B/compat/010-kvcached-kv-cache.patch"; then
  echo "test-llama: the compat patch adds files (it must hold call sites only)" >&2; exit 1
fi
echo "emitted $B/kvcached-llama-cpp.patch and $B/compat/ (git apply --check: ok)"

step "patched llama.cpp (build/llama/build-kvc: ${TARGETS[*]})"
build_llama kvc "$KVC" "$KVC_BUILD" "$KVC_KEY" -DCMAKE_PREFIX_PATH="$PREFIX"
grep -q "kvcached: KV-cache hook on" "$B/kvc-configure.log" \
  || { echo "test-llama: the patched build did not find the C client ($B/kvc-configure.log)" >&2; exit 1; }

step "patched sources without the C client: pass-throughs compile (build/llama/build-nokvc)"
NOKVC_KEY=$(hash_of "$KVC_KEY" nokvc)
if [[ ! -f "$B/build-nokvc/.kvc-stamp" || "$(cat "$B/build-nokvc/.kvc-stamp")" != "$NOKVC_KEY" ]]; then
  rm -rf "$B/build-nokvc"
  cmake -S "$KVC" -B "$B/build-nokvc" "${CMAKE_FLAGS[@]}" -DCMAKE_DISABLE_FIND_PACKAGE_kvcached=ON \
    >"$B/nokvc-configure.log" 2>&1 || { tail -30 "$B/nokvc-configure.log"; exit 1; }
  grep -q "kvcached: C client not found" "$B/nokvc-configure.log" \
    || { echo "test-llama: build-nokvc found a C client" >&2; exit 1; }
  objs=(src/CMakeFiles/llama.dir/kvcached_kv.cpp.o src/CMakeFiles/llama.dir/llama-kv-cache.cpp.o
        tools/server/CMakeFiles/server-context.dir/server-context.cpp.o)
  cmake --build "$B/build-nokvc" --target "${objs[@]}" -j"$JOBS" >"$B/nokvc-build.log" 2>&1 \
    || { tail -50 "$B/nokvc-build.log"; exit 1; }
  echo "$NOKVC_KEY" >"$B/build-nokvc/.kvc-stamp"
  echo "build-nokvc: the hook and its call sites compile without the C client"
else
  echo "build-nokvc: up to date (stamp $NOKVC_KEY)"
fi

# 7. the hook compiled in llama.cpp's CUDA configuration with NVIDIA's wheels
#    from PyPI (issue 17 item 6; compiled, not run: no GPU here). Cached by
#    input hash: about 3 min cold on 2 cores (the toolkit's download aside),
#    under a second warm.
status=0
step "the hook in llama.cpp's CUDA configuration (scripts/build-hook-cuda.sh)"
scripts/build-hook-cuda.sh || status=$?
if [[ $BUILD_ONLY == 1 ]]; then step "done: builds only (exit $status)"; exit $status; fi

step "pytest tests/llama"
export LLAMA_SERVER_ORIG="$B/build-orig/bin/llama-server"
export LLAMA_SERVER_KVC="$B/build-kvc/bin/llama-server"
export LLAMA_QUANTIZE_ORIG="$B/build-orig/bin/llama-quantize"
export LLAMA_QUANTIZE_KVC="$B/build-kvc/bin/llama-quantize"
export LLAMA_CPP_ORIG="$ORIG"
"$PY" -m pytest -v -p no:cacheprovider --durations=12 tests/llama "$@" || status=$?
step "done (exit $status)"
exit $status
