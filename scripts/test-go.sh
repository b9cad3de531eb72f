#!/usr/bin/env bash
# The Go client's tests (clients/go): gofmt, go vet, go test -race, against
# real kvcached-serve daemons (host backend, and CUDA backend on the test
# driver) that the tests start themselves. Exits non-zero on any failure.
#
# Needs: go (1.24+), gcc (cgo, -race), /usr/bin/protoc (apt protobuf-compiler,
# installed by scripts/setup.sh), .venv with kvcached-serve (scripts/setup.sh).
# Installs the pinned protoc plugins itself, and builds the CUDA test driver
# when it is missing. Extra arguments go to `go test` (e.g. -run TestRegion -v).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT/clients/go"

PROTOC_GEN_GO=v1.36.10      # keep in step with internal/kvcachedpb/gen.go
PROTOC_GEN_GO_GRPC=v1.5.1

command -v go >/dev/null || { echo "test-go.sh: go is not installed (https://go.dev/dl, or scripts/setup.sh)" >&2; exit 1; }
command -v protoc >/dev/null || { echo "test-go.sh: protoc missing: apt-get install -y protobuf-compiler (scripts/setup.sh)" >&2; exit 1; }
GOBIN="$(go env GOPATH)/bin"
export PATH="$GOBIN:$PATH"
have_version() { command -v "$1" >/dev/null && "$1" --version 2>/dev/null | grep -q -- "${2#v}"; }
have_version protoc-gen-go "$PROTOC_GEN_GO" || go install "google.golang.org/protobuf/cmd/protoc-gen-go@$PROTOC_GEN_GO"
have_version protoc-gen-go-grpc "$PROTOC_GEN_GO_GRPC" || go install "google.golang.org/grpc/cmd/protoc-gen-go-grpc@$PROTOC_GEN_GO_GRPC"

if [ ! -f "$ROOT/build/testdriver/libcuda.so.1" ]; then
    "$ROOT/scripts/build-testdriver.sh"
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

echo "== go build (CGO_ENABLED=0)"
CGO_ENABLED=0 go build -o /dev/null ./cmd/kvcached-loadgen

echo "== go test -race"
go test -race -count=1 "$@" ./...
