#!/usr/bin/env bash
# A real Ollama with its llama-server children's KV caches in kvcached-serve
# pages (issue 13), end to end:
#   1. the llama suite's builds (scripts/test-llama.sh: build/llama/build-orig
#      and build/llama/build-kvc, each with bin/llama-server and
#      bin/llama-quantize); this suite builds no llama.cpp of its own
#   2. Ollama v0.34.0's Go binary twice with integrations/ollama/build.sh
#      --go-only, each cached by the hash of its inputs (about 3-5 min cold
#      on 2 cores, nothing when warm):
#        build/ollama/stock  Ollama's Go code as published  + build-orig
#        build/ollama/kvc    + integrations/ollama/patches   + build-kvc
#      and build/ollama/stockgo-kvc: the stock binary with build-kvc (stock
#      Ollama Go code reading the hook's re-logged "KV buffer size" line)
#   3. go vet and Ollama's own tests of the patched packages (envconfig, llm,
#      server) plus tests/ollama/sched_kvcached_test.go copied into server/
#      (Ollama's scheduler, stock vs kvcached, against a real daemon)
#   4. pytest tests/ollama (real `ollama serve`, `ollama create`, daemons)
#   5. the capacity bench on a real Ollama, quick mode (scripts/bench.sh --only
#      ollama --quick: about 2-3 minutes)
# The full build through Ollama's CMake preset (integrations/ollama/build.sh
# without --go-only) is documented in docs/ollama.md; it is not part of CI.
# Exits non-zero on any failure. Extra arguments go to pytest.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="$REPO/.venv/bin/python"
B="$REPO/build/ollama"
LB="$REPO/build/llama"
T0=$SECONDS
step() { printf '\n==== test-ollama [%ds]: %s ====\n' "$((SECONDS - T0))" "$*"; }
die() { echo "test-ollama: $*" >&2; exit 1; }

step "the llama suite's llama.cpp builds"
for v in orig kvc; do
  for b in llama-server llama-quantize; do
    [[ -x "$LB/build-$v/bin/$b" ]] \
      || die "$LB/build-$v/bin/$b is missing: run scripts/test-llama.sh first (scripts/test-all.sh runs it before this suite)"
  done
done
"$PY" -c 'import gguf' 2>/dev/null || die "the gguf package is missing from .venv (scripts/test-llama.sh installs it)"

step "stock Ollama (Go) -> build/ollama/stock"
integrations/ollama/build.sh --stock --out "$B/stock" --link-llama "$LB/build-orig/bin"
step "patched Ollama (Go) -> build/ollama/kvc"
integrations/ollama/build.sh --out "$B/kvc" --link-llama "$LB/build-kvc/bin"
step "stock Ollama (Go) with the patched llama-server -> build/ollama/stockgo-kvc"
mkdir -p "$B/stockgo-kvc/bin"
# a copy, not a symlink: Ollama finds lib/ollama from its resolved executable
cp -f "$B/stock/bin/ollama" "$B/stockgo-kvc/bin/ollama"
rm -rf "$B/stockgo-kvc/lib" && mkdir -p "$B/stockgo-kvc/lib" && cp -a "$B/kvc/lib/ollama" "$B/stockgo-kvc/lib/ollama"

step "Ollama's tests of the patched packages + the scheduler with a daemon (go test)"
W="$B/kvc/.work/ollama"
cp tests/ollama/sched_kvcached_test.go "$W/server/"
unformatted="$(cd "$W" && gofmt -l llm/kvcached.go server/sched_kvcached.go server/sched_kvcached_test.go)"
[[ -z "$unformatted" ]] || die "gofmt: $unformatted"
(cd "$W" && go vet ./envconfig ./llm ./server)
(cd "$W" && go test -count=1 ./envconfig ./llm && go test -count=1 -skip Kvcached ./server)
out="$(cd "$W" && KVCACHED_SERVE="$REPO/.venv/bin/kvcached-serve" go test -count=1 -v -run Kvcached ./server 2>&1)" \
  || { echo "$out" | tail -80; die "the scheduler tests with a daemon failed"; }
echo "$out" | grep -E '^(=== RUN|--- |ok|PASS|FAIL)|sched_kvcached_test.go:[0-9]+: [a-z]' || true

step "pytest tests/ollama"
status=0
"$PY" -m pytest -v -s -p no:cacheprovider tests/ollama "$@" || status=$?

# The capacity scenario on a real Ollama (issue 14) in its quick mode: stock
# vs kvcached on one seeded trace; fails on differing greedy outputs or
# failed requests (docs/benchmarks.md has the full mode's table).
step "scripts/bench.sh --only ollama --quick"
scripts/bench.sh --only ollama --quick --out "$B/bench-quick" || status=$?
step "done (exit $status)"
exit $status
