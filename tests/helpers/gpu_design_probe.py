"""Stage 4's measurements for issue 42's design (item 7: "the bundle measures
what decides the design"), each one group of driver calls in a process of
its own, on the library in $KVCACHED_LIBCUDA, through the project's own
bindings (kvcached_service.cuda.driver, via gpu_check_probe.Probe). Each
group prints one JSON object as its last line: latencies already reduced to
{"p50_us", "p99_us", "n"} per name, plus what the group counted.
tests/helpers/gpu_figures.py turns them into rows and figures.json; nothing
here judges a timing.

    python tests/helpers/gpu_design_probe.py GROUP [--scale real|small]

GROUP:
  handles      import from an exported fd and from an os.dup of it; release
               of an imported handle while a mapping keeps the page, when
               not mapped, and when it is the page's last reference; close of
               an exported fd while a handle remains and when it is the last
               reference (and whether that frees device memory at once)
  runs         one cuMemSetAccess and one cuMemUnmap over runs of 1, 2, 8,
               32 and 64 adjacent mapped 2 MiB pages
  sizes        create, export, import, map, set-access, unmap, release at
               page sizes 2, 8, 32 and 128 MiB
  concurrency  the create..release cycle from 1, 2, 4, 8 threads of one
               process and from 2-4 processes at once (aggregate calls/s)
  memset       cuMemsetD8Async on a non-blocking stream + an event with
               CU_EVENT_BLOCKING_SYNC, against cuMemsetD8_v2 +
               cuCtxSynchronize, over 1, 32 and 256 mapped 2 MiB pages
               (1, 4 and 16 at --scale small)
  fdmem        kernel memory (/proc/meminfo Slab, SUnreclaim) and fd count
               for N held exported fds of N pages (10,000, or what
               RLIMIT_NOFILE and half the free device memory allow)
  worker       (internal) one process of `concurrency`: stdin "go", runs
  zeroer       (internal) zeroes 256 pages in a loop while stdin says "run"
               (decode_zeroing's load); EOF ends it and it prints its count
  decode_zeroing  decode tokens/s of the unpatched llama-server with and
               without a zeroer process running (--orig, --device, --out)

--scale small (the test driver's dry run) uses small counts; the code is
the same.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import threading
import time
from ctypes import byref

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MiB = 1 << 20
RUN_LENGTHS = (1, 2, 8, 32, 64)
SIZES_MIB = (2, 8, 32, 128)
THREADS = (1, 2, 4, 8)
CYCLE = ("create", "export", "import", "close", "map", "set_access", "unmap", "release_imported", "release")

SCALES = {
    #              real (a GPU)           small (the test driver's dry run)
    "handles": {"real": 256, "small": 12},      # pages
    "runs": {"real": 32, "small": 2},           # repetitions over a 64-page reservation
    "sizes": {"real": 32, "small": 3},          # pages per size
    "concurrency": {"real": 0.3, "small": 0.12},  # seconds per level
    "processes": {"real": (2, 4), "small": (2,)},
    "memset": {"real": 50, "small": 2},         # repetitions per size and kind
    "memset_pages": {"real": (1, 32, 256), "small": (1, 4, 16)},  # the test driver's memset is slow
    "fdmem": {"real": 10000, "small": 200},     # fds held
    "fold_wait": {"real": True, "small": False},  # wait for the kernel's vmstat fold before each reading
    "fdmem_export_s": {"real": 10.0, "small": 5.0},  # exporting stops after this long (fewer fds than pages)
    "zeroer_pages": {"real": 256, "small": 32},
}


def stats(v: list[float]) -> dict:
    """Seconds -> {"p50_us", "p99_us", "n"} (nearest rank)."""
    s = sorted(v)
    if not s:
        return {"p50_us": None, "p99_us": None, "n": 0}
    at = lambda p: s[min(len(s) - 1, int(len(s) * p / 100))]  # noqa: E731
    return {"p50_us": round(at(50) * 1e6, 3), "p99_us": round(at(99) * 1e6, 3), "n": len(s)}


def reduce(times: dict[str, list[float]]) -> dict:
    return {k: stats(v) for k, v in times.items() if v}


def probe(pages: int = 1):
    from gpu_check_probe import Probe

    return Probe(pages)


def timed(t: dict, key: str, fn, *args):
    t0 = time.perf_counter()
    r = fn(*args)
    t.setdefault(key, []).append(time.perf_counter() - t0)
    return r


def free_bytes(p) -> int | None:
    try:
        return p.free_mem()[0]
    except Exception:  # noqa: BLE001 - a driver without a current context for it: not recorded
        return None


def err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:200]}"


# ---------------------------------------------------------------------------- handles

def handles(scale: str) -> dict:
    """What the client's handle cache and the daemon's kept export decide on:
    import from the original fd and from an os.dup of it (alternating which
    goes first); cuMemRelease of an imported handle while a mapping keeps
    the page, of one never mapped, and of the page's last reference; os.close
    of an exported fd while handles remain and of the page's last reference."""
    n = SCALES["handles"][scale]
    p = probe()
    t: dict[str, list[float]] = {}
    addr = p.reserve(p.page)
    facts: dict = {"pages": n, "page_bytes": p.page}
    try:
        for i in range(n):
            h = p.create()
            fd = p.export(h)
            d = os.dup(fd)
            for which in ((fd, d) if i % 2 == 0 else (d, fd)):
                name = "import_original_fd" if which == fd else "import_dup_fd"
                hi = timed(t, name, p.import_fd, which)
                if which == fd:  # a client's loan: import, map, set access, drop the handle, keep the mapping
                    p.d.cuMemMap(addr, p.page, 0, hi, 0)
                    p.access(addr, p.page)
                    timed(t, "release_imported_while_mapped", p.d.cuMemRelease, hi)
                    timed(t, "unmap_after_release", p.d.cuMemUnmap, addr, p.page)
                else:
                    timed(t, "release_imported_unmapped", p.d.cuMemRelease, hi)
            timed(t, "close_dup_fd_original_open", os.close, d)
            hl = p.import_fd(fd)
            timed(t, "close_fd_handles_held", os.close, fd)
            timed(t, "release_created_imported_held", p.d.cuMemRelease, h)
            timed(t, "release_imported_last_reference", p.d.cuMemRelease, hl)
        # the last fd of a page whose handles are all gone: does the close cost, does it free?
        hs = [p.create() for _ in range(n)]
        fds = [p.export(h) for h in hs]
        for h in hs:
            p.d.cuMemRelease(h)
        f0 = free_bytes(p)
        for fd in fds:
            timed(t, "close_last_fd", os.close, fd)
        f1 = free_bytes(p)
        time.sleep(0.1)
        f2 = free_bytes(p)
        if None not in (f0, f1, f2):
            facts["close_last_fd_freed_at_once_pages"] = round((f1 - f0) / p.page, 2)
            facts["close_last_fd_freed_after_100ms_pages"] = round((f2 - f0) / p.page, 2)
        # and the last handle of a page (no fd, no mapping left)
        hs = [p.create() for _ in range(n)]
        f0 = free_bytes(p)
        for h in hs:
            timed(t, "release_created_last_reference", p.d.cuMemRelease, h)
        f1 = free_bytes(p)
        if None not in (f0, f1):
            facts["release_last_freed_at_once_pages"] = round((f1 - f0) / p.page, 2)
    finally:
        p.d.cuMemAddressFree(addr, p.page)
        p.close()
    return {"calls": reduce(t), "facts": facts}


# ---------------------------------------------------------------------------- runs

def runs(scale: str) -> dict:
    """One cuMemSetAccess and one cuMemUnmap over L adjacent mapped pages,
    for each L in RUN_LENGTHS, over a 64-page reservation (64/L runs per
    repetition). Per call and per page say whether a run pays per call or
    per page."""
    reps = SCALES["runs"][scale]
    top = max(RUN_LENGTHS)
    p = probe()
    base = p.reserve(top * p.page)
    hs = [p.create() for _ in range(top)]
    t: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    try:
        for L in RUN_LENGTHS:
            try:
                for _ in range(reps):
                    for r0 in range(0, top, L):
                        a = base + r0 * p.page
                        for i in range(L):
                            p.d.cuMemMap(a + i * p.page, p.page, 0, hs[r0 + i], 0)
                        timed(t, f"set_access_{L}", p.access, a, L * p.page)
                        timed(t, f"unmap_{L}", p.d.cuMemUnmap, a, L * p.page)
            except Exception as e:  # noqa: BLE001 - this driver refuses a call over L mappings: say so, go on
                errors[str(L)] = err(e)
                for i in range(top):
                    try:
                        p.d.cuMemUnmap(base + i * p.page, p.page)
                    except Exception:  # noqa: BLE001
                        pass
    finally:
        for h in hs:
            p.d.cuMemRelease(h)
        p.d.cuMemAddressFree(base, top * p.page)
        p.close()
    return {"calls": reduce(t), "errors": errors, "reps": reps, "page_bytes": p.page, "lengths": list(RUN_LENGTHS)}


# ---------------------------------------------------------------------------- sizes

def sizes(scale: str) -> dict:
    """Each call of a page's life at 2, 8, 32 and 128 MiB (rounded up to the
    granularity): create, export, import (then the fd closed), map of the
    imported handle, set-access, unmap, release of the imported handle,
    release of the created one (the last reference: frees)."""
    n = SCALES["sizes"][scale]
    p = probe()
    out: dict = {}
    errors: dict[str, str] = {}
    try:
        for mib in SIZES_MIB:
            size = -(-mib * MiB // p.gran) * p.gran
            t: dict[str, list[float]] = {}
            addr = p.reserve(size)
            try:
                for _ in range(n):
                    h = timed(t, "create", p.create, size)
                    fd = timed(t, "export", p.export, h)
                    hi = timed(t, "import", p.import_fd, fd)
                    os.close(fd)
                    timed(t, "map", p.d.cuMemMap, addr, size, 0, hi, 0)
                    timed(t, "set_access", p.access, addr, size)
                    timed(t, "unmap", p.d.cuMemUnmap, addr, size)
                    timed(t, "release_imported", p.d.cuMemRelease, hi)
                    timed(t, "release", p.d.cuMemRelease, h)
            except Exception as e:  # noqa: BLE001 - out of memory at 128 MiB, say: the smaller sizes stay
                errors[str(mib)] = err(e)
            finally:
                p.d.cuMemAddressFree(addr, size)
            out[str(mib)] = reduce(t)
    finally:
        p.close()
    return {"sizes": out, "errors": errors, "pages": n, "granularity": p.gran}


# ---------------------------------------------------------------------------- concurrency

def cycle_loop(p, until: float, t: dict[str, list[float]]) -> int:
    """The page cycle one after another until `until` (time.perf_counter);
    the number of driver calls made (os.close not counted)."""
    p.d.cuCtxSetCurrent(p.ctx)  # the context is per thread
    addr = p.reserve(p.page)
    calls = 0
    try:
        while time.perf_counter() < until:
            h = timed(t, "create", p.create)
            fd = timed(t, "export", p.export, h)
            hi = timed(t, "import", p.import_fd, fd)
            timed(t, "close", os.close, fd)
            timed(t, "map", p.d.cuMemMap, addr, p.page, 0, hi, 0)
            timed(t, "set_access", p.access, addr, p.page)
            timed(t, "unmap", p.d.cuMemUnmap, addr, p.page)
            timed(t, "release_imported", p.d.cuMemRelease, hi)
            timed(t, "release", p.d.cuMemRelease, h)
            calls += 8
    finally:
        p.d.cuMemAddressFree(addr, p.page)
    return calls


def threads_level(p, k: int, dur: float) -> dict:
    barrier = threading.Barrier(k + 1)
    res: list = [None] * k

    def body(i):
        t: dict[str, list[float]] = {}
        barrier.wait()
        start = time.perf_counter()
        try:
            calls = cycle_loop(p, start + dur, t)
            res[i] = (calls, start, time.perf_counter(), t, None)
        except Exception as e:  # noqa: BLE001
            res[i] = (0, start, time.perf_counter(), t, err(e))

    ths = [threading.Thread(target=body, args=(i,)) for i in range(k)]
    for th in ths:
        th.start()
    barrier.wait()
    for th in ths:
        th.join()
    return merge_level([(c, s, e, t, x) for c, s, e, t, x in res])


def merge_level(parts: list) -> dict:
    """[(calls, start, end, times, error)] of the workers of one level ->
    aggregate calls/s over the level's wall time and the pooled latencies."""
    calls = sum(x[0] for x in parts)
    wall = max(x[2] for x in parts) - min(x[1] for x in parts)
    pooled: dict[str, list[float]] = {}
    for x in parts:
        for k, v in x[3].items():
            pooled.setdefault(k, []).extend(v)
    errors = [x[4] for x in parts if x[4]]
    return {"workers": len(parts), "calls": calls, "wall_s": round(wall, 4),
            "calls_per_s": round(calls / wall, 1) if wall > 0 else None, "latency": reduce(pooled),
            "errors": errors}


def worker(dur: float) -> int:
    """One process of the `concurrency` group: ready, wait for "go", cycle
    for `dur`, print its calls, its start and end (time.time) and latencies."""
    p = probe()
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        p.close()
        return 1
    t: dict[str, list[float]] = {}
    start_wall, start = time.time(), time.perf_counter()
    e = None
    try:
        calls = cycle_loop(p, start + dur, t)
    except Exception as x:  # noqa: BLE001
        calls, e = 0, err(x)
    end_wall = start_wall + (time.perf_counter() - start)
    p.close()
    print(json.dumps({"calls": calls, "start": start_wall, "end": end_wall, "error": e,
                      "times": {k: [round(x, 7) for x in v] for k, v in t.items()}}), flush=True)
    return 0


def processes_level(k: int, dur: float, timeout: float = 60) -> dict:
    ps = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker", "--seconds", str(dur)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
          for _ in range(k)]
    try:
        for pr in ps:  # each has made its context: start them together
            line = pr.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"worker not ready: {line!r} {pr.stderr.read()[-300:] if pr.poll() is not None else ''}")
        for pr in ps:
            pr.stdin.write("go\n")
            pr.stdin.flush()
        parts = []
        for pr in ps:
            out, errtxt = pr.communicate(timeout=timeout)
            lines = [x for x in out.splitlines() if x.startswith("{")]
            if pr.returncode != 0 or not lines:
                raise RuntimeError(f"worker exited {pr.returncode}: {errtxt.strip()[-300:]}")
            r = json.loads(lines[-1])
            parts.append((r["calls"], r["start"], r["end"], r["times"], r["error"]))
        return merge_level(parts)
    finally:
        for pr in ps:
            if pr.poll() is None:
                pr.kill()
                pr.wait()


def concurrency(scale: str) -> dict:
    dur = SCALES["concurrency"][scale]
    p = probe()
    levels: dict = {}
    try:
        for k in THREADS:
            levels[f"threads_{k}"] = threads_level(p, k, dur)
    finally:
        p.close()
    for k in SCALES["processes"][scale]:
        try:
            levels[f"processes_{k}"] = processes_level(k, dur)
        except Exception as e:  # noqa: BLE001
            levels[f"processes_{k}"] = {"workers": k, "errors": [err(e)]}
    return {"levels": levels, "seconds_per_level": dur, "calls_per_cycle": 8, "page_bytes": p.page}


# ---------------------------------------------------------------------------- memset

class Window:
    """n pages of the default size mapped in one reservation, read-write."""

    def __init__(self, p, n: int):
        self.p, self.n = p, n
        self.size = n * p.page
        self.base = p.reserve(self.size)
        self.hs: list[int] = []
        try:
            for i in range(n):
                self.hs.append(p.create())
                p.d.cuMemMap(self.base + i * p.page, p.page, 0, self.hs[-1], 0)
            try:
                p.access(self.base, self.size)
            except Exception:  # noqa: BLE001 - one call over the run refused: page by page
                for i in range(n):
                    p.access(self.base + i * p.page, p.page)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        p = self.p
        for i in range(len(self.hs)):
            try:
                p.d.cuMemUnmap(self.base + i * p.page, p.page)
            except Exception:  # noqa: BLE001
                pass
        for h in self.hs:
            p.d.cuMemRelease(h)
        p.d.cuMemAddressFree(self.base, self.size)


def stream_and_event(p):
    from kvcached_service.cuda import driver as cu

    s, ev = cu.CUstream(), cu.CUevent()
    p.d.cuStreamCreate(byref(s), cu.CU_STREAM_NON_BLOCKING)
    p.d.cuEventCreate(byref(ev), cu.CU_EVENT_BLOCKING_SYNC | cu.CU_EVENT_DISABLE_TIMING)
    return s, ev


def zero_async(p, w: Window, s, ev) -> float:
    """Issue the memset and the event: the seconds the issue took."""
    t0 = time.perf_counter()
    p.d.cuMemsetD8Async(w.base, 0, w.size, s)
    p.d.cuEventRecord(ev, s)
    return time.perf_counter() - t0


def memset(scale: str) -> dict:
    reps = SCALES["memset"][scale]
    pages = SCALES["memset_pages"][scale]
    p = probe()
    t: dict[str, list[float]] = {}
    s = ev = None
    w = None
    try:
        s, ev = stream_and_event(p)
        w = Window(p, max(pages))
        for n in pages:
            size = n * p.page
            for r in range(reps + 1):  # the first of each kind is a warm-up
                for kind in (("async", "sync") if r % 2 == 0 else ("sync", "async")):
                    t0 = time.perf_counter()
                    if kind == "async":
                        p.d.cuMemsetD8Async(w.base, 0, size, s)
                        p.d.cuEventRecord(ev, s)
                        t1 = time.perf_counter()
                        p.d.cuEventSynchronize(ev)
                    else:
                        p.d.cuMemsetD8_v2(w.base, 0, size)
                        t1 = time.perf_counter()
                        p.d.cuCtxSynchronize()
                    t2 = time.perf_counter()
                    if r:
                        t.setdefault(f"{kind}_{n}_issue", []).append(t1 - t0)
                        t.setdefault(f"{kind}_{n}_complete", []).append(t2 - t0)
    finally:
        if w:
            w.close()
        if ev:
            p.d.cuEventDestroy_v2(ev)
        if s:
            p.d.cuStreamDestroy_v2(s)
        p.close()
    return {"calls": reduce(t), "reps": reps, "page_bytes": p.page, "pages": list(pages)}


def zeroer(scale: str) -> int:
    """decode_zeroing's load: zeroes its window (async memset + blocking-sync
    event) in a loop while the last line on stdin was "run"; at EOF prints
    {"loops", "bytes", "running_s"}."""
    p = probe()
    w = Window(p, SCALES["zeroer_pages"][scale])
    s, ev = stream_and_event(p)
    running = threading.Event()
    done = threading.Event()

    def commands():
        for line in sys.stdin:
            (running.set if line.strip() == "run" else running.clear)()
        done.set()
        running.set()

    threading.Thread(target=commands, daemon=True).start()
    print("ready", flush=True)
    loops, busy = 0, 0.0
    try:
        while not done.is_set():
            running.wait()
            if done.is_set():
                break
            t0 = time.perf_counter()
            zero_async(p, w, s, ev)
            p.d.cuEventSynchronize(ev)
            busy += time.perf_counter() - t0
            loops += 1
    finally:
        w.close()
        p.d.cuEventDestroy_v2(ev)
        p.d.cuStreamDestroy_v2(s)
        p.close()
    print(json.dumps({"loops": loops, "bytes": loops * w.size, "running_s": round(busy, 4), "pages": w.n}), flush=True)
    return 0


# ---------------------------------------------------------------------------- fdmem

def meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            if k in ("Slab", "SUnreclaim", "SReclaimable", "VmallocUsed"):
                out[k] = int(v.split()[0]) * 1024
    return out


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def fold_wait() -> str:
    """Make /proc/meminfo's slab counters current: the kernel folds per-CPU
    deltas into them only every vm.stat_interval (1 s) or past a threshold,
    so a reading right after N small allocations may not show them. Writing
    /proc/sys/vm/stat_refresh folds at once (root, writable /proc/sys);
    otherwise wait one interval and a bit. Says which it did."""
    try:
        with open("/proc/sys/vm/stat_refresh", "w") as f:
            f.write("1")
        return "stat_refresh"
    except OSError:
        pass
    try:
        interval = float(open("/proc/sys/vm/stat_interval").read().split()[0])
    except (OSError, ValueError, IndexError):
        interval = 1.0
    time.sleep(min(interval, 2.0) + 0.25)
    return f"waited {min(interval, 2.0) + 0.25:.2f} s"


def fdmem(scale: str) -> dict:
    """Hold N exported fds, one per page (the daemon's design: one export
    kept for each page's life): /proc/meminfo's Slab and SUnreclaim (bytes,
    machine-wide: other processes add noise) and this process's fd count at
    the start, after creating N pages, after exporting each once, after
    closing the fds. (exported - created) / fds is the kernel memory an fd
    costs; (created - start) / N what a created page costs the kernel.
    Exporting stops after SCALES["fdmem_export_s"] (a driver whose export
    is slow, as run 3's p99 of 717 us hinted): fewer fds than pages then,
    and facts["fds"] says how many."""
    want = SCALES["fdmem"][scale]
    wait = SCALES["fold_wait"][scale]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        if hard != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    except (ValueError, OSError):
        pass
    p = probe()
    steps: dict = {}
    facts: dict = {"rlimit_nofile": soft}
    t: dict[str, list[float]] = {}
    hs: list[int] = []
    fds: list[int] = []
    try:
        room = (soft if soft != resource.RLIM_INFINITY else 1 << 20) - fd_count() - 64
        free = free_bytes(p)
        by_mem = int(free * 0.5 // p.page) if free else want
        n = max(1, min(want, room, by_mem))
        facts.update(n=n, wanted=want, limited_by=("the fd limit" if n == room else "device memory" if n == by_mem else None))

        def snap(name):
            how = fold_wait() if wait else "no wait"
            steps[name] = dict(meminfo(), fds=fd_count())
            facts["fold"] = how

        snap("start")
        hs = [timed(t, "create", p.create) for _ in range(n)]
        snap("pages_created")
        stop = time.perf_counter() + SCALES["fdmem_export_s"][scale]
        for h in hs:
            fds.append(timed(t, "export", p.export, h))
            if time.perf_counter() > stop:
                facts["export_stopped_after_s"] = SCALES["fdmem_export_s"][scale]
                break
        facts["fds"] = len(fds)
        snap("pages_exported")
        for fd in fds:
            timed(t, "close", os.close, fd)
        fds = []
        snap("fds_closed")
    finally:
        for fd in fds:
            os.close(fd)
        for h in hs:
            p.d.cuMemRelease(h)
        p.close()
    return {"steps": steps, "facts": facts, "calls": reduce(t), "page_bytes": p.page}


# ---------------------------------------------------------------------------- decode under zeroing

def decode_zeroing(a) -> int:
    """Decode tokens/s of the unpatched llama-server on model A while another
    process zeroes 256 pages in a loop, against without (rounds alternate
    which comes first; llama-server's own predicted_per_second)."""
    import gpu_llama

    run = gpu_llama.Run(argparse.Namespace(device=a.device, orig=a.orig, kvc=a.orig, out=a.out, rows="",
                                           deadline=0.0))
    z = None
    try:
        run.make_models()
        srv = run.server(run.orig, "A", daemon=None, parallel=1, fa="on", ctx=4096, tag="orig-zeroing")
        srv.complete("Hello", 8, id_slot=0)  # warm-up
        z = subprocess.Popen([sys.executable, os.path.abspath(__file__), "zeroer", "--scale", a.scale],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = z.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"zeroer not ready: {line!r} {z.stderr.read()[-300:] if z.poll() is not None else ''}")

        def set_zeroing(on: bool):
            z.stdin.write("run\n" if on else "pause\n")
            z.stdin.flush()
            time.sleep(0.05)

        samples = decode_rounds(lambda k, i: float(srv.complete(f"Hello {i}", k, id_slot=0, cache_prompt=False)
                                                   ["timings"]["predicted_per_second"]),
                                set_zeroing, a.rounds, a.tokens)
        out, errtxt = z.communicate(timeout=60)  # closes stdin: EOF ends the zeroer
        lines = [x for x in out.splitlines() if x.startswith("{")]
        if z.returncode != 0 or not lines:
            raise RuntimeError(f"zeroer exited {z.returncode}: {errtxt.strip()[-300:]}")
        load = json.loads(lines[-1])
    finally:
        if z and z.poll() is None:
            z.kill()
            z.wait()
        run.close()
    print(json.dumps({"samples": samples, "zeroer": load, "tokens": a.tokens, "rounds": a.rounds, "device": a.device}))
    return 0


def decode_rounds(complete, set_zeroing, rounds: int, tokens: int) -> dict[str, list[float]]:
    """`rounds` pairs of one decode quiet and one with the zeroer running,
    alternating which comes first: {"quiet": [tokens/s], "zeroing": [...]}."""
    samples: dict[str, list[float]] = {"quiet": [], "zeroing": []}
    for i in range(rounds):
        for kind in (("quiet", "zeroing") if i % 2 == 0 else ("zeroing", "quiet")):
            set_zeroing(kind == "zeroing")
            try:
                samples[kind].append(complete(tokens, i))
            finally:
                set_zeroing(False)
    return samples


GROUPS = {"handles": handles, "runs": runs, "sizes": sizes, "concurrency": concurrency, "memset": memset,
          "fdmem": fdmem}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("group", choices=[*GROUPS, "worker", "zeroer", "decode_zeroing"])
    ap.add_argument("--scale", choices=["real", "small"], default="real")
    ap.add_argument("--seconds", type=float, default=0.5, help="worker: seconds to cycle")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="decode_zeroing: the builds' device")
    ap.add_argument("--orig", default="", help="decode_zeroing: the unpatched llama-server")
    ap.add_argument("--out", default="", help="decode_zeroing: directory for models and logs")
    ap.add_argument("--tokens", type=int, default=512, help="decode_zeroing: tokens per decode")
    ap.add_argument("--rounds", type=int, default=4, help="decode_zeroing: pairs of decodes")
    a = ap.parse_args(argv)
    if a.group == "worker":
        return worker(a.seconds)
    if a.group == "zeroer":
        return zeroer(a.scale)
    if a.group == "decode_zeroing":
        return decode_zeroing(a)
    t0 = time.perf_counter()
    res = GROUPS[a.group](a.scale)
    res["group_s"] = round(time.perf_counter() - t0, 3)
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
