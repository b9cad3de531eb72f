"""Single-model overhead of the llama.cpp hook (issue 30 item 1).

    python -m bench.overhead [--runs 5] [--threads 2] [--quick] [--out DIR]

One random-weight llama GGUF large enough to be compute-bound on a CPU
(default: 8 layers of 1024, FFN 2816, F32: about 413 MB; F16 KV of 32 KiB
per token), served by the unpatched llama-server (build/llama/build-orig)
and by the patched one (build/llama/build-kvc) with a daemon on the host
backend (2 MiB pages). Both builds come from the same llama.cpp with the
same flags (scripts/test-llama.sh builds them); both run with the same
threads, context and flash attention.

Each run starts a fresh server (an empty KV cache: the hook maps pages as
the context grows), sends one prompt of `--prompt` token ids (default
7,542) and has it generate `--predict` tokens (default 128; greedy,
ignore_eos), streamed, and stops the server. Runs alternate the two sides
(unpatched first in even rounds, patched first in odd ones) so drift in
the machine's speed falls on both. Per run it records llama-server's own
timings (prompt and predicted tokens per second), the time to the first
streamed token as the client saw it, and what the kernel says about the
server process during the request: minor page faults, voluntary and
involuntary context switches, the number of memory mappings, and RSS.

Printed: median, min and max per side, the patched / unpatched ratio of
the medians, and the issue's goals (decode at most 1 % slower, prefill at
most 2 %). The JSON with every run goes to OUT (default
bench/results/issue30/).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

from .common import ROOT, Daemon, MiB, rss_kib

sys.path.insert(0, str(ROOT / "tests" / "llama"))
sys.path.insert(0, str(ROOT / "tests"))
import tiny_model  # noqa: E402  (the suite's GGUF writer)
from llamatest import KVC, ORIG, Server  # noqa: E402  (the suite's llama-server launcher: health wait, stop)

SIDES = {"unpatched": ORIG, "patched": KVC}  # the builds of scripts/test-llama.sh (LLAMA_SERVER_ORIG / _KVC)
FULL = {"n_layer": 8, "n_embd": 1024, "n_head": 16, "n_head_kv": 16, "n_ff": 2816}
QUICK = {"n_layer": 4, "n_embd": 256, "n_head": 4, "n_head_kv": 4, "n_ff": 512}
GOALS = {"decode": 0.99, "prefill": 0.98}  # patched / unpatched tokens per second, at least


def model_path(shape: dict, cache: pathlib.Path) -> pathlib.Path:
    """The model for `shape`, written once into `cache` (seeded: same bytes)."""
    name = "overhead-" + "-".join(f"{k[2:]}{v}" for k, v in shape.items()) + ".gguf"
    path = cache / name
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} ...", flush=True)
        tmp = path.with_suffix(".tmp")
        tiny_model.write(tmp, seed=30, name="overhead", **shape)
        tmp.rename(path)
    return path


def proc_counts(pid: int) -> dict:
    """Faults and context switches of every thread of `pid`, its mappings and RSS."""
    out = {"minflt": 0, "majflt": 0, "vcsw": 0, "ivcsw": 0}
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    out["minflt"], out["majflt"] = int(fields[7]), int(fields[9])
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        out["vcsw"] += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        out["ivcsw"] += int(line.split()[1])
        except FileNotFoundError:
            pass
    with open(f"/proc/{pid}/maps") as f:
        out["maps"] = sum(1 for _ in f)
    out["rss_mib"] = rss_kib(pid) / 1024
    return out


def stream(srv, prompt: list[int], n_predict: int) -> dict:
    """One greedy completion on llama-server `srv`, streamed: the client's
    time to the first token, and llama-server's final timings."""
    body = json.dumps({"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "seed": 7,
                       "ignore_eos": True, "cache_prompt": False, "stream": True})
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=1800)
    t0 = time.perf_counter()
    c.request("POST", "/completion", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"/completion: HTTP {r.status}: {r.read()[:500]!r}")
    ttft = None
    last = None
    tokens = 0
    for raw in r:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        msg = json.loads(line[6:])
        if ttft is None and (msg.get("content") or msg.get("tokens")):
            ttft = time.perf_counter() - t0
        tokens += 1
        last = msg
    wall = time.perf_counter() - t0
    if not last or "timings" not in last:
        raise RuntimeError(f"no timings in the stream's last message: {last!r}")
    return {"ttft_s": ttft, "wall_s": wall, "chunks": tokens, "timings": last["timings"]}


def one_run(side: str, model: pathlib.Path, prompt: list[int], a, daemon: Daemon | None, work: pathlib.Path,
            i: int) -> dict:
    srv = Server(SIDES[side], model, work / f"{side}-{i}.log", kvc_socket=daemon.socket if daemon else None,
                 ctx=a.ctx, parallel=1, fa=a.fa, threads=a.threads, log_flags=["-lv", str(a.log_verbosity)])
    try:
        before = proc_counts(srv.proc.pid)
        res = stream(srv, prompt, a.predict)
        after = proc_counts(srv.proc.pid)
    finally:
        srv.stop()
    t = res["timings"]
    row = {
        "side": side, "round": i,
        "prefill_tps": t["prompt_per_second"], "decode_tps": t["predicted_per_second"],
        "prompt_n": t["prompt_n"], "predicted_n": t["predicted_n"],
        "prompt_ms": t["prompt_ms"], "predicted_ms": t["predicted_ms"],
        "ttft_s": res["ttft_s"], "wall_s": res["wall_s"],
        "minflt": after["minflt"] - before["minflt"], "majflt": after["majflt"] - before["majflt"],
        "vcsw": after["vcsw"] - before["vcsw"], "ivcsw": after["ivcsw"] - before["ivcsw"],
        "maps_before": before["maps"], "maps_after": after["maps"], "rss_mib_after": after["rss_mib"],
    }
    if row["prompt_n"] != len(prompt) or row["predicted_n"] != a.predict:
        raise RuntimeError(f"{side}: ran {row['prompt_n']} prompt / {row['predicted_n']} predicted tokens, "
                           f"asked {len(prompt)} / {a.predict}")
    return row


class OllamaSides:
    """--via ollama: the stock and the kvcached `ollama serve` of
    scripts/test-ollama.sh (build/ollama/stock, build/ollama/kvc), one
    model imported once; each run sends keep_alive 0, so the runner is
    unloaded after it and the next run starts with an empty KV cache."""

    def __init__(self, model: pathlib.Path, a, work: pathlib.Path, daemon: Daemon):
        sys.path.insert(0, str(ROOT / "tests" / "ollama"))
        from ollamatest import Ollama

        models = work / "ollama-models"
        models.mkdir()
        env = {"OLLAMA_NUM_PARALLEL": "1", "OLLAMA_FLASH_ATTENTION": "1" if a.fa == "on" else "0",
               "OLLAMA_KEEP_ALIVE": "0"}
        self.sides = {"unpatched": Ollama("stock", work, models, env=env, name="stock"),
                      "patched": Ollama("kvc", work, models, env={**env, "OLLAMA_KVCACHED_SOCKET": daemon.socket},
                                        name="kvc")}
        self.sides["unpatched"].create("overhead", model, num_ctx=a.ctx, num_thread=a.threads)
        self.a = a

    def run(self, side: str, prompt: str, i: int) -> dict:
        o = self.sides[side]
        t0 = time.perf_counter()
        ttft, last, out = None, None, []
        for line in o.stream("overhead", prompt, self.a.predict, num_ctx=self.a.ctx, num_thread=self.a.threads):
            if line.get("error"):
                raise RuntimeError(f"{side}: {line['error']}")
            if ttft is None and line.get("response"):
                ttft = time.perf_counter() - t0
            out.append(line.get("response", ""))
            last = line
        if not last or not last.get("done"):
            raise RuntimeError(f"{side}: the stream ended without a final message")
        return {"side": side, "round": i,
                "prefill_tps": last["prompt_eval_count"] / (last["prompt_eval_duration"] / 1e9),
                "decode_tps": last["eval_count"] / (last["eval_duration"] / 1e9),
                "prompt_n": last["prompt_eval_count"], "predicted_n": last["eval_count"],
                "load_s": last.get("load_duration", 0) / 1e9, "ttft_s": ttft, "wall_s": time.perf_counter() - t0,
                "response": "".join(out)}

    def stop(self) -> None:
        for o in self.sides.values():
            o.stop()


def stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(rows: list[dict]) -> dict:
    out: dict = {}
    for side in SIDES:
        mine = [r for r in rows if r["side"] == side]
        out[side] = {k: stats([r[k] for r in mine]) for k in
                     ("prefill_tps", "decode_tps", "ttft_s", "minflt", "ivcsw", "vcsw", "maps_after", "load_s")
                     if k in mine[0]}
    out["ratio"] = {k: out["patched"][k]["median"] / out["unpatched"][k]["median"]
                    for k in ("prefill_tps", "decode_tps", "ttft_s")}
    out["goals"] = {
        "decode": {"goal": f">= {GOALS['decode']:.2f}", "measured": out["ratio"]["decode_tps"],
                   "met": out["ratio"]["decode_tps"] >= GOALS["decode"]},
        "prefill": {"goal": f">= {GOALS['prefill']:.2f}", "measured": out["ratio"]["prefill_tps"],
                    "met": out["ratio"]["prefill_tps"] >= GOALS["prefill"]},
    }
    return out


def markdown(r: dict) -> str:
    s = r["summary"]
    lines = [f"Run {r['started']} · `{r['command']}` · {r['cpus']} CPUs, load average at start {r['load_at_start']}",
             "",
             f"Model: {r['model']['file']} ({r['model']['mib']:.0f} MiB, {r['model']['shape']}), "
             + ("through `ollama serve` (stock vs kvcached build), num_thread {t}, num_ctx {c}, parallel 1, flash attention {f}; "
                .format(t=r['threads'], c=r['ctx'], f=r['fa']) if r.get('via') == 'ollama' else
                f"-t {r['threads']} -c {r['ctx']} -np 1 -fa {r['fa']}; ")
             + f"prompt {r['prompt_tokens']} {'characters' if r.get('via') == 'ollama' else 'token ids'}, "
             f"then {r['predict']} tokens; daemon: host backend, {r['page_size'] // MiB} MiB pages. "
             f"{r['runs']} runs per side, alternated.",
             "",
             "| figure | unpatched median (min-max) | patched + daemon median (min-max) | patched / unpatched |",
             "|---|---:|---:|---:|"]

    def cell(d, fmt):
        return f"{fmt.format(d['median'])} ({fmt.format(d['min'])}-{fmt.format(d['max'])})"

    for key, label, fmt in (("prefill_tps", "prefill tokens/s", "{:.1f}"), ("decode_tps", "decode tokens/s", "{:.2f}"),
                            ("ttft_s", "time to first token, s", "{:.2f}")):
        lines.append(f"| {label} | {cell(s['unpatched'][key], fmt)} | {cell(s['patched'][key], fmt)} | "
                     f"{s['ratio'][key]:.3f}x |")
    for key, label, fmt in (("minflt", "minor page faults in the request", "{:.0f}"),
                            ("ivcsw", "involuntary context switches", "{:.0f}"),
                            ("maps_after", "memory mappings after", "{:.0f}"), ("load_s", "Ollama load_duration, s", "{:.2f}")):
        if key not in s["unpatched"]:
            continue
        lines.append(f"| {label} | {cell(s['unpatched'][key], fmt)} | {cell(s['patched'][key], fmt)} | |")
    lines += ["", "| goal (patched / unpatched, medians) | measured | met |", "|---|---:|---|"]
    for name, g in s["goals"].items():
        lines.append(f"| {name} tokens/s {g['goal']} | {g['measured']:.3f}x | {'yes' if g['met'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="runs per side (default 5)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--prompt", type=int, default=7542, help="prompt length in tokens")
    ap.add_argument("--predict", type=int, default=128)
    ap.add_argument("--fa", default="on", choices=["on", "off"])
    ap.add_argument("--page-size", default="2MiB")
    ap.add_argument("--log-verbosity", type=int, default=3, help="llama-server -lv (4 shows the hook's lines)")
    ap.add_argument("--daemon-arg", action="append", default=[], help="an extra kvcached-serve argument")
    ap.add_argument("--via", choices=["llama-server", "ollama"], default="llama-server",
                    help="the two llama-servers directly, or through stock vs kvcached `ollama serve`")
    ap.add_argument("--quick", action="store_true", help="a tiny model, 2 runs, 1k context (checks the harness)")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results" / "issue30")
    ap.add_argument("--tag", default="", help="added to the result file's name")
    a = ap.parse_args(argv)
    if a.quick:
        a.runs, a.ctx, a.prompt, a.predict = min(a.runs, 2), 1024, 700, 32
    shape = QUICK if a.quick else FULL
    model = model_path(shape, ROOT / "build" / "bench-models")
    import random

    rng = random.Random(30)
    n_vocab = len(tiny_model.vocab()[0])
    prompt = [rng.randrange(3, n_vocab) for _ in range(a.prompt)]
    page = int(a.page_size[:-3]) * (MiB if a.page_size.endswith("MiB") else 1024)
    work = pathlib.Path(tempfile.mkdtemp(prefix="overhead-"))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = " ".join(open("/proc/loadavg").read().split()[:3])
    rows: list[dict] = []
    text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(a.prompt))  # --via ollama: ~1 token a char
    with Daemon(work, "daemon", "host", ["--page-size", str(page), *a.daemon_arg]) as d:
        ollama = OllamaSides(model, a, work, d) if a.via == "ollama" else None
        try:
            for i in range(a.runs):
                order = ["unpatched", "patched"] if i % 2 == 0 else ["patched", "unpatched"]
                for side in order:
                    if ollama:
                        row = ollama.run(side, text, i)
                    else:
                        row = one_run(side, model, prompt, a, d if side == "patched" else None, work, i)
                    rows.append(row)
                    print(f"round {i + 1}/{a.runs} {side:9s}: prefill {row['prefill_tps']:7.1f} tok/s, decode "
                          f"{row['decode_tps']:6.2f} tok/s, ttft {row['ttft_s']:6.2f} s"
                          + (f", load {row['load_s']:.2f} s" if ollama else
                             f", faults {row['minflt']}, ivcsw {row['ivcsw']}, maps {row['maps_after']}"), flush=True)
        finally:
            if ollama:
                ollama.stop()
    if ollama:  # greedy: the same prompt gives the same tokens on both sides
        answers = {r["response"] for r in rows}
        for r in rows:
            r.pop("response")
        if len(answers) != 1:
            raise SystemExit(f"greedy outputs differ between runs or sides: {len(answers)} different answers")
    cmd = "python -m bench.overhead " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {
        "started": started, "command": cmd.strip(), "cpus": os.cpu_count(), "load_at_start": load,
        "model": {"file": model.name, "mib": model.stat().st_size / MiB, "shape": shape},
        "via": a.via, "threads": a.threads, "ctx": a.ctx, "fa": a.fa, "prompt_tokens": a.prompt, "predict": a.predict,
        "page_size": page, "runs": a.runs, "rows": rows, "summary": summarize(rows), "work": str(work),
    }
    text = markdown(result)
    print()
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    stem = "overhead" + ("-ollama" if a.via == "ollama" else "") + ("-quick" if a.quick else "") + (f"-{a.tag}" if a.tag else "") + time.strftime("-%Y%m%dT%H%M", time.gmtime())
    (a.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (a.out / f"{stem}.md").write_text(text)
    print(f"raw: {a.out / (stem + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
