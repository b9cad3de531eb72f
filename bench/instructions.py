"""The daemon's instructions per one-page Allocate+Free pair, counted by
callgrind: a figure the machine's load does not move.

    python -m bench.instructions [--compare REF[,REF]] [--pairs N] [--clients N] [--runs N] [--out DIR]

Each daemon (this checkout's, and each REF's kvcached_service extracted as
`scripts/bench.sh --compare` does) runs on the host backend under
`valgrind --tool=callgrind` (PYTHONHASHSEED=0). The compiled load client
(bench/loadc.c, scenario 2's "C client" rows: no Python on the client side)
opens its sessions, does `--pairs` // 4 pairs to warm up, then the counters
are zeroed (`callgrind_control -z`), it does `--pairs` pairs, and they are
dumped (`-d`): every instruction the daemon's process ran meanwhile, all
threads, divided by the pairs. The trees alternate, `--runs` times each.

Wall-clock figures on a 2-core machine that others share swing 0.5-3x
between runs minutes apart (docs/benchmarks.md); this one moves by well
under 1 % between runs of one tree, so it tells whether a change made the
request path cheaper or dearer when timings cannot. It says nothing about
waiting (sockets, locks, the scheduler): scenario 2's timings are for that.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from . import common, suite
from .run import tree_of

PAGE = 2 << 20


def _totals(dump: pathlib.Path) -> int:
    m = re.search(r"^totals:\s*(\d+)", dump.read_text(errors="replace"), re.M)
    if not m:
        raise RuntimeError(f"{dump}: no totals line")
    return int(m.group(1))


class Counted:
    """kvcached-serve of `tree` (None: this checkout) under callgrind: a
    bench Daemon (common.Daemon) run under valgrind."""

    def __init__(self, workdir: pathlib.Path, name: str, tree: pathlib.Path | None):
        self.out = pathlib.Path(tempfile.mkdtemp(prefix=f"{name}-cg-", dir=workdir)) / "callgrind.out"
        self.daemon = common.Daemon(
            workdir, name, "host", ["--page-size", str(PAGE), "--memory-limit", str(256 * PAGE), "--prealloc", str(64 * PAGE)],
            env={"PYTHONHASHSEED": "0"}, tree=tree, ready_timeout=300,
            prefix=("valgrind", "--tool=callgrind", f"--callgrind-out-file={self.out}", "--dump-instr=no"))
        self.dumps = 0

    def control(self, *args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(self.daemon.pid)], check=True, capture_output=True, timeout=120)

    def count(self, clients: int, pairs: int) -> dict:
        """Instructions over `pairs` pairs of `clients` C clients (after a
        warm-up of pairs // 4): scenario 2's C-client run
        (suite.c_client_run), the counters zeroed before its loop and
        dumped after."""
        ctx = suite.Ctx("host", True, self.out.parent)
        suite.c_client_run(ctx, self.daemon, clients, "rtt", max(1, pairs // 4 // clients))
        got = suite.c_client_run(ctx, self.daemon, clients, "rtt", max(1, pairs // clients),
                                 before=lambda: self.control("-z"), after=lambda: self.control("-d"))
        self.dumps += 1
        dump = pathlib.Path(f"{self.out}.{self.dumps}")
        for _ in range(100):  # the dump is written by the daemon's process: wait for it
            if dump.exists() and "totals:" in dump.read_text(errors="replace"):
                break
            time.sleep(0.1)
        return {"pairs": got["pairs"], "instructions": _totals(dump), "per_pair": _totals(dump) / got["pairs"]}

    def stop(self) -> None:
        self.daemon.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", default="", metavar="REF[,REF]", help="git revisions whose daemon is counted too")
    ap.add_argument("--pairs", type=int, default=2000, help="pairs counted per run (default 2000)")
    ap.add_argument("--clients", type=int, default=1, help="C clients at once (default 1)")
    ap.add_argument("--runs", type=int, default=2, help="runs per tree, alternated (default 2)")
    ap.add_argument("--out", default="", help="a directory for results.json and results.md")
    a = ap.parse_args(argv)
    if not shutil.which("valgrind") or not shutil.which("callgrind_control"):
        print("bench.instructions: needs valgrind (callgrind_control): apt-get install valgrind", file=sys.stderr)
        return 2
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=common.ROOT, capture_output=True, text=True).stdout.strip()
    trees = [(f"this tree ({head})", None)] + [(ref, tree_of(ref)) for ref in a.compare.split(",") if ref]
    per: dict[str, list[float]] = {name: [] for name, _ in trees}
    with tempfile.TemporaryDirectory(prefix="kvc-instr-") as tmp:
        for run in range(a.runs):
            for name, tree in trees:
                print(f"[{name}] run {run + 1} of {a.runs}: daemon under callgrind ...", flush=True)
                d = Counted(pathlib.Path(tmp), "instr", tree)
                try:
                    r = d.count(a.clients, a.pairs)
                finally:
                    d.stop()
                per[name].append(r["per_pair"])
                print(f"[{name}] {r['pairs']} pairs: {r['per_pair']:,.0f} instructions per pair", flush=True)
    base = statistics.median(per[trees[0][0]])
    lines = [f"Daemon instructions per one-page Allocate+Free pair (callgrind, host backend, {a.clients} C client"
             f"{'s' if a.clients > 1 else ''}, {a.pairs} pairs counted, {a.runs} runs per tree, alternated)", "",
             "| daemon | instructions per pair, median (runs) | this tree / it |", "|---|---:|---:|"]
    for name, _ in trees:
        m = statistics.median(per[name])
        runs = ", ".join(f"{v:,.0f}" for v in per[name])
        lines.append(f"| {name} | {m:,.0f} ({runs}) | {base / m:.3f}x |")
    md = "\n".join(lines)
    print("\n" + md)
    if a.out:
        out = pathlib.Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"clients": a.clients, "pairs": a.pairs, "per_pair": per,
                                                      "command": " ".join(["python -m bench.instructions", *(argv or sys.argv[1:])])}, indent=1))
        (out / "results.md").write_text(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
