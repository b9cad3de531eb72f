#!/usr/bin/env bash
# A release of Ollama with kvcached the way Ollama ships Linux (docs/ollama.md, "Install"):
#
#   integrations/ollama/dist.sh [--from DIR] [--out DIR] [--version V]
#
# packs DIR (what integrations/ollama/build.sh laid out: bin/ollama and
# lib/ollama/ with llama-server, llama-quantize and the ggml backends; a CUDA
# preset's backend directory too when one was built into it) into
# OUT/ollama-kvcached-<V>-linux-amd64.tgz, laid out exactly as Ollama's own
# Linux tarball (./bin/ollama, ./lib/ollama/...), plus
# OUT/ollama-kvcached-<V>-linux-amd64.tgz.sha256 (sha256sum's format).
# Symlinks (build.sh --link-llama lays lib/ollama out as links) are packed as
# the files they point to. The archive is reproducible: sorted names, owner
# root, a fixed modification time.
#
#   --from DIR   the layout to pack (default build/ollama/dist)
#   --out DIR    where the tarball goes (default build/ollama/release)
#   --version V  the version in the name (default: the Ollama release the
#                layout's bin/ollama reports, then "+kvcached")
#
# Then install it with integrations/ollama/install.sh.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
FROM="$REPO/build/ollama/dist"; OUT="$REPO/build/ollama/release"; VERSION=""
die() { echo "integrations/ollama/dist.sh: $*" >&2; exit 1; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --from) FROM="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --version) VERSION="$2"; shift 2 ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (--help)" ;;
  esac
done
[[ -d "$FROM" ]] || die "$FROM does not exist: build it first (integrations/ollama/build.sh --out $FROM)"
FROM="$(cd "$FROM" && pwd)"
for need in bin/ollama lib/ollama/llama-server lib/ollama/llama-quantize; do
  [[ -e "$FROM/$need" ]] || die "$FROM/$need is missing: not a layout of integrations/ollama/build.sh"
done
ls "$FROM"/lib/ollama/libggml-base.so* >/dev/null 2>&1 || die "$FROM/lib/ollama has no ggml backend libraries"
if [[ -z "$VERSION" ]]; then
  # `ollama -v` without a server prints "... client version is X"
  VERSION="$("$FROM/bin/ollama" -v 2>&1 | sed -n 's/.*version is \([0-9][0-9A-Za-z.+-]*\).*/\1/p' | head -n1)"
  [[ -n "$VERSION" ]] || die "cannot read the version of $FROM/bin/ollama: give --version"
  VERSION="$VERSION+kvcached"
fi
[[ "$VERSION" =~ ^[0-9A-Za-z.+_-]+$ ]] || die "--version $VERSION: use letters, digits and . + _ -"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
NAME="ollama-kvcached-$VERSION-linux-amd64.tgz"
TMP="$OUT/.$NAME.tmp"
# -h: the files symlinks point at; the ggml libraries' own version links
# become copies, as in a build without --link-llama
tar -C "$FROM" -h --sort=name --owner=0 --group=0 --numeric-owner --mtime='2026-01-01 00:00Z' \
    --exclude='./.*' -czf "$TMP" ./bin/ollama ./lib/ollama
mv "$TMP" "$OUT/$NAME"
(cd "$OUT" && sha256sum "$NAME" > "$NAME.sha256")
echo "dist.sh: $OUT/$NAME ($(du -h "$OUT/$NAME" | cut -f1), $(tar -tzf "$OUT/$NAME" | grep -vc '/$') files); checksum in $NAME.sha256"
