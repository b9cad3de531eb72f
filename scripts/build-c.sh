#!/usr/bin/env bash
# Brings a build of the C client up to date, one cmake at a time per build
# folder. build/c is shared: scripts/test-c.sh, test-llama.sh,
# build-hook-cuda.sh and the GPU bundle's stage2 part all build it, and
# scripts/prebuild.sh builds it in the background while other suites run, so
# builds of it go through here, under build/.c.lock (build/.c-asan.lock). One
# exception: scripts/gpu-bundle/build-llama.sh runs cmake on build/c itself
# (editing it would void the cached CUDA llama.cpp part of the GPU bundle,
# ~75 min to rebuild); it builds only targets that are up to date by then.
#
#   scripts/build-c.sh [--asan] [--install PREFIX] [TARGET...]
#
#   build/c        RelWithDebInfo (the default)
#   build/c-asan   --asan: Debug with AddressSanitizer + UBSan (KVC_SANITIZE=ON)
#
# Configures when the folder has no CMakeCache.txt (a build re-runs cmake by
# itself when a CMakeLists.txt changed), builds the TARGETs (all when none)
# with $JOBS jobs (default 2), then installs to PREFIX when asked. Build
# output goes to stdout; exits non-zero when cmake does.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
JOBS="${JOBS:-2}"
name=c flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo) prefix=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --asan) name=c-asan flags=(-DCMAKE_BUILD_TYPE=Debug -DKVC_SANITIZE=ON); shift ;;
    --install) prefix="${2:?build-c.sh: --install needs a PREFIX}"; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) echo "build-c.sh: unknown option $1 (--asan, --install PREFIX)" >&2; exit 2 ;;
    *) break ;;
  esac
done
DIR="$REPO/build/$name"
mkdir -p "$REPO/build"
exec 9>"$REPO/build/.$name.lock"
flock 9
if [[ ! -f "$DIR/CMakeCache.txt" ]]; then
  cmake -S "$REPO/clients/c" -B "$DIR" "${flags[@]}" >/dev/null
fi
cmake --build "$DIR" -j"$JOBS" ${1:+--target "$@"}
if [[ -n "$prefix" ]]; then
  cmake --install "$DIR" --prefix "$prefix" >/dev/null
fi
