"""py-spy on the daemon while a scenario runs (scripts/bench.sh --profile).

Two samplers attach to the daemon process without stopping it
(--nonblocking): one writes the flame graph (SVG), the other the collapsed
stacks (one line per stack with its sample count), from which `summary`
reads the functions where the samples fell. Both stop (SIGINT) when the
measured run ends. py-spy comes from PyPI (the dev extra); it reads the
target's memory (process_vm_readv), which needs ptrace permission: root,
or kernel.yama.ptrace_scope 0 for the daemon's own user.
"""

from __future__ import annotations

import collections
import os
import pathlib
import shutil
import signal
import subprocess
import sys

RATE = 1000  # samples per second


def py_spy() -> str | None:
    here = pathlib.Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


class Spy:
    def __init__(self, pid: int, out_dir: pathlib.Path, name: str):
        self.out_dir = out_dir
        self.name = name
        self.error = ""
        self.procs: list[subprocess.Popen] = []
        exe = py_spy()
        if exe is None:
            self.error = "py-spy is not installed (pip install py-spy; the dev extra has it)"
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.svg = out_dir / f"{name}.svg"
        self.raw = out_dir / f"{name}.txt"
        for fmt, path in (("flamegraph", self.svg), ("raw", self.raw)):
            self.procs.append(subprocess.Popen(
                [exe, "record", "--pid", str(pid), "--rate", str(RATE), "--nonblocking", "--format", fmt, "--output", str(path)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))

    def finish(self) -> dict:
        if self.error:
            return {"error": self.error}
        errs = []
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in self.procs:
            try:
                _, err = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            if p.returncode not in (0, -signal.SIGINT):
                errs.append(err.strip()[-400:])
        if not self.raw.exists() or self.raw.stat().st_size == 0:
            return {"error": "py-spy wrote no samples: " + "; ".join(errs)}
        out = summary(self.raw)
        out["flamegraph"] = self.svg.name if self.svg.exists() else ""
        out["stacks"] = self.raw.name
        return out


def start(pid: int, out_dir: pathlib.Path | None, name: str, secs: float | None = None) -> Spy | None:
    return Spy(pid, out_dir, name) if out_dir is not None else None


# Where a sample means "waiting", not working: the loop's poll (asyncio's
# selector, or uvloop's run, whose C loop py-spy shows as the Python frame
# that called it) and a worker thread waiting for work.
IDLE = ("EpollSelector.select", "Runner.run (asyncio/runners.py", "run_until_complete", "_worker (concurrent/futures/thread.py",
        "Thread.wait", "Condition.wait", "SimpleQueue.get")


def _idle(frame: str) -> bool:
    return any(frame.startswith(x) for x in IDLE)


def summary(raw: pathlib.Path, top: int = 15) -> dict:
    """The functions where samples fell (self), and the code paths that
    contain them (inclusive), as shares of the samples that were not idle."""
    self_c: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    total = busy = 0
    for line in raw.read_text().splitlines():
        if not line.strip():
            continue
        stack, _, n = line.rpartition(" ")
        count = int(n)
        frames = stack.split(";")
        total += count
        if _idle(frames[-1]):
            continue
        busy += count
        self_c[frames[-1]] += count
        for f in set(frames):
            incl[f] += count

    def share(c: collections.Counter) -> list[list]:
        return [[f, round(100 * n / busy, 1)] for f, n in c.most_common(top)] if busy else []

    return {"samples": total, "busy_samples": busy, "busy_share": round(busy / total, 3) if total else 0.0,
            "self_top": share(self_c), "inclusive_top": share(incl)}


if __name__ == "__main__":  # python -m bench.profile STACKS.txt: print the summary
    import json

    print(json.dumps(summary(pathlib.Path(sys.argv[1])), indent=1))
    os._exit(0)
