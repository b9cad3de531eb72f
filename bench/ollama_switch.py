"""Model switch on a real Ollama (issue 30 item 2).

    python -m bench.ollama_switch [--requests 30] [--quick] [--out DIR]

Two scenarios, each on both sides (stock: Ollama as published with the
unpatched llama-server; kvcached: the Go patch, the patched llama-server,
kvcached-serve), the builds of scripts/test-ollama.sh:

- pair: requests alternate between two models, A B A B ...;
- round robin: three models, A B C A B C ...

Requests are sequential (each sent when the previous one finished), short
prompts, 8 tokens generated, greedy. The budget B holds every model's
weights and compute buffers and the KV its runners actually use for these
requests, but not two worst cases (num_ctx x OLLAMA_NUM_PARALLEL of F16
KV): held to it by Ollama's own GPU rule (bench/ollama_capacity.py,
stock_admits), stock keeps one model loaded, so every switch unloads one
runner and starts another; the kvcached side gets the same B (the daemon's
--memory-limit is B minus the weights and buffers of every model) and
keeps all of them loaded. One request per model is sent first and not
counted (the first load is the same on both sides).

Per switch (a request to another model than the one before): time to
first token as the client saw it (streamed /api/generate) and Ollama's
load_duration. Printed: median, p99 and max per side and scenario, the
reloads (Ollama's "starting llama-server" lines after the first load of
each model), the ratio of medians, and the seed's target (a switch under
100 ms). Greedy outputs are compared request by request (sequential
requests: they must be identical). JSON to OUT (default
bench/results/issue30/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time

from . import common
from .common import GiB, MiB, ROOT
from .ollama_capacity import stock_admits

sys.path.insert(0, str(ROOT / "tests" / "llama"))
sys.path.insert(0, str(ROOT / "tests" / "ollama"))
sys.path.insert(0, str(ROOT / "tests"))

PAGE = 2 * MiB
# 8 layers x 512 wide, FFN 1408, F32: a ~100 MB file, 16 KiB of F16 KV per
# token; num_ctx 8192 x 2 slots: 256 MiB worst-case KV per model.
FULL = {"n_layer": 8, "n_embd": 512, "n_ff": 1408, "num_ctx": 8192, "parallel": 2, "requests": 30}
QUICK = {"n_layer": 4, "n_embd": 256, "n_ff": 512, "num_ctx": 16384, "parallel": 2, "requests": 8}
SCENARIOS = {"pair": 2, "round robin": 3}
TARGET_S = 0.1
PROMPTS = ["the page of the cache", "alpha beta gamma delta", "a daemon lends pages", "the model of the token"]


def starts(log: str) -> int:
    return len(re.findall(r'msg="starting llama-server"', log))


def one_side(side: str, names: list[str], models_dir: pathlib.Path, work: pathlib.Path, cfg: dict, n_stock: int,
             daemon_budget: int) -> dict:
    from ollamatest import Ollama

    env = {"OLLAMA_NUM_PARALLEL": str(cfg["parallel"]), "OLLAMA_KEEP_ALIVE": "10m", "OLLAMA_FLASH_ATTENTION": "1",
           "OLLAMA_DEBUG": "1"}
    daemon = None
    if side == "stock":
        env["OLLAMA_MAX_LOADED_MODELS"] = str(n_stock)
        layout = "stock"
    else:
        env["OLLAMA_MAX_LOADED_MODELS"] = str(len(names))
        daemon = common.Daemon(work, "daemon", "host", ["--memory-limit", str(daemon_budget), "--page-size", str(PAGE),
                                                         "--reclaim-timeout-ms", "2000"])
        env["OLLAMA_KVCACHED_SOCKET"] = daemon.socket
        layout = "kvc"
    o = Ollama(layout, work, models_dir, env=env, name=f"switch-{side}-{len(names)}")
    rows = []
    try:
        for name in names:  # first loads, not counted
            o.generate(name, PROMPTS[0], 2)
        first_starts = starts(o.log_text())
        prev = names[-1]
        for i in range(cfg["requests"]):
            name = names[i % len(names)]
            t0 = time.monotonic()
            ttft = None
            out = []
            load = 0.0
            for line in o.stream(name, PROMPTS[i % len(PROMPTS)], 8):
                if line.get("error"):
                    raise RuntimeError(f"{side}: {name}: {line['error']}")
                if ttft is None and line.get("response"):
                    ttft = time.monotonic() - t0
                out.append(line.get("response", ""))
                if line.get("done"):
                    load = (line.get("load_duration") or 0) / 1e9
            rows.append({"i": i, "model": name, "switch": name != prev, "ttft_s": ttft, "load_s": load,
                         "total_s": time.monotonic() - t0, "response": "".join(out)})
            prev = name
        log = o.log_text()
    finally:
        o.stop()
        if daemon is not None:
            daemon.stop()
    (work / f"ollama-{side}-{len(names)}.log").write_text(log)
    sw = [r["ttft_s"] for r in rows if r["switch"] and r["ttft_s"] is not None]
    return {"side": side, "rows": rows, "reloads": starts(log) - first_starts,
            "ttft_p50_s": common.pct(sw, 50), "ttft_p99_s": common.pct(sw, 99), "ttft_max_s": max(sw),
            "load_p50_s": common.pct([r["load_s"] for r in rows if r["switch"]], 50),
            "max_loaded": env["OLLAMA_MAX_LOADED_MODELS"]}


def run(quick: bool, requests: int | None) -> dict:
    import tiny_model
    from ollamatest import Ollama

    cfg = dict(QUICK if quick else FULL)
    if requests:
        cfg["requests"] = requests
    work = pathlib.Path(tempfile.mkdtemp(prefix="kvc-bench-switch-"))
    models_dir = work / "models"
    models_dir.mkdir()
    shape = {k: cfg[k] for k in ("n_layer", "n_embd", "n_ff")}
    shape["n_head"] = shape["n_head_kv"] = cfg["n_embd"] // 64
    kv_per_token = 2 * cfg["n_layer"] * cfg["n_embd"] * 2
    worst_kv = cfg["parallel"] * cfg["num_ctx"] * kv_per_token
    n_max = max(SCENARIOS.values())
    names = [f"switch{i}" for i in range(n_max)]
    common_env = {"OLLAMA_NUM_PARALLEL": str(cfg["parallel"]), "OLLAMA_FLASH_ATTENTION": "1"}
    creator = Ollama("stock", work, models_dir, env=common_env, name="create")
    try:
        for i, name in enumerate(names):
            gguf = tiny_model.write(work / f"{name}.gguf", seed=300 + i, name=name, **shape)
            creator.create(name, gguf, num_ctx=cfg["num_ctx"], num_thread=2)
        creator.generate(names[0], PROMPTS[0], 2)
        actual = creator.ps()[names[0]]["size"]
    finally:
        creator.stop()
    weights = (work / f"{names[0]}.gguf").stat().st_size
    predicted = weights + worst_kv
    other = max(0, actual - weights - worst_kv)
    out = {"config": {**cfg, "kv_bytes_per_token": kv_per_token, "worst_case_kv_per_model": worst_kv,
                      "weights_file": weights, "stock_actual_per_model": actual, "other_buffers_per_model": other,
                      "page_size": PAGE}, "scenarios": {}}
    for scen, n in SCENARIOS.items():
        # the daemon's share: twice the pages a runner maps for a short
        # prompt (one per K and V tensor and slot) for every model
        daemon_budget = n * 2 * cfg["n_layer"] * cfg["parallel"] * PAGE * 2
        budget = daemon_budget + n * (weights + other)
        n_stock = stock_admits(budget, predicted, actual, n)
        sides = {side: one_side(side, names[:n], models_dir, work, cfg, n_stock, daemon_budget)
                 for side in ("stock", "kvcached")}
        same = sum(1 for a, b in zip(sides["stock"]["rows"], sides["kvcached"]["rows"]) if a["response"] == b["response"])
        out["scenarios"][scen] = {"models": n, "budget": budget, "daemon_budget": daemon_budget,
                                  "stock_max_loaded_models": n_stock, "sides": sides,
                                  "greedy_identical": same, "requests": cfg["requests"]}
    shutil.rmtree(work, ignore_errors=True)
    return out


def markdown(r: dict, cmd: str) -> str:
    c = r["config"]
    lines = [f"Run {r['started']} · `{cmd}` · {os.cpu_count()} CPUs, load average at start {r['load_at_start']}", "",
             f"Models: llama, {c['n_layer']} layers x {c['n_embd']} wide, random weights, {c['weights_file'] / MiB:.0f} MiB "
             f"file, {c['kv_bytes_per_token'] // 1024} KiB of F16 KV per token; num_ctx {c['num_ctx']} x "
             f"OLLAMA_NUM_PARALLEL {c['parallel']}: {c['worst_case_kv_per_model'] / MiB:.0f} MiB worst-case KV per "
             f"model; one stock load uses {c['stock_actual_per_model'] / MiB:.0f} MiB (ollama ps). {c['requests']} "
             f"sequential requests per scenario and side after one warm-up request per model; 2 MiB pages.", "",
             "| scenario | budget | side | max loaded | switch TTFT p50 | p99 | max | load_duration p50 | reloads | greedy identical |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for scen, s in r["scenarios"].items():
        for side in ("stock", "kvcached"):
            d = s["sides"][side]
            lines.append(f"| {scen} ({s['models']} models) | {s['budget'] / GiB:.2f} GiB | {side} | {d['max_loaded']} | "
                         f"{d['ttft_p50_s'] * 1000:.0f} ms | {d['ttft_p99_s'] * 1000:.0f} ms | {d['ttft_max_s'] * 1000:.0f} ms | "
                         f"{d['load_p50_s'] * 1000:.0f} ms | {d['reloads']} | "
                         f"{s['greedy_identical'] if side == 'kvcached' else ''}{' of ' + str(s['requests']) if side == 'kvcached' else ''} |")
    lines += ["", f"| goal | scenario | measured (kvcached p50 / p99) | stock / kvcached (p50) | met |", "|---|---|---:|---:|---|"]
    for scen, s in r["scenarios"].items():
        k, st = s["sides"]["kvcached"], s["sides"]["stock"]
        ratio = st["ttft_p50_s"] / k["ttft_p50_s"] if k["ttft_p50_s"] else math.inf
        lines.append(f"| switch < {TARGET_S * 1000:.0f} ms (p99) | {scen} | {k['ttft_p50_s'] * 1000:.0f} / "
                     f"{k['ttft_p99_s'] * 1000:.0f} ms | {ratio:.1f}x | {'yes' if k['ttft_p99_s'] < TARGET_S else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ollama_switch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny models, 8 requests (checks the harness)")
    ap.add_argument("--requests", type=int, default=0, help="requests per scenario and side (default 30)")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results" / "issue30")
    a = ap.parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = " ".join(open("/proc/loadavg").read().split()[:3])
    r = run(a.quick, a.requests or None)
    r.update({"started": started, "load_at_start": load})
    cmd = "python -m bench.ollama_switch " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(r, cmd.strip())
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    stem = "switch" + ("-quick" if a.quick else "") + time.strftime("-%Y%m%dT%H%M", time.gmtime())
    (a.out / f"{stem}.json").write_text(json.dumps(r, indent=1) + "\n")
    (a.out / f"{stem}.md").write_text(text)
    print(f"raw: {a.out / (stem + '.json')}")
    bad = [f"{scen}: greedy outputs differ ({s['greedy_identical']} of {s['requests']} identical)"
           for scen, s in r["scenarios"].items() if s["greedy_identical"] != s["requests"]]
    for b in bad:
        print("FAILED:", b, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
