"""Soak: nothing grows over a day (issue 46 item 3).

    python -m bench.soak [--backend host|cuda] [--quick] [--cycles N] [--sessions N]
                         [--clients 64] [--interval 10] [--out-dir DIR] [--img-dir DIR]

One daemon (bench/common.py's way of starting one, plus a read-only probe,
below) takes:

- **cycles**: one-page Allocate+Free pairs from `--clients` (64) sessions of
  the compiled load client (bench/loadc.c, as in scenario 2), in chunks
  (100; 20 in quick mode) so that the harness knows how far it is; every
  chunk is one loadc run: its 64 sessions open, do their pairs and end;
- **sessions**: open/close rounds, each one loadc run of `--clients`
  sessions doing one pair each (opened over a fresh gRPC connection, ended
  by closing their fd channel) plus `--py-sessions` (8) sessions of the
  Python client (a fresh Client, so a fresh gRPC connection; unique session
  names, so every session's metric series must go away; ended by
  CloseSession). Only these count towards `--sessions`.

The two run at once and are paced to the same fraction of their totals
(neither more than 2 % ahead), so the second half of the run has the same
mix as the first. Full run: 1,000,000 cycles and 100,000 sessions; quick
(`--quick`, under a minute): 50,000 and 2,000, sampled every 2 s.

Every `--interval` seconds (10; 5 quick) one sample of the daemon:

- RSS (`/proc/PID/status` VmRSS; RssAnon beside it), open fds
  (`/proc/PID/fd`), threads (`/proc/PID/status` Threads);
- asyncio tasks (`asyncio.all_tasks()` on the daemon's loop), live Python
  objects (`len(gc.get_objects())`) and the sizes of the daemon's
  containers (every dict/list/set/deque reachable in up to three attribute
  steps from a kvcached_service.server object of which there is one, such as
  `Daemon.sessions`): through the probe, a thread started in the daemon's
  process before the daemon's own code runs (`python -m bench.soak _daemon
  PROBE -- ARGS`; it runs `kvcached_service.server` as `-m` would). It
  reads only: the daemon's code is not changed. It costs one thread and one
  listening socket (constant, included in the figures);
- metric series: the samples on the daemon's `/metrics`
  (`--metrics-address 127.0.0.1:PORT`), lines that are not comments.

Before the soak, a warm-up (one cycle chunk and one session round) and an
*idle start* sample with no client connected; after it, an *idle end*
sample the same way (2 s after the last client left).

The daemon runs with `--state-dir` (as deploy/systemd runs it; `--no-state-dir`
for none), so the journal's size and the page-store keeper's RSS and fds are
sampled and judged too.

**Verdict** per resource, on the loaded samples of the second half of the
run (t >= half the run's length): the least-squares line y = a + b t; its
slope b is reported per hour. It *grows* when the change the line makes
over that window, b x (t_last - t_first), is more than twice the residual
standard deviation around it or the resource's floor (RSS 2 MiB; fds,
threads, tasks, series, keeper fds 2; journal 64 KiB), whichever is larger:
a growth that the window's own noise or a couple of units explain is not
called growth (a fall beyond it is reported, and is not growth). A count
(fds less the pages the daemon holds, threads, tasks, series, keeper fds)
also grows when idle end minus idle start exceeds its floor. Otherwise it
is *flat*.

`--tracemalloc N` runs the daemon with PYTHONTRACEMALLOC=N and records where
its Python heap grew from idle start to idle end (slow).

Writes DIR/soak-BACKEND[-quick].json (every sample, the fits, the verdicts,
the first and last container sizes and the growth of the Python object
types between warm-up and end) and IMG/soak-BACKEND[-quick].png. Exits 1 if
a resource is not flat, or, in quick mode, if idle end minus idle start is
beyond the generous bounds of QUICK_BOUNDS.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import urllib.request

from . import common

MiB = 1 << 20
PAGE = 2 * MiB
RESOURCES = ("rss_mib", "fds", "threads", "tasks", "series")  # the verdict's
# counts judged at idle too: idle end minus idle start at most the floor (fds: less the pages the daemon holds)
IDLE_JUDGED = {"fds": "fds_less_pages", "threads": "threads", "tasks": "tasks", "series": "series", "keeper_fds": "keeper_fds"}
# with a state dir (the default, as deploy/systemd runs the daemon): the page store's keeper process and the journal
STATE_RESOURCES = ("keeper_rss_mib", "keeper_fds", "journal_kib")
DIAGNOSTIC = ("rss_anon_mib", "py_objects", "pages", "fds_less_pages")  # reported, not judged
FLOOR = {"rss_mib": 2.0, "fds": 2.0, "threads": 2.0, "tasks": 2.0, "series": 2.0, "rss_anon_mib": 2.0, "py_objects": 1000.0, "pages": 2.0,
         "fds_less_pages": 2.0, "keeper_rss_mib": 2.0, "keeper_fds": 2.0, "journal_kib": 64.0}
# quick mode: idle end minus idle start may be at most this much (generous)
# (fds less the pages the daemon holds: on the host backend each pooled page is an fd, and the pool is only trimmed
# after --pool-idle-seconds)
QUICK_BOUNDS = {"rss_mib": 64.0, "fds_less_pages": 16, "threads": 4, "tasks": 16, "series": 16}
LABEL = {"rss_mib": "RSS, MiB", "fds": "open fds", "threads": "threads", "tasks": "asyncio tasks",
         "series": "metric series", "rss_anon_mib": "RssAnon, MiB", "py_objects": "Python objects (gc)", "pages": "pages (pooled + lent)",
         "fds_less_pages": "fds less pages", "keeper_rss_mib": "keeper RSS, MiB", "keeper_fds": "keeper fds",
         "journal_kib": "journal, KiB"}


def judged(samples: list[dict]) -> tuple:
    """The resources the verdict covers: the daemon's five, and the keeper's and the journal's where there is a state dir."""
    return RESOURCES + tuple(r for r in STATE_RESOURCES if samples and r in samples[0])


# ---- the probe: runs inside the daemon's process ---------------------------------------------
def _module(o) -> str:
    m = getattr(type(o), "__module__", "")
    return m if isinstance(m, str) else ""


def _ours(o) -> bool:
    return _module(o).startswith("kvcached_service")


def _attrs(o):
    d = getattr(o, "__dict__", None)
    if isinstance(d, dict):
        yield from list(d.items())
    for klass in type(o).__mro__:
        for name in getattr(klass, "__slots__", ()) or ():
            if isinstance(name, str) and name not in ("__dict__", "__weakref__") and hasattr(o, name):
                yield name, getattr(o, name, None)


def _walk(o, path: str, depth: int, out: dict, seen: set) -> None:
    import weakref

    containers = (dict, list, set, frozenset, collections.deque, weakref.WeakSet, weakref.WeakValueDictionary,
                  weakref.WeakKeyDictionary)
    for name, val in _attrs(o):
        p = f"{path}.{name}"
        if isinstance(val, containers):
            try:
                out[p] = out.get(p, 0) + len(val)
            except TypeError:
                continue
            if depth < 3 and isinstance(val, dict) and 0 < len(val) <= 8:  # e.g. pools by device
                for v in list(val.values()):
                    if _ours(v) and id(v) not in seen and not isinstance(v, type):
                        seen.add(id(v))
                        _walk(v, p + "[*]", depth + 1, out, seen)
        elif depth < 3 and _ours(val) and not isinstance(val, type) and id(val) not in seen:
            seen.add(id(val))
            _walk(val, p, depth + 1, out, seen)


def _probe_roots():
    """Objects of kvcached_service.server classes of which there is exactly one (Daemon, its pools on one device, the
    control socket's front door, the metrics, ...): where a structure that grows with use would hang."""
    import gc

    by_type: dict[type, list] = collections.defaultdict(list)
    for o in gc.get_objects():
        if not isinstance(o, type) and _module(o).startswith("kvcached_service.server"):
            by_type[type(o)].append(o)
    return [objs[0] for objs in by_type.values() if len(objs) == 1]


def _probe_structures(roots) -> dict:
    out: dict[str, int] = {}
    seen: set = set()
    for r in roots:
        seen.add(id(r))
        _walk(r, type(r).__name__, 0, out, seen)
    for name, mod in list(sys.modules.items()):  # module-level containers of the daemon's modules
        if name.startswith("kvcached_service") and mod is not None:
            for k, v in list(vars(mod).items()):
                if isinstance(v, (dict, list, set, collections.deque)) and not k.startswith("__"):
                    out[f"{name}:{k}"] = len(v)
    return out


def _probe_answer(cmd: str, state: dict) -> dict:
    import asyncio
    import concurrent.futures
    import gc

    loop = state.get("loop")
    if loop is None or loop.is_closed():
        loop = None
        for o in gc.get_objects():
            if isinstance(o, asyncio.AbstractEventLoop) and o.is_running():
                loop = o
                break
            if isinstance(o, asyncio.Task) and not o.done():
                loop = o.get_loop()
                break
        if loop is None:
            return {"error": "no running event loop yet"}
        state["loop"] = loop

    def on_loop():
        if cmd in ("snap", "diff"):  # tracemalloc (--tracemalloc): where the Python heap grew between "snap" and "diff"
            import tracemalloc

            if not tracemalloc.is_tracing():
                return {"error": "tracemalloc is not tracing (--tracemalloc)"}
            gc.collect()
            snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
            if cmd == "snap":
                state["snap"] = snap
                return {"traced": tracemalloc.get_traced_memory()[0]}
            stats = snap.compare_to(state["snap"], "traceback")[:25]
            return {"traced": tracemalloc.get_traced_memory()[0], "top": [
                {"size_diff": st.size_diff, "count_diff": st.count_diff, "size": st.size, "count": st.count,
                 "where": [f"{fr.filename}:{fr.lineno}" for fr in st.traceback]} for st in stats]}
        if cmd == "types":  # Python objects by type, for naming what grows: after a full collection (cycles not yet
            # collected are not a leak), and how many objects that collection freed
            before = len(gc.get_objects())
            freed = gc.collect()
            c = collections.Counter(f"{_module(o)}.{getattr(type(o), '__qualname__', '?')}" for o in gc.get_objects())
            return {"types": dict(c.most_common(300)), "objects_before_collect": before, "collected": freed}
        if state.get("roots") is None or cmd == "roots":
            state["roots"] = _probe_roots()
        return {"tasks": len(asyncio.all_tasks(loop)), "py_objects": len(gc.get_objects()),
                "structures": _probe_structures(state["roots"])}

    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        try:
            fut.set_result(on_loop())
        except BaseException as exc:  # noqa: BLE001 - handed to the harness
            fut.set_exception(exc)

    loop.call_soon_threadsafe(run)
    return fut.result(30)


def _probe_serve(path: str) -> None:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    srv.bind(path)
    srv.listen(4)
    state: dict = {}
    while True:
        conn, _ = srv.accept()
        with conn:
            try:
                cmd = conn.makefile("r").readline().strip()
                out = _probe_answer(cmd, state)
            except Exception as exc:  # noqa: BLE001 - reported to the harness
                out = {"error": f"{type(exc).__name__}: {exc}"}
            try:
                conn.sendall(json.dumps(out).encode())
            except OSError:
                pass


def daemon_main(probe_path: str, args: list[str]) -> None:
    """`python -m bench.soak _daemon PROBE -- ARGS`: the probe thread, then kvcached-serve ARGS as `python -m
    kvcached_service.server` runs it."""
    import runpy

    threading.Thread(target=_probe_serve, args=(probe_path,), name="soak-probe", daemon=True).start()
    sys.argv = ["kvcached-serve", *args]
    runpy.run_module("kvcached_service.server", run_name="__main__", alter_sys=True)


# ---- the harness ------------------------------------------------------------------------------
class ProbedDaemon(common.Daemon):
    """common.Daemon, started through daemon_main (the probe) with metrics on 127.0.0.1."""

    def __init__(self, workdir: pathlib.Path, backend: str, args: list[str], env: dict, state_dir: bool = True):
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="soak-", dir=workdir))
        self.state_dir = str(self.dir / "state") if state_dir else ""
        self.keeper: int | None = None
        if self.state_dir:
            os.mkdir(self.state_dir, 0o700)
            args = [*args, "--state-dir", self.state_dir]
        self.socket = str(self.dir / "kvc.sock")
        self.probe_path = str(self.dir / "probe.sock")
        self.log_path = self.dir / "daemon.log"
        self.metrics_port = common.free_port()
        cmd = [common.PY, "-m", "bench.soak", "_daemon", self.probe_path, "--", "--socket", self.socket, "--backend", backend,
               "--log-level", "WARNING", "--metrics-address", f"127.0.0.1:{self.metrics_port}", *args]
        full_env = dict(os.environ)
        full_env.update(env)
        full_env["PYTHONPATH"] = str(common.ROOT)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=common.ROOT)
        self.pid = self.proc.pid
        self._wait_ready()

    def probe(self, cmd: str = "sample", timeout: float = 60) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(self.probe_path)
            s.sendall(cmd.encode() + b"\n")
            chunks = []
            while True:
                b = s.recv(1 << 16)
                if not b:
                    break
                chunks.append(b)
        out = json.loads(b"".join(chunks))
        if "error" in out:
            raise RuntimeError(f"probe {cmd}: {out['error']}")
        return out

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30) as r:
            return r.read().decode()


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _proc_status(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "Threads"):
                out[k] = int(v.split()[0])
    return out


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def keeper_pid(state_dir: str) -> int | None:
    """The page store's keeper process of this state dir (kvcached_service.server.recovery.keeper), if one runs."""
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                cmd = open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"kvcached_service.server.recovery.keeper" in cmd and state_dir.encode() in cmd:
                return int(p)
    return None


def sample(d: ProbedDaemon, t0: float, progress: dict) -> dict:
    st = _proc_status(d.pid)
    text = d.metrics()
    p = d.probe("sample")
    out = {
        "t": round(time.monotonic() - t0, 3),
        "rss_mib": st["VmRSS"] / 1024,
        "rss_anon_mib": st["RssAnon"] / 1024,
        "threads": st["Threads"],
        "fds": common.open_fds(d.pid),  # on the host backend every page (pooled or lent) is one memfd here
        "tasks": p["tasks"],
        "py_objects": p["py_objects"],
        "series": sum(1 for line in text.splitlines() if line and not line.startswith("#")),
        "sessions_open": int(_metric(text, "kvcached_sessions_open")),
        "pages": int((_metric(text, "kvcached_device_pooled_bytes") + _metric(text, "kvcached_device_in_use_bytes")) // PAGE),
        "allocations": int(_metric(text, "kvcached_device_allocations_total")),
        "sessions_opened": int(_metric(text, "kvcached_sessions_opened_total")),
        "cycles_done": progress["cycles"],
        "sessions_done": progress["sessions"],
        "structures": p["structures"],
    }
    out["fds_less_pages"] = out["fds"] - out["pages"]
    if d.state_dir:
        out["journal_kib"] = _dir_bytes(d.state_dir) / 1024
        kp = d.keeper or keeper_pid(d.state_dir)
        try:
            ks = _proc_status(kp) if kp else None
            out["keeper_rss_mib"], out["keeper_fds"] = ks["VmRSS"] / 1024, common.open_fds(kp)
            d.keeper = kp
        except (OSError, TypeError):
            out["keeper_rss_mib"], out["keeper_fds"] = float("nan"), -1
            d.keeper = None
    return out


def fit(points: list[tuple[float, float]], floor: float) -> dict:
    """Least squares y = a + b t over `points`; flat (not growing) when b x span <= max(2 x residual sd, floor); a fall
    beyond that bound is reported as one, and is not growth."""
    n = len(points)
    if n < 3:
        return {"n": n, "slope_per_hour": float("nan"), "flat": None, "why": "fewer than 3 samples"}
    ts = [p[0] for p in points]
    ys = [p[1] for p in points]
    mt, my = sum(ts) / n, sum(ys) / n
    sxx = sum((t - mt) ** 2 for t in ts)
    b = sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / sxx if sxx else 0.0
    a = my - b * mt
    resid = [y - (a + b * t) for t, y in zip(ts, ys)]
    sd = math.sqrt(sum(r * r for r in resid) / (n - 2)) if n > 2 else 0.0
    span = ts[-1] - ts[0]
    change = b * span
    bound = max(2 * sd, floor)
    return {"n": n, "t_from": ts[0], "t_to": ts[-1], "slope_per_hour": b * 3600, "intercept": a, "change_over_window": change,
            "residual_sd": sd, "bound": bound, "flat": change <= bound, "falls": change < -bound, "mean": my, "min": min(ys),
            "max": max(ys)}


def analyse(samples: list[dict], idle_start: dict, idle_end: dict, quick: bool = False) -> dict:
    """quick: every resource is judged at idle only (idle end minus idle
    start, within QUICK_BOUNDS or the floor); the slopes are reported, not
    judged. The daemon's fds, metric series and the keeper's fds follow the
    clients connected at the moment of each sample, and the five samples of
    a quick run's second half make a slope of noise (21 s runs saw keeper
    fds "grow" 33 against a bound of 31, and fds 255 against 82, with
    nothing left at idle)."""
    t_end = samples[-1]["t"]
    half = [s for s in samples if s["t"] >= t_end / 2]
    judge = judged(samples)
    fits = {r: fit([(s["t"], s[r]) for s in half], FLOOR[r]) for r in judge + DIAGNOSTIC}
    idle = {r: idle_end[r] - idle_start[r] for r in judge + DIAGNOSTIC}
    verdicts = {}
    for r in judge:
        f = fits[r]
        key = IDLE_JUDGED.get(r)
        if quick:  # judged at idle only (see the docstring)
            limit = QUICK_BOUNDS.get(key or r, FLOOR[r])
            verdicts[r] = "grows (idle)" if idle[key or r] > limit else "flat"
        elif f["flat"] is None:
            verdicts[r] = "too few samples"
        elif not f["flat"]:
            verdicts[r] = "grows"
        elif key and idle[key] > FLOOR[r]:
            verdicts[r] = "grows (idle)"
        else:
            verdicts[r] = "falls" if f["falls"] else "flat"
    # the daemon's containers: which grew over the second half (the structure to name if something does)
    keys = sorted(set().union(*(s["structures"] for s in half))) if half else []
    structs = {}
    for k in keys:
        f = fit([(s["t"], s["structures"].get(k, 0)) for s in half], 2.0)
        structs[k] = {"first": half[0]["structures"].get(k, 0), "last": half[-1]["structures"].get(k, 0),
                      "idle_start": idle_start["structures"].get(k, 0), "idle_end": idle_end["structures"].get(k, 0),
                      "slope_per_hour": f["slope_per_hour"], "flat": f["flat"]}
    # the tombstones of ended sessions (Daemon.tombstones, sessions.py) grow with every session until their cap
    # (65,536): the RSS line again over the samples after the cap was reached, when the run got there
    tomb = [s["structures"].get("Daemon.tombstones._d") for s in samples]
    after_cap = None
    if tomb and tomb[-1] is not None:
        at = next(i for i, v in enumerate(tomb) if v == tomb[-1])
        if len(samples) - at >= 5 and tomb[-1] >= 65536:
            after_cap = {"t_from": samples[at]["t"], "entries": tomb[-1],
                         "fits": {r: fit([(s["t"], s[r]) for s in samples[at:]], FLOOR[r]) for r in ("rss_mib", "rss_anon_mib")}}
    return {"fits": fits, "idle_delta": idle, "structures": structs, "after_tombstone_cap": after_cap,
            "verdicts": verdicts,
            "verdict": "flat" if all(v in ("flat", "falls") for v in verdicts.values()) else "grows",
            "growing": [r for r, v in verdicts.items() if v not in ("flat", "falls")],
            "growing_structures": [k for k, v in structs.items() if v["flat"] is False or v["idle_end"] > v["idle_start"] + 2]}


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    names = judged(samples) + ("py_objects", "pages")
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 1.8 * len(names)), sharex=True)
    tmin = [s["t"] / 60 for s in samples]
    t_end = samples[-1]["t"]
    idle = [(result["idle_start"], 0.0), (result["idle_end"], result["idle_end"]["t"] / 60)]
    for ax, r in zip(axes, names):
        ax.plot(tmin, [s[r] for s in samples], marker=".", linewidth=1, color="#1f77b4", label="_loaded")
        ax.plot([x for _, x in idle], [s[r] for s, _ in idle], "s", color="black", markersize=4, label="idle (start, end)")
        f = result["analysis"]["fits"][r]
        if f.get("flat") is not None:
            xs = [f["t_from"], f["t_to"]]
            ax.plot([x / 60 for x in xs], [f["intercept"] + f["slope_per_hour"] / 3600 * x for x in xs], color="#d62728",
                    linewidth=1.5, label=f"2nd half: {f['slope_per_hour']:+.3g}/h ({result['analysis']['verdicts'].get(r, 'diagnostic')})")
        ax.legend(loc="lower right", fontsize=7)
        ax.axvspan(t_end / 2 / 60, t_end / 60, color="gray", alpha=0.08)
        ax.set_ylabel(LABEL[r], fontsize=8)
        ax.grid(alpha=0.3)
        lo, hi = min(s[r] for s in samples + [i for i, _ in idle]), max(s[r] for s in samples + [i for i, _ in idle])
        pad = max((hi - lo) * 0.2, FLOOR[r] / 2)
        ax.set_ylim(lo - pad, hi + pad)
    axes[-1].set_xlabel("minutes into the soak (shaded: second half, fitted; squares: idle, no client, before and after)")
    c = result["config"]
    fig.suptitle(f"kvcached-serve soak, {c['backend']} backend: {result['cycles_done']:,} Allocate/Free cycles, "
                 f"{result['sessions_done']:,} sessions, {c['clients']} clients", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


class Soak:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.kind = a.backend
        self.progress = {"cycles": 0, "sessions": 0, "py_sessions": 0, "loadc_sessions": 0, "cycle_sessions": 0}
        self.done = {"cycles": False, "sessions": False}
        self.failed: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()

    # pacing: neither workload more than 2 % of its total ahead of the other
    def _frac(self, which: str) -> float:
        total = self.a.cycles if which == "cycles" else self.a.sessions
        return self.progress[which] / max(1, total)

    def _wait_turn(self, mine: str, other: str) -> None:
        while not self.stop.is_set() and not self.done[other] and self._frac(mine) > self._frac(other) + 0.02:
            time.sleep(0.05)

    def _cycles(self, d, ctx, chunks: int) -> None:
        from . import suite

        per_client = max(1, math.ceil(self.a.cycles / chunks / self.a.clients))
        try:
            while self.progress["cycles"] < self.a.cycles and not self.stop.is_set():
                self._wait_turn("cycles", "sessions")
                n = min(per_client, math.ceil((self.a.cycles - self.progress["cycles"]) / self.a.clients))
                r = suite.c_client_run(ctx, d, self.a.clients, "rtt", n)
                with self.lock:
                    self.progress["cycles"] += r["pairs"]
                    self.progress["cycle_sessions"] += self.a.clients
        except Exception as exc:  # noqa: BLE001 - fails the run
            self.failed.append(f"cycles: {type(exc).__name__}: {exc}")
            self.stop.set()
        finally:
            self.done["cycles"] = True

    def _round(self, d, ctx, n_round: int) -> None:
        from kvcached_service.client import Client

        from . import suite

        suite.c_client_run(ctx, d, self.a.clients, "rtt", 1)
        with self.lock:
            self.progress["sessions"] += self.a.clients
            self.progress["loadc_sessions"] += self.a.clients
        if self.a.py_sessions:
            with Client.connect(d.socket, timeout=60) as c:
                for i in range(self.a.py_sessions):
                    s = c.open_session(f"soak-{n_round}-{i}")
                    s.close()
                    with self.lock:
                        self.progress["sessions"] += 1
                        self.progress["py_sessions"] += 1

    def _sessions(self, d, ctx) -> None:
        n = 0
        try:
            while self.progress["sessions"] < self.a.sessions and not self.stop.is_set():
                self._wait_turn("sessions", "cycles")
                self._round(d, ctx, n)
                n += 1
        except Exception as exc:  # noqa: BLE001 - fails the run
            self.failed.append(f"sessions: {type(exc).__name__}: {exc}")
            self.stop.set()
        finally:
            self.done["sessions"] = True

    def _line(self, s: dict, rate: tuple[float, float]) -> str:
        return (f"[soak {self.kind}] t={s['t']:7.0f}s cycles {s['cycles_done']:>9,}/{self.a.cycles:,} ({rate[0]:,.0f}/s) "
                f"sessions {s['sessions_done']:>7,}/{self.a.sessions:,} ({rate[1]:,.0f}/s) | rss {s['rss_mib']:.1f} MiB "
                f"fds {s['fds']} threads {s['threads']} tasks {s['tasks']} series {s['series']} objs {s['py_objects']:,}")

    def idle_sample(self, d, t0: float) -> dict:
        deadline = time.monotonic() + 30
        while True:  # no session left (channel closes are seen a moment later)
            s = sample(d, t0, self.progress)
            if s["sessions_open"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        time.sleep(2)
        types = d.probe("types")  # a full collection first: cycles not yet collected are not growth
        s = sample(d, t0, self.progress)
        s["types"] = types
        return s

    def run(self) -> dict:
        a = self.a
        from . import suite

        suite.c_binary("loadc")  # build before the clock starts
        workdir = pathlib.Path(tempfile.mkdtemp(prefix="kvc-soak-"))
        env = {}
        state = None
        if self.kind == "cuda":
            if not common.TESTDRIVER.exists():
                raise SystemExit(f"CUDA test driver not built: {common.TESTDRIVER} (run scripts/build-testdriver.sh)")
            base = "/dev/shm" if os.path.isdir("/dev/shm") else None
            state = tempfile.mkdtemp(prefix="kvc-soak-gpu-", dir=base)
            env = {"KVCACHED_LIBCUDA": str(common.TESTDRIVER), "KVCACHED_TESTDRV_STATE": state,
                   "KVCACHED_TESTDRV_MEMORY": str(2 << 30), "KVCACHED_TESTDRV_GRANULARITY": str(PAGE)}
            os.environ.update(env)  # the Python client sessions of this process
        args = ["--page-size", str(PAGE)]
        if self.kind == "host":
            args += ["--host-memory", str(1 << 30)]
        ctx = types.SimpleNamespace(kind=self.kind)
        if a.tracemalloc:
            env = {**env, "PYTHONTRACEMALLOC": str(a.tracemalloc)}
        d = ProbedDaemon(workdir, common.daemon_backend(self.kind), args, env, state_dir=not a.no_state_dir)
        samples: list[dict] = []
        try:
            t0 = time.monotonic()
            # warm-up: one chunk of cycles and one session round, then idle
            suite.c_client_run(ctx, d, a.clients, "rtt", max(1, math.ceil(a.cycles / a.chunks / a.clients)))
            self._round(d, ctx, -1)
            self.progress.update({k: 0 for k in self.progress})
            idle_start = self.idle_sample(d, t0)
            idle_start["t"] = 0.0  # the soak's clock starts here
            types_start = idle_start.pop("types")["types"]
            if a.tracemalloc:
                d.probe("snap", timeout=300)
            print(self._line(idle_start, (0, 0)) + "  (idle, after warm-up)", flush=True)
            t0 = time.monotonic()
            workers = [threading.Thread(target=self._cycles, args=(d, ctx, a.chunks), name="cycles"),
                       threading.Thread(target=self._sessions, args=(d, ctx), name="sessions")]
            for w in workers:
                w.start()
            last = (0.0, 0, 0)
            next_t = a.interval
            while any(w.is_alive() for w in workers):
                time.sleep(max(0.0, min(0.2, next_t - (time.monotonic() - t0))))
                if time.monotonic() - t0 < next_t:
                    continue
                next_t += a.interval
                s = sample(d, t0, self.progress)
                dt = max(1e-9, s["t"] - last[0])
                rate = ((s["cycles_done"] - last[1]) / dt, (s["sessions_done"] - last[2]) / dt)
                last = (s["t"], s["cycles_done"], s["sessions_done"])
                samples.append(s)
                print(self._line(s, rate), flush=True)
                if a.max_seconds and s["t"] > a.max_seconds:
                    self.failed.append(f"stopped at --max-seconds {a.max_seconds}")
                    self.stop.set()
            for w in workers:
                w.join()
            elapsed = time.monotonic() - t0
            idle_end = self.idle_sample(d, t0)
            types_end = idle_end.pop("types")["types"]
            heap_growth = d.probe("diff", timeout=300) if a.tracemalloc else None
            print(self._line(idle_end, (0, 0)) + "  (idle, at the end)", flush=True)
            log_tail = d.log_path.read_text()[-4000:]
        finally:
            rc = d.stop()
            if state:
                shutil.rmtree(state, ignore_errors=True)
            shutil.rmtree(workdir, ignore_errors=True)
        grown = {k: types_end.get(k, 0) - types_start.get(k, 0) for k in set(types_start) | set(types_end)}
        top_grown = dict(sorted(((k, v) for k, v in grown.items() if v > 0), key=lambda kv: -kv[1])[:25])
        result = {
            "config": {"backend": self.kind, "quick": a.quick, "cycles": a.cycles, "sessions": a.sessions, "clients": a.clients,
                       "py_sessions_per_round": a.py_sessions, "state_dir": not a.no_state_dir, "chunks": a.chunks, "interval_s": a.interval, "page_size": PAGE,
                       "nproc": os.cpu_count(), "loadavg_at_start": self.loadavg0, "nofile": common.nofile_limits(os.getpid())},
            "elapsed_s": elapsed, "cycles_done": self.progress["cycles"], "sessions_done": self.progress["sessions"],
            "progress": dict(self.progress), "daemon_exit": rc, "failed": self.failed,
            "idle_start": idle_start, "idle_end": idle_end, "samples": samples,
            "py_types_grown_warmup_to_end": top_grown, "tracemalloc_growth": heap_growth, "daemon_log_tail": log_tail if (rc or self.failed) else "",
        }
        result["analysis"] = analyse(samples, idle_start, idle_end, quick=a.quick)
        return result


def report(result: dict) -> str:
    an = result["analysis"]
    lines = [f"soak {result['config']['backend']}: {result['cycles_done']:,} cycles, {result['sessions_done']:,} sessions "
             f"in {result['elapsed_s']:.0f} s; verdict: {an['verdict']}"]
    lines.append(f"  {'resource':<14} {'slope/h (2nd half)':>20} {'change':>10} {'bound':>9} {'verdict':>13} {'idle end-start':>15}")
    for r in judged(result["samples"]) + DIAGNOSTIC:
        f = an["fits"][r]
        v = an["verdicts"].get(r) or ("-" if f["flat"] is None else ("flat" if f["flat"] else "grows"))
        tag = "" if r in an["verdicts"] else " (diag)"
        lines.append(f"  {r + tag:<14} {f['slope_per_hour']:>20.4g} {f.get('change_over_window', float('nan')):>10.3g} "
                     f"{f.get('bound', float('nan')):>9.3g} {v:>13} {an['idle_delta'][r]:>15.4g}")
    if an.get("after_tombstone_cap"):
        ac = an["after_tombstone_cap"]
        lines.append(f"  after the tombstones reached their cap ({ac['entries']:,} entries, t >= {ac['t_from']:.0f} s): " + ", ".join(
            f"{r} {f['slope_per_hour']:+.3g}/h (change {f['change_over_window']:+.3g}, bound {f['bound']:.3g})" for r, f in ac["fits"].items()))
    if an["growing_structures"]:
        lines.append("  containers not flat or larger at idle end: " + ", ".join(
            f"{k} ({an['structures'][k]['idle_start']}->{an['structures'][k]['idle_end']}, {an['structures'][k]['slope_per_hour']:+.3g}/h)"
            for k in an["growing_structures"][:20]))
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_daemon":
        daemon_main(argv[1], argv[3:] if argv[2:3] == ["--"] else argv[2:])
        return 0
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["host", "cuda"], default="host", help="cuda: the CUDA backend on the test driver")
    ap.add_argument("--quick", action="store_true", help="under a minute: 50,000 cycles, 2,000 sessions, 2 s sampling")
    ap.add_argument("--cycles", type=int, default=0, help="Allocate/Free pairs (default 1,000,000; quick 50,000)")
    ap.add_argument("--sessions", type=int, default=0, help="sessions opened and closed (default 100,000; quick 2,000)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--py-sessions", type=int, default=8, help="Python client sessions per session round")
    ap.add_argument("--chunks", type=int, default=0, help="loadc runs the cycles are split into (default 100; quick 20)")
    ap.add_argument("--interval", type=float, default=0, help="seconds between samples (default 10; quick 5)")
    ap.add_argument("--no-state-dir", action="store_true",
                    help="no --state-dir (default: one, as deploy/systemd runs the daemon: journal and page-store keeper)")
    ap.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES",
                    help="trace the daemon's Python allocations (PYTHONTRACEMALLOC=FRAMES; slow) and record where its heap "
                         "grew from idle start to idle end")
    ap.add_argument("--max-seconds", type=float, default=0, help="stop (and fail) after this long")
    ap.add_argument("--out-dir", type=pathlib.Path, default=common.ROOT / "bench" / "results" / "soak")
    ap.add_argument("--img-dir", type=pathlib.Path, default=common.ROOT / "docs" / "img")
    ap.add_argument("--name", default="", help="file name stem (default soak-BACKEND[-quick])")
    ap.add_argument("--replot", type=pathlib.Path, help="no soak: analyse and plot this JSON again (into --img-dir)")
    a = ap.parse_args(argv)
    if a.replot:
        result = json.loads(a.replot.read_text())
        result["analysis"] = analyse(result["samples"], result["idle_start"], result["idle_end"],
                                     quick=result["config"].get("quick", False))
        a.replot.write_text(json.dumps(result, indent=1))
        a.img_dir.mkdir(parents=True, exist_ok=True)
        plot(result, a.img_dir / f"{a.replot.stem}.png")
        print(report(result))
        return 0 if result["analysis"]["verdict"] == "flat" else 1
    a.cycles = a.cycles or (50_000 if a.quick else 1_000_000)
    a.sessions = a.sessions or (2_000 if a.quick else 100_000)
    a.chunks = a.chunks or (20 if a.quick else 100)
    a.interval = a.interval or (2.0 if a.quick else 10.0)
    stem = a.name or f"soak-{a.backend}{'-quick' if a.quick else ''}"
    soak = Soak(a)
    soak.loadavg0 = os.getloadavg()
    print(f"[soak {a.backend}] {a.cycles:,} cycles, {a.sessions:,} sessions, {a.clients} clients, sample every {a.interval:g} s "
          f"(load average {soak.loadavg0[0]:.1f} on {os.cpu_count()} cpus)", flush=True)
    result = soak.run()
    a.out_dir.mkdir(parents=True, exist_ok=True)
    a.img_dir.mkdir(parents=True, exist_ok=True)
    out = a.out_dir / f"{stem}.json"
    img = a.img_dir / f"{stem}.png"
    out.write_text(json.dumps(result, indent=1))
    plot(result, img)
    print(report(result))
    for st in (result.get("tracemalloc_growth") or {}).get("top", [])[:12]:
        print(f"  heap {st['size_diff']:+,} B in {st['count_diff']:+,} blocks at {' <- '.join(st['where'][:3])}")
    print(f"wrote {out} and {img}")
    rc = 0
    if result["failed"] or result["daemon_exit"] != 0:
        print(f"FAILED: {result['failed']} daemon exit {result['daemon_exit']}")
        rc = 1
    if result["analysis"]["verdict"] != "flat":
        print(f"NOT FLAT: {result['analysis']['growing']}")
        rc = 1
    if a.quick:
        over = {r: result["analysis"]["idle_delta"][r] for r, lim in QUICK_BOUNDS.items() if result["analysis"]["idle_delta"][r] > lim}
        if over:
            print(f"idle end minus idle start beyond the quick bounds {QUICK_BOUNDS}: {over}")
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
