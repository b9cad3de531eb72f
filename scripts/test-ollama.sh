#!/usr/bin/env bash
# A real Ollama with its llama-server children's KV caches in kvcached-serve
# pages (issue 13), end to end:
#   1. the llama suite's builds (scripts/test-llama.sh: build/llama/build-orig
#      and build/llama/build-kvc, each with bin/llama-server and
#      bin/llama-quantize, on the default release's llama.cpp; the same in
#      build/llama/b<N> for each other release pinned to another llama.cpp,
#      integrations/ollama/llama-cpp-pins); this suite builds no llama.cpp of
#      its own, and build.sh --link-llama refuses a build of another llama.cpp
#      than the release's
#   2. Ollama's Go binaries with integrations/ollama/build.sh --go-only
#      --link-llama (only bin/ollama is built), each cached by the hash of
#      its inputs (about 3-5 min each cold on 2 cores, nothing when warm).
#      The default release (build.sh --list-versions):
#        build/ollama/stock  Ollama's Go code as published  + build-orig
#        build/ollama/kvc    + integrations/ollama/patches   + build-kvc
#      and build/ollama/stockgo-kvc: the stock binary with build-kvc (stock
#      Ollama Go code reading the hook's re-logged "KV buffer size" line);
#      each other supported release X (the oldest, v0.34.0), on its own
#      llama.cpp (build/llama/b<N>: b10760 for v0.34.0):
#        build/ollama/vX-stock  Ollama's Go code as published + b<N>/build-orig
#        build/ollama/vX-kvc    + integrations/ollama/patches  + b<N>/build-kvc
#   2b. for every supported release: Ollama's own llama/compat patches (as
#      published in that release) and the hook's compat form
#      (apply.py --emit-compat) applied with git apply, in the order Ollama's
#      cmake/apply-git-patches.cmake applies them (sorted by file name), to a
#      copy of the release's llama.cpp: what build.sh's full build
#      (Ollama's CMake preset) does to it before compiling
#   3. for every supported release: go vet and Ollama's own tests of the
#      patched packages (envconfig, llm, server) plus
#      tests/ollama/sched_kvcached_test.go copied into server/ (Ollama's
#      scheduler, stock vs kvcached, against a real daemon; the KV geometry
#      read through that release's model metadata type)
#   4. pytest tests/ollama (real `ollama serve`, `ollama create`, daemons):
#      the whole suite on the default release, a smoke run of each other
#   5. the chaos run through a real Ollama, quick mode (bench.chaos --quick:
#      about 2-3 minutes, every fault kind), then the capacity bench on a real Ollama, quick
#      mode (scripts/bench.sh --only ollama --quick: about 2-3 minutes)
# The full build through Ollama's CMake preset (integrations/ollama/build.sh
# without --go-only) is documented in docs/ollama.md; it is not part of CI.
# With --build-only (first argument) it does 1 and 2, and compiles what 3
# runs (go vet, and go test -run '^$' of those packages: Go's build cache
# keeps them), then stops: scripts/prebuild.sh runs that in the background
# while the earlier suites run.
# Exits non-zero on any failure. Extra arguments go to pytest.
set -euo pipefail
BUILD_ONLY=0
if [[ "${1:-}" == --build-only ]]; then BUILD_ONLY=1; shift; fi

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="$REPO/.venv/bin/python"
B="$REPO/build/ollama"
LB="$REPO/build/llama"
T0=$SECONDS
step() { printf '\n==== test-ollama [%ds]: %s ====\n' "$((SECONDS - T0))" "$*"; }
die() { echo "test-ollama: $*" >&2; exit 1; }

VERSIONS="$(integrations/ollama/build.sh --list-versions)"
DEFAULT="$(awk '$2 == "(default)" {print $1}' <<<"$VERSIONS")"
OTHERS=($(awk 'NF == 1 {print $1}' <<<"$VERSIONS"))
[[ -n "$DEFAULT" ]] || die "integrations/ollama/build.sh --list-versions names no default release"
echo "Ollama releases: v$DEFAULT (default: the whole suite)${OTHERS[*]:+; smoke runs: ${OTHERS[*]/#/v}}"
DEFAULT_N="$(scripts/build-llama-src.sh --info --ollama "$DEFAULT" | awk '{print $3}')" \
  || die "integrations/ollama/llama-cpp-pins pins no llama.cpp for the default release v$DEFAULT"
llama_of() { # release -> the llama suite's folder of its llama.cpp builds
  local n; n="$(scripts/build-llama-src.sh --info --ollama "$1" | awk '{print $3}')" || die "no llama.cpp pinned for v$1"
  if [[ "$n" == "$DEFAULT_N" ]]; then echo "$LB"; else echo "$LB/b$n"; fi
}

step "the llama suite's llama.cpp builds"
for v in "$DEFAULT" "${OTHERS[@]}"; do
  L="$(llama_of "$v")"
  for d in orig kvc; do
    for b in llama-server llama-quantize; do
      [[ -x "$L/build-$d/bin/$b" ]] \
        || die "$L/build-$d/bin/$b (Ollama v$v's llama.cpp) is missing: run scripts/test-llama.sh first (scripts/test-all.sh runs it before this suite)"
    done
  done
  echo "Ollama v$v: $(head -1 "$L/build-orig/bin/.kvc-llama-build")"
done
"$PY" -c 'import gguf' 2>/dev/null || die "the gguf package is missing from .venv (scripts/test-llama.sh installs it)"

step "stock Ollama v$DEFAULT (Go) -> build/ollama/stock"
integrations/ollama/build.sh --version "$DEFAULT" --stock --out "$B/stock" --link-llama "$LB/build-orig/bin"
step "patched Ollama v$DEFAULT (Go) -> build/ollama/kvc"
integrations/ollama/build.sh --version "$DEFAULT" --out "$B/kvc" --link-llama "$LB/build-kvc/bin"
for v in "${OTHERS[@]}"; do
  L="$(llama_of "$v")"
  step "stock Ollama v$v (Go) on its llama.cpp -> build/ollama/v$v-stock"
  integrations/ollama/build.sh --version "$v" --stock --out "$B/v$v-stock" --link-llama "$L/build-orig/bin"
  step "patched Ollama v$v (Go) on its llama.cpp -> build/ollama/v$v-kvc"
  integrations/ollama/build.sh --version "$v" --out "$B/v$v-kvc" --link-llama "$L/build-kvc/bin"
done
step "stock Ollama (Go) with the patched llama-server -> build/ollama/stockgo-kvc"
mkdir -p "$B/stockgo-kvc/bin"
# a copy, not a symlink: Ollama finds lib/ollama from its resolved executable
cp -f "$B/stock/bin/ollama" "$B/stockgo-kvc/bin/ollama"
rm -rf "$B/stockgo-kvc/lib" && mkdir -p "$B/stockgo-kvc/lib" && cp -a "$B/kvc/lib/ollama" "$B/stockgo-kvc/lib/ollama"

compat_check() { # version Ollama-work-dir llama.cpp-tree
  local v="$1" W="$2" T="$3" C p n=0
  C="$(mktemp -d)"
  cp -a "$W/compat.orig" "$C/compat" && chmod -R u+w "$C/compat" && cp -a "$T" "$C/llama.cpp" && rm -f "$C/llama.cpp/.git" \
    || { rm -rf "$C"; die "copying v$v's compat dir or llama.cpp failed"; }
  "$PY" integrations/llama.cpp/apply.py "$T" --emit-compat "$C/compat" >/dev/null 2>&1 \
    || { rm -rf "$C"; die "apply.py --emit-compat failed on $T"; }
  for p in $(cd "$C/compat" && find . -name '*.patch' | awk -F/ '{print $NF "|" $0}' | LC_ALL=C sort | cut -d'|' -f2-); do
    (cd "$C/llama.cpp" && GIT_CEILING_DIRECTORIES="$C" git init -q . && git apply --whitespace=nowarn "$C/compat/$p") \
      || { rm -rf "$C"; die "Ollama v$v: llama/compat/${p#./} does not apply to $(head -1 "$T/.kvc-llama-build")"; }
    echo "Ollama v$v: llama/compat/${p#./} applies"; n=$((n + 1))
  done
  rm -rf "$C"
  [[ $n -ge 2 ]] || die "Ollama v$v: $n compat patches (expected Ollama's and the hook's)"
}
step "Ollama's compat patches and the hook's on each release's llama.cpp (git apply)"
compat_check "$DEFAULT" "$B/kvc/.work" "$(llama_of "$DEFAULT")/src/llama.cpp"
for v in "${OTHERS[@]}"; do compat_check "$v" "$B/v$v-kvc/.work" "$(llama_of "$v")/src/llama.cpp"; done

go_tests() { # version work-tree (with --build-only: go vet, and the tests compiled, not run)
  local v="$1" W="$2" out pkgs=(./envconfig ./llm ./server)
  cp tests/ollama/sched_kvcached_test.go "$W/server/"
  if [[ $BUILD_ONLY == 1 ]]; then
    step "Ollama v$v: compile what go vet and go test run (nothing run)"
    (cd "$W" && go vet "${pkgs[@]}" && go test -count=1 -run '^$' "${pkgs[@]}" >/dev/null) \
      || die "compiling Ollama v$v's tests failed"
    return
  fi
  step "Ollama v$v: Ollama's tests of the patched packages + the scheduler with a daemon (go test)"
  unformatted="$(cd "$W" && gofmt -l envconfig/kvcached.go llm/kvcached.go llm/kvcached_model.go server/sched_kvcached.go server/sched_kvcached_test.go cmd/kvcached.go)"
  [[ -z "$unformatted" ]] || die "gofmt (v$v): $unformatted"
  (cd "$W" && go vet "${pkgs[@]}") || die "go vet failed on v$v"
  (cd "$W" && go test -count=1 ./envconfig ./llm && go test -count=1 -skip Kvcached ./server) \
    || die "Ollama v$v's own tests of the patched packages failed"
  out="$(cd "$W" && KVCACHED_SERVE="$REPO/.venv/bin/kvcached-serve" go test -count=1 -v -run Kvcached ./server 2>&1)" \
    || { echo "$out" | tail -80; die "the scheduler tests with a daemon failed on v$v"; }
  echo "$out" | grep -E '^(=== RUN|\s*--- |ok|PASS|FAIL)|sched_kvcached_test.go:[0-9]+: [a-z]' || true
}
go_tests "$DEFAULT" "$B/kvc/.work/ollama"
for v in "${OTHERS[@]}"; do go_tests "$v" "$B/v$v-kvc/.work/ollama"; done
if [[ $BUILD_ONLY == 1 ]]; then step "done: builds only"; exit 0; fi

step "pytest tests/ollama"
status=0
"$PY" -m pytest -v -s -p no:cacheprovider --durations=12 tests/ollama "$@" || status=$?

# Issue 46 item 1: the chaos run through a real Ollama, quick mode (about 2-3
# minutes): 4 models, 8 clients, a seeded fault schedule (daemon SIGKILLs,
# budget shrink and grow by restart, a runner SIGKILL, unloads, squeezes);
# exits 1 on a failed request no fault explains, an answer that differs from
# stock, books that do not add up, a page lost or leaked, memory that grows.
# Every kind, daemon_term (SIGTERM restarts) too since the sessions outlive
# a clean stop (docs/reliability.md, "A chaos run through a real Ollama").
step "bench.chaos --quick"
"$PY" -m bench.chaos --quick --seed 46 --out "$B/bench-quick" || status=$?

# The capacity scenario on a real Ollama (issue 14) in its quick mode: stock
# vs kvcached on one seeded trace; fails on differing greedy outputs or
# failed requests (docs/benchmarks.md has the full mode's table).
step "scripts/bench.sh --only ollama --quick"
scripts/bench.sh --only ollama --quick --out "$B/bench-quick" || status=$?
# Issue 30's harnesses in quick mode, so they do not rot (figures: the full
# runs in docs/benchmarks.md): the budget sweep over mixed shapes, the model
# switch and the single-model overhead through Ollama (each fails on
# differing greedy outputs or failed requests).
step "bench.ollama_capacity --quick --mixed --sweep; bench.ollama_switch --quick; bench.overhead --quick --via ollama"
"$PY" -m bench.ollama_capacity --quick --mixed --models 6 --sweep 1,6 --duration 30 --out "$B/bench-quick" || status=$?
"$PY" -m bench.ollama_switch --quick --out "$B/bench-quick" || status=$?
"$PY" -m bench.overhead --quick --via ollama --out "$B/bench-quick" || status=$?
step "done (exit $status)"
exit $status
