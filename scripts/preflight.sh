#!/usr/bin/env bash
# What the test suites need that set-up cannot install (and the Go it will), checked in seconds
# before set-up downloads anything (issue 45: a newcomer's `make test` on a
# fresh Debian 12 must fail fast and say what is missing, not after 5 GB of
# downloads and half an hour of tests).
#   scripts/preflight.sh all          what `make test` needs (every suite)
#   scripts/preflight.sh SUITE...     python go c packaging llama ollama gpu-bundle fuzz
#   scripts/preflight.sh --python312  print the python3.12 the suites use (exit 1: none)
# Prints one line per missing thing ("preflight: missing: ...", saying how to
# get it), then exits 1; prints what it found and exits 0 when nothing is
# missing. Installs nothing. The Makefile's `setup` runs it first, with the
# suites of the target asked for (`make test`: all).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

# The python3.12 the suites use (scripts/test-python.sh, test-gpu-bundle.sh):
# $PYTHON312, then python3.12 on the PATH, then a pyenv one; with venv and pip.
find_python312() {
  local c
  for c in "${PYTHON312:-}" python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
    [ -n "$c" ] && "$c" -c 'import sys, venv, ensurepip; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$c"; return 0; }
  done
  return 1
}
if [ "${1:-}" = --python312 ]; then find_python312; exit; fi

declare -A need=()
for s in "$@"; do
  case "$s" in
    all) for x in root python312 go126 bookworm; do need[$x]=1; done ;;
    python) need[root]=1; need[python312]=1 ;;
    gpu-bundle) need[python312]=1 ;;
    go|fuzz) need[go124]=1 ;;
    ollama) need[go126]=1 ;;
    packaging) need[root]=1; need[bookworm]=1 ;;
    c|llama) ;;
    *) echo "preflight: unknown suite '$s' (all, python, go, c, packaging, llama, ollama, gpu-bundle, fuzz)" >&2; exit 2 ;;
  esac
done
[ -n "${need[go126]:-}" ] && unset 'need[go124]'
((${#need[@]})) || exit 0

missing=0
miss() { echo "preflight: missing: $*" >&2; missing=$((missing + 1)); }
found=()

if [ -n "${need[root]:-}" ] && [ "$(id -u)" -ne 0 ]; then
  miss "root: the Python and packaging suites run clients as other uids (setuid to nobody, daemon), mount namespaces and chroot; run as root (sudo make test)"
fi

if [ -n "${need[python312]:-}" ]; then
  if py=$(find_python312); then
    found+=("python3.12 $py")
  elif bare=$(command -v python3.12) && "$bare" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    miss "python3.12's venv and ensurepip: $bare has neither (on Ubuntu: apt-get install python3.12-venv; scripts/setup.sh's python3-venv brings it where python3 is 3.12)"
  else
    miss "python3.12 (with venv and ensurepip): the Python suite reruns the request path on it and the GPU bundle's dry run uses it; Debian 12 packages none and no registry set-up reaches has one (PyPI has no CPython builds; uv and pyenv download theirs from GitHub and python.org, Ubuntu 24.04 packages it: apt-get install python3.12-venv); install one where you can and set PYTHON312=/path/to/python3.12"
  fi
fi

# Go: set-up installs one from the Go module proxy when the PATH has none as
# new (scripts/install-go.sh); missing only when it cannot (a too-old go in
# the place it links to, an architecture it pins none for).
for v in go124 go126; do
  [ -n "${need[$v]:-}" ] || continue
  want="1.${v#go1}"
  what="the Go client's tests"; [ "$v" = go126 ] && what="the Ollama build (its go.mod says go 1.26.0)"
  if said=$(KVC_GO_WANT=$want scripts/install-go.sh --check 2>&1); then
    found+=("$said")
  else
    miss "go >= $want, for $what: ${said#install-go: }"
  fi
done

if [ -n "${need[bookworm]:-}" ]; then
  # the sources the packaging suite's mmdebstrap uses: apt's bookworm mirrors
  # on a Debian 12 host, else Debian's own with debian-archive-keyring, which
  # scripts/setup-ops.sh installs (scripts/bookworm-mirrors.sh)
  if said=$(scripts/bookworm-mirrors.sh --check); then
    found+=("$said")
  else
    found+=("bookworm: apt lists no bookworm sources: Debian's mirrors, checked with debian-archive-keyring (set-up installs it)")
  fi
fi

if ((missing)); then
  echo "preflight: $missing missing for $*: nothing was installed or run" >&2
  exit 1
fi
echo "preflight: ok for $*: ${found[*]/%/;}" | sed 's/;$//' >&2
