"""The GPU bundle's rows, verdict, table and results.json (docs/gpu-check.md,
"The offline GPU bundle").

A row is one JSON object {"check", "expected", "seen", "verdict", "kind"}
(verdict: pass / FAIL / DIFF / info / skip), as scripts/gpu-check.sh writes
them; verify.sh adds "stage" (the stage's number, 0 for the bundle's own
preparation). Used by runner.py on the GPU host and by
tests/test_gpu_bundle.py; standard library only (it runs on the host's
python before the bundle's venv exists).
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile

VERDICTS = ("pass", "FAIL", "DIFF", "info", "skip")
STAGE_NAMES = {0: "prepare", 1: "gpu-check", 2: "clients", 3: "llama.cpp", 4: "figures", 5: "capacity"}


def row(check: str, expected: str, seen: str, verdict: str, kind: str, **extra) -> dict:
    assert verdict in VERDICTS, verdict
    return {"check": check, "expected": expected, "seen": seen, "verdict": verdict, "kind": kind, **extra}


def read_rows(path: pathlib.Path) -> tuple[list[dict], list[str]]:
    """The rows of a rows.jsonl, and a complaint for each line that is not one."""
    rows, bad = [], []
    if not path.exists():
        return rows, bad
    for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except ValueError as exc:
            bad.append(f"line {i}: not JSON ({exc})")
            continue
        if not isinstance(r, dict) or r.get("verdict") not in VERDICTS or "check" not in r:
            bad.append(f"line {i}: not a row: {line[:120]}")
            continue
        r.setdefault("expected", "")
        r.setdefault("seen", "")
        r.setdefault("kind", "")
        rows.append(r)
    return rows, bad


def stage_rows(n: int, outcome: dict, stage_out: pathlib.Path | None) -> list[dict]:
    """The rows one stage contributes, given how it went.

    outcome["status"]: "missing" (no stage script in the bundle), "deadline"
    (not started: VERIFY_DEADLINE had passed), "ran" (rc, seconds) or
    "killed" (ran past the deadline and its grace). A stage that ran but left
    no rows, or exited non-zero without a FAIL row, gets a FAIL row: a
    stage's silence never reads as a pass."""
    name = STAGE_NAMES.get(n, f"stage {n}")
    label = f"stage {n} ({name})"
    status = outcome["status"]
    if status == "missing":
        return [row(f"stage {n}: not in bundle", "the stage script is in the bundle",
                    f"no scripts/gpu-bundle/stage{n}.sh", "FAIL", "verify", stage=n)]
    if status == "deadline":
        return [row(f"{label}: not started", "starts before VERIFY_DEADLINE",
                    f"skipped: the deadline ({outcome.get('deadline_s')} s) had passed at "
                    f"{outcome.get('elapsed_s', 0):.0f} s", "skip", "verify", stage=n, not_run=True)]
    rows, bad = read_rows(stage_out / "rows.jsonl") if stage_out else ([], [])
    for r in rows:
        r["stage"] = n
    rc = outcome.get("rc")
    out = list(rows)
    for b in bad:
        out.append(row(f"{label}: rows.jsonl", "one JSON row per line", b, "FAIL", "verify", stage=n))
    if status == "killed":
        out.append(row(f"{label}: finished", "ends by the deadline and its grace",
                       f"killed after {outcome.get('seconds', 0):.0f} s", "FAIL", "verify", stage=n))
    elif not rows:
        out.append(row(f"{label}: rows", "the stage writes its rows",
                       f"none (exit {rc}; see its log)", "FAIL", "verify", stage=n))
    elif rc not in (0, None) and not any(r["verdict"] == "FAIL" for r in rows):
        out.append(row(f"{label}: exit status", "0 unless a row is FAIL",
                       f"exit {rc} with no FAIL row (see its log)", "FAIL", "verify", stage=n))
    return out


def verdict(rows: list[dict]) -> str:
    """PASS, PASS with N DIFF rows, or FAIL: FAIL when a row is FAIL or a
    stage that was asked for did not run (the deadline)."""
    if any(r["verdict"] == "FAIL" or r.get("not_run") for r in rows):
        return "FAIL"
    diff = sum(r["verdict"] == "DIFF" for r in rows)
    return f"PASS with {diff} DIFF rows" if diff else "PASS"


def _cell(s) -> str:
    return str(s).replace("|", "/").replace("\n", " ")


def table_md(rows: list[dict], host: dict | None = None) -> str:
    lines = []
    if host:
        lines.append("host: " + ", ".join(f"{k} {_cell(v)}" for k, v in host.items() if v not in (None, "")))
        lines.append("")
    lines += ["| # | stage | check | expected | seen | result |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        lines.append(f"| {i} | {r.get('stage', '')} | {_cell(r['check'])} | {_cell(r['expected'])} | "
                     f"{_cell(r['seen'])} | {r['verdict']} |")
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    lines.append("")
    lines.append("rows: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    diff = [r["check"] for r in rows if r["verdict"] == "DIFF"]
    if diff:
        lines.append("the CUDA test driver's model differs from this driver (please report): " + "; ".join(diff))
    lines.append("")
    lines.append(verdict(rows))
    return "\n".join(lines) + "\n"


def read_figures(stage_out: pathlib.Path | None) -> tuple[dict, str | None]:
    """A stage's figures.json ({name: {"value": number, "unit": str, ...}})
    and a complaint when it is there but not that shape."""
    if not stage_out or not (stage_out / "figures.json").exists():
        return {}, None
    try:
        figs = json.loads((stage_out / "figures.json").read_text())
    except ValueError as exc:
        return {}, f"not JSON ({exc})"
    if not isinstance(figs, dict) or not all(isinstance(v, dict) and isinstance(v.get("value"), (int, float))
                                             for v in figs.values()):
        return {}, "not {name: {value: number, unit: str}}"
    return figs, None


def _atomic_write(path: pathlib.Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write(out: pathlib.Path, rows: list[dict], figures: dict, host: dict, stages: list[dict]) -> str:
    """table.md and results.json in out (rewritten after every stage: what
    has finished is on disk whatever happens next); returns the verdict."""
    v = verdict(rows)
    _atomic_write(out / "table.md", table_md(rows, host))
    results = {"verdict": v, "host": host, "stages": stages, "rows": rows, "figures": figures}
    _atomic_write(out / "results.json", json.dumps(results, indent=1, sort_keys=False) + "\n")
    return v
