"""The GPU model of the bench: a figure on the GPU of the cost table
(bench/gpu_costs.json, taken from the newest real run in docs/gpu-results/)
predicted from this run's host-backend figure and the driver calls counted
on the CUDA test driver (bench/drivercalls.py).

    latency  = host + client + daemon                               (us)
      client: the calls one client process makes on the operation's path;
              with N clients each pays its own once if the driver runs
              processes' calls in parallel (serial 'worker'), or N times
              if it serialises them on the device (serial 'device', the
              table's default: run 3's in-process baselines, 16 processes
              at once, took 16 x one process's pair);
      daemon: the calls the daemon makes on the path. The daemon makes its
              driver calls on one worker thread per device, one queue: with
              N clients each pays the others' work too, so a scenario whose
              daemon work is on every operation's path pays N x the daemon's
              calls per operation (`queue=N`); and no latency is below the
              queue's own work, N x the daemon's calls per operation
              (`floor`).
    rate     = N / latency(N)     (pairs/s of N clients in a closed loop;
               host latency(N) = N / host rate)

Each call costs its table entry once (per 'call') or per page of the table (per
'page'); cuMemSetAccess and cuMemUnmap over a run of pages cost per page by
default (run_cost 'page') or once per call ('call'): the table says which
calls that choice touches. Every prediction comes out as low/mid/high (the
table's ranges) with its inputs, so anyone can redo it.

What it cannot see: contention (the daemon's loop and worker threads share
the GIL, a spinning cuCtxSynchronize burns a core, processes share one
driver), driver-internal serialisation across processes, and costs the run
did not measure (import, memset, synchronize: labelled derived/assumed in
the table).
"""

from __future__ import annotations

import json
import pathlib

COSTS = pathlib.Path(__file__).with_name("gpu_costs.json")
BOUNDS = ("low", "mid", "high")


def load(path: str | pathlib.Path | None = None) -> dict:
    return json.loads(pathlib.Path(path or COSTS).read_text())


def _entry(table: dict, fn: str) -> dict:
    e = table["costs"].get(fn) or table["other"]
    return {**e, "mid": (e["low"] + e["high"]) / 2}


def cost_us(counts: dict, table: dict, run_cost: str | None = None) -> dict:
    """What `counts` ({"calls": {fn: n}, "bytes": {fn: bytes}}, per
    operation) cost on the table's GPU: {"low", "mid", "high"} in us and the
    breakdown per function ({fn: {"n", "per", "us_each", "us", "kind"}});
    per-page costs are paid per table["page_size"] bytes."""
    run_cost = run_cost or table.get("run_cost_default", "page")
    if run_cost not in ("page", "call"):
        raise ValueError(f"run_cost must be 'page' or 'call', not {run_cost!r}")
    calls, nbytes = counts.get("calls", {}), counts.get("bytes", {})
    page = table["page_size"]
    out = {b: 0.0 for b in BOUNDS}
    parts = {}
    for fn in sorted(set(calls) | set(nbytes)):
        e = _entry(table, fn)
        per = e["per"]
        if fn in table.get("run_cost", ()):
            per = run_cost
        # per page: the pages the calls covered (a call that takes no size counts once)
        n = nbytes[fn] / page if per == "page" and fn in nbytes else calls.get(fn, 0)
        for b in BOUNDS:
            out[b] += n * e[b]
        parts[fn] = {"n": n, "per": per, "us_each": e["mid"], "us": n * e["mid"], "kind": e["kind"]}
    out["by_function"] = parts
    return out


def latency(host_us: float, client: dict, daemon: dict, table: dict, queue: int = 1, floor: dict | None = None,
            floor_n: int = 1, run_cost: str | None = None, client_queue: int = 1) -> dict:
    """Predicted latency of one operation (see the module's docstring):
    host_us + client_queue x cost(client) + queue x cost(daemon), and at
    least floor_n x cost(floor) (the daemon's whole work per operation, when
    the daemon's calls on the path are fewer). client_queue is N when the
    driver serialises the N clients' calls on the device (serial 'device'),
    1 when they run in parallel (serial 'worker')."""
    c, d = cost_us(client, table, run_cost), cost_us(daemon, table, run_cost)
    f = cost_us(floor, table, run_cost) if floor else None
    out = {}
    for b in BOUNDS:
        v = host_us + client_queue * c[b] + queue * d[b]
        if f is not None:
            v = max(v, floor_n * f[b])
        out[b] = v
    out["inputs"] = {"host_us": host_us, "client_us": c["mid"], "daemon_us": d["mid"], "queue": queue, "client_queue": client_queue,
                     "client_calls": c["by_function"], "daemon_calls": d["by_function"], "run_cost": run_cost or table.get("run_cost_default", "page")}
    if f is not None:
        out["inputs"].update({"floor_us": floor_n * f["mid"], "floor_n": floor_n})
    return out


def rate(host_per_s: float, n: int, client: dict, daemon: dict, table: dict, run_cost: str | None = None,
         serial: str = "worker") -> dict:
    """Predicted operations per second of n clients in a closed loop: n over
    the latency of one pair with n clients, whose host part is n / host
    rate and whose daemon part is paid n times (one queue); the clients'
    part once (serial 'worker': clients in parallel) or n times (serial
    'device': the driver serialises every process's calls on the device)."""
    host_us = n / host_per_s * 1e6
    lat = latency(host_us, client, daemon, table, queue=n, run_cost=run_cost,
                  client_queue=n if serial == "device" else 1)
    out = {b: n / lat[b] * 1e6 for b in BOUNDS}
    # higher latency is the lower rate: keep low <= mid <= high
    out["low"], out["high"] = out["high"], out["low"]
    out["inputs"] = {**lat["inputs"], "host_per_s": host_per_s, "clients": n, "latency_us": lat["mid"]}
    return out


def error(predicted: float, measured: float) -> float:
    """predicted / measured - 1 (0.2 = 20 % over)."""
    return predicted / measured - 1


# ---- the bench's scenarios 1-3 -------------------------------------------------------------------------
def _calls(m: dict, key: str = "path") -> dict | None:
    dc = m.get("driver_calls")
    if not dc:
        return None
    if "daemon_per_op" in dc:  # one window (scenarios 2, 3)
        return dc
    return dc.get(key)  # scenario 1: "path" (the timed windows) and "all" (every call of the loop)


def predict(cuda: dict, host: dict, table: dict, run_cost: str | None = None, serial: str | None = None) -> list[dict]:
    """The predicted GPU figures of scenarios 1-3: `cuda` and `host` are one
    run's `scenarios` of the CUDA test driver (with driver_calls, from
    bench/suite.py) and of the host backend. One row per figure: the test
    driver's value, the host's, the prediction (low/mid/high, and mid with
    the other run_cost), its inputs; the reference value of the table's run
    where it has one. Rules per scenario (docs/benchmarks.md, "On a GPU"):
    1: the calls an Allocate waited for (counted with the daemon idle at its
       start), and at least the daemon's whole work per Allocate (queue);
    2: a pair's daemon work (zeroing, export of the freed page) is on the
       next pair's path, N times with N clients; clients pay their own once;
    3: one chain (holder unmaps, daemon zeroes and exports, new session
       maps): every call counted during it, in sequence.
    serial: with N clients, 'device' (the table's default) has the driver
    serialise every process's calls on the device, so each pays the other
    clients' calls too; 'worker' only the daemon's (clients in parallel).
    Each row carries the prediction under the other choice as well."""
    run_cost = run_cost or table.get("run_cost_default", "page")
    other = "call" if run_cost == "page" else "page"
    serial = serial or table.get("serial_default", "device")
    if serial not in ("device", "worker"):
        raise ValueError(f"serial must be 'device' or 'worker', not {serial!r}")
    other_serial = "worker" if serial == "device" else "device"
    ref = table.get("reference", {}).get("figures", {})
    rows: list[dict] = []

    def add(scenario, figure, kind, unit, measured, host_value, fn, scale=1.0):
        pred = fn(run_cost, serial)
        alt = fn(other, serial)
        alt_serial = fn(run_cost, other_serial)
        row = {"scenario": scenario, "figure": figure, "kind": kind, "unit": unit, "testdriver": measured, "host": host_value,
               "predicted": pred["mid"] / scale, "low": pred["low"] / scale, "high": pred["high"] / scale,
               "run_cost": run_cost, f"predicted_run_cost_{other}": alt["mid"] / scale,
               "serial": serial, f"predicted_serial_{other_serial}": alt_serial["mid"] / scale, "inputs": pred["inputs"]}
        key = f"{scenario}|{figure}"
        if key in ref:
            row["reference"] = ref[key]
            row["error_vs_reference"] = [error(row["predicted"], v) for v in ref[key]]
        rows.append(row)

    empty = {"calls": {}, "bytes": {}}
    if "allocate64" in cuda and "allocate64" in host:
        c, h = cuda["allocate64"], host["allocate64"]
        for key, label in (("daemon_warm", "warm pool"), ("daemon_cold", "cold (pages created)"),
                           ("daemon_standby", "re-grow from standby")):
            if key not in c or key not in h:
                continue
            path, every = _calls(c[key]), _calls(c[key], "all")
            if not path:
                continue
            for p in ("p50", "p99"):
                add("1 Allocate 64 pages", f"{label} {p}", "kvcached", "us", c[key][f"{p}_us"], h[key][f"{p}_us"],
                    lambda rc, se, path=path, every=every, hv=h[key][f"{p}_us"]: latency(
                        hv, path["client_per_op"], path["daemon_per_op"], table,
                        floor=every["daemon_per_op"] if every else None, run_cost=rc))
        b = _calls(c["baseline_inproc_create_map"])
        if b:
            for p in ("p50", "p99"):
                hv = h["baseline_inproc_create_map"][f"{p}_us"]
                add("1 Allocate 64 pages", f"in-process create+map of 64 pages {p}", "baseline", "us",
                    c["baseline_inproc_create_map"][f"{p}_us"], hv,
                    lambda rc, se, hv=hv: latency(hv, b["client_per_op"], empty, table, run_cost=rc))
    if "roundtrip" in cuda and "roundtrip" in host:
        c, h = cuda["roundtrip"], host["roundtrip"]
        sc = "2 Allocate+Free 1 page"
        for prefix, cs, hs, keyf in (("", c, h, "rtt_{n}_{mode}"),
                                     ("C client (bench/loadc.c), ", c.get("cclient"), h.get("cclient"), "rtt_{n}")):
            if not cs or not hs:
                continue
            for n in (1, 16):
                for mode in ("daemon", "base") if not prefix else ("daemon",):
                    key = keyf.format(n=n, mode=mode)
                    if key not in cs or key not in hs:
                        continue
                    calls = _calls(cs[key])
                    if calls is None:
                        continue
                    who = f"{n} client{'s' if n > 1 else ''}"
                    for p in ("p50", "p99"):
                        fig = f"{prefix}{who} {p}" if mode == "daemon" else f"in-process create+map+unmap+release, {who} {p}"
                        hv = hs[key][f"{p}_us"]
                        add(sc, fig, "kvcached" if mode == "daemon" else "baseline", "us", cs[key][f"{p}_us"], hv,
                            lambda rc, se, calls=calls, hv=hv, n=n: latency(hv, calls["client_per_op"], calls["daemon_per_op"], table,
                                                                            queue=n, run_cost=rc,
                                                                            client_queue=n if se == "device" else 1))
            for mode in ("daemon", "base") if not prefix else ("daemon",):
                key = "tput_64_" + mode if not prefix else "tput_64"
                if key not in cs or key not in hs or _calls(cs[key]) is None:
                    continue
                calls = _calls(cs[key])
                fig = ("C client, 64 clients pairs/s" if prefix else "64 clients pairs/s") if mode == "daemon" else \
                    "in-process create+map+unmap+release, 64 clients pairs/s"
                add(sc, fig, "kvcached" if mode == "daemon" else "baseline", "/s", cs[key]["pairs_per_s"], hs[key]["pairs_per_s"],
                    lambda rc, se, calls=calls, hv=hs[key]["pairs_per_s"]: rate(hv, 64, calls["client_per_op"], calls["daemon_per_op"],
                                                                                 table, run_cost=rc, serial=se))
    if "reclaim" in cuda and "reclaim" in host:
        for c, h in ((cuda["reclaim"], host["reclaim"]), (cuda["reclaim"].get("large"), host["reclaim"].get("large"))):
            calls = _calls(c["daemon_reclaim"]) if c and h else None
            if not calls:
                continue
            gib = c["moved_bytes"] / (1 << 30)
            pages = "" if c.get("page_size", table["page_size"]) == table["page_size"] else f", {c['page_size'] >> 20} MiB pages"
            hv = h["daemon_reclaim"]["p50_us"]
            add("3 Reclaim", f"move {gib:.2f} GiB idle->new{pages} (median of {c['reps']})", "kvcached", "ms",
                c["daemon_reclaim"]["p50_us"] / 1e3, hv / 1e3,
                lambda rc, se, calls=calls, hv=hv: latency(hv, calls["client_per_op"], calls["daemon_per_op"], table, run_cost=rc),
                scale=1e3)
            b = _calls(c["baseline_unload_reload"])
            if b:
                hb = h["baseline_unload_reload"]["p50_us"]
                add("3 Reclaim", f"unload+reload in-process{pages} (median of {c['reps']})", "baseline", "ms",
                    c["baseline_unload_reload"]["p50_us"] / 1e3, hb / 1e3,
                    lambda rc, se, b=b, hb=hb: latency(hb, b["client_per_op"], empty, table, run_cost=rc), scale=1e3)
    return rows
