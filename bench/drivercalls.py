"""Reading the CUDA test driver's live call counters.

With KVCACHED_TESTDRV_CALLS=DIR every process that loads the test driver
(build/testdriver/libcuda.so.1) keeps its driver calls per function in the
file DIR/<pid>, updated with atomics as the calls happen (layout:
tests/cudadriver/testdriver.c, "Live call counters"; README: the knob's
row). `snapshot(DIR)` reads every file at one moment; the difference of two
snapshots is what each process (and each of its threads) called in between,
including processes that exited meanwhile (their files stay).

Counts are `calls` (every call, failed ones too) and `bytes` (the sizes
that cuMemCreate/cuMemMap/cuMemUnmap/cuMemSetAccess were given, summed: the
pages the calls covered, so one cuMemSetAccess over a run of 32 pages of
2 MiB is 1 call and 64 MiB).
"""

from __future__ import annotations

import os
import struct

MAGIC = 0x314C4E4344565444
_HEAD = struct.Struct("<QIIIIII")  # magic, version, nfn, slots, name length, pid, slots taken


def read_file(path: str) -> dict | None:
    """One process's counters, or None if the file is not (yet) one."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if len(data) < _HEAD.size:
        return None
    magic, version, nfn, slots, name_len, pid, taken = _HEAD.unpack_from(data, 0)
    if magic != MAGIC or version != 1:
        return None
    off = 32
    names = [data[off + i * name_len: off + (i + 1) * name_len].split(b"\0", 1)[0].decode() for i in range(nfn)]
    off += nfn * name_len
    vals = struct.unpack_from(f"<{2 * nfn}Q", data, off)
    off += 16 * nfn
    out = {"pid": pid, "calls": _nz(names, vals[:nfn]), "bytes": _nz(names, vals[nfn:]), "threads": {}}
    slot = 24 + 16 * nfn
    for i in range(min(taken, slots)):
        base = off + i * slot
        tid, _ = struct.unpack_from("<II", data, base)
        comm = data[base + 8: base + 24].split(b"\0", 1)[0].decode(errors="replace")
        tv = struct.unpack_from(f"<{2 * nfn}Q", data, base + 24)
        if tid:
            out["threads"][tid] = {"comm": comm, "calls": _nz(names, tv[:nfn]), "bytes": _nz(names, tv[nfn:])}
    return out


def _nz(names, vals) -> dict:
    return {n: v for n, v in zip(names, vals) if v}


def snapshot(directory: str, pids=None) -> dict[int, dict]:
    """{pid: counters} of every process that counted in `directory` (or of
    `pids` only)."""
    out: dict[int, dict] = {}
    try:
        entries = os.listdir(directory) if pids is None else [str(p) for p in pids]
    except OSError:
        return out
    for name in entries:
        if name.isdigit():
            got = read_file(os.path.join(directory, name))
            if got is not None:
                out[int(name)] = got
    return out


def _sub(a: dict, b: dict) -> dict:
    return {k: v - b.get(k, 0) for k, v in a.items() if v - b.get(k, 0)}


def delta(after: dict[int, dict], before: dict[int, dict]) -> dict[int, dict]:
    """What each process called between two snapshots (processes with no
    call in between are left out). A pid whose file was replaced (a new
    process with the same pid, or a fork child) counts from zero."""
    out: dict[int, dict] = {}
    for pid, a in after.items():
        b = before.get(pid, {})
        d = {"calls": _sub(a["calls"], b.get("calls", {})), "bytes": _sub(a["bytes"], b.get("bytes", {})), "threads": {}}
        for tid, t in a["threads"].items():
            bt = b.get("threads", {}).get(tid, {})
            td = {"comm": t["comm"], "calls": _sub(t["calls"], bt.get("calls", {})),
                  "bytes": _sub(t["bytes"], bt.get("bytes", {}))}
            if td["calls"] or td["bytes"]:
                d["threads"][tid] = td
        if d["calls"] or d["bytes"]:
            out[pid] = d
    return out


def add(acc: dict[int, dict], d: dict[int, dict]) -> dict[int, dict]:
    """Sum the delta `d` into `acc` (several measured windows of one figure)."""
    for pid, c in d.items():
        a = acc.setdefault(pid, {"calls": {}, "bytes": {}, "threads": {}})
        for kind in ("calls", "bytes"):
            for k, v in c[kind].items():
                a[kind][k] = a[kind].get(k, 0) + v
        for tid, t in c["threads"].items():
            at = a["threads"].setdefault(tid, {"comm": t["comm"], "calls": {}, "bytes": {}})
            for kind in ("calls", "bytes"):
                for k, v in t[kind].items():
                    at[kind][k] = at[kind].get(k, 0) + v
    return acc


class Counter:
    """Snapshots of one counter directory (None: counting is off, every
    window is empty)."""

    def __init__(self, directory: str | None):
        self.dir = directory

    def snap(self, pids=None) -> dict[int, dict]:
        return snapshot(self.dir, pids) if self.dir else {}

    def since(self, before: dict[int, dict], pids=None) -> dict[int, dict]:
        return delta(self.snap(pids), before) if self.dir else {}

    def settle(self, pid: int, quiet: float = 0.03, timeout: float = 10.0) -> None:
        """Wait until process `pid` made no driver call for `quiet` seconds
        (its work queued by an earlier operation is done), so that the next
        window holds only what its own operation makes."""
        if not self.dir:
            return
        import time

        path = os.path.join(self.dir, str(pid))
        last, since = read_file(path), time.monotonic()
        deadline = since + timeout
        while time.monotonic() < deadline:
            time.sleep(0.005)
            cur = read_file(path)
            if cur != last:
                last, since = cur, time.monotonic()
            elif time.monotonic() - since >= quiet:
                return


def split(d: dict[int, dict], daemon_pids: set[int] | int, ops: int, exclude: set[int] | None = None) -> dict:
    """Calls of one measured window as the cost model takes them: the
    daemon's (all its threads: the device worker is one queue), and the
    clients' (every other process that called, less `exclude`), each per
    operation (`ops`: operations in the window, all clients together). The
    daemon's threads that called are listed with their share."""
    if isinstance(daemon_pids, int):
        daemon_pids = {daemon_pids}
    exclude = exclude or set()
    dm: dict = {"calls": {}, "bytes": {}}
    cl: dict = {"calls": {}, "bytes": {}}
    threads = []
    clients = 0
    for pid, c in d.items():
        if pid in exclude:
            continue
        into = dm if pid in daemon_pids else cl
        if pid in daemon_pids:
            for tid, t in c["threads"].items():
                threads.append({"pid": pid, "tid": tid, "comm": t["comm"], "calls": sum(t["calls"].values())})
        else:
            clients += 1
        for kind in ("calls", "bytes"):
            for k, v in c[kind].items():
                into[kind][k] = into[kind].get(k, 0) + v
    n = max(1, ops)
    per = lambda x: {kind: {k: v / n for k, v in sorted(x[kind].items())} for kind in ("calls", "bytes")}  # noqa: E731
    return {"ops": ops, "daemon_per_op": per(dm), "client_per_op": per(cl), "client_processes": clients,
            "daemon_threads": sorted(threads, key=lambda t: -t["calls"])}
