#!/usr/bin/env bash
# Packaging suite (issue 20): the install forms as a user meets them.
#   1. tools: scripts/setup-ops.sh (podman, mmdebstrap, promtool, ...), the
#      CUDA test driver (scripts/build-testdriver.sh)
#   2. sdist and wheel: python -m build (the wheel is built from the sdist),
#      the wheel repaired by auditwheel to manylinux_2_17 (the lowest tag its
#      glibc symbols allow); both into build/packaging/dist
#   3. a Debian base image: mmdebstrap --variant=minbase with python3 from
#      the Debian mirrors apt uses here, podman import; cached by the hash of
#      its inputs (build/packaging/base-<hash>.tar and the image tag)
#   4. a fresh Debian 12 root (mmdebstrap --variant=minbase, what the
#      debian:12 image has), cached by the hash of its inputs
#      (build/packaging/fresh-bookworm-<hash>.tar); an Ubuntu 24.04 one too
#      when KVC_PKG_UBUNTU_KEYRING names the Ubuntu archive's key file
#   5. the Dockerfile's image: podman build --isolation chroot --format docker
#      on that base; cached by the hash of the build context and the base
#   6. pytest tests/packaging: the wheel and the sdist installed into clean
#      venvs and run from there; the image run from its filesystem as its
#      user (tests/packaging/imagerun.py); in the fresh root, the README's
#      first commands (make serve; make test stops at once naming what
#      Debian 12 lacks) and the manylinux wheel (test_fresh_root.py)
# podman keeps its images in build/packaging/podman (not the machine's
# default store). With --build-only (first argument) it stops after 5:
# scripts/prebuild.sh runs that in the background while the earlier suites
# run. Exits non-zero on any failure. Extra arguments go to pytest.
set -euo pipefail
BUILD_ONLY=0
if [[ "${1:-}" == --build-only ]]; then BUILD_ONLY=1; shift; fi

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="$REPO/.venv/bin/python"
B="$REPO/build/packaging"
T0=$SECONDS
step() { printf '\n==== test-packaging [%ds]: %s ====\n' "$((SECONDS - T0))" "$*"; }
mkdir -p "$B"

step "tools"
scripts/setup-ops.sh
scripts/build-testdriver.sh >/dev/null

step "sdist and wheel (python -m build), the wheel repaired to manylinux (auditwheel)"
t=$SECONDS
rm -rf "$B/dist" "$B/wheel-built"
# LDSHARED: the interpreter's own link line may carry an rpath into its
# prefix (pyenv's does: -Wl,-rpath,~/.pyenv/versions/...), which would end up
# in _relay.abi3.so; a plain `cc -shared` links nothing of the build machine in.
LDSHARED="${CC:-cc} -shared" "$PY" -m build --outdir "$B/wheel-built" . >"$B/build.log" 2>&1 || { tail -40 "$B/build.log"; exit 1; }
mkdir -p "$B/dist"
mv "$B"/wheel-built/*.tar.gz "$B/dist/"
# The lowest tag the relay's symbols allow (relay.c binds the pthread calls to
# their original versions: glibc 2.17 is the floor). A change that needs a
# newer glibc symbol makes the repair fail here, naming the symbol's version.
MANYLINUX="manylinux_2_17_$(uname -m)"
RAW_WHEEL=("$B"/wheel-built/*.whl)
{ PATH="$REPO/.venv/bin:$PATH" "$PY" -m auditwheel show "${RAW_WHEEL[0]}" \
    && PATH="$REPO/.venv/bin:$PATH" "$PY" -m auditwheel repair --plat "$MANYLINUX" -w "$B/dist" "${RAW_WHEEL[0]}"; } \
  >"$B/auditwheel.log" 2>&1 || { cat "$B/auditwheel.log"; exit 1; }
ls "$B/dist"
echo "built in $((SECONDS - t)) s"

PODMAN=(podman --root "$B/podman/storage" --runroot "$B/podman/run" --storage-driver overlay)
hash_of() { # files and strings -> one sha256
  { for x in "$@"; do if [[ -f "$x" ]]; then echo "$x"; sha256sum <"$x"; else echo "$x"; fi; done; } | sha256sum | cut -c1-16
}

step "Debian base image (mmdebstrap, cached by input hash)"
# The bookworm, bookworm-updates and bookworm-security sources, as one-line
# sources: the mirrors apt uses on this machine when it lists them (Debian
# 12), else Debian's own, checked with debian-archive-keyring
# (scripts/bookworm-mirrors.sh says which).
said="$(scripts/bookworm-mirrors.sh --check)" || {
  echo "test-packaging: apt lists no bookworm sources, and ${said#keyring } (Debian's archive keys, for Debian's mirrors) is missing: scripts/setup-ops.sh installs debian-archive-keyring" >&2
  exit 1
}
echo "bookworm sources: $said"
SOURCES="$(scripts/bookworm-mirrors.sh)"
mapfile -t MIRRORS < <(grep '^deb ' <<<"$SOURCES")
mapfile -t KEYS < <(grep '^--keyring=' <<<"$SOURCES" || true)
# gcc and libc6-dev: the Dockerfile's build stage compiles relay.c (with a
# compiler in the base it installs none; python:3.11-slim has none, and the
# Dockerfile gets one with apt there)
BASE_ARGS=(--variant=minbase --include=python3,python3-venv,passwd,gcc,libc6-dev
           --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
           --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*'
           --dpkgopt='path-exclude=/usr/share/info/*')
BASE_ARGS+=("${KEYS[@]}")
BASE_KEY=$(hash_of "$(mmdebstrap --version)" "${BASE_ARGS[*]}" "${MIRRORS[*]}" bookworm)
BASE_TAR="$B/base-$BASE_KEY.tar"
BASE_IMAGE="localhost/kvcached-base:$BASE_KEY"
t=$SECONDS
if "${PODMAN[@]}" image exists "$BASE_IMAGE"; then
  echo "$BASE_IMAGE: up to date"
else
  if [[ ! -f "$BASE_TAR" ]]; then
    rm -f "$B"/base-*.tar
    mmdebstrap --format=tar "${BASE_ARGS[@]}" bookworm "$BASE_TAR.tmp" "${MIRRORS[@]}" >"$B/mmdebstrap.log" 2>&1 \
      || { tail -30 "$B/mmdebstrap.log"; rm -f "$BASE_TAR.tmp"; exit 1; }
    mv "$BASE_TAR.tmp" "$BASE_TAR"
  fi
  "${PODMAN[@]}" import --change 'CMD ["/usr/bin/python3"]' "$BASE_TAR" "$BASE_IMAGE" >/dev/null
  echo "$BASE_IMAGE: made in $((SECONDS - t)) s"
fi

step "a fresh Debian 12 root for first contact (mmdebstrap --variant=minbase, cached by input hash)"
# Only what the debian:12 image has (minbase: no python, no make, no
# compiler); tests/packaging/test_fresh_root.py unpacks it, copies the
# checkout in and runs the README's commands there with chroot.
FRESH_ARGS=(--variant=minbase "${KEYS[@]}")
FRESH_KEY=$(hash_of "$(mmdebstrap --version)" "${FRESH_ARGS[*]}" "${MIRRORS[*]}" bookworm fresh)
FRESH_TAR="$B/fresh-bookworm-$FRESH_KEY.tar"
t=$SECONDS
if [[ -f "$FRESH_TAR" ]]; then
  echo "$FRESH_TAR: up to date"
else
  rm -f "$B"/fresh-bookworm-*.tar
  mmdebstrap --format=tar "${FRESH_ARGS[@]}" bookworm "$FRESH_TAR.tmp" "${MIRRORS[@]}" >"$B/mmdebstrap-fresh.log" 2>&1 \
    || { tail -30 "$B/mmdebstrap-fresh.log"; rm -f "$FRESH_TAR.tmp"; exit 1; }
  mv "$FRESH_TAR.tmp" "$FRESH_TAR"
  echo "$FRESH_TAR: made in $((SECONDS - t)) s"
fi

FRESH_ROOTS=("bookworm=$FRESH_TAR")
# Ubuntu 24.04, only when given the Ubuntu archive's key (a file: on Ubuntu,
# /usr/share/keyrings/ubuntu-archive-keyring.gpg; Debian's archive carries
# none): its archive is not one of the registries this project's machines
# are given, so CI runs without it (docs/operations.md, "Test setup").
# No mirror named: mmdebstrap's own default for an Ubuntu suite; the
# components the ubuntu:24.04 image lists; apt, which its minbase lacks.
if [[ -n "${KVC_PKG_UBUNTU_KEYRING:-}" ]]; then
  step "a fresh Ubuntu 24.04 root for first contact (KVC_PKG_UBUNTU_KEYRING given; cached by input hash)"
  UBU_ARGS=(--variant=minbase --include=apt --components=main,restricted,universe,multiverse "--keyring=$KVC_PKG_UBUNTU_KEYRING")
  UBU_KEY=$(hash_of "$(mmdebstrap --version)" "${UBU_ARGS[*]}" "$KVC_PKG_UBUNTU_KEYRING" noble fresh)
  UBU_TAR="$B/fresh-noble-$UBU_KEY.tar"
  t=$SECONDS
  if [[ -f "$UBU_TAR" ]]; then
    echo "$UBU_TAR: up to date"
  else
    rm -f "$B"/fresh-noble-*.tar
    mmdebstrap --format=tar "${UBU_ARGS[@]}" noble "$UBU_TAR.tmp" >"$B/mmdebstrap-noble.log" 2>&1 \
      || { tail -30 "$B/mmdebstrap-noble.log"; rm -f "$UBU_TAR.tmp"; exit 1; }
    mv "$UBU_TAR.tmp" "$UBU_TAR"
    echo "$UBU_TAR: made in $((SECONDS - t)) s"
  fi
  FRESH_ROOTS+=("noble=$UBU_TAR")
fi

step "the Dockerfile's image (podman build --isolation chroot --format docker)"
# The build context as .dockerignore leaves it: Dockerfile, pyproject.toml,
# setup.py, README.md, kvcached_service/ (without bytecode or built libraries).
CONTEXT_FILES=(Dockerfile .dockerignore pyproject.toml setup.py README.md
               $(find kvcached_service -type f ! -name '*.pyc' ! -name '*.so' ! -path '*/__pycache__/*' | LC_ALL=C sort))
IMAGE_KEY=$(hash_of "$BASE_KEY" "${CONTEXT_FILES[@]}")
IMAGE="localhost/kvcached:pkg-$IMAGE_KEY"
# pip inside the build reaches PyPI through this machine's CA bundle (a
# TLS-intercepting proxy here); a build without it just gets no secret.
CA="${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}"
SECRET=()
[[ -s "$CA" ]] && SECRET=(--secret "id=pip-ca,src=$CA")
t=$SECONDS
if "${PODMAN[@]}" image exists "$IMAGE"; then
  echo "$IMAGE: up to date"
else
  "${PODMAN[@]}" build --isolation chroot --format docker --layers=false "${SECRET[@]}" \
    --build-arg "PYTHON_IMAGE=$BASE_IMAGE" -t "$IMAGE" . >"$B/image-build.log" 2>&1 \
    || { tail -40 "$B/image-build.log"; exit 1; }
  echo "$IMAGE: built in $((SECONDS - t)) s"
  # keep the store small: images of earlier inputs go
  "${PODMAN[@]}" images --format '{{.Repository}}:{{.Tag}}' | grep -E '^localhost/kvcached(-base)?:' \
    | grep -v -e "^$IMAGE\$" -e "^$BASE_IMAGE\$" | xargs -r "${PODMAN[@]}" rmi -f >/dev/null 2>&1 || true
fi

if [[ $BUILD_ONLY == 1 ]]; then step "done: builds only"; exit 0; fi

step "pytest tests/packaging"
export KVC_PKG_DIST="$B/dist" KVC_PKG_IMAGE="$IMAGE" KVC_PKG_WORK="$B" KVC_PKG_PODMAN="${PODMAN[*]}" KVC_PKG_FRESH_ROOTS="${FRESH_ROOTS[*]}"
status=0
"$PY" -m pytest -v -p no:cacheprovider tests/packaging "$@" || status=$?
step "done (exit $status)"
exit $status
