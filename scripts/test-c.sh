#!/usr/bin/env bash
# C client (clients/c): no function in clients/c/src over 60 lines
# (scripts/check-fn-length.py), build, ctest (plain and ASan+UBSan), valgrind leak
# check (ctest entry valgrind_host), install to a temporary prefix and build
# plain-C consumers (gcc) with pkg-config and with find_package.
#
# Needs: cmake, gcc, g++, readelf (binutils), libgrpc++-dev, protobuf-compiler-grpc, libprotobuf-dev,
# libgtest-dev, nlohmann-json3-dev, valgrind, pkg-config (scripts/setup.sh), python3; the daemon in .venv
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

status=0
step "function length: none in clients/c/src over 60 lines (scripts/check-fn-length.py)"
python3 "$REPO/scripts/check-fn-length.py" --max 60 "$SRC/src" || status=1

step "configure + build build/c"
"$REPO/scripts/build-c.sh"

step "configure + build build/c-asan (AddressSanitizer + UndefinedBehaviorSanitizer)"
"$REPO/scripts/build-c.sh" --asan

step "ctest build/c (unit, integration host + cuda, valgrind)"
ctest --test-dir "$REPO/build/c" --output-on-failure || status=1

step "ctest build/c-asan"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:strict_string_checks=1}"
export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=$SRC/tests/lsan.supp:print_suppressions=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
# LeakSanitizer's own tracer can crash at exit on a loaded machine ("Tracer
# caught signal 11 ... LeakSanitizer has encountered a fatal error") after
# every test passed: a tool failure, not a finding. Only then are the failed
# entries run once more; any test failure or leak report fails at once.
asan_log="$REPO/build/c-asan/ctest.log"
asan_rc=0
ctest --test-dir "$REPO/build/c-asan" --output-on-failure 2>&1 | tee "$asan_log" || asan_rc=$?
if [ "$asan_rc" -ne 0 ]; then
  if grep -q "LeakSanitizer has encountered a fatal error" "$asan_log" && ! grep -qE "\[  FAILED  \]|ERROR: (LeakSanitizer: detected|AddressSanitizer)|runtime error:" "$asan_log"; then
    echo "test-c: LeakSanitizer's tracer crashed (a tool failure, every test had passed): running the failed entries once more"
    ctest --test-dir "$REPO/build/c-asan" --output-on-failure --rerun-failed || status=1
  else
    status=1
  fi
fi

step "install to a temporary prefix; plain-C consumers (gcc) via pkg-config and find_package"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
cmake --install "$REPO/build/c" --prefix "$TMP/prefix" >/dev/null
LIBDIR="$(cd "$TMP/prefix" && ls -d lib*/ | head -1)"
LIBDIR="$TMP/prefix/${LIBDIR%/}"
test -f "$TMP/prefix/include/kvcached.h"
test -f "$LIBDIR/pkgconfig/kvcached.pc"
test -f "$LIBDIR/pkgconfig/kvcached-static.pc"
test -f "$LIBDIR/cmake/kvcached/kvcachedConfig.cmake"
CONSUMER="$SRC/tests/install/consumer.c"
# The consumer is C: gcc compiles and links it (never g++), so nothing C++
# comes in unless the package says so. It checks the API version and that
# the library answers a missing daemon with a status.
needed() { readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }
shared_client() {  # the program needs libkvcached.so.1
  needed "$1" | grep -qx 'libkvcached.so.1' || { echo "test-c: $1 does not need libkvcached.so.1" >&2; exit 1; }
}
static_client() {  # the program carries the client: no libkvcached NEEDED
  if needed "$1" | grep -q '^libkvcached'; then echo "test-c: $1 needs libkvcached at run time" >&2; exit 1; fi
}
# pkg-config, shared; resolvable from our .pc alone (no grpc++/protobuf .pc
# needed: PKG_CONFIG_LIBDIR hides the system's)
PC="$LIBDIR/pkgconfig"
PKG_CONFIG_LIBDIR="$PC" pkg-config --exists --print-errors kvcached
gcc -Wall -Werror -o "$TMP/consumer_pc" "$CONSUMER" \
  $(PKG_CONFIG_LIBDIR="$PC" pkg-config --cflags --libs kvcached) -Wl,-rpath,"$LIBDIR"
"$TMP/consumer_pc"
shared_client "$TMP/consumer_pc"
# pkg-config, static, the archive beside the shared library: module kvcached-static
gcc -Wall -Werror -o "$TMP/consumer_pc_static" "$CONSUMER" \
  $(PKG_CONFIG_LIBDIR="$PC" pkg-config --cflags --libs kvcached-static)
"$TMP/consumer_pc_static"
static_client "$TMP/consumer_pc_static"
# pkg-config --static, a prefix holding only the archive (as a static-only
# install): Libs.private lists everything libkvcached.a needs
mkdir -p "$TMP/static-only"
cp -a "$TMP/prefix/." "$TMP/static-only/"
rm -f "$TMP/static-only/${LIBDIR#$TMP/prefix/}"/libkvcached.so*
SPC="$TMP/static-only/${LIBDIR#$TMP/prefix/}/pkgconfig"
gcc -Wall -Werror -o "$TMP/consumer_pc_static2" "$CONSUMER" \
  $(PKG_CONFIG_LIBDIR="$SPC" pkg-config --static --cflags --libs kvcached)
"$TMP/consumer_pc_static2"
static_client "$TMP/consumer_pc_static2"
# find_package, from a C-only CMake project (tests/install/CMakeLists.txt)
cmake -S "$SRC/tests/install" -B "$TMP/consumer" -DCMAKE_PREFIX_PATH="$TMP/prefix" -DCMAKE_C_COMPILER=gcc >/dev/null
cmake --build "$TMP/consumer" -j"$JOBS" >/dev/null
"$TMP/consumer/consumer_shared"
shared_client "$TMP/consumer/consumer_shared"
"$TMP/consumer/consumer_static"
static_client "$TMP/consumer/consumer_static"
# find_package, the embeddable archive (kvcached::kvcached_embed): runs, needs no gRPC/protobuf/abseil
sh "$SRC/tests/check_embed.sh" "$TMP/consumer/consumer_embed"
echo "install test: ok"

if [[ $status -ne 0 ]]; then
  echo "test-c: FAILED" >&2
  exit 1
fi
echo "test-c: all passed"
