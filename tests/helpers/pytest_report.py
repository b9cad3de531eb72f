"""The skip list and the outcome of a pytest run, from its JUnit XML.

    python pytest_report.py RUN.xml [--skips FILE] [--outcomes FILE] [--first IDS]
                            [--min-passed N] [--label TEXT]

--skips FILE: every skipped test with its reason, grouped by reason (the
reason as pytest.skip gave it; a skip without one is listed as such and
makes the exit status 1). --outcomes FILE: one line per test, in the order
they ran: `passed|failed|error|skipped  node id`. --first IDS: a file of
node ids (tests/cuda/gpu-first.txt) whose outcomes are summed up on their
own line. Prints a summary; exits 1 when a test failed or erred, a skip
names no reason, or fewer than --min-passed passed. Standard library only
(it runs on the GPU host too: scripts/gpu-check.sh).
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import sys
import xml.etree.ElementTree as ET


def node_id(case: ET.Element) -> str:
    """pytest's node id back from JUnit's classname ("tests.cuda.test_x" or
    "tests.cuda.test_x.TestClass") and name."""
    parts = case.get("classname", "").split(".")
    name = case.get("name", "")
    # the module path ends at the first part that names a file test_*.py/ *_test.py
    for i, p in enumerate(parts):
        if p.startswith("test_") or p.endswith("_test"):
            return "/".join(parts[: i + 1]) + ".py::" + "::".join(parts[i + 1:] + [name])
    return "/".join(parts) + ".py::" + name


def read(xml: pathlib.Path) -> list[tuple[str, str, str]]:
    """(node id, outcome, reason) per test case, in the order they ran."""
    out = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        nid = node_id(case)
        failure, error, skipped = case.find("failure"), case.find("error"), case.find("skipped")
        if error is not None:
            out.append((nid, "error", error.get("message", "")))
        elif failure is not None:
            out.append((nid, "failed", failure.get("message", "")))
        elif skipped is not None:
            reason = (skipped.get("message") or "").strip()
            # pytest writes "file:line: reason" in the text, the reason alone in message
            if not reason:
                reason = re.sub(r"^\S+:\d+: ", "", (skipped.text or "").strip())
            out.append((nid, "skipped", reason))
        else:
            out.append((nid, "passed", ""))
    return out


def first_ids(path: pathlib.Path) -> list[str]:
    ids = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            ids.append(line)
    return ids


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("xml")
    ap.add_argument("--skips")
    ap.add_argument("--outcomes")
    ap.add_argument("--first")
    ap.add_argument("--min-passed", type=int, default=0)
    ap.add_argument("--label", default="pytest")
    a = ap.parse_args(argv)
    xml = pathlib.Path(a.xml)
    if not xml.exists():
        print(f"{a.label}: no JUnit XML at {xml} (pytest did not run to its end)")
        return 1
    cases = read(xml)
    n = collections.Counter(o for _, o, _ in cases)
    bad = [(nid, o, r) for nid, o, r in cases if o in ("failed", "error")]
    no_reason = [nid for nid, o, r in cases if o == "skipped" and not r]
    if a.skips:
        by_reason: dict[str, list[str]] = collections.defaultdict(list)
        for nid, o, r in cases:
            if o == "skipped":
                by_reason[r or "(NO REASON GIVEN)"].append(nid)
        lines = [f"# {n['skipped']} of {len(cases)} tests skipped, by reason ({len(by_reason)} reasons)", ""]
        for reason, ids in sorted(by_reason.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            lines.append(f"## {len(ids)}: {reason}")
            lines += [f"- {i}" for i in ids]
            lines.append("")
        pathlib.Path(a.skips).write_text("\n".join(lines))
    if a.outcomes:
        pathlib.Path(a.outcomes).write_text("".join(f"{o:8} {nid}\n" for nid, o, _ in cases))
    print(f"{a.label}: {n['passed']} passed, {n['failed']} failed, {n['error']} errors, {n['skipped']} skipped "
          f"of {len(cases)}")
    if a.first:
        ids = first_ids(pathlib.Path(a.first))
        mine = [(nid, o) for nid, o, _ in cases if any(nid == i or nid.startswith(i + "[") for i in ids)]
        c = collections.Counter(o for _, o in mine)
        ran_first = [nid for nid, _, _ in cases[: len(mine)]] == [nid for nid, _ in mine]
        print(f"{a.label}: run first ({a.first}): {len(mine)} tests, {c['passed']} passed, {c['failed']} failed, "
              f"{c['error']} errors, {c['skipped']} skipped{'' if ran_first or not mine else ' (NOT run first)'}")
    for nid, o, r in bad:
        print(f"  {o.upper()} {nid}: {r[:200]}")
    for nid in no_reason:
        print(f"  SKIPPED WITHOUT A REASON {nid}")
    if n["passed"] < a.min_passed:
        print(f"{a.label}: {n['passed']} passed, fewer than the {a.min_passed} required")
    return 1 if bad or no_reason or n["passed"] < a.min_passed else 0


if __name__ == "__main__":
    sys.exit(main())
