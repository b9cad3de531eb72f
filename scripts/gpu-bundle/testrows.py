"""Test programs' results as bundle rows (stage2.sh; standard library only).

    python testrows.py go LABEL LOG RC        a Go test binary's -test.v output
    python testrows.py gtest LABEL JSON LOG RC
                                              a gtest program's --gtest_output=json
                                              (LOG: its console output, read when
                                              the JSON is missing: a crash)

Prints rows (JSON lines): one for the program (pass/fail counts; FAIL unless
every test passed and it exited 0), then one FAIL row per failing test,
named, with the first lines of what it reported.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

KIND = "clients"


def _row(check, expected, seen, verdict):
    return {"check": check, "expected": expected, "seen": seen, "verdict": verdict, "kind": KIND}


def _short(lines: list[str], n: int = 2, width: int = 300) -> str:
    text = " / ".join(line.strip() for line in lines[:n] if line.strip())
    return text[:width] if text else "(no message)"


def go_rows(label: str, log: str, rc: int) -> list[dict]:
    results: dict[str, str] = {}  # test name (with /subtests) -> PASS / FAIL / SKIP
    messages: dict[str, list[str]] = {}
    current = None
    for line in log.splitlines():
        m = re.match(r"^=== (RUN|CONT|PAUSE|NAME)\s+(\S+)", line)
        if m:
            current = m.group(2)
            continue
        m = re.match(r"^\s*--- (PASS|FAIL|SKIP): (\S+)", line)
        if m:
            results[m.group(2)] = m.group(1)
            continue
        if current and re.match(r"^\s+\S+\.go:\d+: ", line):
            messages.setdefault(current, []).append(line)
    timed_out = [ln for ln in log.splitlines() if ln.startswith("panic: test timed out")]
    top = {k: v for k, v in results.items() if "/" not in k}
    sub = {k: v for k, v in results.items() if "/" in k}
    passed = sum(v == "PASS" for v in top.values())
    failed = sum(v == "FAIL" for v in top.values())
    skipped = sum(v == "SKIP" for v in top.values())
    ok = rc == 0 and failed == 0 and top
    seen = f"{passed} passed, {failed} failed, {skipped} skipped of {len(top)} tests ({len(sub)} subtests)"
    if timed_out:
        seen += f"; {timed_out[0]}"
    elif rc != 0 and not failed:
        seen += f"; exit {rc}"
    rows = [_row(f"{label}", "every test passes", seen, "pass" if ok else "FAIL")]
    # leaves: a failing test none of whose subtests failed
    for name, v in results.items():
        if v != "FAIL" or any(k.startswith(name + "/") and w == "FAIL" for k, w in results.items()):
            continue
        rows.append(_row(f"{label}: {name}", "passes", _short(messages.get(name, [])), "FAIL"))
    return rows


def gtest_rows(label: str, json_path: str, log: str, rc: int) -> list[dict]:
    try:
        data = json.loads(pathlib.Path(json_path).read_text())
    except (OSError, ValueError):
        data = None
    if data is None:
        failed = re.findall(r"^\[  FAILED  \] (\S+)", log, re.M)
        passed = len(re.findall(r"^\[       OK \] ", log, re.M))
        last = [ln for ln in log.splitlines() if ln.strip()][-1:] or ["(no output)"]
        rows = [_row(label, "every test passes",
                     f"no results file (exit {rc}: crashed?); {passed} passed before that; last line: {last[0][:200]}", "FAIL")]
        rows += [_row(f"{label}: {n}", "passes", "failed (see the log)", "FAIL") for n in dict.fromkeys(failed)]
        return rows
    tests = [(s["name"] + "." + t["name"], t) for s in data.get("testsuites", []) for t in s.get("testsuite", [])]
    run = [(n, t) for n, t in tests if t.get("status", "RUN") == "RUN"]
    failed = [(n, t) for n, t in run if t.get("failures")]
    skipped = [(n, t) for n, t in run if t.get("result") == "SKIPPED" and not t.get("failures")]
    passed = len(run) - len(failed) - len(skipped)
    ok = rc == 0 and not failed and run
    seen = f"{passed} passed, {len(failed)} failed, {len(skipped)} skipped of {len(run)} tests"
    if rc != 0 and not failed:
        seen += f"; exit {rc}"
    rows = [_row(label, "every test passes", seen, "pass" if ok else "FAIL")]
    for n, t in failed:
        msgs = [f.get("failure", "") for f in t["failures"]]
        first = [ln for m in msgs for ln in m.splitlines() if ln.strip()]
        rows.append(_row(f"{label}: {n}", "passes", _short(first, 3), "FAIL"))
    return rows


def main(argv: list[str]) -> int:
    kind = argv[0]
    if kind == "go":
        label, log, rc = argv[1], pathlib.Path(argv[2]).read_text(errors="replace"), int(argv[3])
        rows = go_rows(label, log, rc)
    elif kind == "gtest":
        label, js, log, rc = argv[1], argv[2], pathlib.Path(argv[3]).read_text(errors="replace"), int(argv[4])
        rows = gtest_rows(label, js, log, rc)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
