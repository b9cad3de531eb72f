#!/usr/bin/env bash
# Install everything kvcached-service needs to build, run and test, on a
# fresh Debian/Ubuntu machine. Idempotent: re-running only fills gaps.
#   - Debian packages (C++ gRPC, protoc, cmake, valgrind, prometheus, ...)
#   - .venv with the Python package (editable) and its dev extras
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

APT_PACKAGES=(
  python3-venv
  build-essential cmake pkg-config
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libgtest-dev valgrind util-linux
)

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
stamp=.venv/.kvcached-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  log "installing kvcached-service (editable) with the dev and torch extras into .venv (torch from PyPI is a ~5 GB CUDA build)"
  .venv/bin/pip install -q --upgrade pip >/dev/null
  .venv/bin/pip install -q -e '.[dev,torch]'
  touch "$stamp"
fi
if ! command -v go >/dev/null 2>&1; then
  log "Go is not installed: the Go client (clients/go) needs Go >= 1.24 (https://go.dev/dl); the daemon does not"
fi
log "ready: .venv/bin/kvcached-serve"
