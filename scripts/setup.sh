#!/usr/bin/env bash
# Install what kvcached-service needs on a fresh Debian/Ubuntu machine.
# Idempotent: re-running only fills gaps.
#   scripts/setup.sh         to run the daemon: .venv with the package
#   scripts/setup.sh --dev   to build and test everything: Debian packages
#                            (C++ gRPC, protoc, cmake, valgrind, ...) and the
#                            dev and torch extras (torch from PyPI is a
#                            ~5 GB CUDA build)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

DEV=0
[ "${1:-}" = "--dev" ] && DEV=1

APT_PACKAGES=(python3-venv gcc libc6-dev)  # gcc: the control socket's relay (kvcached_service/server/transports/relay.c)
if [ "$DEV" = 1 ]; then
  APT_PACKAGES+=(
    build-essential cmake ninja-build pkg-config  # ninja: scripts/build-c.sh (a stopped build is redone)
    libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
    libgtest-dev valgrind util-linux nlohmann-json3-dev
    ccache  # scripts/test-llama.sh: the patched llama.cpp build reuses the unpatched one's objects
    clang   # scripts/test-fuzz.sh: the C decoder's fuzz target (it installs libFuzzer's runtime, libclang-rt-N-dev)
  )
fi

log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  log "installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  log "creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
if [ "$DEV" = 1 ]; then
  stamp=.venv/.kvcached-installed-dev extras='.[dev,torch,bench]'
  what="with the dev, torch and bench extras (torch from PyPI is a ~5 GB CUDA build)"
else
  stamp=.venv/.kvcached-installed extras='.'
  what="(the daemon and its Python client)"
fi
# The editable install also builds the control socket's relay in place
# (kvcached_service/server/transports/relay.c -> _relay.abi3.so): again when it changed.
RELAY_SO=kvcached_service/server/transports/_relay.abi3.so
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
   || [ ! -f "$RELAY_SO" ] || [ kvcached_service/server/transports/relay.c -nt "$RELAY_SO" ]; then
  log "installing kvcached-service into .venv $what"
  .venv/bin/pip install -q --upgrade pip >/dev/null
  .venv/bin/pip install -q -e "$extras"
  touch "$stamp"
fi
# Go, when the suites asked for need it (the Makefile's GO_WANT: the Go
# client's and fuzz suites, the Ollama build): from the Go module proxy when
# no usable Go is on the PATH (scripts/install-go.sh). The daemon needs none.
if [ "$DEV" = 1 ] && [ -n "${KVC_GO_WANT:-}" ]; then
  scripts/install-go.sh
fi
log "ready: .venv/bin/kvcached-serve"
