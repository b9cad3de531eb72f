#!/usr/bin/env bash
# The one-run verdict on a CUDA driver (docs/gpu-check.md).
#
#   scripts/gpu-check.sh            # the real driver: libcuda.so.1
#
# 1. driver probe (tests/helpers/gpu_check_probe.py): every assumption the
#    code makes about the driver, checked on the library itself: fstat
#    identity of exported fds, importing one fd twice, memset and copy across
#    adjacent mappings, access and peer rules, fork, granularity, the cost of
#    create / map / set-access / unmap per page, free memory after N pages,
#    exported fds outliving their exporter;
# 2. the daemon end to end: kvcached-serve --backend cuda on a temporary
#    socket, two client processes (one writes pages through CudaMapper and
#    passes the fds to the other, which reads them; freed pages come back
#    zeroed; a Region grows and trims), the daemon's books, device memory,
#    a clean shutdown;
# 3. the CUDA behaviour tests (pytest) pointed at this driver;
# 4. the CUDA bench (bench.suite, quick) on this driver;
# then one table: check, expected, seen, result (pass / FAIL / DIFF / info /
# skip). FAIL: an assumption the code relies on does not hold (exit 1). DIFF:
# the CUDA test driver's model of a real driver is wrong there (exit 0, but
# please report it). The last line is the verdict: `PASS` (no FAIL or DIFF
# row, no stage that was asked for skipped), `PASS with N DIFF rows` (exit 0),
# or `FAIL` (a FAIL row or an asked-for stage skipped; exit 1).
#
# Environment: KVCACHED_LIBCUDA (driver library, default libcuda.so.1),
# PYTHON (default: the repo's .venv, else python3), GPU_CHECK_MEMORY (daemon
# budget, default 256MiB), GPU_CHECK_PAGES (pages the probe creates, default
# 32), GPU_CHECK_TESTS (pytest arguments for stage 3; default the CUDA test
# set, "-m cuda" and the files tests/cuda/suite.txt names; empty skips it),
# GPU_CHECK_FIRST (node ids to run first, default tests/cuda/gpu-first.txt:
# the last GPU run's failures; empty: none), GPU_CHECK_BENCH
# (bench scenarios for stage 4, default allocate64,roundtrip; empty skips
# it), GPU_CHECK_KEEP=1 (keep the temp dir). With the CUDA test driver
# (KVCACHED_LIBCUDA=build/testdriver/libcuda.so.1, KVCACHED_TESTDRV_* set) it
# also reads the driver's leak reports; stages 3 and 4 are skipped there
# (make test runs those suites and the bench on it) unless GPU_CHECK_TESTS /
# GPU_CHECK_BENCH are set. GPU_CHECK_OUT=DIR: also write into DIR the rows
# (rows.jsonl), the table (table.md), the verdict line (verdict.txt), every
# number the probe and the bench measured with its unit (figures.json) and
# the logs (daemon.log, probe.jsonl, probe.err, pytest.log, bench.json,
# bench.log, the client helpers' *.out / *.err) and the tests' record
# (pytest.xml, skips.txt: every skip with its reason, outcomes.txt: every
# test's outcome in the order they ran, pytest-report.txt).
set -u

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
HELPER="$REPO/tests/helpers/gpu_check_client.py"
PROBE="$REPO/tests/helpers/gpu_check_probe.py"
TMP="$(mktemp -d "${TMPDIR:-/tmp}/kvcached-gpu-check.XXXXXX")"
SOCK="$TMP/kvc.sock"
LOG="$TMP/daemon.log"
ROWS="$TMP/rows.jsonl"
OUTDIR="${GPU_CHECK_OUT:-}"
if [[ -n "$OUTDIR" ]]; then mkdir -p "$OUTDIR" && OUTDIR="$(cd "$OUTDIR" && pwd)" || { echo "gpu-check: GPU_CHECK_OUT=$OUTDIR: cannot create it" >&2; exit 2; }; fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export KVCACHED_SOCKET="$SOCK"
export KVCACHED_TESTDRV_REPORT="$TMP/leaks-client-%p.json"  # test driver only; the real driver ignores it
LIB="${KVCACHED_LIBCUDA:-libcuda.so.1}"
TESTDRIVER=0
[[ "$(readlink -f "$LIB" 2>/dev/null)" == "$(readlink -f "$REPO/build/testdriver/libcuda.so.1" 2>/dev/null)" ]] && TESTDRIVER=1
FAILED=0
DAEMON=""
# stages 3 and 4 are asked for on another driver by default, on the test driver only when named
TESTS_ASKED=0; [[ ( $TESTDRIVER == 0 && -z "${GPU_CHECK_TESTS+set}" ) || -n "${GPU_CHECK_TESTS:-}" ]] && TESTS_ASKED=1
BENCH_ASKED=0; [[ ( $TESTDRIVER == 0 && -z "${GPU_CHECK_BENCH+set}" ) || -n "${GPU_CHECK_BENCH:-}" ]] && BENCH_ASKED=1
: >"$ROWS"

say() { printf '%s\n' "$*"; }
addrow() { # check expected seen verdict kind [asked]: asked=1 on a skip row of a stage that was asked for (a FAIL)
    "$PYTHON" -c '
import json, sys
r = dict(zip(("check", "expected", "seen", "verdict", "kind"), sys.argv[1:6]))
if sys.argv[6:] == ["1"]:
    r["asked"] = True
print(json.dumps(r))' "$@" >>"$ROWS"
}
figure() { # name value unit: a number measured outside the probe and the bench (figures.json)
    "$PYTHON" -c 'import json,sys; print(json.dumps({"figures": {sys.argv[1]: {"value": float(sys.argv[2]), "unit": sys.argv[3]}}}))' "$@" >>"$TMP/figures.jsonl"
}
STAGE_T0=$SECONDS
stage_time() { figure "stage.$1.wall" "$((SECONDS - STAGE_T0))" s; STAGE_T0=$SECONDS; }
pass() { say "ok   $*"; addrow "$*" "holds" "yes" pass code; }
fail() { say "FAIL $*"; FAILED=1; addrow "${1%%:*}" "holds" "${1#*: }" FAIL code; }

table() {
    "$PYTHON" - "$ROWS" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
cell = lambda s: str(s).replace("|", "/").replace("\n", " ")
print("| # | check | expected | seen | result |")
print("|---|---|---|---|---|")
for i, r in enumerate(rows, 1):
    print(f"| {i} | {cell(r['check'])} | {cell(r['expected'])} | {cell(r['seen'])} | {r['verdict']} |")
counts = {}
for r in rows:
    counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
print("\nrows: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
diff = [r["check"] for r in rows if r["verdict"] == "DIFF"]
if diff:
    print("the CUDA test driver's model differs from this driver (please report): " + "; ".join(diff))
EOF
}

verdict() { # the last line: PASS, PASS with N DIFF rows, or FAIL
    "$PYTHON" - "$ROWS" "$FAILED" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
fail = sys.argv[2] != "0" or any(r["verdict"] == "FAIL" or (r["verdict"] == "skip" and r.get("asked")) for r in rows)
ndiff = sum(r["verdict"] == "DIFF" for r in rows)
print("FAIL" if fail else f"PASS with {ndiff} DIFF rows" if ndiff else "PASS")
EOF
}

figures() { # every measured number as {name: {value, unit, stage}} (figures.json)
    "$PYTHON" - "$ROWS" "$TMP/figures.jsonl" <<'EOF'
import json, os, sys
out = {}
for path, run in ((sys.argv[1], False), (sys.argv[2], True)):
    if not os.path.exists(path):
        continue
    for l in open(path):
        if not l.strip():
            continue
        r = json.loads(l)
        for name, f in (r.get("figures") or {}).items():
            key = name if run else f"{r.get('stage', 'probe')}.{name}"
            out[key] = {"value": f["value"], "unit": f["unit"], "stage": key.split(".")[0]}
print(json.dumps(out, indent=1, sort_keys=True))
EOF
}

save_out() { # copy the results into GPU_CHECK_OUT
    [[ -n "$OUTDIR" ]] || return 0
    cp "$ROWS" "$OUTDIR/rows.jsonl"
    table >"$OUTDIR/table.md"
    printf '%s\n' "$1" >"$OUTDIR/verdict.txt"
    figures >"$OUTDIR/figures.json"
    local f
    for f in "$LOG" "$TMP"/probe.jsonl "$TMP"/probe.err "$TMP"/pytest.log "$TMP"/pytest.xml "$TMP"/skips.txt \
             "$TMP"/outcomes.txt "$TMP"/pytest-report.txt "$TMP"/bench.json "$TMP"/bench.log \
             "$TMP"/*.out "$TMP"/*.err "$TMP"/leaks-*.json; do
        if [[ -f "$f" ]]; then cp "$f" "$OUTDIR/"; fi
    done
    say "(results in $OUTDIR: rows.jsonl, table.md, verdict.txt, figures.json, logs)"
}

finish() {
    say ""
    say "== table (also in $TMP/rows.jsonl)"
    table
    say ""
    local v
    v="$(verdict)"
    [[ "$v" == PASS* ]] || { v=FAIL; FAILED=1; }
    save_out "$v"
    if [[ $FAILED == 0 ]]; then
        say "PASS: kvcached CUDA path on $LIB: driver assumptions, cross-process page data, zeroing, region grow/trim, books, clean shutdown"
        say "$v"
        exit 0
    fi
    say "FAIL: see the FAIL lines above (daemon log: $LOG)"
    say "FAIL"
    exit 1
}

cleanup() {
    if [[ -n "$DAEMON" ]] && kill -0 "$DAEMON" 2>/dev/null; then
        kill -TERM "$DAEMON" 2>/dev/null
        sleep 2
        kill -KILL "$DAEMON" 2>/dev/null
    fi
    if [[ "$FAILED" == 0 && -z "${GPU_CHECK_KEEP:-}" ]]; then rm -rf "$TMP"; else say "(logs kept in $TMP)" >&2; fi  # stdout ends with the verdict
}
trap cleanup EXIT

say "kvcached gpu-check: driver $LIB, python $PYTHON"

say "== driver probe"
if "$PYTHON" "$PROBE" --pages "${GPU_CHECK_PAGES:-32}" >"$TMP/probe.jsonl" 2>"$TMP/probe.err"; then :; else
    addrow "driver probe" "runs to the end" "exited $? ($(tail -1 "$TMP/probe.err"))" FAIL code
fi
cat "$TMP/probe.jsonl" >>"$ROWS"
"$PYTHON" - "$TMP/probe.jsonl" <<'EOF'
import json, sys
for l in open(sys.argv[1]):
    if l.strip():
        r = json.loads(l)
        tag = {"pass": "ok  ", "FAIL": "FAIL", "DIFF": "DIFF", "info": "info", "skip": "skip"}.get(r["verdict"], r["verdict"])
        print(f"{tag} {r['check']}: {r['seen']}")
EOF
grep -q '"verdict": "FAIL"' "$TMP/probe.jsonl" && FAILED=1
stage_time probe

say "== daemon"
KVCACHED_TESTDRV_REPORT="$TMP/leaks-daemon.json" "$PYTHON" -m kvcached_service.server \
    --backend cuda --socket "$SOCK" --memory-limit "${GPU_CHECK_MEMORY:-256MiB}" \
    --pool-idle-seconds 3 --shutdown-grace 1 >"$LOG" 2>&1 &  # freed pages stay pooled 3 s: the reader gets them back
DAEMON=$!
if ! "$PYTHON" "$HELPER" wait "$SOCK" "$DAEMON" 2>>"$TMP/wait.err" || ! kill -0 "$DAEMON" 2>/dev/null; then
    fail "kvcached-serve --backend cuda did not start: $(grep -m1 -E 'ERROR|failed|refus' "$LOG" || tail -1 "$LOG")"
    sed 's/^/     /' "$LOG" | tail -20
    DAEMON=""
    say "FAIL: the daemon cannot use this driver (see above)"
    addrow "CUDA behaviour tests" "pass on this driver" "not run: the daemon did not start" skip code "$TESTS_ASKED"
    addrow "CUDA bench" "runs" "not run: the daemon did not start" skip info "$BENCH_ASKED"
    finish
fi
pass "kvcached-serve --backend cuda serving on $SOCK (pid $DAEMON)"
grep -E "CUDA device [0-9]+:" "$LOG" | sed 's/.*INFO [^:]*: /     /'

lines_to_rows() { # ok/FAIL lines of a helper -> rows
    "$PYTHON" -c '
import json, sys
for l in sys.stdin:
    l = l.rstrip("\n")
    if l.startswith("ok   "):
        print(json.dumps({"check": l[5:], "expected": "holds", "seen": "yes", "verdict": "pass", "kind": "code"}))
    elif l.startswith("FAIL "):
        what, _, why = l[5:].partition(": ")
        print(json.dumps({"check": what, "expected": "holds", "seen": why or "no", "verdict": "FAIL", "kind": "code"}))
' >>"$ROWS"
}

run() { # run a helper mode; its ok/FAIL lines are shown; non-zero exit = failure
    local out rc
    out="$("$PYTHON" "$HELPER" "$@" 2>"$TMP/$1.err")"; rc=$?
    printf '%s\n' "$out" | grep -E '^(ok|FAIL) '
    printf '%s\n' "$out" | grep -E '^(ok|FAIL) ' | lines_to_rows
    if [[ $rc != 0 ]]; then FAILED=1; [[ -s "$TMP/$1.err" ]] && tail -5 "$TMP/$1.err" | sed 's/^/     /'; fi
    LAST="$(printf '%s\n' "$out" | grep '^{' | tail -1)"
    return $rc
}

json() { "$PYTHON" -c "import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])" "$1" "$2"; }

FREE0=""
if run devfree; then FREE0="$(json "$LAST" free)"; fi

say "== two client processes"
"$PYTHON" "$HELPER" reader "$TMP/handoff.sock" >"$TMP/reader.out" 2>"$TMP/reader.err" &
READER=$!
for _ in $(seq 100); do grep -q listening "$TMP/reader.out" 2>/dev/null && break; sleep 0.1; done
run writer "$TMP/handoff.sock"
wait "$READER"; RRC=$?
grep -E '^(ok|FAIL) ' "$TMP/reader.out"
grep -E '^(ok|FAIL) ' "$TMP/reader.out" | lines_to_rows
if [[ $RRC != 0 ]]; then FAILED=1; tail -5 "$TMP/reader.err" | sed 's/^/     /'; fi

say "== books and device memory"
run books
if [[ -n "$FREE0" ]] && run devfree; then
    FREE1="$(json "$LAST" free)"
    figure daemon.device_free_before "$((FREE0 >> 20))" MiB
    figure daemon.device_free_after "$((FREE1 >> 20))" MiB
    PAGE=$((2 << 20))
    DIFF=$(( FREE0 - FREE1 ))
    if (( DIFF <= PAGE )); then
        pass "device memory back to where it started once the daemon released its pages (free $((FREE0 >> 20)) MiB -> $((FREE1 >> 20)) MiB)"
    else
        fail "device memory back to where it started: free is $((DIFF >> 20)) MiB lower than before the clients ran (free $((FREE0 >> 20)) -> $((FREE1 >> 20)) MiB): pages not released? (another process using the GPU also changes this)"
    fi
fi

say "== shutdown"
kill -TERM "$DAEMON"
for _ in $(seq 300); do kill -0 "$DAEMON" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$DAEMON" 2>/dev/null; then
    fail "the daemon stops within 30 s of SIGTERM: it did not"
    kill -KILL "$DAEMON"; DAEMON=""
else
    wait "$DAEMON"; RC=$?; DAEMON=""
    if [[ $RC == 0 ]]; then pass "daemon exited 0 after SIGTERM"; else fail "daemon exits 0 after SIGTERM: exited $RC"; fi
fi
if grep -q "stopped: every page released" "$LOG"; then pass "daemon log: every page released"; else fail "daemon log: every page released: the log does not say so"; fi
if grep -qE " ERROR |Traceback" "$LOG"; then
    fail "daemon log has no errors: $(grep -m1 -E " ERROR |Traceback" "$LOG")"; grep -E " ERROR |Traceback" "$LOG" | head -5 | sed 's/^/     /'
else
    pass "daemon log has no errors"
fi
if [[ ! -e "$SOCK" && ! -e "$SOCK.fd" ]]; then pass "sockets removed"; else fail "sockets removed: left behind"; fi
if [[ -f "$TMP/leaks-daemon.json" ]]; then
    LEAKS="$(json "$(cat "$TMP/leaks-daemon.json")" leaks)"
    if [[ "$LEAKS" == 0 ]]; then pass "test driver leak report: nothing left (handles, fds, mappings, reservations, contexts)"
    else fail "test driver leak report: $LEAKS objects left: $(json "$(cat "$TMP/leaks-daemon.json")" counts)"; fi
    UNSYNC="$(json "$(cat "$TMP/leaks-daemon.json")" unsynchronized 2>/dev/null)"
    if [[ -n "$UNSYNC" && "$UNSYNC" != *"'lost': 0"* ]]; then fail "daemon lost no memset to a missing synchronize: $UNSYNC"; fi
    for rep in "$TMP"/leaks-client-*.json; do
        [[ -f "$rep" ]] || continue
        L="$(json "$(cat "$rep")" leaks)"
        [[ "$L" == 0 ]] || fail "test driver leak report of client process $(json "$(cat "$rep")" pid): $L objects left"
    done
else
    say "     (no driver leak report: the real driver keeps no count; the release path was checked through the books and device memory)"
fi

stage_time daemon

say "== CUDA behaviour tests"
# the CUDA test set (tests/cuda/suite.txt, docs/gpu-check.md "The CUDA test set"): every test marked cuda
TESTS="${GPU_CHECK_TESTS-"-m cuda $(grep -v '^#' "$REPO/tests/cuda/suite.txt" | tr '\n' ' ')"}"
# the tests that failed on the last GPU run go first (tests/conftest.py orders them); GPU_CHECK_FIRST= turns it off
FIRST="${GPU_CHECK_FIRST-$REPO/tests/cuda/gpu-first.txt}"
TLABEL="pytest $TESTS"; [[ -z "${GPU_CHECK_TESTS+set}" ]] && TLABEL="pytest -m cuda, the files of tests/cuda/suite.txt"
if [[ $TESTDRIVER == 1 && -z "${GPU_CHECK_TESTS+set}" ]]; then
    say "     skipped: this is the project's test driver, which make test runs them on"
    addrow "CUDA behaviour tests" "pass on this driver" "skipped: the test driver (make test runs them)" skip code
elif [[ -z "$TESTS" ]]; then
    addrow "CUDA behaviour tests" "pass on this driver" "skipped (GPU_CHECK_TESTS empty)" skip code
else
    # shellcheck disable=SC2086
    # -v: the log names every test in the order it ran (the first ones first); -rs: every skip's reason;
    # the JUnit XML gives skips.txt (each skip with its reason, by reason) and outcomes.txt (test by test)
    KVCACHED_TEST_FIRST="$FIRST" KVCACHED_TEST_LIBCUDA="$LIB" "$PYTHON" -m pytest -v -rs -p no:cacheprovider \
        --junitxml="$TMP/pytest.xml" $TESTS >"$TMP/pytest.log" 2>&1; TRC=$?
    SUMMARY="$(grep -E '(passed|failed|error)' "$TMP/pytest.log" | tail -1 | sed 's/^=* *//; s/ *=*$//')"
    "$PYTHON" "$REPO/tests/helpers/pytest_report.py" "$TMP/pytest.xml" --skips "$TMP/skips.txt" \
        --outcomes "$TMP/outcomes.txt" ${FIRST:+--first "$FIRST"} --label "     pytest" >"$TMP/pytest-report.txt" 2>&1
    sed -n '1,12p' "$TMP/pytest-report.txt"
    if [[ -n "$FIRST" ]]; then
        FIRSTLINE="$(grep -m1 'run first' "$TMP/pytest-report.txt" | sed 's/^.*run first ([^)]*): //')"
        if [[ -z "$FIRSTLINE" ]]; then addrow "the last GPU run's failures, run first" "pass on this driver" "no report (pytest did not finish)" FAIL code; FAILED=1
        elif printf '%s' "$FIRSTLINE" | grep -qE ' 0 failed, 0 errors' && ! printf '%s' "$FIRSTLINE" | grep -q 'NOT run first'; then
            addrow "the last GPU run's failures, run first" "pass on this driver" "$FIRSTLINE" pass code
        else addrow "the last GPU run's failures, run first" "pass on this driver" "$FIRSTLINE" FAIL code; FAILED=1; fi
    fi
    for k in passed failed skipped error; do
        n="$(printf '%s' "$SUMMARY" | grep -oE "[0-9]+ ${k}" | grep -oE '^[0-9]+')"
        figure "tests.$k" "${n:-0}" tests
    done
    say "     $TLABEL: ${SUMMARY:-exit $TRC}"
    if [[ $TRC == 0 ]]; then addrow "CUDA behaviour tests ($TLABEL)" "pass on this driver" "$SUMMARY" pass code
    else FAILED=1; addrow "CUDA behaviour tests ($TLABEL)" "pass on this driver" "${SUMMARY:-exit $TRC} (log kept: $TMP/pytest.log)" FAIL code
        grep -E '^(FAILED|ERROR) ' "$TMP/pytest.log" | head -10 | sed 's/^/     /'; fi
fi

stage_time tests

say "== CUDA bench"
BENCH="${GPU_CHECK_BENCH-allocate64,roundtrip}"
if [[ $TESTDRIVER == 1 && -z "${GPU_CHECK_BENCH+set}" ]]; then
    say "     skipped: this is the project's test driver (scripts/bench.sh runs on it; GPU_CHECK_BENCH=allocate64 runs it here)"
    addrow "CUDA bench" "runs" "skipped: the test driver (set GPU_CHECK_BENCH to run it)" skip info
elif [[ -z "$BENCH" ]]; then
    addrow "CUDA bench" "runs" "skipped (GPU_CHECK_BENCH empty)" skip info
else
    BTMP="$(mktemp -d /tmp/kvcgc-bench.XXXXXX)"  # short: the bench's sockets live under it
    TMPDIR="$BTMP" "$PYTHON" -m bench.suite --backend cuda-gpu --quick --only "$BENCH" --out "$TMP/bench.json" >"$TMP/bench.log" 2>&1; BRC=$?
    rm -rf "$BTMP"
    "$PYTHON" - "$TMP/bench.json" "$BRC" >>"$ROWS" <<'EOF' || FAILED=1
import atexit, json, sys
path, rc = sys.argv[1], int(sys.argv[2])
failed = []
atexit.register(lambda: sys.stdout.flush() or (failed and __import__("os")._exit(1)))
def row(check, expected, seen, verdict, kind="info"):
    if verdict == "FAIL":
        failed.append(check)
    print(json.dumps({"check": check, "expected": expected, "seen": seen, "verdict": verdict, "kind": kind}))
try:
    res = json.load(open(path))
except Exception as exc:  # noqa: BLE001
    row("CUDA bench (bench.suite --quick)", "runs", f"no results (exit {rc}): {exc}", "FAIL", "code")
    raise SystemExit
for name, err in res.get("errors", {}).items():
    row(f"CUDA bench: {name}", "runs", err.strip().splitlines()[-1][:200], "FAIL", "code")
sc = res.get("scenarios", {})
UNITS = (("_us", "us"), ("_ms", "ms"), ("_per_s", "1/s"), ("_mib", "MiB"), ("_bytes", "B"), ("_size", "B"), ("secs", "s"), ("_s", "s"))
figs = {}
def walk(prefix, v):
    if isinstance(v, bool):
        return
    if isinstance(v, (int, float)):
        leaf = prefix.rsplit(".", 1)[-1].lower()
        unit = next((u for suf, u in UNITS if leaf.endswith(suf)), "us" if "_us_" in leaf else "count")
        figs[prefix] = {"value": v, "unit": unit}
    elif isinstance(v, dict):
        for k, x in v.items():
            walk(f"{prefix}.{k}", x)
for name, v in sc.items():
    walk(name, v)
if figs:  # every number the bench measured (figures.json, bench.*)
    print(json.dumps({"check": "bench figures", "expected": "recorded", "seen": f"{len(figs)} numbers (figures.json)",
                      "verdict": "info", "kind": "info", "stage": "bench", "figures": figs}))
a = sc.get("allocate64")
if a:
    row("bench: Allocate(64 x 2 MiB) end to end in the client, p50 (us)", "daemon warm below in-process create+map",
        f"daemon warm {a['daemon_warm']['p50_us']:.0f}, daemon cold {a['daemon_cold']['p50_us']:.0f}, "
        f"in-process {a['baseline_inproc_create_map']['p50_us']:.0f}", "info")
r = sc.get("roundtrip")
if r:
    row("bench: one-page Allocate+Free round trip p50 (us), 1 / 16 clients", "recorded",
        f"{r['rtt_1_daemon']['p50_us']:.0f} / {r['rtt_16_daemon']['p50_us']:.0f} (in-process {r['rtt_1_base']['p50_us']:.0f}); "
        f"{r['tput_64_daemon']['pairs_per_s']:.0f} pairs/s with 64 clients", "info")
EOF
    say "     bench.suite $BENCH: exit $BRC (log $TMP/bench.log)"
    stage_time bench
fi

finish
