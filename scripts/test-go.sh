#!/usr/bin/env bash
# The Go client's tests (clients/go): gofmt, go vet, go test -race, against
# real kvcached-serve daemons (host backend, and CUDA backend on the test
# driver) that the tests start themselves. Exits non-zero on any failure.
#
# Needs: go (1.24+), gcc (cgo, -race), /usr/bin/protoc (apt protobuf-compiler,
# installed by scripts/setup.sh), .venv with kvcached-serve (scripts/setup.sh).
# Installs the pinned protoc plugins itself, and builds the CUDA test driver
# when it is missing. Extra arguments go to `go test` (e.g. -run TestRegion -v).
# With --build-only (first argument) it installs the tools and compiles what
# the checks and tests run (go vet, go test -race -run '^$': Go's build cache
# keeps it), runs nothing else, and stops: scripts/prebuild.sh runs that in
# the background while the Python suite runs.
set -euo pipefail
BUILD_ONLY=0
if [[ "${1:-}" == --build-only ]]; then BUILD_ONLY=1; shift; fi
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT/clients/go"

PROTOC_GEN_GO=v1.36.10      # keep in step with internal/kvcachedpb/gen.go
PROTOC_GEN_GO_GRPC=v1.5.1
STATICCHECK=v0.8.2          # staticcheck 2026.2.2: the first release that supports Go 1.26

command -v go >/dev/null || { echo "test-go.sh: go is not installed (https://go.dev/dl, or scripts/setup.sh)" >&2; exit 1; }
command -v protoc >/dev/null || { echo "test-go.sh: protoc missing: apt-get install -y protobuf-compiler (scripts/setup.sh)" >&2; exit 1; }
GOBIN="$(go env GOPATH)/bin"
export PATH="$GOBIN:$PATH"
have_version() { command -v "$1" >/dev/null && "$1" --version 2>/dev/null | grep -q -- "${2#v}"; }
have_version protoc-gen-go "$PROTOC_GEN_GO" || go install "google.golang.org/protobuf/cmd/protoc-gen-go@$PROTOC_GEN_GO"
have_version protoc-gen-go-grpc "$PROTOC_GEN_GO_GRPC" || go install "google.golang.org/grpc/cmd/protoc-gen-go-grpc@$PROTOC_GEN_GO_GRPC"
have_version staticcheck "${STATICCHECK#v}" || go install "honnef.co/go/tools/cmd/staticcheck@$STATICCHECK"

if [ ! -f "$ROOT/build/testdriver/libcuda.so.1" ]; then
    "$ROOT/scripts/build-testdriver.sh"
fi

if [[ $BUILD_ONLY == 1 ]]; then
    echo "== compile: go vet, go test -race (nothing run)"
    go vet ./... && CGO_ENABLED=0 go vet ./... && go test -race -count=1 -run '^$' ./... >/dev/null
    exit
fi

echo "== gofmt"
unformatted="$(gofmt -l .)"
if [ -n "$unformatted" ]; then
    echo "gofmt: these files need formatting:" >&2
    echo "$unformatted" >&2
    exit 1
fi

echo "== go vet"
go vet ./...
CGO_ENABLED=0 go vet ./...   # the build without cgo (no CUDA) must stay valid

echo "== go mod tidy (go.mod and go.sum must not change)"
tidy="$(mktemp -d)"
trap 'rm -rf "$tidy"' EXIT
cp go.mod go.sum "$tidy/"
go mod tidy
if ! cmp -s go.mod "$tidy/go.mod" || ! cmp -s go.sum "$tidy/go.sum"; then
    echo "go mod tidy changed go.mod/go.sum (restored; run it and commit the result):" >&2
    diff -u "$tidy/go.mod" go.mod >&2 || true
    diff -u "$tidy/go.sum" go.sum >&2 || true
    cp "$tidy/go.mod" "$tidy/go.sum" .
    exit 1
fi

echo "== staticcheck"
staticcheck ./...
CGO_ENABLED=0 staticcheck ./...

echo "== an outside module requires this one (replace directive, as README.md documents)"
# The commands are README.md's "Using the module before it is published",
# run in a throwaway module whose main.go is README.md's first example.
consumer="$tidy/consumer"
mkdir -p "$consumer"
awk '/^```go$/ {on=1; next} on && /^```$/ {exit} on {print}' README.md >"$consumer/main.go"
grep -q '^package main' "$consumer/main.go" || { echo "README.md's first go example is not a main package" >&2; exit 1; }
(
    cd "$consumer"
    go mod init example.com/kvcached-consumer >/dev/null 2>&1
    go mod edit -require=github.com/kvcached/kvcached-service/clients/go@v0.0.0 \
        -replace=github.com/kvcached/kvcached-service/clients/go="$ROOT/clients/go"
    go mod tidy
    go vet .
    go build -o consumer .
    CGO_ENABLED=0 go build -o /dev/null .
    # It runs: without a socket variable it stops with ErrNoSocket's message.
    out="$(env -u OLLAMA_KVCACHED_SOCKET -u KVCACHED_SOCKET ./consumer 2>&1 || true)"
    echo "$out" | grep -q "KVCACHED_SOCKET" || { echo "the consumer did not run as expected: $out" >&2; exit 1; }
)

echo "== go build (CGO_ENABLED=0)"
CGO_ENABLED=0 go build -o /dev/null ./cmd/kvcached-loadgen

echo "== go test -race"
go test -race -count=1 "$@" ./...
