"""Stage 4 of the offline GPU bundle (issue 24): the figures for the docs, as
rows of kind "figures" (verdict info, or skip with the reason) and one
figures.json ({name: {"value", "unit", "driver", ...}}).

    python tests/helpers/gpu_figures.py --out DIR --driver real|testdriver
        [--deadline EPOCH] [--servers FILE] [--full]

1. cuMemCreate / cuMemMap / cuMemSetAccess / cuMemUnmap per 2 MiB page,
   p50 and p99, in this process (tests/helpers/gpu_check_probe.py's Probe);
2. warm Allocate(64 pages) through the daemon against in-process
   create+map (bench.suite allocate64);
3. one-page Allocate+Free round trip with 1 and 16 clients (bench.suite
   roundtrip);
4. reclaim of most of a 4 GiB budget from an idle session to a new one
   (bench.suite reclaim, full size; on the test driver its quick size,
   256 MiB, as /dev/shm backs its "device");
5. decode tokens/s of the patched llama-server against the unpatched one on
   one model (tests/helpers/gpu_llama.py decode), with the builds stage 3
   recorded in --servers (default $BUNDLE/work/llama/servers.json); also
   the patched build without the daemon and both with CUDA graphs off, and
   each one's time split into per-token and per-request parts (128 and
   1024 tokens, 5 rounds);
6-12. what decides issue 42's design (item 7), each group of driver calls
   in a process of its own (tests/helpers/gpu_design_probe.py): release of
   an imported handle, import from a dup'ed fd, close of the last fd;
   cuMemSetAccess / cuMemUnmap over runs of 1-64 adjacent pages; per-call
   costs at 2, 8, 32 and 128 MiB pages; the calls from 1-8 threads and 2-4
   processes at once; an asynchronous memset with an event against memset +
   cuCtxSynchronize; kernel memory per held exported fd; decode tokens/s of
   the unpatched llama-server while another process zeroes 256 pages (CUDA
   builds only). On the test driver the same code runs with small counts.
On the test driver every figure is the test driver's (marked "driver":
"testdriver": they say nothing about a GPU); the decode figure needs
llama-server with ggml-cuda and is a skip row there, unless stage 3 ran
its CPU mode (then it is a CPU figure, marked as such).
--full: bench.suite's full sizes for 2 and 3 (longer); default quick.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
KIND = "figures"  # the stage's name (scripts/gpu-bundle/report.py STAGE_NAMES)
MiB = 1 << 20
CALLS = ("cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap")
IMPORT_CALLS = ("cuMemExportToShareableHandle", "cuMemImportFromShareableHandle")
RUN_CALLS = ("cuMemSetAccess_run", "cuMemUnmap_run")  # one call over BATCH mapped pages
BATCH = 32

SECTIONS = [
    "driver calls per 2 MiB page (p50/p99)",
    "warm Allocate(64) through the daemon vs in-process create+map",
    "one-page round trip, 1 and 16 clients",
    "reclaim from an idle session to a new one",
    "decode tokens/s, patched vs unpatched llama-server",
]
# issue 42 item 7: what decides the design (tests/helpers/gpu_design_probe.py measures, one process per group)
DESIGN = {
    "handles": ("imported handles: import from a dup'ed fd, release, close of the last fd",
                "recorded (import and release costs decide the client handle cache; close of the last fd, "
                "whether a kept export costs and frees)"),
    "runs": ("cuMemSetAccess and cuMemUnmap over runs of 1-64 adjacent pages",
             "recorded (per call or per page decides whether clients gain from runs)"),
    "sizes": ("per-call costs at page sizes 2, 8, 32, 128 MiB",
              "recorded (per call or per byte decides the large page class)"),
    "memset": ("asynchronous memset + blocking-sync event vs memset + cuCtxSynchronize",
               "recorded (decides background zeroing: issue cost and issue-to-complete)"),
    "concurrency": ("driver calls from 1-8 threads and 2-4 processes at once",
                    "recorded (aggregate calls/s against 1 thread: does the driver serialise them? decides "
                    "one worker thread or several, and whether clients contend)"),
    "fdmem": ("kernel memory per held exported fd",
              "recorded (decides whether the daemon keeps one export per page for its life)"),
    "decode_zeroing": ("decode tokens/s of the unpatched llama-server while another process zeroes pages",
                       "recorded (decides whether background zeroing may run during decode)"),
}


def row(check: str, expected: str, seen: str, verdict: str = "info") -> dict:
    assert verdict in ("pass", "FAIL", "DIFF", "info", "skip"), verdict
    return {"check": check, "expected": expected, "seen": seen, "verdict": verdict, "kind": KIND}


def pct(v: list[float], p: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(len(s) * p / 100))] if s else float("nan")


def fig(value: float, unit: str, driver: str, **extra) -> dict:
    f = {"value": round(float(value), 3), "unit": unit, "driver": driver}
    if driver == "testdriver":
        f["note"] = "the CUDA test driver's figure: says nothing about a GPU"
    f.update(extra)
    return f


def driver_call_figures(times: dict[str, list[float]], page: int, driver: str, batch: int = BATCH,
                        run_error: str | None = None) -> tuple[dict, dict]:
    """Per-call latencies (seconds) -> (figures, row): p50/p99 in us per 2 MiB
    page; export/import per page; one SetAccess/Unmap over `batch` pages."""
    scale = 1e6 / (page / (2 * MiB))
    figs, parts = {}, []
    for k in CALLS:
        v = times.get(k) or []
        if not v:
            continue
        p50, p99 = pct(v, 50) * scale, pct(v, 99) * scale
        figs[f"stage4.{k}_p50_us"] = fig(p50, "us per 2 MiB page", driver, n=len(v))
        figs[f"stage4.{k}_p99_us"] = fig(p99, "us per 2 MiB page", driver, n=len(v))
        parts.append(f"{k.replace('cuMem', '')} {p50:.1f}/{p99:.1f}")
    for k in IMPORT_CALLS:
        v = times.get(k) or []
        if v:
            short = k.replace("cuMem", "").replace("ToShareableHandle", "").replace("FromShareableHandle", "")
            figs[f"stage4.{k}_p50_us"] = fig(pct(v, 50) * 1e6, "us per page", driver, n=len(v))
            figs[f"stage4.{k}_p99_us"] = fig(pct(v, 99) * 1e6, "us per page", driver, n=len(v))
            parts.append(f"{short} {pct(v, 50) * 1e6:.1f}/{pct(v, 99) * 1e6:.1f}")
    runs = []
    for k in RUN_CALLS:
        v = times.get(k) or []
        one = times.get(k.removesuffix("_run")) or []
        if v:
            per_page = pct(v, 50) * 1e6 / batch
            figs[f"stage4.{k}_{batch}_pages_p50_us"] = fig(pct(v, 50) * 1e6, f"us per call over {batch} pages", driver,
                                                           n=len(v), per_page_us=round(per_page, 3))
            against = f" against {pct(one, 50) * scale:.1f} one by one" if one else ""
            runs.append(f"{k.removesuffix('_run').replace('cuMem', '')} over {batch} pages in one call "
                        f"{pct(v, 50) * 1e6:.0f} us p50 ({per_page:.2f} per page{against})")
    if run_error:
        runs.append(f"one call over {batch} mapped pages refused: {run_error[:200]}")
    n = len(times.get("cuMemCreate") or [])
    return figs, row(SECTIONS[0], "recorded (A100 p50: create 193, map 1.5, set-access 36, unmap 26 us)",
                     f"p50/p99 us over {n} pages: " + ", ".join(parts) + ("; " + "; ".join(runs) if runs else "") + tag(driver))


def tag(driver: str) -> str:
    return " [CUDA test driver]" if driver == "testdriver" else ""


def bench_figures(res: dict, driver: str) -> tuple[dict, list[dict]]:
    """bench.suite's JSON -> (figures, rows) for allocate64, roundtrip and reclaim."""
    sc = res.get("scenarios", {})
    figs, rows = {}, []
    for name, err in res.get("errors", {}).items():
        rows.append(row(f"bench.suite {name}", "runs", err.strip().splitlines()[-1][:300] if err.strip() else "error", "FAIL"))
    a = sc.get("allocate64")
    if a:
        w, b, c = a["daemon_warm"], a["baseline_inproc_create_map"], a["daemon_cold"]
        for key, s in (("warm", w), ("inproc", b), ("cold", c)):
            figs[f"stage4.allocate64_{key}_p50_us"] = fig(s["p50_us"], "us", driver, n=s["n"])
            figs[f"stage4.allocate64_{key}_p99_us"] = fig(s["p99_us"], "us", driver, n=s["n"])
        rows.append(row(SECTIONS[1], "recorded (the daemon's warm path below in-process create+map)",
                        f"p50/p99 us: daemon warm {w['p50_us']:.0f}/{w['p99_us']:.0f}, in-process "
                        f"{b['p50_us']:.0f}/{b['p99_us']:.0f}, daemon cold {c['p50_us']:.0f}/{c['p99_us']:.0f}" + tag(driver)))
    r = sc.get("roundtrip")
    if r:
        parts = []
        for n in (1, 16):
            s = r[f"rtt_{n}_daemon"]
            figs[f"stage4.roundtrip_{n}_clients_p50_us"] = fig(s["p50_us"], "us", driver, n=s["n"])
            figs[f"stage4.roundtrip_{n}_clients_p99_us"] = fig(s["p99_us"], "us", driver, n=s["n"])
            parts.append(f"{n} client{'s' if n > 1 else ''} {s['p50_us']:.0f}/{s['p99_us']:.0f}")
        cc = r.get("cclient", {})
        for n in (1, 16):
            if f"rtt_{n}" in cc:
                figs[f"stage4.roundtrip_{n}_clients_c_client_p50_us"] = fig(cc[f"rtt_{n}"]["p50_us"], "us", driver)
                parts.append(f"C client {n}: {cc[f'rtt_{n}']['p50_us']:.0f} p50")
        rows.append(row(SECTIONS[2], "recorded", "p50/p99 us (Python client): " + ", ".join(parts) + tag(driver)))
    c = sc.get("reclaim")
    if c:
        s = c["daemon_reclaim"]
        gib = c["moved_bytes"] / (1 << 30)
        figs["stage4.reclaim_p50_ms"] = fig(s["p50_us"] / 1e3, "ms", driver, moved_bytes=c["moved_bytes"],
                                            budget_bytes=c["budget_bytes"], reps=c["reps"])
        figs["stage4.reclaim_unload_reload_p50_ms"] = fig(c["baseline_unload_reload"]["p50_us"] / 1e3, "ms", driver,
                                                          moved_bytes=c["moved_bytes"])
        rows.append(row(f"{SECTIONS[3]} ({gib:.2f} GiB of a {c['budget_bytes'] / (1 << 30):.2f} GiB budget)",
                        "recorded (issue 18's target: < 50 ms)",
                        f"p50 {s['p50_us'] / 1e3:.1f} ms over {c['reps']} runs; unload+reload in-process "
                        f"{c['baseline_unload_reload']['p50_us'] / 1e3:.1f} ms" + tag(driver)))
        large = c.get("large")
        if large:  # the same move on a daemon with 32 MiB pages (issue 42 item 5)
            mib = large["page_size"] >> 20
            figs[f"stage4.reclaim_{mib}mib_pages_p50_ms"] = fig(large["daemon_reclaim"]["p50_us"] / 1e3, "ms", driver,
                                                                moved_bytes=large["moved_bytes"], page_size=large["page_size"],
                                                                reps=large["reps"])
            figs[f"stage4.reclaim_{mib}mib_pages_unload_reload_p50_ms"] = fig(
                large["baseline_unload_reload"]["p50_us"] / 1e3, "ms", driver, moved_bytes=large["moved_bytes"])
            rows.append(row(f"{SECTIONS[3]}, {mib} MiB pages ({large['moved_bytes'] / (1 << 30):.2f} GiB)",
                            "recorded (issue 42's goal with large pages: at most 50 ms)",
                            f"p50 {large['daemon_reclaim']['p50_us'] / 1e3:.1f} ms over {large['reps']} runs; unload+reload "
                            f"in-process at the same page size {large['baseline_unload_reload']['p50_us'] / 1e3:.1f} ms" + tag(driver)))
    return figs, rows


# ---- issue 42 item 7: the design figures (gpu_design_probe.py's groups -> figures, one row each)


def _stat_figs(figs: dict, prefix: str, st: dict, unit: str, driver: str, **extra) -> None:
    """{"p50_us", "p99_us", "n"} -> prefix_p50_us and prefix_p99_us."""
    if not st or st.get("n", 0) == 0:
        return
    for q in ("p50", "p99"):
        figs[f"{prefix}_{q}_us"] = fig(st[f"{q}_us"], unit, driver, n=st["n"], **extra)


def _pp(st: dict | None) -> str:
    """'p50/p99' of a stat, in us."""
    if not st or not st.get("n"):
        return "-"
    return f"{st['p50_us']:.1f}/{st['p99_us']:.1f}"


def handles_figures(res: dict, driver: str) -> tuple[dict, dict]:
    c, f = res.get("calls", {}), res.get("facts", {})
    n = f.get("pages", 0)
    figs: dict = {}
    for k, st in c.items():
        _stat_figs(figs, f"stage4.handle.{k}", st, "us per call (2 MiB page)", driver)
    freed = []
    for k, what in (("close_last_fd_freed_at_once_pages", "at once"), ("close_last_fd_freed_after_100ms_pages", "after 100 ms"),
                    ("release_last_freed_at_once_pages", "release at once")):
        if k in f:
            figs[f"stage4.handle.{k}"] = fig(f[k], f"pages of {n} (device free memory, cuMemGetInfo)", driver, n=n)
            freed.append(f"{what} {f[k]:g}")
    seen = (f"p50/p99 us over {n} pages: import original fd {_pp(c.get('import_original_fd'))}, dup'ed fd "
            f"{_pp(c.get('import_dup_fd'))}; release of an imported handle while mapped "
            f"{_pp(c.get('release_imported_while_mapped'))} (then unmap {_pp(c.get('unmap_after_release'))}), "
            f"not mapped {_pp(c.get('release_imported_unmapped'))}, the last reference "
            f"{_pp(c.get('release_imported_last_reference'))}; release of the created handle, last reference "
            f"{_pp(c.get('release_created_last_reference'))}; close of an exported fd while handles remain "
            f"{_pp(c.get('close_fd_handles_held'))}, of the last fd {_pp(c.get('close_last_fd'))}"
            + (f"; pages freed of {n} (close of the last fd {', '.join(freed)})" if freed else ""))
    return figs, row(DESIGN["handles"][0], DESIGN["handles"][1], seen + tag(driver))


def runs_figures(res: dict, driver: str) -> tuple[dict, dict]:
    c = res.get("calls", {})
    figs: dict = {}
    parts = []
    for call, key in (("cuMemSetAccess", "set_access"), ("cuMemUnmap", "unmap")):
        one = []
        for L in res.get("lengths", []):
            st = c.get(f"{key}_{L}")
            if not st or not st.get("n"):
                continue
            _stat_figs(figs, f"stage4.run.{call}_{L}_pages", st, f"us per call over {L} pages", driver,
                       per_page_p50_us=round(st["p50_us"] / L, 3))
            one.append(f"{L}: {st['p50_us']:.1f} ({st['p50_us'] / L:.2f}/page, n {st['n']})")
        if one:
            parts.append(f"{call.replace('cuMem', '')} p50 us per call {', '.join(one)}")
    for L, e in (res.get("errors") or {}).items():
        parts.append(f"one call over {L} pages refused: {e}")
        figs[f"stage4.run.refused_{L}_pages"] = fig(1, "refused (1)", driver, error=e)
    return figs, row(DESIGN["runs"][0], DESIGN["runs"][1],
                     f"over a {max(res.get('lengths') or [0])}-page reservation, {res.get('reps')} repetitions: "
                     + "; ".join(parts) + tag(driver))


SIZE_CALLS = ("create", "export", "import", "map", "set_access", "unmap", "release_imported", "release")


def sizes_figures(res: dict, driver: str) -> tuple[dict, dict]:
    figs: dict = {}
    parts = []
    for mib, calls in (res.get("sizes") or {}).items():
        one = []
        for k in SIZE_CALLS:
            st = calls.get(k)
            if st and st.get("n"):
                _stat_figs(figs, f"stage4.size_{mib}mib.{k}", st, f"us per call ({mib} MiB page)", driver,
                           per_mib_p50_us=round(st["p50_us"] / float(mib), 3))
                one.append(f"{k.replace('_', '-')} {st['p50_us']:.1f}")
        if one:
            parts.append(f"{mib} MiB: " + ", ".join(one))
    for mib, e in (res.get("errors") or {}).items():
        parts.append(f"{mib} MiB stopped: {e}")
    return figs, row(DESIGN["sizes"][0], DESIGN["sizes"][1],
                     f"p50 us per call, {res.get('pages')} pages a size: " + "; ".join(parts) + tag(driver))


def memset_figures(res: dict, driver: str) -> tuple[dict, dict]:
    c = res.get("calls", {})
    figs: dict = {}
    parts = []
    for n in res.get("pages", []):
        for kind in ("async", "sync"):
            for what in ("issue", "complete"):
                _stat_figs(figs, f"stage4.memset.{kind}_{n}_pages_{what}", c.get(f"{kind}_{n}_{what}"),
                           f"us ({n} x 2 MiB in one reservation)", driver)
        parts.append(f"{n} page{'s' if n > 1 else ''}: async {_pp(c.get(f'async_{n}_complete'))} (issue "
                     f"{_pp(c.get(f'async_{n}_issue'))}), sync {_pp(c.get(f'sync_{n}_complete'))} (issue "
                     f"{_pp(c.get(f'sync_{n}_issue'))})")
    return figs, row(DESIGN["memset"][0], DESIGN["memset"][1],
                     f"issue-to-complete p50/p99 us, {res.get('reps')} repetitions each: " + "; ".join(parts) + tag(driver))


def concurrency_figures(res: dict, driver: str) -> tuple[dict, dict]:
    levels = res.get("levels", {})
    figs: dict = {}
    base = (levels.get("threads_1") or {}).get("calls_per_s")
    parts, lat = [], []
    for name, lv in levels.items():
        k, kind = lv.get("workers"), name.split("_")[0]
        label = f"{k} {kind[:-1] if k == 1 else kind}"
        if lv.get("errors"):
            parts.append(f"{label}: {'; '.join(lv['errors'])[:200]}")
        cps = lv.get("calls_per_s")
        if not cps:
            continue
        figs[f"stage4.concurrency.{name}_calls_per_s"] = fig(cps, "driver calls/s, all workers together", driver,
                                                              calls=lv["calls"], wall_s=lv["wall_s"])
        x = ""
        if base:
            figs[f"stage4.concurrency.{name}_over_1_thread"] = fig(cps / base, "x (calls/s against 1 thread)", driver)
            x = f" ({cps / base:.2f}x)"
        parts.append(f"{label} {cps:,.0f}{x}")
        for call, st in (lv.get("latency") or {}).items():
            _stat_figs(figs, f"stage4.concurrency.{name}.{call}", st, "us per call", driver)
        L = lv.get("latency") or {}
        lat.append(f"{label}: create {_pp(L.get('create'))}, set-access {_pp(L.get('set_access'))}, "
                   f"import {_pp(L.get('import'))}")
    return figs, row(DESIGN["concurrency"][0], DESIGN["concurrency"][1],
                     f"calls/s over {res.get('seconds_per_level')} s a level (create, export, import, map, set-access, "
                     f"unmap, 2 releases a cycle): " + ", ".join(parts) + "; p50/p99 us " + "; ".join(lat) + tag(driver))


def fdmem_figures(res: dict, driver: str) -> tuple[dict, dict]:
    st, f = res.get("steps", {}), res.get("facts", {})
    n = f.get("n") or 0
    nf = f.get("fds", n) or 0  # fds exported (fewer than n when exporting ran out of time)
    figs: dict = {}
    parts = []
    need = ("start", "pages_created", "pages_exported", "fds_closed")
    if n and nf and all(k in st for k in need):
        s0, s1, s2, s3 = (st[k] for k in need)
        for key in ("Slab", "SUnreclaim", "VmallocUsed"):
            if not all(key in x for x in (s0, s1, s2, s3)):
                continue
            per_fd = (s2[key] - s1[key]) / nf
            per_page = (s1[key] - s0[key]) / n
            figs[f"stage4.fdmem.{key.lower()}_per_fd_bytes"] = fig(per_fd, "bytes per held exported fd", driver, n=nf,
                                                                   fold=f.get("fold"))
            figs[f"stage4.fdmem.{key.lower()}_per_created_page_bytes"] = fig(per_page, "bytes per created page", driver,
                                                                             n=n)
            figs[f"stage4.fdmem.{key.lower()}_back_after_close_bytes"] = fig(s2[key] - s3[key],
                                                                             f"bytes back after closing {nf} fds",
                                                                             driver, n=nf)
            parts.append(f"{key} {per_fd:,.0f} B per fd ({(s2[key] - s3[key]) / 1024:,.0f} KiB back after the closes), "
                         f"{per_page:,.0f} B per created page")
        figs["stage4.fdmem.fds_held"] = fig(s2["fds"] - s1["fds"], "fds (this process, /proc/self/fd)", driver, n=nf,
                                            rlimit_nofile=f.get("rlimit_nofile"))
        parts.append(f"fds {s1['fds']} -> {s2['fds']} -> {s3['fds']}")
    else:
        parts.append(f"incomplete: steps {sorted(st)}")
    lim = f" (limited by {f['limited_by']})" if f.get("limited_by") else ""
    if f.get("export_stopped_after_s"):
        lim += f" (exporting stopped after {f['export_stopped_after_s']:g} s)"
    return figs, row(DESIGN["fdmem"][0], DESIGN["fdmem"][1],
                     f"{nf} exported fds of {n} pages held{lim}, /proc/meminfo ({f.get('fold', '?')}, machine-wide): "
                     + "; ".join(parts) + tag(driver))


def median(v: list[float]) -> float:
    s = sorted(v)
    if not s:
        return float("nan")
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2


def decode_zeroing_figures(res: dict, driver: str) -> tuple[dict, dict]:
    sm, z = res.get("samples", {}), res.get("zeroer", {})
    q, w = sm.get("quiet") or [], sm.get("zeroing") or []
    figs: dict = {}
    seen = f"{res.get('tokens')} tokens, {res.get('rounds')} rounds: "
    if q and w:
        mq, mw = median(q), median(w)
        figs["stage4.decode_zeroing.tokens_per_s_quiet"] = fig(mq, "tokens/s (median)", driver, samples=q)
        figs["stage4.decode_zeroing.tokens_per_s_zeroing"] = fig(mw, "tokens/s (median)", driver, samples=w)
        figs["stage4.decode_zeroing.zeroing_over_quiet"] = fig(mw / mq if mq else float("nan"), "x", driver)
        seen += f"unpatched {mq:,.0f} tokens/s quiet, {mw:,.0f} while zeroing ({mw / mq:.3f}x)" if mq else "no tokens/s"
    if z.get("running_s"):
        gbs = z["bytes"] / z["running_s"] / 1e9
        figs["stage4.decode_zeroing.zeroer_gb_per_s"] = fig(gbs, "GB/s zeroed (async memset + event)", driver,
                                                            loops=z["loops"], pages=z.get("pages"))
        seen += f"; the zeroer: {z['loops']} loops over {z.get('pages')} pages, {gbs:.1f} GB/s"
    return figs, row(DESIGN["decode_zeroing"][0], DESIGN["decode_zeroing"][1], seen + tag(driver))


DESIGN_FIGURES = {"handles": handles_figures, "runs": runs_figures, "sizes": sizes_figures, "memset": memset_figures,
                  "concurrency": concurrency_figures, "fdmem": fdmem_figures}


class Stage:
    def __init__(self, a):
        self.a = a
        self.out = pathlib.Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.rows = self.out / "rows.jsonl"
        self.figs: dict = {}
        self.deadline = a.deadline or time.time() + 3600
        self.driver = a.driver

    def emit(self, r: dict) -> None:
        with open(self.rows, "a") as f:
            f.write(json.dumps(r) + "\n")
        print(f"{r['verdict']:5} {r['check']}: {r['seen']}", flush=True)

    def save(self) -> None:
        (self.out / "figures.json").write_text(json.dumps(self.figs, indent=1, sort_keys=True))

    def left(self) -> float:
        return self.deadline - time.time()

    def env(self) -> dict:
        e = dict(os.environ)
        e["PYTHONPATH"] = str(ROOT) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
        return e

    # 1
    def driver_calls(self) -> None:
        n = 256 if self.driver == "real" else 32
        code = f"""
import json, os, sys, time
sys.path.insert(0, {str(HERE)!r})
from gpu_check_probe import Probe
p = Probe({n})
t = {{k: [] for k in {CALLS + IMPORT_CALLS + RUN_CALLS!r}}}
base = p.reserve({n} * p.page)
hs = []
try:
    for i in range({n}):
        t0 = time.perf_counter(); h = p.create(); t["cuMemCreate"].append(time.perf_counter() - t0); hs.append(h)
        a = base + i * p.page
        t0 = time.perf_counter(); p.d.cuMemMap(a, p.page, 0, h, 0); t["cuMemMap"].append(time.perf_counter() - t0)
        t0 = time.perf_counter(); p.access(a, p.page); t["cuMemSetAccess"].append(time.perf_counter() - t0)
    for i in range({n}):
        t0 = time.perf_counter(); p.d.cuMemUnmap(base + i * p.page, p.page); t["cuMemUnmap"].append(time.perf_counter() - t0)
    # what a client pays besides: the daemon's export and the client's import of each page
    for h in hs:
        t0 = time.perf_counter(); fd = p.export(h); t["cuMemExportToShareableHandle"].append(time.perf_counter() - t0)
        try:
            t0 = time.perf_counter(); h2 = p.import_fd(fd); t["cuMemImportFromShareableHandle"].append(time.perf_counter() - t0)
            p.d.cuMemRelease(h2)
        finally:
            os.close(fd)
    # one cuMemSetAccess (and one cuMemUnmap) over a run of {BATCH} mapped pages, against one per page above
    run_error = None
    try:
        for b0 in range(0, {n} - {BATCH} + 1, {BATCH}):
            a = base + b0 * p.page
            for i in range({BATCH}):
                p.d.cuMemMap(a + i * p.page, p.page, 0, hs[b0 + i], 0)
            t0 = time.perf_counter(); p.access(a, {BATCH} * p.page); t["cuMemSetAccess_run"].append(time.perf_counter() - t0)
            t0 = time.perf_counter(); p.d.cuMemUnmap(a, {BATCH} * p.page); t["cuMemUnmap_run"].append(time.perf_counter() - t0)
    except Exception as e:  # this driver refuses a call over several mappings: say which, keep the rest
        run_error = f"{{type(e).__name__}}: {{e}}"
        for i in range({n}):
            try:
                p.d.cuMemUnmap(base + i * p.page, p.page)
            except Exception:
                pass
finally:
    for h in hs:
        p.d.cuMemRelease(h)
    p.d.cuMemAddressFree(base, {n} * p.page)
    p.close()
print(json.dumps({{"page": p.page, "times": t, "run_error": run_error}}))
"""
        r = subprocess.run([sys.executable, "-c", code], env=self.env(), capture_output=True, text=True,
                           timeout=max(30, self.left()))
        if r.returncode != 0:
            self.emit(row(SECTIONS[0], "runs", f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}", "FAIL"))
            return
        res = json.loads(r.stdout.strip().splitlines()[-1])
        figs, rw = driver_call_figures(res["times"], res["page"], self.driver, run_error=res.get("run_error"))
        self.figs.update(figs)
        self.emit(rw)

    # 2-4
    def bench(self, only: str, full: bool) -> None:
        backend = "cuda-gpu" if self.driver == "real" else "cuda-testdriver"
        out = self.out / f"bench-{only.replace(',', '-')}.json"
        cmd = [sys.executable, "-m", "bench.suite", "--backend", backend, "--only", only, "--out", str(out)]
        if not full:
            cmd.append("--quick")
        # the bench's sockets live in its temp dir: keep the path short
        with open(self.out / f"bench-{only.replace(',', '-')}.log", "w") as log:
            tmp = pathlib.Path(subprocess.check_output(["mktemp", "-d", "/tmp/kvcb4.XXXXXX"], text=True).strip())
            env = dict(self.env(), TMPDIR=str(tmp))
            try:
                r = subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   timeout=max(30, self.left() + 30))
            finally:
                subprocess.run(["rm", "-rf", str(tmp)])
        if not out.exists():
            self.emit(row(f"bench.suite {only}", "runs", f"no results (exit {r.returncode}; log {out.with_suffix('.log').name})",
                          "FAIL"))
            return
        figs, rows = bench_figures(json.loads(out.read_text()), self.driver)
        self.figs.update(figs)
        for rw in rows:
            self.emit(rw)

    # 5
    def decode(self) -> None:
        path = pathlib.Path(self.a.servers) if self.a.servers else None
        if not path or not path.exists():
            reason = "no CUDA runtime" if self.driver != "real" else f"stage 3 recorded no llama-server builds ({path})"
            self.emit(row(SECTIONS[4], "recorded", f"skip: {reason}", "skip"))
            return
        rec = json.loads(path.read_text())
        env = self.llama_env(rec)
        r = subprocess.run([sys.executable, str(HERE / "gpu_llama.py"), "decode", "--device", rec["device"],
                            "--orig", rec["orig"], "--kvc", rec["kvc"], "--out", str(self.out / "decode")],
                           env=env, capture_output=True, text=True, timeout=max(60, self.left() + 30))
        (self.out / "decode.log").write_text(r.stdout + r.stderr)
        if r.returncode != 0:
            self.emit(row(SECTIONS[4], "runs", f"exit {r.returncode}: {(r.stderr.strip().splitlines() or [''])[-1][:300]}",
                          "FAIL"))
            return
        res = json.loads(r.stdout.strip().splitlines()[-1])
        dev = rec["device"]
        figs = {f"stage4.{k}": dict(v, driver=self.driver if dev == "cuda" else "cpu build (no GPU)")
                for k, v in res["figures"].items()}
        self.figs.update(figs)
        self.emit(row(SECTIONS[4] + f" ({'CUDA' if dev == 'cuda' else 'CPU builds'})",
                      "recorded (patched close to unpatched)",
                      res["summary"] + (" [CPU builds, not a GPU]" if dev != "cuda" else "")))

    def llama_env(self, rec: dict) -> dict:
        env = self.env()
        if rec.get("libdir"):
            env["LD_LIBRARY_PATH"] = rec["libdir"] + (os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        if rec.get("pylib"):  # stage 3's unpacked gguf wheel (the decode run writes its test model)
            env["PYTHONPATH"] += os.pathsep + rec["pylib"]
        return env

    # 6-11 (issue 42 item 7)
    def design(self, group: str) -> None:
        """One group of gpu_design_probe.py in a process of its own (its raw
        result kept as design-GROUP.json, its stderr as design-GROUP.log)."""
        scale = "real" if self.driver == "real" else "small"
        r = subprocess.run([sys.executable, str(HERE / "gpu_design_probe.py"), group, "--scale", scale], env=self.env(),
                           capture_output=True, text=True, timeout=min(180, max(20, self.left() + 30)))
        (self.out / f"design-{group}.log").write_text(r.stderr)
        lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
        if r.returncode != 0 or not lines:
            self.emit(row(DESIGN[group][0], "runs", f"exit {r.returncode}: {(r.stderr.strip().splitlines() or [''])[-1][:300]}",
                          "FAIL"))
            return
        (self.out / f"design-{group}.json").write_text(lines[-1])
        figs, rw = DESIGN_FIGURES[group](json.loads(lines[-1]), self.driver)
        self.figs.update(figs)
        self.emit(rw)

    # 12
    def decode_zeroing(self) -> None:
        name = DESIGN["decode_zeroing"][0]
        path = pathlib.Path(self.a.servers) if self.a.servers else None
        if not path or not path.exists():
            why = " (no CUDA runtime)" if self.driver != "real" else ""
            self.emit(row(name, "recorded", f"skip: no llama-server: stage 3 recorded no builds ({path}){why}", "skip"))
            return
        rec = json.loads(path.read_text())
        if rec.get("device") != "cuda":
            self.emit(row(name, "recorded", "skip: stage 3's builds are CPU builds: a device memset does not compete "
                          "with their decode", "skip"))
            return
        r = subprocess.run([sys.executable, str(HERE / "gpu_design_probe.py"), "decode_zeroing", "--device", "cuda",
                            "--orig", rec["orig"], "--out", str(self.out / "decode-zeroing"), "--tokens", "512",
                            "--rounds", "5", "--scale", "real" if self.driver == "real" else "small"],
                           env=self.llama_env(rec), capture_output=True, text=True, timeout=max(60, self.left() + 30))
        (self.out / "decode-zeroing.log").write_text(r.stdout + r.stderr)
        lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
        if r.returncode != 0 or not lines:
            self.emit(row(name, "runs", f"exit {r.returncode}: {(r.stderr.strip().splitlines() or [''])[-1][:300]}", "FAIL"))
            return
        figs, rw = decode_zeroing_figures(json.loads(lines[-1]), self.driver)
        self.figs.update(figs)
        self.emit(rw)

    def run(self) -> int:
        steps = [(SECTIONS[0], self.driver_calls),
                 (SECTIONS[1] + "; " + SECTIONS[2], lambda: self.bench("allocate64,roundtrip", self.a.full)),
                 (SECTIONS[3], lambda: self.bench("reclaim", self.driver == "real")),
                 (SECTIONS[4], self.decode)]
        steps += [(DESIGN[g][0], (lambda g=g: self.design(g))) for g in DESIGN_FIGURES]
        steps += [(DESIGN["decode_zeroing"][0], self.decode_zeroing)]
        for i, (name, fn) in enumerate(steps):
            if self.left() <= 0:
                for n, _ in steps[i:]:
                    self.emit(row(n, "runs before the stage deadline", "skip: stage deadline reached", "skip"))
                break
            t = time.monotonic()
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - this figure fails, the next ones still run
                self.emit(row(name, "runs", f"{type(e).__name__}: {str(e)[:300]}", "FAIL"))
            print(f"      ({time.monotonic() - t:.1f} s)", flush=True)
            self.save()
        self.save()
        return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--driver", choices=["real", "testdriver"], required=True)
    ap.add_argument("--deadline", type=float, default=0.0)
    ap.add_argument("--servers", default="", help="stage 3's record of its llama-server builds")
    ap.add_argument("--full", action="store_true", help="bench.suite full sizes for allocate64 and roundtrip")
    return Stage(ap.parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
