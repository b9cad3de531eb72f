#!/usr/bin/env bash
# Stage 2 of the offline GPU bundle: the Go and C clients' tests against real
# kvcached-serve daemons on the CUDA backend of this host's driver
# ($KVCACHED_LIBCUDA), from the test programs build-stage2.sh compiled on the
# CPU machine ($BUNDLE/parts/stage2). The tests start their own daemons (the
# venv's kvcached-serve in $REPO/.venv, made by verify.sh), as
# scripts/test-go.sh and scripts/test-c.sh run them:
#   go/kvcached.test   every test of the Go client, host and CUDA daemons
#   go/ollama.test     the Ollama integration package's tests
#   c/test_integration the C client's integration suite, KVC_TEST_BACKEND=cuda
#                      (all but the valgrind tests, as ctest's integration_cuda;
#                      on NVIDIA's driver also all but *TestDriver*, which
#                      need the test driver's fault injection: an info row)
# One row per program (pass/fail counts) and one FAIL row per failing test.
# Environment: the bundle's stage interface (docs/gpu-check.md); a program
# that would start after STAGE_DEADLINE is not started (a skip row); one
# still running at the deadline is stopped.
set -u
: "${BUNDLE:?}" "${REPO:?}" "${PYTHON:?}" "${STAGE_OUT:?}" "${KVCACHED_LIBCUDA:?}"
STAGE_DEADLINE="${STAGE_DEADLINE:-$(( $(date +%s) + 600 ))}"
BIN="$BUNDLE/parts/stage2"
ROWS="$STAGE_OUT/rows.jsonl"
TR="$REPO/scripts/gpu-bundle/testrows.py"
VENV="$REPO/.venv"
: >>"$ROWS"

row() { "$PYTHON" -c 'import json,sys; print(json.dumps(dict(zip(("check","expected","seen","verdict","kind"), sys.argv[1:]))))' "$@" >>"$ROWS"; }

if [[ ! -d "$BIN" ]]; then
    row "stage 2 test programs" "in the bundle (parts/stage2)" "missing: $BIN" FAIL clients
    exit 1
fi
if [[ ! -x "$VENV/bin/kvcached-serve" ]]; then
    row "stage 2: the daemon" "$VENV/bin/kvcached-serve (made by verify.sh)" "missing" FAIL clients
    exit 1
fi

left() { echo $(( STAGE_DEADLINE - $(date +%s) )); }
export KVCACHED_REPO="$REPO" KVCACHED_TEST_LIBCUDA="$KVCACHED_LIBCUDA" KVCACHED_LIBCUDA
export PATH="$VENV/bin:$PATH"
export TMPDIR="${TMPDIR:-/tmp}"

run_go() { # label binary dir
    local label="$1" bin="$2" dir="$3" log="$STAGE_OUT/$(basename "$2").log" t rc
    t="$(left)"
    if (( t < 20 )); then row "$label" "every test passes" "not started: the stage deadline had passed" skip clients; return; fi
    echo "== $label ($(basename "$bin"), ${t}s left)"
    (cd "$dir" && timeout -k 10 "$t" "$bin" -test.v -test.count=1 -test.timeout "$((t - 5))s") >"$log" 2>&1; rc=$?
    "$PYTHON" "$TR" go "$label" "$log" "$rc" >>"$ROWS" || row "$label" "results readable" "testrows.py failed on $log" FAIL clients
    grep -E '^(--- FAIL|FAIL|ok|PASS)' "$log" | tail -15 | sed 's/^/   /'
}

run_go "Go client tests (clients/go, host + CUDA daemons)" "$BIN/go/kvcached.test" "$REPO/clients/go"
run_go "Go Ollama package tests (clients/go/ollama)" "$BIN/go/ollama.test" "$REPO/clients/go/ollama"

label="C client integration tests on the CUDA backend (clients/c/tests)"
t="$(left)"
if (( t < 20 )); then
    row "$label" "every test passes" "not started: the stage deadline had passed" skip clients
else
    echo "== $label (${t}s left)"
    log="$STAGE_OUT/c-test_integration.log"
    json="$STAGE_OUT/c-test_integration.json"
    filter='-*Valgrind*'
    if [[ "${VERIFY_DRIVER:-real}" == real ]]; then
        # tests of the test driver's fault injection and leak report (named *TestDriver*) need it
        filter+=':*TestDriver*'
        only_td="$("$BIN/c/test_integration" --gtest_list_tests --gtest_filter='*TestDriver*' 2>/dev/null \
            | awk '/^[^ ]/ {s = $1} /^  / {printf "%s%s%s", sep, s, $1; sep = ", "}')"
        row "C tests that need the CUDA test driver (fault injection, leak report)" "not run on NVIDIA's driver" \
            "not run: ${only_td:-none}" info clients
    fi
    KVC_TEST_BACKEND=cuda KVC_REPO_ROOT="$REPO" KVC_SERVE="$VENV/bin/kvcached-serve" KVC_PYTHON="$VENV/bin/python" \
        KVC_TEST_HELPER="$BIN/c/kvc_test_helper" \
        timeout -k 10 "$t" "$BIN/c/test_integration" --gtest_filter="$filter" --gtest_output="json:$json" >"$log" 2>&1
    rc=$?
    "$PYTHON" "$TR" gtest "$label" "$json" "$log" "$rc" >>"$ROWS" || row "$label" "results readable" "testrows.py failed on $log" FAIL clients
    grep -E '^\[  (FAILED|PASSED) ' "$log" | tail -15 | sed 's/^/   /'
fi

if grep -q '"verdict": "FAIL"' "$ROWS"; then exit 1; fi
exit 0
