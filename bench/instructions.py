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
import os
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
    """kvcached-serve of `tree` (None: this checkout) under callgrind."""

    def __init__(self, workdir: pathlib.Path, name: str, tree: pathlib.Path | None):
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix=f"{name}-", dir=workdir))
        self.socket = str(self.dir / "kvc.sock")
        self.out = self.dir / "callgrind.out"
        env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=str(tree or common.ROOT))
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={self.out}", "--dump-instr=no",
               common.PY, "-m", "kvcached_service.server", "--socket", self.socket, "--backend", "host",
               "--log-level", "WARNING", "--page-size", str(PAGE), "--memory-limit", str(256 * PAGE),
               "--prealloc", str(64 * PAGE)]
        self._log = open(self.dir / "daemon.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=tree or common.ROOT)
        from kvcached_service.client.health import wait_serving

        if not wait_serving(self.socket, 300, alive=lambda: self.proc.poll() is None):
            self.stop()
            raise RuntimeError(f"daemon under callgrind not serving: {(self.dir / 'daemon.log').read_text()[-2000:]}")
        self.dumps = 0

    def control(self, *args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(self.proc.pid)], check=True, capture_output=True, timeout=120)

    def count(self, clients: int, pairs: int) -> dict:
        """Instructions over `pairs` pairs of `clients` C clients (after a
        warm-up of pairs // 4)."""
        import grpc

        from kvcached_service._generated.kvcached.v1 import kvcached_pb2 as pb
        from kvcached_service._generated.kvcached.v1 import kvcached_pb2_grpc as pb_grpc

        with grpc.insecure_channel(f"unix:{self.socket}") as ch:
            stub = pb_grpc.KVCachedStub(ch)
            fd_socket = stub.GetInfo(pb.GetInfoRequest(), timeout=120).fd_socket
            for phase, n in (("warm-up", max(1, pairs // 4)), ("counted", pairs)):
                p = subprocess.Popen([suite.c_binary("loadc"), fd_socket, str(clients), "rtt", str(max(1, n // clients)),
                                      str(PAGE), "map"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
                try:
                    for i in range(clients):
                        secret = bytes.fromhex(json.loads(p.stdout.readline())["secret"])
                        stub.OpenSession(pb.OpenSessionRequest(channel_secret=secret, name=f"instr-{i}"), timeout=120)
                    if phase == "counted":
                        self.control("-z")
                    p.stdin.write("go\n")
                    p.stdin.flush()
                    line = p.stdout.readline()
                    if phase == "counted":
                        self.control("-d")
                    if p.wait(120) != 0 or not line:
                        raise RuntimeError(f"loadc exited {p.returncode}: {p.stderr.read()}")
                finally:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
        self.dumps += 1
        got = json.loads(line)
        dump = pathlib.Path(f"{self.out}.{self.dumps}")
        for _ in range(100):  # the dump is written by the daemon's process: wait for it
            if dump.exists() and "totals:" in dump.read_text(errors="replace"):
                break
            time.sleep(0.1)
        return {"pairs": got["pairs"], "instructions": _totals(dump), "per_pair": _totals(dump) / got["pairs"]}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


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
