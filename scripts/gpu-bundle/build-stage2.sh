#!/usr/bin/env bash
# Part "stage2" of the offline GPU bundle (scripts/gpu-bundle.sh calls it with
# an empty PARTDIR and packs what it leaves there):
#
#   scripts/gpu-bundle/build-stage2.sh PARTDIR
#
# The Go and C clients' test programs, built here, run by stage2.sh on a GPU
# host that has no Go, no C++ gRPC, protobuf or abseil:
#   go/kvcached.test, go/ollama.test   `go test -c` of the client packages
#                                      (cgo: they need only the C library)
#   c/test_integration, c/kvc_test_helper
#                                      clients/c/tests' integration test (gtest)
#                                      and its helper, linked with
#                                      build/c/libkvcached_embed.a (the client
#                                      with Debian's static gRPC, protobuf and
#                                      abseil prelinked, as scripts/test-llama.sh
#                                      builds it), libgtest.a, and the C++ and
#                                      gcc runtimes statically: they need libc,
#                                      libm and the dynamic loader only
# The test programs find the daemon, python and repository at run time
# (KVCACHED_REPO; KVC_REPO_ROOT, KVC_SERVE, KVC_PYTHON, KVC_TEST_HELPER).
#
# gpu-bundle-xz: 9   (the Go and C test programs share most of their code: 13.5 -> 7.8 MB for some 25 s more)
# gpu-bundle-inputs: clients/go clients/c protos scripts/gpu-bundle/build-stage2.sh scripts/build-c.sh
set -euo pipefail

PART="${1:?usage: build-stage2.sh PARTDIR}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
JOBS="${JOBS:-2}"
mkdir -p "$PART/go" "$PART/c"
PART="$(cd "$PART" && pwd)"
cd "$REPO"

command -v go >/dev/null || { echo "build-stage2: go is not installed (scripts/setup.sh)" >&2; exit 1; }

echo "build-stage2: go test -c (clients/go, clients/go/ollama)"
(
    cd clients/go
    CGO_ENABLED=1 go test -c -ldflags="-s -w" -o "$PART/go/kvcached.test" .
    CGO_ENABLED=1 go test -c -ldflags="-s -w" -o "$PART/go/ollama.test" ./ollama
)

# The C client with gRPC inside: build/c's libkvcached_embed.a (scripts/test-c.sh
# and scripts/test-llama.sh build build/c; this only brings it up to date).
EMBED="$REPO/build/c/libkvcached_embed.a"
"$REPO/scripts/build-c.sh" kvcached_embed >/dev/null
[[ -f "$EMBED" ]] || { echo "build-stage2: build/c made no libkvcached_embed.a (Debian's static gRPC/protobuf/abseil archives missing? scripts/setup.sh)" >&2; exit 1; }
GTEST_A="$(find /usr/lib /usr/local/lib -name libgtest.a 2>/dev/null | head -1)"
[[ -n "$GTEST_A" ]] || { echo "build-stage2: libgtest.a missing (apt-get install libgtest-dev)" >&2; exit 1; }

echo "build-stage2: clients/c/tests/test_integration and kvc_test_helper, linked with libkvcached_embed.a and $GTEST_A"
OBJ="$(mktemp -d)"
trap 'rm -rf "$OBJ"' EXIT
# The compiled-in defaults are never used in the bundle (stage2.sh sets the variables).
g++ -std=gnu++17 -O1 -g0 -Iclients/c/include \
    -DKVC_REPO_ROOT_DEFAULT='"/nonexistent-set-KVC_REPO_ROOT"' -DKVC_TEST_HELPER_DEFAULT='"kvc_test_helper"' \
    -c clients/c/tests/test_integration.cc -o "$OBJ/test_integration.o"
gcc -std=gnu11 -O1 -g0 -Iclients/c/include -c clients/c/tests/helper.c -o "$OBJ/helper.o"
LINK=(-static-libstdc++ -static-libgcc -pthread -ldl -s)
g++ -o "$PART/c/test_integration" "$OBJ/test_integration.o" "$EMBED" "$GTEST_A" "${LINK[@]}"
g++ -o "$PART/c/kvc_test_helper" "$OBJ/helper.o" "$EMBED" "${LINK[@]}"

# What they need at run time: nothing beyond the C library.
for b in "$PART"/go/*.test "$PART"/c/*; do
    extra="$(readelf -d "$b" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | grep -vxE 'lib(c|m|pthread|dl|resolv)\.so\.[0-9]+|ld-linux-x86-64\.so\.2' || true)"
    if [[ -n "$extra" ]]; then echo "build-stage2: $b needs $extra at run time (a GPU host may lack it)" >&2; exit 1; fi
done
( cd "$PART" && ls -l go c | sed 's/^/build-stage2:   /' )
