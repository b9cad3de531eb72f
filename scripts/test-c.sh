#!/usr/bin/env bash
# C client (clients/c): build, ctest (plain and ASan+UBSan), valgrind leak
# check (ctest entry valgrind_host), install to a temporary prefix and build
# consumers with pkg-config and with find_package.
#
# Needs: cmake, g++, libgrpc++-dev, protobuf-compiler-grpc, libprotobuf-dev,
# libgtest-dev, valgrind, pkg-config (scripts/setup.sh); the daemon in .venv
# (scripts/setup.sh) and the CUDA test driver (scripts/build-testdriver.sh).
# Exits non-zero on any failure.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$REPO/clients/c"
JOBS="${JOBS:-2}"
cd "$REPO"

if [[ ! -f "$REPO/build/testdriver/libcuda.so.1" ]]; then
  echo "test-c: build/testdriver/libcuda.so.1 is missing; building it" >&2
  "$REPO/scripts/build-testdriver.sh"
fi

step() { printf '\n==== test-c: %s ====\n' "$*"; }

step "configure + build build/c"
cmake -S "$SRC" -B "$REPO/build/c" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$REPO/build/c" -j"$JOBS"

step "configure + build build/c-asan (AddressSanitizer + UndefinedBehaviorSanitizer)"
cmake -S "$SRC" -B "$REPO/build/c-asan" -DCMAKE_BUILD_TYPE=Debug -DKVC_SANITIZE=ON >/dev/null
cmake --build "$REPO/build/c-asan" -j"$JOBS"

status=0
step "ctest build/c (unit, integration host + cuda, valgrind)"
ctest --test-dir "$REPO/build/c" --output-on-failure || status=1

step "ctest build/c-asan"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:strict_string_checks=1}"
export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=$SRC/tests/lsan.supp:print_suppressions=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
ctest --test-dir "$REPO/build/c-asan" --output-on-failure || status=1

step "install to a temporary prefix; consumers via pkg-config and find_package"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
cmake --install "$REPO/build/c" --prefix "$TMP/prefix" >/dev/null
LIBDIR="$(cd "$TMP/prefix" && ls -d lib*/ | head -1)"
LIBDIR="$TMP/prefix/${LIBDIR%/}"
test -f "$TMP/prefix/include/kvcached.h"
test -f "$LIBDIR/pkgconfig/kvcached.pc"
test -f "$LIBDIR/cmake/kvcached/kvcachedConfig.cmake"
# pkg-config, shared
PKG_CONFIG_PATH="$LIBDIR/pkgconfig" cc -Wall -Werror -o "$TMP/consumer_pc" \
  "$SRC/tests/install/consumer.c" $(PKG_CONFIG_PATH="$LIBDIR/pkgconfig" pkg-config --cflags --libs kvcached) \
  -Wl,-rpath,"$LIBDIR"
"$TMP/consumer_pc"
# pkg-config, static
PKG_CONFIG_PATH="$LIBDIR/pkgconfig" c++ -o "$TMP/consumer_pc_static" -x c "$SRC/tests/install/consumer.c" -x none \
  $(PKG_CONFIG_PATH="$LIBDIR/pkgconfig" pkg-config --static --cflags kvcached) \
  "$LIBDIR/libkvcached.a" $(PKG_CONFIG_PATH="$LIBDIR/pkgconfig" pkg-config --static --libs-only-l --libs-only-L kvcached | sed 's/-lkvcached//')
"$TMP/consumer_pc_static"
# find_package
cmake -S "$SRC/tests/install" -B "$TMP/consumer" -DCMAKE_PREFIX_PATH="$TMP/prefix" >/dev/null
cmake --build "$TMP/consumer" -j"$JOBS" >/dev/null
"$TMP/consumer/consumer_shared"
"$TMP/consumer/consumer_static"
# find_package, the embeddable archive (kvcached::kvcached_embed): runs, needs no gRPC/protobuf/abseil
sh "$SRC/tests/check_embed.sh" "$TMP/consumer/consumer_embed"
echo "install test: ok"

if [[ $status -ne 0 ]]; then
  echo "test-c: FAILED" >&2
  exit 1
fi
echo "test-c: all passed"
