#!/usr/bin/env bash
# Go for the Go client's tests, the fuzz suite and the Ollama build, from the
# Go module proxy (issue 45 item 3: set-up installs every tool it needs).
#   scripts/install-go.sh           install go$GO_VERSION when no Go of at least $KVC_GO_WANT is usable
#   scripts/install-go.sh --check   say what it would do; exit 0 when Go is usable or installable
#
# A Go is usable when it is at least go$GO_WANT, or at least 1.21 with
# GOTOOLCHAIN not "local" (1.21+ fetches the toolchain a go.mod asks for from
# the same proxy by itself). Otherwise the toolchain module
# golang.org/toolchain@v0.0.1-go$GO_VERSION.linux-<arch> (the zip Go's own
# GOTOOLCHAIN=auto downloads; the same files as go.dev/dl's archive) is
# fetched from the first proxy in $GOPROXY (default https://proxy.golang.org),
# checked against the sha256 pinned below, unpacked into
# $KVC_GO_PREFIX/go$GO_VERSION (default /usr/local/lib/kvcached-go), and linked
# as $KVC_GO_BIN/go and gofmt (default /usr/local/bin, ahead of /usr/bin on
# Debian's default PATH). It links nothing over an existing file there: a Go
# in that place that is too old is named, not replaced.
#
# Recovers from its own failures: the download and the unpacking go to
# folders of their own and are renamed into place once whole and checked, so
# an interrupted or failed run leaves nothing that a later run takes for done.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
die() { echo "install-go: $*" >&2; exit 1; }
log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

# The least Go wanted: KVC_GO_WANT (the Makefile's GO_WANT: 1.24 for the Go
# client's and fuzz suites, 1.26 for the Ollama build, whose go.mod says go 1.26.0).
GO_WANT="${KVC_GO_WANT:-1.26}"
GO_VERSION=1.26.8
# sha256 of golang.org/toolchain/@v/v0.0.1-go$GO_VERSION.linux-<arch>.zip
# (fetched from proxy.golang.org 2026-11-29). KVC_GO_PINS names a file of
# "arch sha256" lines instead (tests/test_build_recovery.py).
declare -A SHA256=(
  [amd64]=30c2b1bf7dcc88d3eb0a1364e47ddd9128edb3110a30e8a0ef61cd5856b31de7
  [arm64]=02b36b6787b3ac767668f630e2998df45a3b1f9ffee08d1bf3ef6487cd658d99
)
if [[ -n "${KVC_GO_PINS:-}" ]]; then
  SHA256=()
  while read -r a s; do [[ -n "$a" && "$a" != \#* ]] && SHA256[$a]=$s; done <"$KVC_GO_PINS"
fi
PREFIX="${KVC_GO_PREFIX:-/usr/local/lib/kvcached-go}"
BIN="${KVC_GO_BIN:-/usr/local/bin}"
CHECK=0
[[ "${1:-}" == --check ]] && CHECK=1

# What the Go on the PATH is worth: "ok VERSION", "fetches VERSION" or "old VERSION"; nothing when none.
go_state() {
  command -v go >/dev/null 2>&1 || return 0
  local gv minor tc
  gv=$(go env GOVERSION 2>/dev/null) || { echo "old unknown"; return 0; }
  gv=${gv#go}; minor=$(echo "$gv" | cut -d. -f2); minor=${minor%%[!0-9]*}
  tc=$(go env GOTOOLCHAIN 2>/dev/null || echo local)
  if [[ "${minor:-0}" -ge "${GO_WANT#1.}" ]]; then echo "ok $gv"
  elif [[ "${minor:-0}" -ge 21 && "$tc" != local ]]; then echo "fetches $gv"
  else echo "old $gv"; fi
}

v=${GO_VERSION#1.}; w=${GO_WANT#1.}
[[ "${v%%.*}" -ge "${w%%.*}" ]] || die "KVC_GO_WANT=$GO_WANT is newer than the go$GO_VERSION pinned here"
state=$(go_state)
case "$state" in
  ok\ *) [[ $CHECK == 1 ]] && echo "go ${state#ok }"; exit 0 ;;
  fetches\ *) [[ $CHECK == 1 ]] && echo "go ${state#fetches } (GOTOOLCHAIN fetches go$GO_WANT from the Go module proxy)"; exit 0 ;;
esac
case "$(uname -m)" in
  x86_64) ARCH=amd64 ;; aarch64|arm64) ARCH=arm64 ;;
  *) die "no Go toolchain pinned for $(uname -m): install Go >= $GO_WANT (go.dev/dl)" ;;
esac
[[ -n "${SHA256[$ARCH]:-}" ]] || die "no sha256 pinned for linux-$ARCH"
DEST="$PREFIX/go$GO_VERSION"
if [[ -e "$BIN/go" && "$(readlink -f "$BIN/go")" != "$DEST/bin/go" ]]; then
  die "$BIN/go is ${state#old } (too old: Go >= $GO_WANT is needed, or >= 1.21 with GOTOOLCHAIN=auto) and is not set-up's to replace: install Go >= $GO_WANT there, or remove it and run set-up again"
fi
if [[ $CHECK == 1 ]]; then
  if [[ -n "$state" ]]; then have="the go on the PATH is ${state#old }, too old"; else have="no go on the PATH"; fi
  echo "go: $have; set-up installs go$GO_VERSION from the Go module proxy into $DEST"
  exit 0
fi

if [[ ! -x "$DEST/bin/go" ]]; then
  PROXY="${GOPROXY:-https://proxy.golang.org}"
  PROXY="$(echo "$PROXY" | tr ',|' '\n\n' | grep -v -x -e direct -e off | head -n1)"
  [[ -n "$PROXY" ]] || die "GOPROXY=$GOPROXY names no proxy to fetch the toolchain from"
  NAME="v0.0.1-go$GO_VERSION.linux-$ARCH"
  URL="${PROXY%/}/golang.org/toolchain/@v/$NAME.zip"
  PY="$(command -v python3)" || die "python3 is needed (set-up's python3-venv brings it)"
  mkdir -p "$PREFIX"
  rm -rf "$PREFIX/download.tmp" "$PREFIX/unpack.tmp"
  mkdir -p "$PREFIX/download.tmp" "$PREFIX/unpack.tmp"
  log "installing go$GO_VERSION (linux-$ARCH, about 70 MB) from $URL into $DEST"
  "$PY" - "$REPO/scripts" "$URL" "${SHA256[$ARCH]}" "$PREFIX/download.tmp/go.zip" "$PREFIX/unpack.tmp" "golang.org/toolchain@$NAME/" <<'PYEOF' \
    || { rm -rf "$PREFIX/download.tmp" "$PREFIX/unpack.tmp"; die "installing go$GO_VERSION failed (see above); nothing was installed"; }
import os, sys, zipfile
sys.path.insert(0, sys.argv[1])
import fetch  # scripts/fetch.py
url, want, dest, out, top = sys.argv[2:]
fetch.download(url, want, dest, "scripts/install-go.sh")
with zipfile.ZipFile(dest) as z:
    for info in z.infolist():
        if not info.filename.startswith(top) or ".." in info.filename.split("/"):
            sys.exit(f"{url}: unexpected entry {info.filename!r}")
        rel = info.filename[len(top):]
        path = os.path.join(out, rel)
        if info.is_dir() or not rel:
            os.makedirs(path, exist_ok=True)
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with z.open(info) as src, open(path, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        mode = (info.external_attr >> 16) & 0o777
        os.chmod(path, mode or 0o644)
if not os.access(os.path.join(out, "bin", "go"), os.X_OK):
    sys.exit(f"{url}: no executable bin/go in the toolchain")
PYEOF
  rm -rf "$DEST" && mv "$PREFIX/unpack.tmp" "$DEST"
  rm -rf "$PREFIX/download.tmp"
fi
mkdir -p "$BIN"
ln -sfn "$DEST/bin/go" "$BIN/go"
ln -sfn "$DEST/bin/gofmt" "$BIN/gofmt"
got=$("$BIN/go" env GOVERSION) || die "$BIN/go does not run"
[[ "$got" == "go$GO_VERSION" ]] || die "$BIN/go says $got, not go$GO_VERSION"
hash -r
cur=$(command -v go || true)
if [[ "$cur" != "$BIN/go" ]]; then
  log "go$GO_VERSION is $BIN/go, but ${cur:-no go} is what this PATH finds: put $BIN first on the PATH"
else
  log "go$GO_VERSION ready: $BIN/go"
fi
