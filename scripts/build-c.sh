#!/usr/bin/env bash
# Brings a build of the C client up to date, one cmake at a time per build
# folder. build/c is shared: scripts/test-c.sh, test-llama.sh,
# build-hook-cuda.sh and the GPU bundle's stage2 and llama parts all build it,
# and scripts/prebuild.sh builds it in the background while other suites run,
# so every build of it goes through here, under build/.c.lock
# (build/.c-asan.lock).
#
#   scripts/build-c.sh [--asan] [--install PREFIX] [TARGET...]
#
#   build/c        RelWithDebInfo (the default)
#   build/c-asan   --asan: Debug with AddressSanitizer + UBSan (KVC_SANITIZE=ON)
#
# Configures (Ninja) unless the folder holds the stamp of a configure that
# succeeded with these flags (.kvc-configured; a build re-runs cmake by itself
# when a CMakeLists.txt changed), builds the TARGETs (all when none) with
# $JOBS jobs (default 2), then installs to PREFIX when asked. Build output
# goes to stdout; exits non-zero when cmake does.
#
# Recovers from its own failures: a configure that failed (a missing
# package) or was stopped leaves no stamp, and the next run configures the
# folder anew (it is emptied first: a configure that did not finish built
# nothing worth keeping; a folder without the stamp, made by hand or before
# it existed, is built once anew); a build that failed or was stopped is redone by ninja, which
# rebuilds every output whose command did not finish (.ninja_log), a
# half-written object or archive included.
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
flags=(-G Ninja "${flags[@]}")
STAMP="$DIR/.kvc-configured"
if [[ "$(cat "$STAMP" 2>/dev/null)" != "${flags[*]}" ]]; then
  # never configured here, a configure that failed or was stopped, other
  # flags, or a folder another generator made: start from an empty folder
  rm -rf "$DIR"
  cmake -S "$REPO/clients/c" -B "$DIR" "${flags[@]}" >/dev/null
  echo "${flags[*]}" >"$STAMP.tmp" && mv "$STAMP.tmp" "$STAMP"
fi
cmake --build "$DIR" -j"$JOBS" ${1:+--target "$@"}
if [[ -n "$prefix" ]]; then
  cmake --install "$DIR" --prefix "$prefix" >/dev/null
fi
