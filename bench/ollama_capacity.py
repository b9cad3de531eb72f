"""Scenario 7: capacity on a real Ollama (issue 14).

    scripts/bench.sh --only ollama [--quick] [--out DIR]
    python -m bench.ollama_capacity [--quick] [--out DIR] [--seed N] [--models N]

One seeded request trace is replayed against two real `ollama serve`
(Ollama v0.34.0 built by integrations/ollama/build.sh, laid out by
scripts/test-ollama.sh):

- stock: Ollama's Go code as published, unpatched llama-server, no daemon;
- kvcached: the Go patch, the patched llama-server, kvcached-serve.

Same models (random-weight llama GGUFs written with the gguf package by
tests/llama/tiny_model.py, imported with `ollama create`, each with a large
num_ctx), same options (OLLAMA_NUM_PARALLEL 4, or 2 in quick mode,
OLLAMA_FLASH_ATTENTION=1,
keep_alive longer than every idle gap), same memory budget B.

The budget. Ollama 0.34 cannot be held to a memory budget on a CPU-only host:
its pre-load check (server/sched.go, load) runs only when GPUs are present;
on a CPU host it loads models until OLLAMA_MAX_LOADED_MODELS (default 3)
and reads the cgroup limit only for logs. The closest honest equivalent used
here: B is a memory size; the stock side gets OLLAMA_MAX_LOADED_MODELS =
the number of models Ollama's own GPU rule would admit on a device with B
free (a model loads while its estimate, file + full KV, is at most 80 % of B
minus what the loaded models use, measured from a stock load); the kvcached
side gets the same B, of which the weights and compute buffers of every
model it may keep loaded are set aside and the rest is the daemon's budget
(--memory-limit); its OLLAMA_MAX_LOADED_MODELS is the number of models, so
only the memory budget limits it.

The trace (trace()): seeded; a Poisson stream of bursts (mean gap
`burst_gap` s); each burst picks one or two models by Zipf popularity
(s = 1.0) and sends 1-4 requests (1-2 per model when two) within two
seconds; prompts are short (20-150 characters, about 0.8 tokens each with
the tiny vocabulary) 88 % of the time and long (500-1500 characters)
otherwise; 4-16 tokens generated. Idle gaps are much shorter than keep_alive (10 min),
so the stock side unloads only to make room.

Figures, side by side: requests served, time to first token p50/p99
(streamed /api/generate, from send to the first token), model loads and
reloads (from Ollama's "starting llama-server" log lines), models resident
(time average of /api/ps, sampled every 0.5 s), peak and mean memory held
(the sum of `ollama ps` sizes; the RSS of the llama-server processes plus
the daemon's pooled pages), and for the kvcached side: reclaim requests and
pages given back (daemon metrics), scheduler shrinks (Ollama log),
allocation stalls (Allocate calls that waited over 50 ms, from the
daemon's histogram) and failures. Greedy outputs of the two sides are
compared request by request; llama.cpp's results depend on the batch a
sequence is decoded in (the two replays interleave requests differently), so
a request whose outputs differ is run again alone on both sides, where they
must match (the run fails otherwise).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from . import common
from .common import GiB, MiB, ROOT

sys.path.insert(0, str(ROOT / "tests" / "llama"))
sys.path.insert(0, str(ROOT / "tests" / "ollama"))
sys.path.insert(0, str(ROOT / "tests"))

KiB = 1 << 10
KEEP_ALIVE = "10m"
PAGE = 2 * MiB

# Models: 8 layers x 256 wide (4 heads of 64, no GQA), FFN 512: 8 KiB of F16
# KV per token and about 5 M weights, so that on a CPU the KV cache at the
# configured context dominates memory while compute stays light. num_ctx is
# the models' training context (tests/llama/tiny_model.py: 16384); the
# worst case is num_ctx x parallel x 8 KiB: 512 MiB (full), 256 MiB (quick).
# Every runner gets num_thread 1 (Modelfile), both sides: on 2 cores several
# runners with a thread per core would spin against each other.
FULL = {"models": 6, "n_layer": 8, "n_embd": 256, "n_ff": 512, "num_ctx": 16384, "parallel": 4, "duration": 600.0,
        "burst_gap": 8.0, "num_thread": 1}
QUICK = {"models": 5, "n_layer": 8, "n_embd": 256, "n_ff": 512, "num_ctx": 16384, "parallel": 2, "duration": 60.0,
         "burst_gap": 6.0, "num_thread": 1}

WORDS = ["alpha", "beta", "gamma", "delta", "kv", "cache", "page", "daemon", "llama", "token", "slot", "the", "of", "model"]


# ---- the trace ---------------------------------------------------------------------------------
def words(rng: random.Random, n_chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < n_chars:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


def trace(n_models: int, duration: float, burst_gap: float, seed: int) -> list[dict]:
    """[{id, t, model, prompt, n}] sorted by t (seconds from the start).
    The tiny vocabulary makes about one token per character."""
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) for k in range(n_models)]  # Zipf, s = 1
    reqs: list[dict] = []
    t = rng.expovariate(1.0 / burst_gap) * 0.2
    while t < duration:
        models = {rng.choices(range(n_models), weights)[0] for _ in range(rng.choice([1, 1, 2]))}
        for m in models:
            for _ in range(rng.randint(1, 4 if len(models) == 1 else 2)):
                long = rng.random() < 0.12
                n_chars = rng.randint(500, 1500) if long else rng.randint(20, 150)
                reqs.append({"t": round(t + rng.uniform(0, 2.0), 3), "model": f"bench{m}",
                             "prompt": words(rng, n_chars), "n": rng.randint(4, 16), "long": long})
        t += rng.expovariate(1.0 / burst_gap)
    reqs.sort(key=lambda r: r["t"])
    for i, r in enumerate(reqs):
        r["id"] = i
    return reqs


# ---- Ollama's admission rule on a device with `budget` free -----------------------------------
def stock_admits(budget: int, predicted: int, actual: int, n_models: int) -> int:
    """How many of n identical models Ollama 0.34's GPU scheduler keeps
    loaded on a device with `budget` bytes free: the first always loads; the
    next loads while predicted <= 80 % of (budget - actual usage of the
    loaded ones) (server/sched.go: load, updateFreeSpace)."""
    n = 1
    while n < n_models and predicted <= 0.8 * (budget - n * actual):
        n += 1
    return n


# ---- helpers -----------------------------------------------------------------------------------
def metrics(address: str) -> dict[str, float]:
    """Prometheus text -> {series: value}."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                k, _, v = line.rpartition(" ")
                try:
                    out[k] = float(v)
                except ValueError:
                    pass
    return out


def metric_sum(m: dict[str, float], prefix: str, **labels) -> float:
    total = 0.0
    for k, v in m.items():
        if k == prefix or k.startswith(prefix + "{"):
            if all(f'{lk}="{lv}"' in k for lk, lv in labels.items()):
                total += v
    return total


def rss_bytes(pid: int) -> int:
    try:
        return common.rss_kib(pid) * KiB
    except OSError:
        return 0


class Sampler(threading.Thread):
    """Every 0.5 s: loaded models (/api/ps) and their sizes, llama-server RSS,
    the daemon's pooled/in-use bytes."""

    def __init__(self, o, daemon=None):
        super().__init__(daemon=True)
        self.o, self.d = o, daemon
        self.samples: list[dict] = []
        self.stop_ev = threading.Event()

    def run(self):
        while not self.stop_ev.is_set():
            t = time.monotonic()
            try:
                ps = self.o.ps()
            except Exception:  # noqa: BLE001
                ps = {}
            rss = sum(rss_bytes(p) for p in self.o.runners())
            s = {"t": t, "resident": len(ps), "ps_bytes": sum(m["size"] for m in ps.values()), "rss": rss, "pooled": 0, "in_use": 0}
            if self.d is not None:
                try:
                    st = self.d.stats()
                    s["pooled"], s["in_use"] = st.total.pooled_bytes, st.total.in_use_bytes
                except Exception:  # noqa: BLE001
                    pass
            self.samples.append(s)
            self.stop_ev.wait(max(0.0, 0.5 - (time.monotonic() - t)))

    def stop(self):
        self.stop_ev.set()
        self.join(10)


def time_average(samples: list[dict], key: str) -> float:
    if len(samples) < 2:
        return float(samples[0][key]) if samples else float("nan")
    area = sum(samples[i][key] * (samples[i + 1]["t"] - samples[i]["t"]) for i in range(len(samples) - 1))
    return area / (samples[-1]["t"] - samples[0]["t"])


def replay(o, reqs: list[dict], timeout: float) -> list[dict]:
    """Open loop: every request at its time, each on its own thread, streamed."""
    results: list[dict] = [None] * len(reqs)  # type: ignore[list-item]
    t0 = time.monotonic()

    def one(r):
        res = {"id": r["id"], "model": r["model"], "long": r["long"], "ok": False, "ttft": None, "total": None, "response": "", "error": ""}
        start = time.monotonic()
        try:
            chunks = []
            for line in o.stream(r["model"], r["prompt"], r["n"]):
                if res["ttft"] is None and line.get("response"):
                    res["ttft"] = time.monotonic() - start
                chunks.append(line.get("response", ""))
                if line.get("error"):
                    raise RuntimeError(line["error"])
                if line.get("done"):
                    res["ok"] = True
                    res["eval_count"] = line.get("eval_count")
                    res["load_s"] = (line.get("load_duration") or 0) / 1e9
            res["response"] = "".join(chunks)
        except Exception as e:  # noqa: BLE001
            res["error"] = repr(e)[:300]
        res["total"] = time.monotonic() - start
        results[r["id"]] = res

    threads = []
    for r in reqs:
        delay = r["t"] - (time.monotonic() - t0)
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=one, args=(r,), daemon=True)
        th.start()
        threads.append(th)
    deadline = time.monotonic() + timeout
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    for i, r in enumerate(results):
        if r is None:
            results[i] = {"id": i, "model": reqs[i]["model"], "long": reqs[i]["long"], "ok": False, "ttft": None,
                          "total": None, "response": "", "error": "no answer before the replay timeout"}
    return results


def side_figures(name: str, results: list[dict], samples: list[dict], log: str, extra: dict) -> dict:
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    loads_by_model: dict[str, int] = {}
    for m in re.finditer(r'msg="starting llama-server".*?--model (\S+)', log):
        loads_by_model[m.group(1)] = loads_by_model.get(m.group(1), 0) + 1
    loads = sum(loads_by_model.values())
    fig = {
        "side": name,
        "requests": len(results),
        "served": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
        "ttft_p50_s": common.pct(ttft, 50),
        "ttft_p99_s": common.pct(ttft, 99),
        "ttft_max_s": max(ttft) if ttft else float("nan"),
        "ttft_long_p50_s": common.pct([r["ttft"] for r in ok if r["long"] and r["ttft"] is not None], 50),
        "load_s_sum": sum(r.get("load_s", 0.0) for r in ok),
        "load_s_max": max((r.get("load_s", 0.0) for r in ok), default=0.0),
        "loads": loads,
        "reloads": loads - len(loads_by_model),
        "resident_mean": time_average(samples, "resident"),
        "resident_max": max((s["resident"] for s in samples), default=0),
        "ps_bytes_peak": max((s["ps_bytes"] for s in samples), default=0),
        "ps_bytes_mean": time_average(samples, "ps_bytes"),
        "held_peak": max((s["rss"] + s["pooled"] for s in samples), default=0),
        "held_mean": time_average([{**s, "held": s["rss"] + s["pooled"]} for s in samples], "held"),
        "evictions": log.count("resetting model to expire immediately to make room"),
    }
    fig.update(extra)
    return fig


# ---- the run -----------------------------------------------------------------------------------
# Mixed shapes (--mixed): cycled over the models. Heads of 64; "small KV"
# has one KV head (1 KiB per token: at 2 MiB pages its smallest footprint,
# one page per K and V tensor and slot, is as large as its worst case).
MIXED = [
    {"label": "8x256", "n_layer": 8, "n_embd": 256, "n_ff": 512, "n_head": 4, "n_head_kv": 4},
    {"label": "8x512 GQA 8/2", "n_layer": 8, "n_embd": 512, "n_ff": 1408, "n_head": 8, "n_head_kv": 2},
    {"label": "4x256 small KV", "n_layer": 4, "n_embd": 256, "n_ff": 512, "n_head": 4, "n_head_kv": 1},
    {"label": "16x256 GQA 4/2", "n_layer": 16, "n_embd": 256, "n_ff": 512, "n_head": 4, "n_head_kv": 2},
]


def make_models(cfg: dict, work: pathlib.Path, models_dir: pathlib.Path, common_env: dict, mixed: bool) -> list[dict]:
    """Write and import the models; one stock load of each distinct shape
    gives what a loaded model really uses (ollama ps)."""
    import tiny_model
    from ollamatest import Ollama

    uniform = {"label": f"{cfg['n_layer']}x{cfg['n_embd']}", "n_layer": cfg["n_layer"], "n_embd": cfg["n_embd"],
               "n_ff": cfg["n_ff"], "n_head": cfg["n_embd"] // 64, "n_head_kv": cfg["n_embd"] // 64}
    models: list[dict] = []
    creator = Ollama("stock", work, models_dir, env=common_env, name="create")
    try:
        actual_by_label: dict[str, int] = {}
        for i in range(cfg["models"]):
            shape = dict(MIXED[i % len(MIXED)] if mixed else uniform)
            label = shape.pop("label")
            name = f"bench{i}"
            gguf = tiny_model.write(work / f"{name}.gguf", seed=100 + i, name=name, **shape)
            creator.create(name, gguf, num_ctx=cfg["num_ctx"], num_thread=cfg["num_thread"])
            if label not in actual_by_label:
                creator.generate(name, "Hello", 2)
                actual_by_label[label] = creator.ps()[name]["size"]
                creator.unload(name)
            kv_per_token = 2 * shape["n_layer"] * 64 * shape["n_head_kv"] * 2
            weights = gguf.stat().st_size
            worst = cfg["parallel"] * cfg["num_ctx"] * kv_per_token
            actual = actual_by_label[label]
            models.append({"name": name, "label": label, "shape": shape, "weights": weights, "kv_per_token": kv_per_token,
                           "worst_kv": worst, "actual": actual, "predicted": weights + worst,  # PredictServerVRAM
                           "other": max(0, actual - weights - worst)})  # compute and output buffers
    finally:
        creator.stop()
    return models


def stock_fits(models: list[dict], budget: int) -> int:
    """Models, in popularity order, that Ollama 0.34's GPU rule keeps loaded
    on a device with `budget` free: the first always; each next one while
    its prediction is at most 80 % of what the loaded ones leave (their
    actual use). stock_admits() for identical models."""
    n, used = 0, 0
    for m in models:
        if n and m["predicted"] > 0.8 * (budget - used):
            break
        n, used = n + 1, used + m["actual"]
    return n


def budget_for(models: list[dict], k: int) -> int:
    """The smallest budget at which stock keeps k models (plus 16 MiB), or,
    for k = 1, just under the one that keeps 2."""
    if k <= 1:
        return budget_for(models, 2) - 32 * MiB
    need = max(sum(m["actual"] for m in models[:j]) + models[j]["predicted"] / 0.8 for j in range(1, k))
    return int(need) + 16 * MiB


def kvcached_fits(models: list[dict], budget: int, cfg: dict) -> tuple[int, int]:
    """(models the kvcached side keeps loaded, the daemon's budget): the most
    popular models whose weights and buffers fit in the budget with room left
    for twice their guarantees (one page per K and V tensor), as the classic
    run asks; the daemon gets the rest."""
    best = (0, 0)
    for m in range(1, len(models) + 1):
        fixed = sum(x["weights"] + x["other"] for x in models[:m])
        floor = sum(2 * x["shape"]["n_layer"] * PAGE for x in models[:m])
        rest = budget - fixed
        rest -= rest % PAGE
        if rest >= 2 * floor:
            best = (m, rest)
    return best


def replay_budget(models: list[dict], budget: int, cfg: dict, reqs: list[dict], work: pathlib.Path,
                  models_dir: pathlib.Path, common_env: dict, out_dir: pathlib.Path, tag: str,
                  kvc_models: int | None = None, daemon_budget: int | None = None) -> dict:
    """Both sides' replay of `reqs` under one budget."""
    from kvcached_service.client import Client
    from ollamatest import Ollama

    n_stock = stock_fits(models, budget)
    if kvc_models is None or daemon_budget is None:
        kvc_models, daemon_budget = kvcached_fits(models, budget, cfg)
    if kvc_models == 0:
        raise SystemExit(f"budget {budget / GiB:.2f} GiB leaves the daemon too little for one model")
    sides: dict[str, dict] = {}
    results: dict[str, list] = {}
    samples: dict[str, list] = {}
    for side in ("stock", "kvcached"):
        env = dict(common_env)
        daemon = None
        client = None
        if side == "stock":
            env["OLLAMA_MAX_LOADED_MODELS"] = str(n_stock)
            layout = "stock"
        else:
            env["OLLAMA_MAX_LOADED_MODELS"] = str(kvc_models)
            layout = "kvc"
            metrics_addr = f"127.0.0.1:{common.free_port()}"
            daemon = common.Daemon(work, "daemon", "host", ["--memory-limit", str(daemon_budget), "--page-size", str(PAGE),
                                                             "--metrics-address", metrics_addr, "--reclaim-timeout-ms", "2000"])
            env["OLLAMA_KVCACHED_SOCKET"] = daemon.socket
            client = Client.connect(daemon.socket)
        o = Ollama(layout, work, models_dir, env=env, name=f"replay-{side}{tag}")
        sampler = Sampler(o, client)
        sampler.start()
        t0 = time.monotonic()
        try:
            res = replay(o, reqs, timeout=cfg["duration"] + 600)
        finally:
            wall = time.monotonic() - t0
            sampler.stop()
            log = o.log_text()
            o.stop()
        extra: dict = {"replay_s": wall, "OLLAMA_MAX_LOADED_MODELS": env["OLLAMA_MAX_LOADED_MODELS"]}
        if daemon is not None:
            m = metrics(metrics_addr)
            waited = metric_sum(m, "kvcached_allocate_duration_seconds_count", wait="true")
            fast = metric_sum(m, "kvcached_allocate_duration_seconds_bucket", wait="true", le="0.05")
            extra.update({
                "daemon_budget": daemon_budget,
                "reclaim_requests": metric_sum(m, "kvcached_reclaim_requests_total"),
                "reclaim_returned_pages": metric_sum(m, "kvcached_reclaim_returned_pages_total"),
                "shrinks": log.count("asked idle runners to shrink before unloading a model"),
                "alloc_stalls": waited - fast,
                "alloc_failures": metric_sum(m, "kvcached_device_allocation_failures_total"),
                "allocations": metric_sum(m, "kvcached_device_allocations_total"),
            })
            client.close()
            daemon.stop()
        sides[side] = side_figures(side, res, sampler.samples, log, extra)
        results[side] = res
        t_start = sampler.samples[0]["t"] if sampler.samples else 0.0
        samples[side] = [{"t": round(x["t"] - t_start, 2), "resident": x["resident"], "held": x["rss"] + x["pooled"],
                          "ps_bytes": x["ps_bytes"]} for x in sampler.samples]
        (out_dir / f"ollama-{side}{tag}.log").write_text(log)
    same = sum(1 for a, b in zip(results["stock"], results["kvcached"]) if a["ok"] and b["ok"] and a["response"] == b["response"])
    both = sum(1 for a, b in zip(results["stock"], results["kvcached"]) if a["ok"] and b["ok"])
    diff_ids = [a["id"] for a, b in zip(results["stock"], results["kvcached"]) if a["ok"] and b["ok"] and a["response"] != b["response"]]
    # llama.cpp is not batch invariant: a request decoded beside others (the
    # replays interleave differently) may flip a near tie. Requests that
    # differ are run again alone on both sides: there the outputs must match.
    alone: dict[int, dict] = {}
    if diff_ids:
        for side, layout in (("stock", "stock"), ("kvcached", "kvc")):
            env = dict(common_env)
            daemon = None
            if side == "kvcached":
                daemon = common.Daemon(work, "daemon-alone", "host", ["--memory-limit", str(daemon_budget), "--page-size", str(PAGE)])
                env["OLLAMA_KVCACHED_SOCKET"] = daemon.socket
            o = Ollama(layout, work, models_dir, env=env, name=f"alone-{side}{tag}")
            try:
                for i in diff_ids:
                    r = reqs[i]
                    alone.setdefault(i, {})[side] = o.generate(r["model"], r["prompt"], r["n"])["response"]
            finally:
                o.stop()
                if daemon is not None:
                    daemon.stop()
    alone_same = [i for i in diff_ids if alone[i]["stock"] == alone[i]["kvcached"]]
    differing = [{"id": i, "stock": results["stock"][i]["response"], "kvcached": results["kvcached"][i]["response"],
                  "alone_stock": alone[i]["stock"], "alone_kvcached": alone[i]["kvcached"]} for i in diff_ids]
    return {
        "budget": budget, "stock_max_loaded_models": n_stock, "kvcached_max_loaded_models": kvc_models,
        "daemon_budget": daemon_budget, "sides": sides, "samples": samples,
        "greedy": {"compared": both, "identical": same, "different_ids": diff_ids, "identical_alone": len(alone_same),
                   "differing": differing[:20]},
        "requests": {side: [{k: r.get(k) for k in ("id", "model", "long", "ok", "ttft", "total", "load_s", "error")} for r in res]
                     for side, res in results.items()},
    }


def run(quick: bool, out_dir: pathlib.Path, seed: int, n_models: int | None, mixed: bool = False,
        sweep: list[int] | None = None, duration: float | None = None) -> dict:
    """The classic run (one budget: stock keeps two models by Ollama's rule,
    the kvcached side keeps every model), or with `sweep` one replay per
    budget at which stock keeps k models, for each k given."""
    from ollamatest import LAYOUTS

    cfg = dict(QUICK if quick else FULL)
    if n_models:
        cfg["models"] = n_models
    if duration:
        cfg["duration"] = duration
    for layout in ("stock", "kvc"):
        for need in (LAYOUTS[layout] / "bin" / "ollama", LAYOUTS[layout] / "lib" / "ollama" / "llama-server"):
            if not need.exists():
                raise SystemExit(f"{need} is missing: run scripts/test-ollama.sh first (it builds build/ollama/stock and build/ollama/kvc)")
    work = pathlib.Path(tempfile.mkdtemp(prefix="kvc-bench-ollama-"))
    models_dir = work / "models"
    models_dir.mkdir()
    t_setup = time.monotonic()
    common_env = {"OLLAMA_NUM_PARALLEL": str(cfg["parallel"]), "OLLAMA_KEEP_ALIVE": KEEP_ALIVE, "OLLAMA_FLASH_ATTENTION": "1",
                  "OLLAMA_MAX_QUEUE": "1024", "OLLAMA_DEBUG": "1"}
    models = make_models(cfg, work, models_dir, common_env, mixed)
    reqs = trace(cfg["models"], cfg["duration"], cfg["burst_gap"], seed)
    setup_s = time.monotonic() - t_setup
    m0 = models[0]
    config = {**cfg, "keep_alive": KEEP_ALIVE, "seed": seed, "requests": len(reqs), "mixed": mixed,
              "long_requests": sum(r["long"] for r in reqs), "kv_bytes_per_token": m0["kv_per_token"],
              "worst_case_kv_per_model": m0["worst_kv"], "weights_file": m0["weights"],
              "stock_actual_per_model": m0["actual"], "stock_predicted_per_model": m0["predicted"],
              "other_buffers_per_model": m0["other"], "page_size": PAGE, "setup_s": setup_s,
              "models_detail": [{k: m[k] for k in ("name", "label", "weights", "kv_per_token", "worst_kv", "actual")}
                                for m in models]}
    try:
        if sweep:
            points = []
            for k in sweep:
                budget = budget_for(models, min(k, len(models)))
                print(f"budget for stock keeping {k}: {budget / GiB:.2f} GiB ...", flush=True)
                points.append({"stock_fits": k, **replay_budget(models, budget, cfg, reqs, work, models_dir, common_env,
                                                                out_dir, f"-fits{k}")})
            return {"config": config, "sweep": points}
        # classic: two models at their configured context by Ollama's own rule; the daemon keeps all
        budget = int(m0["actual"] + m0["predicted"] / 0.8) + 16 * MiB
        daemon_budget = budget - sum(m["weights"] + m["other"] for m in models)
        daemon_budget -= daemon_budget % PAGE
        if daemon_budget < cfg["models"] * 2 * cfg["n_layer"] * PAGE * 2:  # twice the guarantees
            raise SystemExit(f"budget {budget} leaves too little for the daemon ({daemon_budget})")
        point = replay_budget(models, budget, cfg, reqs, work, models_dir, common_env, out_dir, "",
                              kvc_models=cfg["models"], daemon_budget=daemon_budget)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    config.update({"budget": budget, "stock_max_loaded_models": point["stock_max_loaded_models"],
                   "daemon_budget": daemon_budget})
    return {"config": config, **point}


def _ratio(a, b) -> float:
    return a / b if b and not (isinstance(b, float) and math.isnan(b)) else float("nan")


def markdown(r: dict, cmd: str, quick: bool) -> str:
    c, s, k = r["config"], r["sides"]["stock"], r["sides"]["kvcached"]
    g = r["greedy"]

    def f(v, unit=""):
        if isinstance(v, float) and math.isnan(v):
            return "n/a"
        if unit == "GiB":
            return f"{v / GiB:.2f} GiB"
        if unit == "s":
            return f"{v:.2f} s"
        if isinstance(v, float):
            return f"{v:.2f}"
        return str(v)

    rows = [
        ("requests served", f"{s['served']} of {s['requests']}", f"{k['served']} of {k['requests']}", "", "higher"),
        ("time to first token p50", f(s["ttft_p50_s"], "s"), f(k["ttft_p50_s"], "s"), _ratio(k["ttft_p50_s"], s["ttft_p50_s"]), "lower"),
        ("time to first token p99", f(s["ttft_p99_s"], "s"), f(k["ttft_p99_s"], "s"), _ratio(k["ttft_p99_s"], s["ttft_p99_s"]), "lower"),
        ("time to first token max", f(s["ttft_max_s"], "s"), f(k["ttft_max_s"], "s"), _ratio(k["ttft_max_s"], s["ttft_max_s"]), "lower"),
        ("model loads", s["loads"], k["loads"], _ratio(k["loads"], s["loads"]), "lower"),
        ("model reloads", s["reloads"], k["reloads"], _ratio(k["reloads"], s["reloads"]), "lower"),
        ("load time in requests (sum of load_duration) / longest", f"{s['load_s_sum']:.2f} s / {s['load_s_max']:.2f} s",
         f"{k['load_s_sum']:.2f} s / {k['load_s_max']:.2f} s", _ratio(k["load_s_sum"], s["load_s_sum"]), "lower"),
        ("evictions to make room", s["evictions"], k["evictions"], "", "lower"),
        ("models resident (time average)", f(s["resident_mean"]), f(k["resident_mean"]), _ratio(k["resident_mean"], s["resident_mean"]), "higher"),
        ("models resident (max)", s["resident_max"], k["resident_max"], "", "higher"),
        ("`ollama ps` sizes, peak", f(s["ps_bytes_peak"], "GiB"), f(k["ps_bytes_peak"], "GiB"), _ratio(k["ps_bytes_peak"], s["ps_bytes_peak"]), "lower"),
        ("`ollama ps` sizes, mean", f(s["ps_bytes_mean"], "GiB"), f(k["ps_bytes_mean"], "GiB"), _ratio(k["ps_bytes_mean"], s["ps_bytes_mean"]), "lower"),
        ("memory held (runner RSS + daemon pool), peak", f(s["held_peak"], "GiB"), f(k["held_peak"], "GiB"), _ratio(k["held_peak"], s["held_peak"]), "lower"),
        ("memory held (runner RSS + daemon pool), mean", f(s["held_mean"], "GiB"), f(k["held_mean"], "GiB"), _ratio(k["held_mean"], s["held_mean"]), "lower"),
        ("daemon: reclaim requests / pages given back", "-", f"{k['reclaim_requests']:.0f} / {k['reclaim_returned_pages']:.0f}", "", ""),
        ("scheduler: idle runners asked to shrink before unloading", "-", k["shrinks"], "", ""),
        ("daemon: allocation stalls (> 50 ms) / failures, of allocations", "-",
         f"{k['alloc_stalls']:.0f} / {k['alloc_failures']:.0f}, of {k['allocations']:.0f}", "", ""),
    ]
    out = [
        f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} · `{cmd}` · {'quick' if quick else 'full'} mode · "
        f"{os.cpu_count()} CPUs, load average at start {', '.join(f'{x:.2f}' for x in r.get('loadavg', (0, 0, 0)))}",
        "",
        f"{c['models']} models (llama, {c['n_layer']} layers x {c['n_embd']} wide, random weights, {c['weights_file'] / MiB:.0f} MiB file, "
        f"{c['kv_bytes_per_token'] // KiB} KiB of F16 KV per token), num_ctx {c['num_ctx']} x OLLAMA_NUM_PARALLEL {c['parallel']}: "
        f"{c['worst_case_kv_per_model'] / GiB:.2f} GiB worst-case KV per model; one stock load uses {c['stock_actual_per_model'] / GiB:.2f} GiB "
        f"(ollama ps). Budget B = {c['budget'] / GiB:.2f} GiB: stock OLLAMA_MAX_LOADED_MODELS={c['stock_max_loaded_models']} "
        f"(Ollama's own rule on a device with B free); kvcached --memory-limit {c['daemon_budget'] / GiB:.2f} GiB "
        f"(B minus the weights and buffers of all {c['models']} models), OLLAMA_MAX_LOADED_MODELS={c['models']}. "
        f"Trace: seed {c['seed']}, {c['requests']} requests ({c['long_requests']} long) over {c['duration']:.0f} s.",
        "",
        "| figure | stock | kvcached | kvcached / stock | better |",
        "|---|---:|---:|---:|---|",
    ]
    for name, a, b, ratio, better in rows:
        rs = "" if ratio == "" else ("n/a" if isinstance(ratio, float) and math.isnan(ratio) else f"{ratio:.2f}x")
        out.append(f"| {name} | {a} | {b} | {rs} | {better} |")
    alone_note = ""
    if g["different_ids"]:
        alone_note = (f"; the {len(g['different_ids'])} that differ (batched beside other requests) are identical when run "
                      f"alone: {g['identical_alone']} of {len(g['different_ids'])}")
    out.append(f"| greedy outputs identical (requests both sides served) | | {g['identical']} of {g['compared']}{alone_note} | | |")
    out += ["", "Against the goal (issue 14):", "",
            "| goal | measured | met |", "|---|---:|---|"]
    res_x = _ratio(k["resident_mean"], s["resident_mean"])
    rel_x = _ratio(s["reloads"], k["reloads"]) if k["reloads"] else (float("inf") if s["reloads"] else float("nan"))
    p99_x = _ratio(s["ttft_p99_s"], k["ttft_p99_s"])
    for goal, v, need in (("models resident >= 3x", res_x, 3), ("reloads >= 5x fewer", rel_x, 5), ("p99 TTFT >= 10x lower", p99_x, 10)):
        vs = "n/a" if math.isnan(v) else ("inf (no reloads)" if math.isinf(v) else f"{v:.2f}x")
        out.append(f"| {goal} | {vs} | {'yes' if (not math.isnan(v) and v >= need) else 'no'} |")
    return "\n".join(out)


def sweep_markdown(r: dict, cmd: str) -> str:
    c = r["config"]
    shapes = sorted({(m["label"], m["weights"], m["kv_per_token"], m["worst_kv"], m["actual"]) for m in c["models_detail"]},
                    key=lambda x: x[0])
    out = [f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} · `{cmd}` · "
           f"{os.cpu_count()} CPUs, load average at start {', '.join(f'{x:.2f}' for x in r.get('loadavg', (0, 0, 0)))}", "",
           f"{c['models']} models, shapes cycled in popularity order (num_ctx {c['num_ctx']} x OLLAMA_NUM_PARALLEL "
           f"{c['parallel']}, num_thread {c['num_thread']}); trace: seed {c['seed']}, {c['requests']} requests "
           f"({c['long_requests']} long) over {c['duration']:.0f} s per side and budget:", "",
           "| shape | file | KV per token | worst-case KV | one stock load (ollama ps) |", "|---|---:|---:|---:|---:|"]
    for label, w, kvt, worst, actual in shapes:
        out.append(f"| {label} | {w / MiB:.0f} MiB | {kvt / KiB:.0f} KiB | {worst / MiB:.0f} MiB | {actual / MiB:.0f} MiB |")
    out += ["", "| budget | stock keeps | kvcached keeps (daemon budget) | resident, stock / kvcached | reloads, stock / kvcached "
            "| TTFT p50, stock / kvcached | TTFT p99, stock / kvcached | memory held mean, stock / kvcached | served, stock / kvcached | greedy identical |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for p in r["sweep"]:
        s, k, g = p["sides"]["stock"], p["sides"]["kvcached"], p["greedy"]
        ident = f"{g['identical']} of {g['compared']}" + (f" (+{g['identical_alone']} of {len(g['different_ids'])} alone)"
                                                           if g["different_ids"] else "")
        out.append(f"| {p['budget'] / GiB:.2f} GiB | {p['stock_max_loaded_models']} | {p['kvcached_max_loaded_models']} "
                   f"({p['daemon_budget'] / GiB:.2f} GiB) | {s['resident_mean']:.2f} / {k['resident_mean']:.2f} | "
                   f"{s['reloads']} / {k['reloads']} | {s['ttft_p50_s']:.2f} / {k['ttft_p50_s']:.2f} s | "
                   f"{s['ttft_p99_s']:.2f} / {k['ttft_p99_s']:.2f} s | {s['held_mean'] / GiB:.2f} / {k['held_mean'] / GiB:.2f} GiB | "
                   f"{s['served']} / {k['served']} of {s['requests']} | {ident} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench.sh --only ollama", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 models, 2 slots, a 60 s trace (CI: a few minutes)")
    ap.add_argument("--out", default="", help="directory for ollama.json and ollama.md (default: a new temp dir)")
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--models", type=int, default=0, help="number of models (default 6, quick 5)")
    ap.add_argument("--mixed", action="store_true", help="models of four shapes (MIXED), cycled")
    ap.add_argument("--sweep", default="", help="comma-separated k: one replay per budget at which stock keeps k models")
    ap.add_argument("--duration", type=float, default=0, help="seconds of trace per side (default 600, quick 60)")
    a, _ = ap.parse_known_args(argv)
    out_dir = pathlib.Path(a.out or tempfile.mkdtemp(prefix="kvc-bench-ollama-out-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    sweep = [int(x) for x in a.sweep.split(",") if x]
    cmd = ("scripts/bench.sh --only ollama" + (" --quick" if a.quick else "") if not (sweep or a.mixed or a.models or a.duration)
           else "python -m bench.ollama_capacity " + " ".join(argv if argv is not None else sys.argv[1:]))
    loadavg = os.getloadavg()
    t0 = time.monotonic()
    r = run(a.quick, out_dir, a.seed, a.models or None, mixed=a.mixed, sweep=sweep or None, duration=a.duration or None)
    r["loadavg"] = loadavg
    r["seconds"] = time.monotonic() - t0
    stem = "sweep" if sweep else "ollama"
    (out_dir / f"{stem}.json").write_text(json.dumps(r, indent=1))
    md = sweep_markdown(r, cmd) if sweep else markdown(r, cmd, a.quick)
    (out_dir / f"{stem}.md").write_text(md + "\n")
    print(md)
    print(f"\nresults: {out_dir}/{stem}.json, {out_dir}/{stem}.md ({r['seconds']:.0f} s)")
    bad = []
    for p in r["sweep"] if sweep else [r]:
        s, k = p["sides"]["stock"], p["sides"]["kvcached"]
        where = f" (budget {p['budget'] / GiB:.2f} GiB)" if sweep else ""
        if p["greedy"]["identical_alone"] != len(p["greedy"]["different_ids"]):
            bad.append(f"greedy outputs differ even when run alone, among requests {p['greedy']['different_ids']}{where}")
        if k["failed"]:
            bad.append(f"kvcached side: {k['failed']} requests failed: {k['errors']}{where}")
        if s["failed"]:
            bad.append(f"stock side: {s['failed']} requests failed: {s['errors']}{where}")
    for b in bad:
        print("FAILED:", b, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
