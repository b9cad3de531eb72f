"""kvcached-service benchmark harness: `scripts/bench.sh [--quick] [--backend host|cuda|all] [--out DIR]`.

Starts its own daemons, measures every scenario of docs/benchmarks.md on
each backend with its baseline in the same run, and writes DIR/results.json
and DIR/results.md (the table printed at the end). Backends:

- host: memfd pages.
- cuda-testdriver: the CUDA backend on the project's test driver
  (build/testdriver/libcuda.so.1): its timings say nothing about a GPU.
- cuda-gpu: the CUDA backend on the real driver, when libcuda.so.1 loads
  and reports a device (otherwise the result says why it did not run).

Exit status 1 if any scenario failed (the error is in results.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

from . import common, costmodel

LABELS = {
    "host": "host (memfd)",
    "cuda-testdriver": "CUDA (test driver: timings say nothing about a GPU)",
    "cuda-gpu": "CUDA (real GPU)",
}


def machine() -> dict:
    cpu = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"nproc": os.cpu_count(), "cpu": cpu, "ram_bytes": mem, "kernel": platform.release(),
            "python": platform.python_version(), "loadavg_at_start": os.getloadavg()}


# ---- figures: (value, baseline, ratio) rows from the raw results --------------------------------------
def _row(scenario, figure, value, baseline, unit, better, baseline_what, note=""):
    ratio = value / baseline if baseline and not math.isnan(baseline) and not math.isnan(value) else float("nan")
    return {"scenario": scenario, "figure": figure, "value": value, "baseline": baseline, "unit": unit,
            "ratio": ratio, "better": better, "baseline_is": baseline_what, "note": note}


def figures(res: dict) -> list[dict]:
    rows: list[dict] = []
    sc = res.get("scenarios", {})
    if "allocate64" in sc:
        s = sc["allocate64"]
        b = s["baseline_inproc_create_map"]
        bw = "in-process create+map of 64 pages"
        for key, label in (("daemon_warm", "warm pool"), ("daemon_cold", "cold (pages created)"),
                           ("daemon_standby", "re-grow from standby")):
            if key not in s:  # a tree before standby pages (--tree)
                continue
            for p in ("p50", "p99"):
                rows.append(_row("1 Allocate 64 pages", f"{label} {p}", s[key][f"{p}_us"], b[f"{p}_us"], "us", "lower", bw))
    if "roundtrip" in sc:
        s = sc["roundtrip"]
        bw = "in-process create+map+unmap+release"
        for conc in (1, 16):
            for p in ("p50", "p99"):
                rows.append(_row("2 Allocate+Free 1 page", f"{conc} client{'s' if conc > 1 else ''} {p}",
                                 s[f"rtt_{conc}_daemon"][f"{p}_us"], s[f"rtt_{conc}_base"][f"{p}_us"], "us", "lower", bw))
        rows.append(_row("2 Allocate+Free 1 page", "64 clients pairs/s", s["tput_64_daemon"]["pairs_per_s"],
                         s["tput_64_base"]["pairs_per_s"], "/s", "higher", bw))
        if "rtt_1_grpc" in s:
            for p in ("p50", "p99"):
                rows.append(_row("2 Allocate+Free 1 page", f"fd channel requests vs gRPC calls, 1 client {p}",
                                 s["rtt_1_daemon"][f"{p}_us"], s["rtt_1_grpc"][f"{p}_us"], "us", "lower",
                                 "the same pair as gRPC Allocate/Free calls"))
        if "floor" in s:
            fl = s["floor"]
            fw = "transport floor: C ping-pong, one SCM_RIGHTS record each way (bench/floor.c)"
            for p in ("p50", "p99"):
                rows.append(_row("2 Allocate+Free 1 page", f"vs transport floor, 1 client {p}", s["rtt_1_daemon"][f"{p}_us"],
                                 fl["rtt_1"][f"{p}_us"], "us", "lower", fw))
                rows.append(_row("2 Allocate+Free 1 page", f"vs transport floor, 16 clients {p}", s["rtt_16_daemon"][f"{p}_us"],
                                 fl["rtt_16"][f"{p}_us"], "us", "lower", fw))
            rows.append(_row("2 Allocate+Free 1 page", "vs transport floor, 64 clients pairs/s", s["tput_64_daemon"]["pairs_per_s"],
                             fl["tput_64"]["per_s"], "/s", "higher", fw + ", round trips/s"))
        if "cclient" in s:
            cc = s["cclient"]
            bw = "the same pairs from the Python client (Region.map/unmap), same daemon"
            for conc in (1, 16):
                for p in ("p50", "p99"):
                    rows.append(_row("2 Allocate+Free 1 page", f"C client (bench/loadc.c), {conc} client{'s' if conc > 1 else ''} {p}",
                                     cc[f"rtt_{conc}"][f"{p}_us"], s[f"rtt_{conc}_daemon"][f"{p}_us"], "us", "lower", bw))
            rows.append(_row("2 Allocate+Free 1 page", "C client, 64 clients pairs/s", cc["tput_64"]["pairs_per_s"],
                             s["tput_64_daemon"]["pairs_per_s"], "/s", "higher", bw))
            for key, pkey, label in (("rtt_1", "rtt_1_daemon", "1 client"), ("rtt_16", "rtt_16_daemon", "16 clients"),
                                     ("tput_64", "tput_64_daemon", "64 clients")):
                if "daemon_cpu_us_per_pair" in s[pkey]:
                    rows.append(_row("2 Allocate+Free 1 page", f"C client, daemon CPU per pair, {label}", cc[key]["daemon_cpu_us_per_pair"],
                                     s[pkey]["daemon_cpu_us_per_pair"], "us", "lower", bw))
            if "floor" in s:
                fl = s["floor"]
                fw = "transport floor: C ping-pong, one SCM_RIGHTS record each way (bench/floor.c)"
                rows.append(_row("2 Allocate+Free 1 page", "C client vs transport floor, 1 client p50", cc["rtt_1"]["p50_us"],
                                 fl["rtt_1"]["p50_us"], "us", "lower", fw))
        for ref, old in s.get("compare", {}).items():
            bw = f"the same, daemon and client of {ref} (same run)"
            for conc in (1, 16):
                for p in ("p50", "p99"):
                    rows.append(_row("2 Allocate+Free 1 page", f"this tree vs {ref}, {conc} client{'s' if conc > 1 else ''} {p}",
                                     s[f"rtt_{conc}_daemon"][f"{p}_us"], old[f"rtt_{conc}_daemon"][f"{p}_us"], "us", "lower", bw))
            rows.append(_row("2 Allocate+Free 1 page", f"this tree vs {ref}, 64 clients pairs/s", s["tput_64_daemon"]["pairs_per_s"],
                             old["tput_64_daemon"]["pairs_per_s"], "/s", "higher", bw))
            for key, label in (("rtt_1_daemon", "1 client"), ("tput_64_daemon", "64 clients")):
                if "daemon_cpu_us_per_pair" in s[key] and "daemon_cpu_us_per_pair" in old[key]:
                    rows.append(_row("2 Allocate+Free 1 page", f"this tree vs {ref}, daemon CPU per pair, {label}",
                                     s[key]["daemon_cpu_us_per_pair"], old[key]["daemon_cpu_us_per_pair"], "us", "lower", bw))
            if "cclient" in s and "cclient" in old:
                cc, occ = s["cclient"], old["cclient"]
                bw = f"the same C client against the daemon of {ref} (same run)"
                for key, label in (("rtt_1", "1 client"), ("rtt_16", "16 clients"), ("tput_64", "64 clients")):
                    rows.append(_row("2 Allocate+Free 1 page", f"C client: this tree vs {ref}, daemon CPU per pair, {label}",
                                     cc[key]["daemon_cpu_us_per_pair"], occ[key]["daemon_cpu_us_per_pair"], "us", "lower", bw))
                for key, p, label in (("rtt_1", "p50", "1 client p50"), ("rtt_16", "p99", "16 clients p99")):
                    rows.append(_row("2 Allocate+Free 1 page", f"C client: this tree vs {ref}, {label}",
                                     cc[key][f"{p}_us"], occ[key][f"{p}_us"], "us", "lower", bw))
                rows.append(_row("2 Allocate+Free 1 page", f"C client: this tree vs {ref}, 64 clients pairs/s",
                                 cc["tput_64"]["pairs_per_s"], occ["tput_64"]["pairs_per_s"], "/s", "higher", bw))
    if "reclaim" in sc:
        for s in (sc["reclaim"], sc["reclaim"].get("large")):
            if not s:
                continue
            gib = s["moved_bytes"] / (1 << 30)
            pages = f", {s['page_size'] >> 20} MiB pages" if s.get("page_size", 2 << 20) != 2 << 20 else ""
            rows.append(_row("3 Reclaim", f"move {gib:.2f} GiB idle->new{pages} (median of {s['reps']})",
                             s["daemon_reclaim"]["p50_us"] / 1e3, s["baseline_unload_reload"]["p50_us"] / 1e3, "ms", "lower",
                             "idle process frees all, new one creates+maps in-process" + (" (same page size)" if pages else "")))
    if "scale" in sc:
        s = sc["scale"]
        lv = s["levels"]
        ref = lv.get("1000")
        for label, l in lv.items():
            if label in ("0", "1000") or ref is None:
                continue
            fig = f"{l['pages_tracked']} pages tracked"
            bw = "same figure at 1000 pages tracked"
            rows.append(_row("4 Scale", f"{fig}: daemon RSS", l["daemon_rss_kib"] / 1024, ref["daemon_rss_kib"] / 1024, "MiB", "lower", bw))
            if "daemon_fds" in l and "daemon_fds" in ref:
                rows.append(_row("4 Scale", f"{fig}: daemon open fds", l["daemon_fds"], ref["daemon_fds"], "fds", "lower", bw))
            if "daemon_other_fds" in l and "daemon_other_fds" in ref:
                rows.append(_row("4 Scale", f"{fig}: daemon fds other than page files", l["daemon_other_fds"], ref["daemon_other_fds"],
                                 "fds", "lower", bw, note="page files: host memfds, or (test driver with KVCACHED_TESTDRV_REFS=fds) its file per page"))
            parts, rparts = l.get("daemon_rss_parts_kib", {}), ref.get("daemon_rss_parts_kib", {})
            if "RssAnon" in parts and "RssAnon" in rparts:
                rows.append(_row("4 Scale", f"{fig}: daemon RssAnon", parts["RssAnon"] / 1024, rparts["RssAnon"] / 1024, "MiB", "lower", bw))
            for what in ("allocate", "getstats"):
                for p in ("p50", "p99"):
                    rows.append(_row("4 Scale", f"{fig}: {'Allocate+map 1 page' if what == 'allocate' else 'GetStats'} {p}",
                                     l[what][f"{p}_us"], ref[what][f"{p}_us"], "us", "lower", bw))
        if "limit" in s:
            lim = s["limit"]
            rows.append(_row("4 Scale", f"{lim['target']} pages: not reachable (fd limit {s['daemon_nofile']['hard']})",
                             lim["reached_pages"], lim["target"], "pages", "higher", "pages asked for",
                             note=lim["error"][:160]))
    if "loadgen" in sc:
        s = sc["loadgen"]
        lg = s["loadgen"]
        bw = "derived: in-process create/map (unmap/release) cost per page x pages per op, measured in this run"
        rows.append(_row("5 Ollama-shaped load (Go)", f"ops/s ({s['args']['runners']} runners x {s['args']['layers']} layers)",
                         lg["ops_per_sec"], s["baseline_ops_per_s"], "/s", "higher", bw,
                         note=f"{lg['requests']} requests, {lg['pages_mapped']} pages mapped, {lg['resource_exhausted']} exhausted, {lg['pages_bad']} bad pages"))
        for op, key in (("grow", "baseline_grow_us"), ("trim", "baseline_trim_us")):
            if op in lg["latency_us"]:
                l = lg["latency_us"][op]
                rows.append(_row("5 Ollama-shaped load (Go)", f"{op} p50 ({s['pages_per_' + op]:.1f} pages/op)", l["p50"], s[key], "us", "lower", bw))
                rows.append(_row("5 Ollama-shaped load (Go)", f"{op} p99", l["p99"], s[key], "us", "lower", bw))
    if "capacity" in sc:
        s = sc["capacity"]
        st, el = s["static"], s["elastic"]
        bw = "static worst-case reservation (Ollama/llama.cpp today)"
        rows.append(_row("6 Capacity", f"requests served (of {el['requests']})", el["served"], st["served"], "req", "higher", bw))
        for p in ("p50", "p90", "p99"):
            rows.append(_row("6 Capacity", f"queueing delay {p} (simulated s)", el["queue_delay_s"][p], st["queue_delay_s"][p], "s", "lower", bw))
        rows.append(_row("6 Capacity", "models resident (time-average)", el["resident_models"]["mean"], st["resident_models"]["mean"], "models", "higher", bw))
        rows.append(_row("6 Capacity", "model loads (incl. reloads)", el["loads"], st["loads"], "loads", "lower", bw,
                         note=f"elastic: {el['reclaim_callbacks']} reclaim callbacks, {el['reclaimed_pages']} pages reclaimed, {el['alloc_stalls']} stalls, {el.get('preemptions', 0)} preemptions, {el['failed']} failed"))
    if "relay" in sc:
        s = sc["relay"]
        bw = "the same call straight to grpcio's private socket (no relay), same daemon"
        for op, label in (("getstats", "GetStats"), ("open_close", "OpenSession+CloseSession")):
            r, d = s[f"{op}_relay"], s[f"{op}_direct"]
            for p in ("p50", "p99"):
                rows.append(_row("8 gRPC relay (control socket)", f"{label} {p}", r[f"{p}_us"], d[f"{p}_us"], "us", "lower", bw))
            rows.append(_row("8 gRPC relay (control socket)", f"{label} daemon CPU per call", r["daemon_cpu_us_per_call"],
                             d["daemon_cpu_us_per_call"], "us", "lower", bw, note=f"{r['n']} calls per path"))
    return rows


def meets(value: float, cmp: str, limit: float) -> bool:
    if isinstance(value, float) and math.isnan(value):
        return False
    return {"<=": value <= limit, "<": value < limit, ">=": value >= limit}[cmp]


def targets(res: dict) -> list[dict]:
    """Issue 18's must-hold figures, each with its limit and whether this run met it."""
    out: list[dict] = []
    sc = res.get("scenarios", {})

    def add(what, value, limit, unit, cmp):
        out.append({"target": what, "value": value, "limit": limit, "unit": unit, "cmp": cmp, "met": meets(value, cmp, limit)})

    if "roundtrip" in sc:
        s = sc["roundtrip"]
        floor_p50 = s["floor"]["rtt_1"]["p50_us"] if "floor" in s else None

        def request_path(prefix, p50, p99_16, tput_64):
            add(f"{prefix}1 client Allocate+Free p50 <= 150 us", p50, 150, "us", "<=")
            if floor_p50 is not None:
                what = "1 client Allocate+Free p50" if not prefix else "1 client p50"
                add(f"{prefix}{what} <= 5x the transport floor p50", p50 / floor_p50, 5, "x", "<=")
            add(f"{prefix}16 clients p99 <= 2 ms", p99_16, 2000, "us", "<=")
            add(f"{prefix}64 clients >= 10,000 pairs/s", tput_64, 10000, "/s", ">=")

        request_path("", s["rtt_1_daemon"]["p50_us"], s["rtt_16_daemon"]["p99_us"], s["tput_64_daemon"]["pairs_per_s"])
        if "cclient" in s:  # the same targets with the compiled client: what the daemon allows
            cc = s["cclient"]
            request_path("C client: ", cc["rtt_1"]["p50_us"], cc["rtt_16"]["p99_us"], cc["tput_64"]["pairs_per_s"])
    if "reclaim" in sc:
        ms = sc["reclaim"]["daemon_reclaim"]["p50_us"] / 1e3
        gib = sc["reclaim"]["moved_bytes"] / (1 << 30)
        add(f"reclaim of {gib:.2f} GiB idle -> new session < 50 ms", ms, 50, "ms", "<")
    if "scale" in sc:
        lv = sc["scale"]["levels"]
        ref, top = lv.get("1000"), lv.get("100000")
        at = "100k pages tracked"
        if top is None:
            lim = sc["scale"].get("limit", {})
            add("100k pages tracked", lim.get("reached_pages", 0), 100000, "pages", ">=")
            fit = sc["scale"].get("fd_fit_pages")
            top = lv.get(str(fit)) if fit else None
            at = f"{fit} pages tracked (the most the fd limit allows here; the 100k targets applied there)"
        if top is not None and ref is not None:
            rss = top["daemon_rss_kib"] / 1024
            add(f"{at}: daemon RSS <= 150 MB", rss, 150e6 / (1 << 20), "MiB", "<=")
            for what, label in (("allocate", "Allocate+map"), ("getstats", "GetStats")):
                r = top[what]["p50_us"] / ref[what]["p50_us"]
                add(f"{at}: {label} p50 within 1.2x of 1k pages", r, 1.2, "x", "<=")
    return out


# ---- repeated runs: medians, ranges, verdicts ------------------------------------------------------------
def _stats(values: list[float]) -> dict:
    v = sorted(x for x in values if not (isinstance(x, float) and math.isnan(x)))
    if not v:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    mid = len(v) // 2
    med = v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2
    return {"median": med, "min": v[0], "max": v[-1], "n": len(v)}


def aggregate(runs: list[dict]) -> tuple[list[dict], list[dict]]:
    """Figures and targets of several runs of one backend, made back to back:
    each figure's value and baseline as median/min/max over the runs (the
    ratio is that of the medians); each target judged on the median of its
    value against its limit, with how many single runs met it. A figure or
    target missing from a run (a scenario that failed there) counts the runs
    it has."""
    figs: dict[tuple, list[dict]] = {}
    for res in runs:
        for r in res.get("figures", []):
            figs.setdefault((r["scenario"], r["figure"]), []).append(r)
    out_f = []
    for rows in figs.values():
        first = rows[0]
        val, base = _stats([r["value"] for r in rows]), _stats([r["baseline"] for r in rows])
        ratio = val["median"] / base["median"] if base["median"] and not math.isnan(base["median"]) else float("nan")
        out_f.append({**first, "value": val["median"], "baseline": base["median"], "ratio": ratio,
                      "value_range": [val["min"], val["max"]], "baseline_range": [base["min"], base["max"]], "runs": len(rows)})
    tgts: dict[str, list[dict]] = {}
    for res in runs:
        for t in res.get("targets", []):
            tgts.setdefault(t["target"], []).append(t)
    out_t = []
    for rows in tgts.values():
        first = rows[0]
        st = _stats([t["value"] for t in rows])
        met = meets(st["median"], first["cmp"], first["limit"])  # the single run's comparison, on the median
        out_t.append({**first, "value": st["median"], "range": [st["min"], st["max"]], "met": met,
                      "runs_met": sum(1 for t in rows if t["met"]), "runs": len(rows)})
    return out_f, out_t


def _fmt(v, unit) -> str:
    if isinstance(v, float) and math.isnan(v):
        return "n/a"
    if unit in ("req", "pages", "loads", "fds"):
        return f"{v:.0f}"
    if unit == "models":
        return f"{v:.2f}"
    if abs(v) >= 100:
        return f"{v:,.0f} {unit}"
    if abs(v) >= 10:
        return f"{v:.1f} {unit}"
    return f"{v:.2f} {unit}"


def markdown(result: dict) -> str:
    m = result["machine"]
    out = [
        f"Run {result['date']} · `{result['command']}` · {'quick' if result['quick'] else 'full'} mode",
        f"Machine: {m['nproc']} CPUs ({m['cpu']}), {m['ram_bytes'] / (1 << 30):.1f} GiB RAM, kernel {m['kernel']}, "
        f"Python {m['python']}; load average at start {', '.join(f'{x:.2f}' for x in m['loadavg_at_start'])}",
        f"GPU: {'present' if result['gpu']['gpu'] else 'none (' + result['gpu']['reason'] + ')'}",
        "",
        "Ratio = kvcached / baseline; `better` says which direction wins for kvcached (lower ratio for times, higher for rates and counts).",
        "",
    ]
    for be, res in result["backends"].items():
        out.append(f"### {LABELS.get(be, be)}")
        out.append("")
        if res.get("skipped"):
            out.append(f"Not run: {res['skipped']}")
            out.append("")
            continue
        out.append("| scenario | figure | kvcached | baseline | ratio | better | baseline is |")
        out.append("|---|---|---:|---:|---:|---|---|")
        for r in res["figures"]:
            ratio = "n/a" if math.isnan(r["ratio"]) else f"{r['ratio']:.2f}x"
            fig = r["figure"] + (f" ({r['note']})" if r["note"] else "")
            val, base = _fmt(r["value"], r["unit"]), _fmt(r["baseline"], r["unit"])
            if r.get("runs", 1) > 1:  # median (min-max) over the repeated runs
                val += f" ({_fmt(r['value_range'][0], r['unit'])}-{_fmt(r['value_range'][1], r['unit'])})"
                base += f" ({_fmt(r['baseline_range'][0], r['unit'])}-{_fmt(r['baseline_range'][1], r['unit'])})"
            out.append(f"| {r['scenario']} | {fig} | {val} | {base} | {ratio} | {r['better']} | {r['baseline_is']} |")
        for name, err in res.get("errors", {}).items():
            out.append(f"\n**{name} failed**: `{err.strip().splitlines()[-1]}`")
        if res.get("targets"):
            out.append("")
            runs = res.get("repeat", 1)
            if runs > 1:
                out.append(f"Must hold (issue 18), judged on the median of {runs} runs made back to back:")
                out.append("")
                out.append("| target | median (min-max) | met (median) | runs that met it |")
                out.append("|---|---:|---|---:|")
            else:
                out.append("Must hold (issue 18):")
                out.append("")
                out.append("| target | this run | met |")
                out.append("|---|---:|---|")
            for t in res["targets"]:
                fmt = (lambda x: f"{x:.2f}x") if t["unit"] == "x" else (lambda x, u=t["unit"]: _fmt(x, u))
                if runs > 1:
                    rng = f" ({fmt(t['range'][0])}-{fmt(t['range'][1])})"
                    out.append(f"| {t['target']} | {fmt(t['value'])}{rng} | {'yes' if t['met'] else '**no**'} | {t['runs_met']}/{t['runs']} |")
                else:
                    out.append(f"| {t['target']} | {fmt(t['value'])} | {'yes' if t['met'] else '**no**'} |")
        out += predicted_markdown(res.get("predicted_gpu", []), result.get("cost_table") or costmodel.load())
        prof = [(k, v) for k, v in res.get("scenarios", {}).get("roundtrip", {}).items() if k.startswith("profile_")]
        for k, v in prof:
            out.append("")
            if v.get("error"):
                out.append(f"Profile {k[8:]}: not taken: {v['error']}")
                continue
            out.append(f"Profile {k[8:]} (py-spy, daemon, {v['samples']} samples, {100 * v['busy_share']:.0f}% not idle; "
                       f"flame graph `{v['flamegraph']}`): where the busy samples fell (self):")
            out.append("")
            for f, pct in v["self_top"][:10]:
                out.append(f"- {pct:.1f}% `{f}`")
        out.append("")
    return "\n".join(out)


PREDICTED = ("allocate64", "roundtrip", "reclaim")  # the scenarios with a figure predicted for a GPU


def predicted_rows(cuda_run: dict, host_run: dict | None, table: dict) -> list[dict]:
    """The GPU figures bench/costmodel.py predicts from one test-driver run
    (its counted driver calls) and the host run made beside it."""
    if not host_run:
        return []
    return costmodel.predict(cuda_run.get("scenarios", {}), host_run.get("scenarios", {}), table)


def aggregate_predicted(runs: list[list[dict]]) -> list[dict]:
    """Predictions of repeated runs: each figure's median (min-max) over the runs."""
    by: dict[tuple, list[dict]] = {}
    for rows in runs:
        for r in rows:
            by.setdefault((r["scenario"], r["figure"]), []).append(r)
    out = []
    for rows in by.values():
        st = _stats([r["predicted"] for r in rows])
        first = rows[-1]  # its inputs (the last run's) are printed; the figures are the medians
        med = {k: _stats([r[k] for r in rows])["median"] for k in ("low", "high", "testdriver", "host", "predicted_run_cost_call",
                                                                   "predicted_run_cost_page", "predicted_serial_worker",
                                                                   "predicted_serial_device") if k in first}
        row = {**first, **med, "predicted": st["median"], "predicted_range": [st["min"], st["max"]], "runs": len(rows),
               "host_range": [min(r["host"] for r in rows), max(r["host"] for r in rows)]}
        if "error_vs_reference" in first:
            row["error_vs_reference"] = [costmodel.error(st["median"], v) for v in first["reference"]]
        out.append(row)
    return out


def predicted_markdown(rows: list[dict], table: dict) -> list[str]:
    if not rows:
        return []
    other = "call" if rows[0]["run_cost"] == "page" else "page"
    serial = rows[0].get("serial", "worker")
    other_serial = "worker" if serial == "device" else "device"
    say = {"device": "clients' calls serialised on the device", "worker": "clients in parallel"}
    out = ["", f"Predicted on the {table['gpu']} (bench/costmodel.py; per-call costs bench/gpu_costs.json, from {table['source_run'].split(' ')[0]}): "
           "the host backend's figure of this run plus the driver calls counted here times their costs, the daemon's "
           f"serialised on its worker, {say[serial]} (docs/benchmarks.md, \"On a GPU\"). cuMemSetAccess/cuMemUnmap over a run of pages: "
           f"per {rows[0]['run_cost']}. Two columns give the prediction under the other choices. Predictions, not measurements.", "",
           f"| scenario | figure | test driver | host | predicted (low-high) | per {other} | {say[other_serial]} | client calls{' (x N)' if serial == 'device' else ''} | daemon calls on the path (x queue) | measured on the GPU ({table.get('reference', {}).get('tree', '-')}) | error |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        u = r["unit"]
        inp = r["inputs"]
        scale = 1e3 if u == "ms" else 1.0
        ref = ", ".join(_fmt(v, u) for v in r.get("reference", [])) or "-"
        err = ", ".join(f"{100 * e:+.0f}%" for e in r.get("error_vs_reference", [])) or "-"
        q = f" x{inp['queue']}" if inp.get("queue", 1) > 1 else ""
        if "floor_us" in inp:  # the daemon's whole work per operation, the least the latency can be
            q += f" (all its work: {_fmt(inp['floor_us'] / scale, 'us' if u != 'ms' else 'ms')})"
        out.append(f"| {r['scenario']} | {r['figure']}{' (baseline)' if r['kind'] == 'baseline' else ''} | {_fmt(r['testdriver'], u)} | "
                   f"{_fmt(r['host'], u)} | **{_fmt(r['predicted'], u)}** ({_fmt(r['low'], u)}-{_fmt(r['high'], u)}) | "
                   f"{_fmt(r['predicted_run_cost_' + other], u)} | {_fmt(r.get('predicted_serial_' + other_serial, float('nan')), u)} | "
                   f"{_fmt(inp['client_us'] / scale, 'us' if u != 'ms' else 'ms')} | "
                   f"{_fmt(inp['daemon_us'] / scale, 'us' if u != 'ms' else 'ms')}{q} | {ref} | {err} |")
    return out


def render(out_dir: pathlib.Path) -> int:
    """--render: the predictions of a finished run again, from its raw
    results and the current cost table (a newer GPU run's costs)."""
    result = json.loads((out_dir / "results.json").read_text())
    table = costmodel.load()
    result["cost_table"] = table
    hr, cr = result["backends"].get("host", {}), result["backends"].get("cuda-testdriver", {})
    if cr and not cr.get("skipped"):
        hruns, cruns = hr.get("runs") or [hr], cr.get("runs") or [cr]
        at_ref = result.get("tree", {}).get("commit", "").startswith(table.get("reference", {}).get("tree", "-"))
        for i, one in enumerate(cruns):
            one["predicted_gpu"] = predicted_rows(one, hruns[min(i, len(hruns) - 1)] if hr else None, table)
            if not at_ref:
                for r in one["predicted_gpu"]:
                    r.pop("error_vs_reference", None)
        if "runs" in cr:
            cr["predicted_gpu"] = aggregate_predicted([r["predicted_gpu"] for r in cruns])
    (out_dir / "results.json").write_text(json.dumps(result, indent=1))
    md = markdown(result)
    (out_dir / "results.md").write_text(md + "\n")
    print(md)
    return 0


def tree_of(ref: str) -> pathlib.Path:
    """The kvcached_service package of git revision `ref`, extracted once
    into build/bench/trees/<commit>/ (for --compare)."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{ref}^{{commit}}"], cwd=common.ROOT, capture_output=True, text=True)
    if sha.returncode != 0:
        raise SystemExit(f"--compare: {ref!r} is not a git revision here: {sha.stderr.strip()}")
    tree = common.ROOT / "build" / "bench" / "trees" / sha.stdout.strip()
    if not (tree / "kvcached_service").is_dir():
        tree.mkdir(parents=True, exist_ok=True)
        arch = subprocess.run(["git", "archive", sha.stdout.strip(), "kvcached_service"], cwd=common.ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=arch.stdout, check=True)
    # server/relay.c before 4b87829, server/transports/relay.c since
    relay = next(iter(sorted((tree / "kvcached_service" / "server").rglob("relay.c"))), tree / "missing")
    if relay.exists() and not list(relay.parent.glob("_relay*.so")):
        # the one compiled part (setup.py builds it in a checkout): the same flags
        subprocess.run(["cc", "-O2", "-Wall", "-shared", "-fPIC", "-o", str(relay.parent / "_relay.abi3.so"), str(relay), "-lpthread"],
                       check=True)
    return tree


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes and short runs (CI; under 2 minutes)")
    ap.add_argument("--backend", default="all", choices=["host", "cuda", "all"],
                    help="cuda = the test driver, plus the real GPU when one is present")
    ap.add_argument("--out", default="", help="directory for results.json and results.md (default: a new temp dir)")
    ap.add_argument("--only", default="", help="comma-separated scenarios: " + ",".join(
        ["allocate64", "roundtrip", "reclaim", "scale", "loadgen", "capacity", "relay"]))
    ap.add_argument("--profile", action="store_true",
                    help="py-spy the daemon during scenario 2 (1 client, 64 clients); flame graphs in DIR/profile-BACKEND/")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="run each backend's scenarios N times back to back; figures and targets as median (min-max), "
                         "targets judged on the median")
    ap.add_argument("--compare", default="", metavar="REF[,REF]",
                    help="run scenario 2 also against the daemon and client of these git revisions, in the same run")
    ap.add_argument("--render", default="", metavar="DIR",
                    help="no run: recompute the GPU predictions of DIR/results.json with the current cost table "
                         "(bench/gpu_costs.json) and write DIR/results.json and results.md again")
    ap.add_argument("--tree", default="", metavar="REF",
                    help="run every scenario with the daemon and clients of this git revision (the bench's code from this "
                         "checkout): e.g. the tree of a GPU run, to check the GPU model against it")
    a = ap.parse_args(argv)
    if a.render:
        return render(pathlib.Path(a.render))
    out_dir = pathlib.Path(a.out or tempfile.mkdtemp(prefix="kvc-bench-out-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = common.detect_gpu()
    wanted = []
    only = [x for x in a.only.split(",") if x]
    host_only = ""  # scenarios the host backend runs only for the GPU prediction (--backend cuda)
    if a.backend in ("host", "all"):
        wanted.append("host")
    if a.backend in ("cuda", "all"):
        if a.backend == "cuda":
            need = [x for x in (only or PREDICTED) if x in PREDICTED]
            if need:
                wanted.append("host")
                host_only = ",".join(need)
        wanted += ["cuda-testdriver", "cuda-gpu"]
    cmd = "scripts/bench.sh" + (" --quick" if a.quick else "") + f" --backend {a.backend}" + (f" --only {a.only}" if a.only else "")
    cmd += (" --profile" if a.profile else "") + (f" --compare {a.compare}" if a.compare else "")
    cmd += f" --repeat {a.repeat}" if a.repeat > 1 else ""
    cmd += f" --tree {a.tree}" if a.tree else ""
    if a.repeat < 1:
        raise SystemExit("--repeat: at least 1")
    trees = [f"{ref}={tree_of(ref)}" for ref in a.compare.split(",") if ref]
    tree = tree_of(a.tree) if a.tree else None
    table = costmodel.load()
    result = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "command": cmd,
              "quick": a.quick, "machine": machine(), "gpu": gpu, "backends": {}, "cost_table": table}
    if tree is not None:
        result["tree"] = {"ref": a.tree, "commit": tree.name, "note": "daemon and clients of this revision; the bench's code from the checkout"}
    if host_only:
        result["host_for_prediction"] = f"the host backend ran {host_only} only: the GPU prediction's host figures"
    rc = 0
    t_all = time.monotonic()
    for be in wanted:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(common.ROOT)
        env.pop("KVCACHED_BENCH_TREE", None)
        if tree is not None:
            env["KVCACHED_BENCH_TREE"] = str(tree)
        state = None
        if be == "cuda-gpu":
            if not gpu["gpu"]:
                result["backends"][be] = {"skipped": f"no GPU on this machine: {gpu['reason']}"}
                continue
            env.pop("KVCACHED_LIBCUDA", None)
            env = {k: v for k, v in env.items() if not k.startswith("KVCACHED_TESTDRV_")}
        elif be == "cuda-testdriver":
            if not common.TESTDRIVER.exists():
                result["backends"][be] = {"errors": {"setup": f"CUDA test driver not built: {common.TESTDRIVER} (run scripts/build-testdriver.sh)"},
                                          "figures": []}
                rc = 1
                continue
            base = "/dev/shm" if os.path.isdir("/dev/shm") else None
            state = tempfile.mkdtemp(prefix="kvc-bench-gpu-", dir=base)
            env["KVCACHED_LIBCUDA"] = str(common.TESTDRIVER)
            env["KVCACHED_TESTDRV_STATE"] = state
            env["KVCACHED_TESTDRV_MEMORY"] = str(8 << 30)
            # 64 KiB granularity so the scale scenario can use 64 KiB pages (the
            # others use 2 MiB pages, a multiple of it, as on a GPU)
            env["KVCACHED_TESTDRV_GRANULARITY"] = str(64 << 10)
            # live call counters per process (tests/cudadriver/README.md): the GPU prediction's inputs
            env["KVCACHED_TESTDRV_CALLS"] = os.path.join(state, "calls")
        runs = []
        for i in range(a.repeat):
            raw = out_dir / (f"raw-{be}.json" if a.repeat == 1 else f"raw-{be}-{i + 1}.json")
            cmdline = [common.PY, "-m", "bench.suite", "--backend", be, "--out", str(raw)] + (["--quick"] if a.quick else [])
            if be == "host" and host_only:
                cmdline += ["--only", host_only]
            elif a.only:
                cmdline += ["--only", a.only]
            if a.profile:
                cmdline += ["--profile-dir", str(out_dir / f"profile-{be}")]
            if trees:
                cmdline += ["--compare", ",".join(trees)]
            if a.repeat > 1:
                print(f"bench: {be} run {i + 1} of {a.repeat} (load average {os.getloadavg()[0]:.2f})", flush=True)
            load = os.getloadavg()
            t0 = time.monotonic()
            p = subprocess.run(cmdline, env=env, cwd=tree or common.ROOT)
            one = json.loads(raw.read_text()) if raw.exists() else {"errors": {"suite": f"suite exited {p.returncode} without results"}, "scenarios": {}}
            one["seconds"] = time.monotonic() - t0
            one["loadavg_at_start"] = load
            try:
                one["figures"] = figures(one)
                one["targets"] = targets(one)
            except Exception as exc:  # noqa: BLE001
                one.setdefault("errors", {})["figures"] = f"cannot compute figures: {exc!r}"
                one["figures"] = []
            if be == "cuda-testdriver":
                hr = result["backends"].get("host", {})
                host_run = (hr.get("runs") or [hr])[min(i, len(hr.get("runs") or [hr]) - 1)] if hr else None
                try:
                    one["predicted_gpu"] = predicted_rows(one, host_run, table)
                    if not (tree is not None and tree.name.startswith(table.get("reference", {}).get("tree", "-"))):
                        for r in one["predicted_gpu"]:  # errors against the GPU run only at that run's tree
                            r.pop("error_vs_reference", None)
                except Exception as exc:  # noqa: BLE001
                    one.setdefault("errors", {})["predicted_gpu"] = f"cannot predict GPU figures: {exc!r}"
            if p.returncode != 0:
                one.setdefault("errors", {}).setdefault("suite", f"exited {p.returncode}")
            runs.append(one)
        if state:
            import shutil

            shutil.rmtree(state, ignore_errors=True)
        if a.repeat == 1:
            res = runs[0]
        else:
            figs, tgts = aggregate(runs)
            res = {"repeat": a.repeat, "runs": runs, "figures": figs, "targets": tgts,
                   **({"predicted_gpu": aggregate_predicted([r.get("predicted_gpu", []) for r in runs])} if be == "cuda-testdriver" else {}),
                   "seconds": sum(r["seconds"] for r in runs), "scenarios": runs[-1].get("scenarios", {}),
                   "errors": {f"run {i + 1}: {k}": v for i, r in enumerate(runs) for k, v in r.get("errors", {}).items()}}
        result["backends"][be] = res
        if res.get("errors"):
            rc = 1
    result["seconds"] = time.monotonic() - t_all
    (out_dir / "results.json").write_text(json.dumps(result, indent=1))
    md = markdown(result)
    (out_dir / "results.md").write_text(md + "\n")
    print(md)
    print(f"\nresults: {out_dir}/results.json, {out_dir}/results.md ({result['seconds']:.0f} s)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
