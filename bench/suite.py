"""Every scenario for one backend, run in one process whose environment
selects the driver (bench/run.py starts it):

    python -m bench.suite --backend host|cuda-testdriver|cuda-gpu [--quick] --out FILE.json

Each scenario measures the daemon path and its baseline in the same run and
records both; bench/run.py turns them into ratios and the table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from . import common
from .common import GiB, MiB, Daemon, summary_us

PAGE = 2 * MiB


class Ctx:
    def __init__(self, backend: str, quick: bool, workdir: pathlib.Path):
        self.backend = backend  # host | cuda-testdriver | cuda-gpu
        self.kind = "host" if backend == "host" else "cuda"
        self.quick = quick
        self.workdir = workdir
        self.testdriver = backend == "cuda-testdriver"

    def q(self, quick, full):
        return quick if self.quick else full

    def daemon(self, name: str, args: list[str], device_bytes: int | None = None) -> Daemon:
        env = {}
        if self.testdriver and device_bytes:
            env["KVCACHED_TESTDRV_MEMORY"] = str(device_bytes)
        if self.kind == "host" and device_bytes:
            args = [*args, "--host-memory", str(device_bytes)]
        return Daemon(self.workdir, name, common.daemon_backend(self.kind), ["--page-size", str(PAGE), *args], env)


# ---- 1. Allocate(64 pages) end to end ------------------------------------------------------
def s1_allocate64(c: Ctx) -> dict:
    n = 64
    size = n * PAGE
    iters = c.q(15, 200)
    out: dict = {"pages": n, "page_size": PAGE}

    # baseline: the same 64 pages created and mapped in this process
    base = common.inproc(c.kind, PAGE)
    res = base.reserve(size)
    lat = []
    for _ in range(iters):
        t0 = time.perf_counter()
        hs = [base.create_map(res + i * PAGE) for i in range(n)]
        lat.append(time.perf_counter() - t0)
        for h in hs:
            base.unmap_release(h)
    base.free_reservation(res, size)
    out["baseline_inproc_create_map"] = summary_us(lat)
    base.close()

    # warm: --prealloc keeps created pages ready; freed pages are reused (zeroed on return)
    with c.daemon("s1-warm", ["--memory-limit", str(4 * size), "--prealloc", str(2 * size)], device_bytes=8 * size) as d:
        with d.client() as cl, cl.open_session("bench-s1-warm") as s:
            region = s.region(size)
            region.map(0, size)  # first use: mapper, context
            region.unmap(0, size)
            time.sleep(0.3)  # let the warm pool top up
            lat = []
            for _ in range(iters):
                t0 = time.perf_counter()
                region.map(0, size)
                lat.append(time.perf_counter() - t0)
                region.unmap(0, size)
            region.close()
        out["daemon_warm"] = summary_us(lat)

    # cold: no warm pages, pool trimmed at once: every Allocate creates its pages
    hold = 4
    batches = c.q(2, 12)
    with c.daemon("s1-cold", ["--memory-limit", str(hold * size), "--pool-idle-seconds", "0"], device_bytes=(hold + 1) * size) as d:
        with d.client() as cl, cl.open_session("bench-s1-cold") as s:
            region = s.region(hold * size)
            lat = []
            for b in range(batches + 1):
                common_wait_pool_empty(s)
                for k in range(hold):
                    t0 = time.perf_counter()
                    region.map(k * size, size)
                    dt = time.perf_counter() - t0
                    if b > 0:  # batch 0 warms up the client's mapper / context
                        lat.append(dt)
                region.unmap(0, hold * size)
            region.close()
        out["daemon_cold"] = summary_us(lat)
    return out


def common_wait_pool_empty(session, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if session.stats().total.pages_pooled == 0:
            return
        time.sleep(0.05)
    raise RuntimeError("the daemon did not release its pooled pages (pool_idle_seconds=0)")


# ---- 2. one-page Allocate+Free round trips; pairs/s with 64 clients -------------------------------
def s2_roundtrip(c: Ctx) -> dict:
    nproc = 64
    out: dict = {"page_size": PAGE}
    # --grpc-page-ops: the "grpc" mode compares the gRPC Allocate/Free (for tools) with the fd channel's requests
    with c.daemon("s2", ["--memory-limit", str(4 * nproc * PAGE), "--grpc-page-ops"], device_bytes=8 * nproc * PAGE) as d:
        env = common.client_env(d)
        procs = []
        try:
            for _ in range(nproc):
                procs.append(subprocess.Popen([common.PY, "-m", "bench.worker", "pairs", c.kind, str(PAGE)],
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=common.ROOT))
            for p in procs:
                line = p.stdout.readline()
                if not line:
                    raise RuntimeError("a pairs worker died during start-up")

            def run(group, cmd):
                start = time.time() + 0.3
                for p in group:
                    p.stdin.write(json.dumps({**cmd, "start": start}) + "\n")
                    p.stdin.flush()
                return [json.loads(p.stdout.readline()) for p in group]

            for conc, n in ((1, c.q(60, 1000)), (16, c.q(15, 150))):
                group = procs[:conc]
                for mode in ("daemon", "grpc", "base") if conc == 1 else ("daemon", "base"):
                    lat = [x for r in run(group, {"op": "rtt", "mode": mode, "n": n}) for x in r["lat"]]
                    out[f"rtt_{conc}_{mode}"] = summary_us(lat)
            secs = c.q(1.0, 5.0)
            for mode in ("daemon", "base"):
                got = run(procs, {"op": "tput", "mode": mode, "secs": secs})
                out[f"tput_{nproc}_{mode}"] = {"pairs": sum(r["pairs"] for r in got), "secs": secs,
                                               "pairs_per_s": sum(r["pairs"] for r in got) / secs, "clients": nproc}
            for p in procs:
                p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                p.stdin.flush()
        finally:
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    return out


# ---- 3. reclaim: most of the budget from an idle session to a new one ------------------------------------------
def s3_reclaim(c: Ctx) -> dict:
    budget = c.q(256 * MiB, 4 * GiB)
    move = budget * 9 // 10 // PAGE * PAGE
    reps = c.q(1, 3)
    out: dict = {"budget_bytes": budget, "moved_bytes": move, "page_size": PAGE, "reps": reps}
    daemon_t, base_t, answered = [], [], []

    def spawn(env, mode):
        p = subprocess.Popen([common.PY, "-m", "bench.worker", "holder", mode, c.kind, str(PAGE), str(budget)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=common.ROOT)
        ready = json.loads(p.stdout.readline())
        return p, ready

    with c.daemon("s3", ["--memory-limit", str(budget), "--reclaim-timeout-ms", "30000", "--default-wait-ms", "60000"],
                  device_bytes=budget + 64 * MiB) as d:
        env = common.client_env(d)
        with d.client(timeout=120) as cl:
            for _ in range(reps):
                holder, ready = spawn(env, "daemon")
                assert ready["pages"] == budget // PAGE, ready
                with cl.open_session("bench-new-model") as s:
                    region = s.region(move)
                    t0 = time.perf_counter()
                    region.grow_to(move, wait=True, wait_timeout_ms=60000)
                    daemon_t.append(time.perf_counter() - t0)
                    assert region.mapped_bytes == move
                    holder.stdin.write("report\n")
                    holder.stdin.flush()
                    answered.append(json.loads(holder.stdout.readline()))
                    region.close()
                holder.stdin.write("quit\n")
                holder.stdin.flush()
                holder.wait(60)
    # baseline: the idle process frees everything (unload), then the new one creates and maps in-process (reload)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(common.ROOT)
    if c.testdriver:
        env["KVCACHED_TESTDRV_MEMORY"] = str(budget + 64 * MiB)
    for _ in range(reps):
        holder, ready = spawn(env, "base")
        base = common.inproc(c.kind, PAGE)
        res = base.reserve(move)
        t0 = time.perf_counter()
        holder.stdin.write("free\n")
        holder.stdin.flush()
        json.loads(holder.stdout.readline())
        hs = [base.create_map(res + i * PAGE) for i in range(move // PAGE)]
        base_t.append(time.perf_counter() - t0)
        for h in hs:
            base.unmap_release(h)
        base.free_reservation(res, move)
        base.close()
        holder.stdin.write("quit\n")
        holder.stdin.flush()
        holder.wait(60)
    out["daemon_reclaim"] = summary_us(daemon_t)
    out["baseline_unload_reload"] = summary_us(base_t)
    out["holder_answers"] = [a["answered"] for a in answered]
    return out


# ---- 4. scale: cost vs pages tracked ------------------------------------------------------------------------
def s4_scale(c: Ctx) -> dict:
    # small pages so 100k fit in memory; a real GPU's granularity is 2 MiB
    page = 2 * MiB if c.backend == "cuda-gpu" else 64 * 1024
    targets = [1000, 10000, 100000]
    probes = c.q(30, 300)
    out: dict = {"page_size": page, "targets": targets, "levels": {}}
    limit_pages = 200000
    args = ["--memory-limit", str(limit_pages * page), "--max-pages-per-request", "65536"]
    env = {"KVCACHED_TESTDRV_MEMORY": str(limit_pages * page + 64 * MiB)} if c.testdriver else {}
    if c.backend == "cuda-gpu":
        args = ["--memory-limit", "80%", "--max-pages-per-request", "65536"]
    host_args = ["--host-memory", str(limit_pages * page * 2)] if c.kind == "host" else []
    d = Daemon(c.workdir, "s4", common.daemon_backend(c.kind), ["--page-size", str(page), *args, *host_args], env)
    try:
        soft, hard = common.nofile_limits(d.pid)
        out["daemon_nofile"] = {"soft": soft, "hard": hard, "fds_at_start": common.open_fds(d.pid)}
        with d.client(timeout=120) as cl, cl.open_session("bench-holder") as holder, cl.open_session("bench-probe") as probe:
            held = 0
            probe_region = probe.region(page)
            probe_region.map(0, page)
            probe_region.unmap(0, page)

            def measure(label: str, pages: int) -> None:
                stats = probe.stats()
                tracked = stats.total.pages_in_use + stats.total.pages_pooled
                lat_a, lat_s = [], []
                for _ in range(probes):
                    t0 = time.perf_counter()
                    probe_region.map(0, page)
                    lat_a.append(time.perf_counter() - t0)
                    probe_region.unmap(0, page)
                for _ in range(probes):
                    t0 = time.perf_counter()
                    probe.stats()
                    lat_s.append(time.perf_counter() - t0)
                out["levels"][label] = {"pages_held": pages, "pages_tracked": tracked, "daemon_rss_kib": d.rss_kib(),
                                        "daemon_fds": common.open_fds(d.pid),
                                        "allocate": summary_us(lat_a), "getstats": summary_us(lat_s)}

            measure("0", 0)
            from kvcached_service import errors

            ids: list[int] = []

            for target in targets:
                failure = None
                while held < target:
                    want = min(1000, target - held)
                    try:
                        resp, fds = holder.allocate_fds(want)
                    except errors.KVCachedError as exc:
                        failure = str(exc)
                        break
                    for fd in fds:
                        os.close(fd)
                    ids.extend(resp.page_ids)
                    held += want
                if failure is None:
                    measure(str(target), held)
                    continue
                # the fd limit: back off so Allocate and GetStats have room, measure there
                spare = max(100, held // 100)
                out["limit"] = {"target": target, "reached_pages": held, "error": failure}
                holder.free_ids(ids[-spare:])
                del ids[-spare:]
                held -= spare
                measure(f"max({held})", held)
                break
    finally:
        rc = d.stop()
        out["daemon_exit"] = rc
    return out


# ---- 5. the Ollama-shaped load (Go loadgen) ----------------------------------------------------------------
def loadgen_binary(workdir: pathlib.Path) -> str:
    out = common.ROOT / "build" / "bench" / "kvcached-loadgen"
    out.parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["go", "build", "-o", str(out), "./cmd/kvcached-loadgen"], cwd=common.ROOT / "clients" / "go",
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"go build of kvcached-loadgen failed:\n{r.stderr}")
    return str(out)


def s5_loadgen(c: Ctx) -> dict:
    binary = loadgen_binary(c.workdir)
    secs = c.q(3, 15)
    runners, layers, ctx, cell_bytes = 4, 8, 4096, 2048
    budget = 1 * GiB
    with c.daemon("s5", ["--memory-limit", str(budget)], device_bytes=budget + 64 * MiB) as d:
        r = subprocess.run([binary, "-socket", d.socket, "-json", "-duration", f"{secs}s", "-runners", str(runners),
                            "-layers", str(layers), "-ctx", str(ctx), "-cell-bytes", str(cell_bytes), "-seed", "1"],
                           capture_output=True, text=True, timeout=secs + 120, env=common.client_env(d))
        if r.returncode != 0:
            raise RuntimeError(f"kvcached-loadgen exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
        res = json.loads(r.stdout)
    # derived baseline: the same pages made/mapped and unmapped/released in-process
    base = common.inproc(c.kind, PAGE)
    n = 32
    resv = base.reserve(n * PAGE)
    mk, rl = [], []
    for _ in range(c.q(5, 30)):
        t0 = time.perf_counter()
        hs = [base.create_map(resv + i * PAGE) for i in range(n)]
        t1 = time.perf_counter()
        for h in hs:
            base.unmap_release(h)
        t2 = time.perf_counter()
        mk.append((t1 - t0) / n)
        rl.append((t2 - t1) / n)
    base.free_reservation(resv, n * PAGE)
    base.close()
    lat = res["latency_us"]
    grow_n = lat.get("grow", {}).get("count", 0)
    trim_n = lat.get("trim", {}).get("count", 0)
    per_grow = res["pages_mapped"] / grow_n if grow_n else 0
    per_trim = res["pages_freed"] / trim_n if trim_n else 0
    p_mk = sorted(mk)[len(mk) // 2]
    p_rl = sorted(rl)[len(rl) // 2]
    return {
        "loadgen": res,
        "args": {"runners": runners, "layers": layers, "ctx": ctx, "cell_bytes": cell_bytes, "secs": secs, "budget": budget},
        "pages_per_grow": per_grow,
        "pages_per_trim": per_trim,
        "baseline_grow_us": per_grow * p_mk * 1e6,
        "baseline_trim_us": per_trim * p_rl * 1e6,
        "baseline_per_page_create_map_us": p_mk * 1e6,
        "baseline_per_page_unmap_release_us": p_rl * 1e6,
        "baseline_ops_per_s": 1.0 / ((grow_n * per_grow * p_mk + trim_n * per_trim * p_rl) / max(1, grow_n + trim_n)) if grow_n + trim_n else 0,
    }


# ---- 6. capacity --------------------------------------------------------------------------------------
def s6_capacity(c: Ctx) -> dict:
    from . import capacity

    return capacity.run(c)


SCENARIOS = {
    "allocate64": s1_allocate64,
    "roundtrip": s2_roundtrip,
    "reclaim": s3_reclaim,
    "scale": s4_scale,
    "loadgen": s5_loadgen,
    "capacity": s6_capacity,
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", required=True, choices=["host", "cuda-testdriver", "cuda-gpu"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    a = ap.parse_args()
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="kvc-bench-"))
    ctx = Ctx(a.backend, a.quick, workdir)
    only = [s for s in a.only.split(",") if s] or list(SCENARIOS)
    result = {"backend": a.backend, "quick": a.quick, "scenarios": {}, "errors": {}}
    for name in only:
        t0 = time.monotonic()
        print(f"[{a.backend}] {name} ...", file=sys.stderr, flush=True)
        try:
            result["scenarios"][name] = SCENARIOS[name](ctx)
        except Exception:  # noqa: BLE001 - recorded, reported, and fails the run
            result["errors"][name] = traceback.format_exc()
            print(result["errors"][name], file=sys.stderr, flush=True)
        print(f"[{a.backend}] {name} done in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
        pathlib.Path(a.out).write_text(json.dumps(result, indent=1))
    shutil.rmtree(workdir, ignore_errors=True)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
