"""Stage 3 of the offline GPU bundle (issue 24): the llama.cpp hook on a
device, checked against the unpatched llama-server, one row per check.

    python tests/helpers/gpu_llama.py checks --device cuda|cpu --orig BIN --kvc BIN \
        --out DIR [--deadline EPOCH] [--rows FILE]
    python tests/helpers/gpu_llama.py decode --device cuda|cpu --orig BIN --kvc BIN --out DIR \
        [--tokens 128,1024] [--rounds 5]

`checks` appends rows ({"check", "expected", "seen", "verdict", "kind"}) to
--rows (default DIR/rows.jsonl) one at a time, so whatever finished is kept
when the stage is stopped. Every row's verdict is pass, FAIL, info or skip.
`decode` prints one JSON object: decode tokens/s of the unpatched server,
the patched one with and without the daemon, the patched one with the whole
KV mapped at start (KVCACHED_PREMAP=1) and, on CUDA, both with CUDA graphs
off (stage 4; --tokens, --rounds); and, from the hook's own counters
(KVCACHED_HOOK_STATS=1), the hook's calls and microseconds per generated
token in each patched server.

--device cuda: kvcached-serve --backend cuda (KVCACHED_LIBCUDA), both
servers with every layer offloaded (-ngl 99), so the KV cache is a CUDA0
buffer: the hook must put it in daemon pages (its log line "kvcached: CUDA0
KV buffer reserved ... in daemon pages"), not fall back to ordinary memory.
--device cpu: the same checks with the daemon's host backend against CPU
builds (scripts/test-llama.sh's build/llama/build-{orig,kvc}), so that this
driver runs in make test; the checks that only mean something on a device
(device memory) are skip rows there.

The checks, cheapest and most telling first (the deadline may cut the
rest, which then become skip rows):
  1. model A, flash attention on, 1 slot: greedy tokens identical to the
     unpatched server; the KV buffer in daemon pages; pages following the
     context (grow with a longer prompt, back to 0 on a slot erase);
  2. a SIGKILLed server's pages back in the pool within 1 s, books exact;
  3. two servers over one budget too small for both: a reclaim moves pages
     from the idle one to the busy one, tokens still identical;
  4. the rest of the greedy matrix: models A and B, flash attention on and
     off, 1 and 4 slots;
  5. a real 8B model's KV shape (KV8B_SHAPES: 32 layers, 8 KV heads of 128,
     random q4_0 weights from tests/helpers/q4_gguf.py with a narrower FFN
     and a smaller vocabulary) at a 32k context over 4 slots: greedy tokens
     identical to the unpatched server, the KV held (daemon books) against
     the unpatched server's "KV buffer size" line, 0 held after every slot
     is erased; then two such servers over one budget of 1.5 times what one
     holds (reclaims both ways, tokens identical) and one of them SIGKILLed
     while holding pages. On --device cpu: 4 layers, a 16k context;
  6. device memory (NVML, else cuMemGetInfo through torch) back to where it
     was before the first server started.
Models are the tiny random-weight GGUFs of tests/llama/tiny_model.py, made
here with the gguf package (the bundle carries its wheel), and the 8B KV
shape's q4_0 GGUF (in the work dir, removed at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
for p in (ROOT, ROOT / "tests", ROOT / "tests" / "llama"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

MiB = 1 << 20
PAGE = 2 * MiB            # the daemon's page: a GPU's VMM granularity, on both devices
KIND = "llama.cpp"  # the stage's name (scripts/gpu-bundle/report.py STAGE_NAMES)

# model name: (seed, tiny_model.write shape); B has GQA and half the layers
MODELS = {
    "A": (0, {}),
    "B": (5, dict(n_layer=2, n_embd=512, n_head=8, n_head_kv=4, n_ff=1024)),
}
CTX = 8192                # -c (all slots together)
LONG_CHARS = 6000         # ~4800 tokens: more than one 2 MiB page per K/V tensor (512 B per cell)
RECLAIM_BUDGET = 40 * MiB  # A holds 32 MiB after the long prompt, B needs 16 MiB: reclaim must move pages
# A trim (slot erase) keeps up to KVCACHED_STANDBY_BYTES as standby pages until no batch ran for
# KVCACHED_STANDBY_IDLE_MS (default 1 s; docs/llama-cpp.md "Standby pages"): "pages back after slot erase"
# waits for that idle release, at most this long
IDLE_RELEASE_WAIT = 1.0 + 3

# A real 8B model's KV shape (Llama-3.1-8B: 32 layers, 8 KV heads of 128, so 2 KiB per cell of each of the 64
# K/V tensors and 128 KiB of f16 KV per token; 32 query heads over n_embd 4,096) with random q4_0 weights from
# stage 5's maker (tests/helpers/q4_gguf.py). On a GPU its FFN is 1,024 wide (not 14,336) and its vocabulary
# 16,384 (not 128,256): 1.0 GiB of weights instead of 4.3, written and loaded in seconds, the KV exactly an
# 8B's; at a 32k context over 4 slots (8,192 cells a slot, 8 pages of 2 MiB per tensor and slot) stock's KV
# buffer is 4 GiB. On a CPU (the dry run in the llama suite) the same KV row on 4 layers, 8 heads of 128 over
# n_embd 1,024, at a 16k context (4,096 cells a slot, 4 pages per tensor and slot): stock's buffer is 256 MiB.
KV8B_SHAPES = {
    "cuda": dict(n_vocab=16384, n_embd=4096, n_ff=1024, n_layer=32, n_head=32, n_head_kv=8, n_ctx_train=131072,
                 rope_base=500000.0),
    "cpu": dict(n_vocab=4096, n_embd=1024, n_ff=256, n_layer=4, n_head=8, n_head_kv=8, n_ctx_train=131072,
                rope_base=500000.0),
}
KV8B_CTX = {"cuda": 32768, "cpu": 16384}
KV8B_SLOTS = 4
KV8B_PROMPT_CHARS = (150, 300, 600, 1400)  # four at once; the longest needs two 2 MiB pages per K/V tensor


def kv8b_label(device: str) -> str:
    sh = KV8B_SHAPES["cuda" if device == "cuda" else "cpu"]
    return (f"8B KV shape ({sh['n_layer']} layers, {sh['n_head_kv']} KV heads of {sh['n_embd'] // sh['n_head']}), "
            f"{KV8B_CTX['cuda' if device == 'cuda' else 'cpu'] // 1024}k context, {KV8B_SLOTS} slots")


GREEDY = [(m, f, n) for m in ("A", "B") for f in ("on", "off") for n in (1, 4)]


def greedy_name(model: str, fa: str, parallel: int) -> str:
    return f"greedy tokens identical: model {model}, flash attention {fa}, {parallel} slot{'s' if parallel > 1 else ''}"


# the 8B KV shape's checks (the first gives three rows, the second two)
KV8B_CHECKS = [
    "8B KV shape: greedy tokens identical, KV held against stock's KV buffer, pages back after slot erase",
    "8B KV shape: two servers share one budget; a SIGKILLed one's pages back",
]

# every check of `checks`, in the order they run (the skip rows name them too)
PLAN_NAMES = [
    "KV buffer in daemon pages; greedy tokens model A, fa on, 1 slot; pages follow the context",
    "SIGKILLed server's pages back in the pool",
    f"two servers, one {RECLAIM_BUDGET // MiB} MiB budget: reclaim moves pages",
    *(greedy_name(*k) for k in GREEDY if k != ("A", "on", 1)),
    *KV8B_CHECKS,
    "device memory back to its start at the end",
]


# ---------------------------------------------------------------- rows and verdicts (unit tested)

def make_row(check: str, expected: str, seen: str, verdict: str, kind: str = KIND) -> dict:
    assert verdict in ("pass", "FAIL", "DIFF", "info", "skip"), verdict
    return {"check": check, "expected": expected, "seen": seen, "verdict": verdict, "kind": kind}


def greedy_row(label: str, want: list[list[int]], got: list[list[int]]) -> dict:
    """Tokens of every prompt, unpatched against patched: pass only when all
    are identical (and there is something to compare)."""
    n = sum(len(t) for t in want)
    if not want or n == 0:
        return make_row(f"greedy tokens identical: {label}", "patched == unpatched", "no tokens to compare", "FAIL")
    if len(want) != len(got):
        return make_row(f"greedy tokens identical: {label}", "patched == unpatched",
                        f"{len(got)} answers for {len(want)} prompts", "FAIL")
    bad = [i for i, (w, g) in enumerate(zip(want, got)) if w != g]
    if bad:
        i = bad[0]
        first = next((k for k, (a, b) in enumerate(zip(want[i], got[i])) if a != b), min(len(want[i]), len(got[i])))
        return make_row(f"greedy tokens identical: {label}", "patched == unpatched",
                        f"{len(bad)} of {len(want)} prompts differ (prompt {i}: first at token {first})", "FAIL")
    return make_row(f"greedy tokens identical: {label}", "patched == unpatched",
                    f"{len(want)} prompts, {n} tokens identical", "pass")


def grow_trim_row(steps: list[tuple[str, int, int, int]], erased: int) -> dict:
    """steps: (what, cells used, held bytes, most the cache may hold) after
    each prompt, in growing order; erased: held bytes after the slot erase.
    Pass when held grew with the context, stayed within its bound at every
    step, and went back to 0."""
    seen = "; ".join(f"{w}: {c} cells, {h / MiB:.0f} MiB (bound {b / MiB:.0f})" for w, c, h, b in steps)
    seen += f"; after erase {erased / MiB:.0f} MiB"
    helds = [h for _, _, h, _ in steps]
    ok = (len(steps) >= 2 and helds[0] > 0 and helds[-1] > helds[0]
          and all(0 < h <= b for _, _, h, b in steps) and erased == 0)
    return make_row("pages follow the context (grow, trim on slot erase)",
                    "held grows with the cells used, within cells read + 1 page per tensor; "
                    "0 after erase (and the idle release)",
                    seen, "pass" if ok else "FAIL")


def memory_back_row(before: int | None, after: int | None, source: str, page: int = PAGE) -> dict:
    """Device memory in use before the first server and after the last one
    (bytes, from `source`): back within one page."""
    check = "device memory back to its start at the end"
    if before is None or after is None:
        return make_row(check, f"within {page // MiB} MiB of the start", f"not measured ({source})", "skip")
    d = after - before
    seen = f"{before / MiB:.0f} -> {after / MiB:.0f} MiB in use ({source}; {d / MiB:+.1f} MiB)"
    return make_row(check, f"within {page // MiB} MiB of the start (other GPU processes change it too)", seen,
                    "pass" if d <= page else "FAIL")


def kv_against_stock_row(label: str, held: int, stock_mib: float | None, bound: int, kv_line: float | None,
                         page: int = PAGE) -> dict:
    """The patched server's KV (daemon books, all slots holding their
    prompts) against the unpatched server's "KV buffer size" line: some
    pages, never more than stock's buffer rounded up to a page, never more
    than the cells read plus a page per tensor and slot."""
    check = f"{label}: KV held against stock's KV buffer"
    expected = "0 < held <= stock's KV buffer (+1 page) and <= cells read + 1 page per tensor and slot"
    if stock_mib is None:
        return make_row(check, expected, f"held {held / MiB:.0f} MiB; stock's log has no KV buffer line", "FAIL")
    stock = int(stock_mib * MiB)
    seen = (f"held {held / MiB:.0f} MiB (daemon books) = {100 * held / stock:.1f} % of stock's {stock_mib:.0f} MiB "
            f"KV buffer; bound {bound / MiB:.0f} MiB; the patched server's last KV line "
            + (f"{kv_line:.0f} MiB" if kv_line is not None else "none"))
    ok = 0 < held <= stock + page and held <= bound
    return make_row(check, expected, seen, "pass" if ok else "FAIL")


def deadline_rows(pending: list[str], reason: str) -> list[dict]:
    return [make_row(c, "runs before the stage deadline", f"skip: {reason}", "skip") for c in pending]


def books_ok(stats) -> bool:
    for p in [stats.total, *stats.devices.values()]:
        if p.pooled_bytes + p.in_use_bytes + p.free_bytes != p.budget_bytes:
            return False
    return True


# decode variants (stage 4): name -> (binary: orig|kvc, through the daemon, CUDA graphs on)
DECODE_VARIANTS = {
    "unpatched": ("orig", False, True),
    "patched_no_daemon": ("kvc", False, True),   # the hook built in, no socket: pass-throughs
    "patched": ("kvc", True, True),               # KV in daemon pages
    "unpatched_graphs_off": ("orig", False, False),  # GGML_CUDA_DISABLE_GRAPHS=1 (cuda only)
    "patched_graphs_off": ("kvc", True, False),
    "patched_premap": ("kvc", True, True),        # KVCACHED_PREMAP=1: the whole KV mapped at start, never trimmed
}
# a variant's own environment (on top of GGML_CUDA_DISABLE_GRAPHS for the graphs-off ones)
DECODE_ENV = {"patched_premap": {"KVCACHED_PREMAP": "1"}}
# every patched server counts and times its hook calls (the hook's KVCACHED_HOOK_STATS line at exit)
HOOK_STATS_ENV = {"KVCACHED_HOOK_STATS": "1"}
# variant -> (its ratio's figure name, the variant it is divided by)
DECODE_RATIOS = {
    "patched": ("decode_patched_over_unpatched", "unpatched"),
    "patched_no_daemon": ("decode_patched_no_daemon_over_unpatched", "unpatched"),
    "patched_graphs_off": ("decode_patched_over_unpatched_graphs_off", "unpatched_graphs_off"),
    "unpatched_graphs_off": ("decode_unpatched_graphs_off_over_unpatched", "unpatched"),
    "patched_premap": ("decode_patched_premap_over_unpatched", "unpatched"),
}


def median(v: list[float]) -> float:
    s = sorted(v)
    if not s:
        return 0.0
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2


def decode_figures(samples: dict[str, dict[int, list[float]]], device: str, model: str) -> dict:
    """figures.json entries from decode tokens/s samples ({variant: {tokens:
    [tokens/s, ...]}}): each variant's median at the longest run and its
    ratio to the unpatched server; with two run lengths, each variant's cost
    split into a per-token and a per-request part (median time of a run
    against its length: t = fixed + n * per_token), which tells a per-token
    cost from one paid once per request (pages mapped, trimmed)."""
    lengths = sorted({n for v in samples.values() for n in v})
    if not lengths:
        return {}
    n_max = lengths[-1]
    rounds = max((len(x) for v in samples.values() for x in v.values()), default=0)
    note = f"llama-server decode, tiny model {model}, {device}, {n_max} tokens, median of {rounds}"
    figs: dict = {}
    for name, runs in samples.items():
        v = median(runs.get(n_max, []))
        if not runs.get(n_max):
            continue
        figs[f"decode_tokens_per_s_{name}"] = {"value": round(v, 1), "unit": "tokens/s", "device": device, "note": note,
                                               "samples": [round(x, 1) for x in runs[n_max]]}
        if name in DECODE_RATIOS:
            key, against = DECODE_RATIOS[name]
            ref = median(samples.get(against, {}).get(n_max, []))
            figs[key] = {"value": round(v / ref, 3) if ref else 0.0, "unit": "ratio", "device": device, "note": note}
        short = [n for n in lengths if runs.get(n)]
        if len(short) >= 2 and short[0] != short[-1]:
            n1, n2 = short[0], short[-1]
            t1, t2 = n1 / median(runs[n1]), n2 / median(runs[n2])  # seconds per run
            per_token = (t2 - t1) / (n2 - n1)
            figs[f"decode_us_per_token_{name}"] = {"value": round(per_token * 1e6, 1), "unit": "us", "device": device,
                                                   "note": f"slope of median run time, {n1} and {n2} tokens"}
            figs[f"decode_ms_per_request_{name}"] = {"value": round((t1 - per_token * n1) * 1e3, 2), "unit": "ms",
                                                     "device": device, "note": f"intercept, {n1} and {n2} tokens"}
    return figs


HOOK_STATS_RE = re.compile(r"kvcached: hook stats: calls (\d+) in ([\d.]+) us; ?(.*)")
HOOK_ENTRY_RE = re.compile(r"(\w+) (\d+) / ([\d.]+) us")


def parse_hook_stats(log: str) -> dict | None:
    """The hook's KVCACHED_HOOK_STATS line (printed at exit): {"calls", "us",
    "entries": {entry: [calls, us]}}; None when the log has none (the
    unpatched server, or a process that did not exit cleanly)."""
    found = HOOK_STATS_RE.findall(log)
    if not found:
        return None
    calls, us, rest = found[-1]
    return {"calls": int(calls), "us": float(us),
            "entries": {m.group(1): [int(m.group(2)), float(m.group(3))] for m in HOOK_ENTRY_RE.finditer(rest)}}


# entries a server calls while it loads or exits, not per batch: left out of the per-token figures
# (buf_clear: the constructor's clear and the one after llama.cpp's warm-up run)
HOOK_LOAD_ENTRIES = ("alloc_kv", "buffer_size", "buf_clear", "buf_free", "set_idle_release")


def hook_figures(stats: dict[str, dict | None], tokens: dict[str, int], device: str, model: str) -> dict:
    """figures.json entries from each patched variant's hook counters and the
    tokens its server generated (every request's, the warm-up included):
    hook calls and microseconds inside the hook per generated token, with
    each entry's share, leaving out what a server calls while it loads and
    exits (HOOK_LOAD_ENTRIES; their time is `load_us`). The per-request
    calls (a prompt batch's Allocate in `map`, the trim of a slot's cells
    in `trim`) are in the figures spread over the tokens, so they are an
    upper bound of what a decode step pays; the counting itself (two clock
    reads a call) is inside them."""
    figs: dict = {}
    for name, st in stats.items():
        n = tokens.get(name, 0)
        if not st or n <= 0:
            continue
        run = {k: v for k, v in st["entries"].items() if k not in HOOK_LOAD_ENTRIES}
        calls, us = sum(c for c, _ in run.values()), sum(u for _, u in run.values())
        load_us = round(sum(u for k, (_, u) in st["entries"].items() if k in HOOK_LOAD_ENTRIES), 1)
        note = (f"the hook's own counters (KVCACHED_HOOK_STATS), {device}, tiny model {model}: its calls over the "
                f"{n} tokens the server generated, load and exit ({', '.join(HOOK_LOAD_ENTRIES)}) left out")
        per = {k: {"calls_per_token": round(c / n, 3), "us_per_token": round(u / n, 3)} for k, (c, u) in sorted(run.items())}
        figs[f"decode_hook_calls_per_token_{name}"] = {"value": round(calls / n, 2), "unit": "calls",
                                                       "device": device, "note": note, "entries": per}
        figs[f"decode_hook_us_per_token_{name}"] = {"value": round(us / n, 3), "unit": "us", "device": device,
                                                    "note": note, "calls": calls, "tokens": n, "load_us": load_us}
    return figs


def decode_summary(figs: dict) -> str:
    """One line for stage 4's row from decode_figures' entries."""
    def v(k, fmt="{:.0f}"):
        return fmt.format(figs[k]["value"]) if k in figs else "-"
    parts = [f"unpatched {v('decode_tokens_per_s_unpatched')}, patched {v('decode_tokens_per_s_patched')} tokens/s "
             f"(ratio {v('decode_patched_over_unpatched', '{:.3f}')})"]
    if "decode_tokens_per_s_patched_no_daemon" in figs:
        parts.append(f"patched without the daemon {v('decode_tokens_per_s_patched_no_daemon')} "
                     f"({v('decode_patched_no_daemon_over_unpatched', '{:.3f}')})")
    if "decode_tokens_per_s_unpatched_graphs_off" in figs:
        parts.append(f"CUDA graphs off: unpatched {v('decode_tokens_per_s_unpatched_graphs_off')}, patched "
                     f"{v('decode_tokens_per_s_patched_graphs_off')} ({v('decode_patched_over_unpatched_graphs_off', '{:.3f}')})")
    if "decode_tokens_per_s_patched_premap" in figs:
        parts.append(f"patched, whole KV mapped at start {v('decode_tokens_per_s_patched_premap')} "
                     f"({v('decode_patched_premap_over_unpatched', '{:.3f}')})")
    hook = [f"{n.removeprefix('decode_hook_us_per_token_')} {figs[n]['value']:.2f} us "
            f"({v(n.replace('_us_', '_calls_'), '{:.1f}')} calls)"
            for n in sorted(figs) if n.startswith("decode_hook_us_per_token_")]
    if hook:
        parts.append("in the hook per token: " + ", ".join(hook))
    if "decode_us_per_token_patched" in figs:
        parts.append(f"per token {v('decode_us_per_token_unpatched', '{:.1f}')} / {v('decode_us_per_token_patched', '{:.1f}')} us, "
                     f"per request {v('decode_ms_per_request_unpatched', '{:.2f}')} / {v('decode_ms_per_request_patched', '{:.2f}')} ms "
                     "(unpatched / patched)")
    note = figs.get("decode_tokens_per_s_unpatched", {}).get("note", "")
    return "; ".join(parts) + (f" [{note.removeprefix('llama-server decode, ')}]" if note else "")


# ---------------------------------------------------------------- processes

class Daemon:
    def __init__(self, workdir: pathlib.Path, name: str, backend: str, memory_limit: int, env: dict[str, str]):
        from kvtest import wait_serving

        self.socket = str(workdir / f"{name}.sock")
        self.log = workdir / f"{name}.log"
        penv = dict(os.environ)
        penv.update(env)
        penv["PYTHONPATH"] = str(ROOT) + (os.pathsep + penv["PYTHONPATH"] if penv.get("PYTHONPATH") else "")
        args = [sys.executable, "-m", "kvcached_service.server", "--socket", self.socket, "--backend", backend,
                "--memory-limit", str(memory_limit), "--page-size", str(PAGE), "--shutdown-grace", "0.5"]
        if backend == "host":
            args += ["--host-memory", str(max(memory_limit * 2, 512 * MiB))]
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(args, env=penv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        wait_serving(self.socket, self.proc, self.log, timeout=60)
        from kvcached_service.client import Client

        self.client = Client.connect(self.socket, timeout=30)
        # an observer session: the daemon's own uid is its admin, so its
        # GetStats lists every session (the servers' included)
        self.obs = self.client.open_session("gpu-llama-observer")

    def stats(self):
        return self.obs.stats()

    def session(self, pid: int):
        for s in self.stats().sessions:
            if s.pid == pid:
                return s
        return None

    def held(self, pid: int) -> int:
        s = self.session(pid)
        return s.held_bytes if s else 0

    def stop(self) -> int:
        try:
            self.obs.close()
            self.client.close()
        except Exception:  # noqa: BLE001 - the daemon may be gone already
            pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def wait_until(pred, timeout: float, interval: float = 0.02):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    return pred()


def device_used() -> tuple[int | None, str]:
    """Bytes in use on device 0: NVML (nvidia-ml-py) first, else torch's
    cuMemGetInfo (which makes a context of its own: measured in a child)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            return int(pynvml.nvmlDeviceGetMemoryInfo(h).used), "NVML"
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001 - fall back to torch
        nvml_err = f"{type(e).__name__}: {e}"
    code = "import torch; f, t = torch.cuda.mem_get_info(0); print(t - f)"
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        if r.returncode == 0:
            return int(r.stdout.strip().splitlines()[-1]), "torch.cuda.mem_get_info in a child (its context counted both times)"
        return None, f"NVML failed ({nvml_err}); torch: {r.stderr.strip().splitlines()[-1:] or r.returncode}"
    except Exception as e:  # noqa: BLE001
        return None, f"NVML failed ({nvml_err}); torch: {e}"


class Run:
    """One run of the checks: models, the unpatched tokens, the rows."""

    def __init__(self, a):
        import llamatest

        self.lt = llamatest
        self.a = a
        self.device = a.device
        self.out = pathlib.Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.rows_path = pathlib.Path(a.rows) if a.rows else self.out / "rows.jsonl"
        self.deadline = a.deadline or (time.time() + 3600)
        # sockets must stay short (108 bytes): a temp dir of our own
        self.work = pathlib.Path(tempfile.mkdtemp(prefix="kvc-gl-"))
        self.logs = self.out / "logs"
        self.logs.mkdir(exist_ok=True)
        self.orig = pathlib.Path(a.orig)
        self.kvc = pathlib.Path(a.kvc)
        self.servers: list = []
        self.daemons: list[Daemon] = []
        self.ref: dict = {}
        self.models: dict[str, pathlib.Path] = {}
        self.n_server = 0
        self.failed = False

    # -- rows
    def emit(self, r: dict) -> None:
        if self.device == "cpu":
            r = dict(r, check=f"cpu build, host pages: {r['check']}")
        if r["verdict"] == "FAIL":
            self.failed = True
        with open(self.rows_path, "a") as f:
            f.write(json.dumps(r) + "\n")
        print(f"{r['verdict']:5} {r['check']}: {r['seen']}", flush=True)

    def time_left(self) -> float:
        return self.deadline - time.time()

    # -- models, servers, daemons
    def make_models(self) -> None:
        try:
            import yaml  # noqa: F401
        except ImportError:
            # gguf imports yaml at start-up (for model cards: unused here); the
            # GPU host may lack PyYAML, and writing a model never needs it
            sys.modules["yaml"] = types.ModuleType("yaml")
        import tiny_model

        d = self.out / "models"
        d.mkdir(exist_ok=True)
        for name, (seed, shape) in MODELS.items():
            self.models[name] = tiny_model.write(d / f"tiny-{name}.gguf", seed=seed, **shape)

    def env(self) -> dict[str, str]:
        e = {}
        if self.device == "cuda" and os.environ.get("KVCACHED_LIBCUDA"):
            e["KVCACHED_LIBCUDA"] = os.environ["KVCACHED_LIBCUDA"]
        return e

    def server(self, binary: pathlib.Path, model: str, *, daemon: Daemon | None, parallel: int = 1, fa: str = "on",
               ctx: int = CTX, env: dict[str, str] | None = None, tag: str = ""):
        extra = ["--slot-save-path", str(self.work)]
        if self.device == "cuda":
            extra += ["-ngl", "99"]
        self.n_server += 1
        tag = tag or ("kvc" if daemon else "orig")
        log = self.logs / f"server{self.n_server:02d}-{tag}-{model}-fa{fa}-np{parallel}.log"
        s = self.lt.Server(binary, self.models[model], log, kvc_socket=daemon.socket if daemon else None, ctx=ctx,
                           parallel=parallel, fa=fa, extra=extra, env={**self.env(), **(env or {})})
        self.servers.append(s)
        return s

    def daemon(self, name: str, limit: int) -> Daemon:
        d = Daemon(self.work, name, "cuda" if self.device == "cuda" else "host", limit, self.env())
        self.daemons.append(d)
        return d

    def stop_all(self) -> None:
        for s in self.servers:
            s.stop()
        self.servers.clear()
        for d in self.daemons:
            d.stop()
            try:
                (self.logs / pathlib.Path(d.log).name).write_text(d.log.read_text(errors="replace"))
            except OSError:
                pass
        self.daemons.clear()

    def close(self) -> None:
        self.stop_all()
        shutil.rmtree(self.work, ignore_errors=True)

    @staticmethod
    def prompts(parallel: int, long: bool = False) -> list[str]:
        """1 slot: three prompts one after another in slot 0 (`long`: the
        last one needs two pages per K/V tensor); 4 slots: four at once."""
        import llamatest as lt

        if parallel == 1:
            return ["Hello", lt.text(300, 1), lt.text(LONG_CHARS, 3) if long else lt.text(1500, 2)]
        return [lt.text(200 + 300 * i, 20 + i) for i in range(parallel)]

    def answers(self, srv, parallel: int, long: bool = False, n_predict: int = 16) -> list[dict]:
        ps = self.prompts(parallel, long)
        if parallel == 1:
            return [srv.complete(p, n_predict, id_slot=0) for p in ps]
        res = srv.complete(ps, n_predict)
        return res if isinstance(res, list) else [res]

    def reference(self, model: str, fa: str, parallel: int, long: bool = False) -> list[list[int]]:
        key = (model, fa, parallel, long)
        if key not in self.ref:
            s = self.server(self.orig, model, daemon=None, parallel=parallel, fa=fa)
            try:
                self.ref[key] = [r["tokens"] for r in self.answers(s, parallel, long)]
            finally:
                s.stop()
                self.servers.remove(s)
        return self.ref[key]

    def kv_buffer_name(self) -> str:
        return "CUDA0" if self.device == "cuda" else "CPU"

    # -- the checks
    def check_first(self) -> None:
        """Model A, fa on, 1 slot: greedy identity, KV buffer in daemon pages, grow and trim."""
        want = self.reference("A", "on", 1, long=True)
        d = self.daemon("d1", 256 * MiB)
        srv = self.server(self.kvc, "A", daemon=d, parallel=1, fa="on")
        buf = self.kv_buffer_name()
        ps = self.prompts(1, long=True)
        got, steps = [], []
        row = tiny_model_row_bytes("A")
        for p, what in zip(ps, ("5 chars", "300 chars", f"{LONG_CHARS} chars")):
            r = srv.complete(p, 16, id_slot=0)
            got.append(r["tokens"])
            used = self.lt.used_cells(r)
            steps.append((what, used, d.held(srv.pid), self.lt.held_bound([used], [row] * 8, PAGE)))
        log = srv.log_text()
        sess = d.session(srv.pid)
        reserved = f"kvcached: {buf} KV buffer reserved" in log
        fallback = "in ordinary memory" in log
        kinds = sorted({dev.kind for dev in d.client.info.devices})
        seen = (f"hook log: {'reserved' if reserved else 'no reservation line'}"
                f"{', FELL BACK to ordinary memory' if fallback else ''}; daemon backend {d.client.info.backend} "
                f"({', '.join(kinds)} pages); session of pid {srv.pid}: "
                f"{'none' if sess is None else f'{sess.held_bytes / MiB:.0f} MiB held'}")
        ok = reserved and not fallback and sess is not None and sess.held_bytes > 0 and \
            d.client.info.backend == ("cuda" if self.device == "cuda" else "host")
        self.emit(make_row(f"KV buffer in daemon pages ({buf} buffer, daemon backend "
                           f"{'cuda' if self.device == 'cuda' else 'host'})",
                           f"hook log 'kvcached: {buf} KV buffer reserved ... in daemon pages'; the session holds pages",
                           seen, "pass" if ok else "FAIL"))
        self.emit(greedy_row(greedy_name("A", "on", 1).split(": ", 1)[1], want, got))
        srv.erase_slot(0)
        wait_until(lambda: d.held(srv.pid) == 0, IDLE_RELEASE_WAIT)  # standby: after the idle release
        self.emit(grow_trim_row(steps, d.held(srv.pid)))
        self.first = (d, srv)

    def check_sigkill(self) -> None:
        d, srv = getattr(self, "first", (None, None))
        if srv is None or srv.proc.poll() is not None:
            d = self.daemons[0] if self.daemons else self.daemon("d1", 256 * MiB)
            srv = self.server(self.kvc, "A", daemon=d)
        srv.complete(self.prompts(1, long=True)[2], 8, id_slot=0)
        pid = srv.pid
        held = d.held(pid)
        os.kill(pid, signal.SIGKILL)
        srv.proc.wait()
        t0 = time.monotonic()
        gone = wait_until(lambda: d.session(pid) is None, 5, 0.01)
        took = time.monotonic() - t0
        st = d.stats()
        # nothing of the dead session stays in use: in use is what the live sessions hold
        live = sum(s.held_bytes for s in st.sessions)
        ok = bool(gone) and took <= 1.0 and held > 0 and st.total.in_use_bytes == live and books_ok(st)
        self.emit(make_row("SIGKILLed server's pages back in the pool",
                           "session gone within 1 s; in use = what live sessions hold; books add up",
                           f"held {held / MiB:.0f} MiB; session gone after {took:.2f} s; in use "
                           f"{st.total.in_use_bytes / MiB:.0f} MiB (live sessions {live / MiB:.0f}), pooled "
                           f"{st.total.pooled_bytes / MiB:.0f} MiB; books {'add up' if books_ok(st) else 'DO NOT add up'}",
                           "pass" if ok else "FAIL"))
        self.servers.remove(srv)
        srv.stop()

    def check_reclaim(self) -> None:
        long_ = self.prompts(1, long=True)[2]
        want_a = self.reference("A", "on", 1, long=True)[2]
        want_b = self.reference("B", "on", 1, long=True)[2]
        d = self.daemon("d2", RECLAIM_BUDGET)
        a = self.server(self.kvc, "A", daemon=d)
        b = self.server(self.kvc, "B", daemon=d)
        ra = a.complete(long_, 16, id_slot=0)
        held_a0 = d.held(a.pid)
        rb = b.complete(long_, 16, id_slot=0)
        held_a1, held_b1 = d.held(a.pid), d.held(b.pid)
        st = d.stats()
        reclaims_seen = "kvcached: reclaim" in a.log_text()
        # and back: A serves its prompt again, taking pages from the now idle B
        ra2 = a.complete(long_, 16, id_slot=0)
        held_a2, held_b2 = d.held(a.pid), d.held(b.pid)
        st2 = d.stats()
        ok = (ra["tokens"] == want_a and rb["tokens"] == want_b and held_a0 + (16 * MiB) > RECLAIM_BUDGET
              and held_a1 < held_a0 and held_b1 > 0 and st.total.in_use_bytes <= RECLAIM_BUDGET and books_ok(st)
              and held_a2 > held_a1 and held_b2 < held_b1 and st2.total.in_use_bytes <= RECLAIM_BUDGET
              and books_ok(st2) and ra2["tokens"] == want_a)
        self.emit(make_row(f"two servers, one {RECLAIM_BUDGET // MiB} MiB budget: reclaim moves pages",
                           "idle A gives pages to B, then B to A; tokens identical; in use <= budget; books add up",
                           f"A {held_a0 / MiB:.0f} -> {held_a1 / MiB:.0f} -> {held_a2 / MiB:.0f} MiB, B 0 -> "
                           f"{held_b1 / MiB:.0f} -> {held_b2 / MiB:.0f} MiB; in use {st.total.in_use_bytes / MiB:.0f} / "
                           f"{st2.total.in_use_bytes / MiB:.0f} MiB; tokens A {'same' if ra['tokens'] == ra2['tokens'] == want_a else 'DIFFER'}, "
                           f"B {'same' if rb['tokens'] == want_b else 'DIFFER'}; A's log "
                           f"{'names' if reclaims_seen else 'does not name'} the reclaim",
                           "pass" if ok else "FAIL"))
        for s in (a, b):
            s.stop()
            self.servers.remove(s)

    def check_greedy(self, model: str, fa: str, parallel: int) -> None:
        label = greedy_name(model, fa, parallel).split(": ", 1)[1]
        want = self.reference(model, fa, parallel)
        d = self.daemons[0] if self.daemons and self.daemons[0].proc.poll() is None else self.daemon("d3", 256 * MiB)
        srv = self.server(self.kvc, model, daemon=d, parallel=parallel, fa=fa)
        got = [r["tokens"] for r in self.answers(srv, parallel)]
        held = d.held(srv.pid)
        r = greedy_row(label, want, got)
        if r["verdict"] == "pass" and held <= 0:
            r = make_row(r["check"], r["expected"] + " (KV in daemon pages)", r["seen"] + "; but no pages held", "FAIL")
        else:
            r["seen"] += f"; {held / MiB:.0f} MiB in daemon pages"
        self.emit(r)
        srv.stop()
        self.servers.remove(srv)

    # -- the 8B KV shape (issue 43 item 3)
    def kv8b_model(self) -> str:
        """Writes the 8B-KV-shape GGUF once (into the work dir: it is not
        output) and returns its name in self.models."""
        if "kv8b" not in self.models:
            if str(HERE) not in sys.path:
                sys.path.insert(0, str(HERE))
            import q4_gguf

            shape = KV8B_SHAPES["cuda" if self.device == "cuda" else "cpu"]
            info = q4_gguf.write(self.work / "kv8b.gguf", shape, seed=43, name="random-q4_0-8b-kv-shape")
            self.models["kv8b"] = pathlib.Path(info["path"])
            self.kv8b_made = f"{info['bytes'] / MiB:.0f} MiB of q4_0 weights written in {info['seconds']:.1f} s"
        return "kv8b"

    def kv8b_prompts(self) -> list[str]:
        return [self.lt.text(n, 80 + i) for i, n in enumerate(KV8B_PROMPT_CHARS)]

    def kv8b_server(self, binary: pathlib.Path, daemon: Daemon | None, tag: str = ""):
        ctx = KV8B_CTX["cuda" if self.device == "cuda" else "cpu"]
        return self.server(binary, self.kv8b_model(), daemon=daemon, parallel=KV8B_SLOTS, fa="on", ctx=ctx, tag=tag)

    def kv8b_answers(self, srv, **kw) -> list[dict]:
        res = srv.complete(self.kv8b_prompts(), 16, **kw)
        return res if isinstance(res, list) else [res]

    def kv8b_bound(self, answers: list[dict]) -> int:
        import q4_gguf

        shape = KV8B_SHAPES["cuda" if self.device == "cuda" else "cpu"]
        rows = [q4_gguf.kv_row_bytes(shape)] * (2 * shape["n_layer"])
        # the prompts go through in shared ubatches, and a ubatch's graph reads n_kv cells (its longest
        # stream's, padded) of every stream it touches: each stream may hold what the longest reads
        longest = max(self.lt.used_cells(r) for r in answers)
        return self.lt.held_bound([longest] * len(answers), rows, PAGE)

    def check_kv8b(self) -> None:
        """Stock's tokens and KV buffer line, then the patched server through
        the daemon: tokens identical, KV held against stock's, 0 after every
        slot is erased."""
        label = kv8b_label(self.device)
        stock = self.kv8b_server(self.orig, None, tag="orig-kv8b")
        try:
            want = [r["tokens"] for r in self.kv8b_answers(stock)]
            lines = self.lt.kv_line_values(stock.log_text(), self.kv_buffer_name())
        finally:
            stock.stop()
            self.servers.remove(stock)
        self.ref["kv8b"] = want
        stock_mib = lines[-1] if lines else None
        limit = 2 * int(stock_mib * MiB) if stock_mib else 8 << 30
        d = self.daemon("d8", max(limit, 256 * MiB))
        srv = self.kv8b_server(self.kvc, d, tag="kvc-kv8b")
        got = self.kv8b_answers(srv)
        held = d.held(srv.pid)
        bound = self.kv8b_bound(got)
        time.sleep(1.2)  # the hook logs a changed KV line at most once a second
        kv_lines = self.lt.kv_line_values(srv.log_text(), self.kv_buffer_name())
        r = greedy_row(label, want, [x["tokens"] for x in got])
        r["seen"] += f"; {getattr(self, 'kv8b_made', '')}"
        self.emit(r)
        self.emit(kv_against_stock_row(label, held, stock_mib, bound, kv_lines[-1] if kv_lines else None))
        self.kv8b_held = held
        for i in range(KV8B_SLOTS):
            srv.erase_slot(i)
        # what the erase keeps as standby (up to KVCACHED_STANDBY_BYTES) goes back once no batch ran for
        # KVCACHED_STANDBY_IDLE_MS: wait for that idle release
        t0 = time.monotonic()
        wait_until(lambda: d.held(srv.pid) == 0, IDLE_RELEASE_WAIT)
        waited = time.monotonic() - t0
        after = d.held(srv.pid)
        st = d.stats()
        self.emit(make_row(f"{label}: pages back after slot erase",
                           "0 held once every slot is erased (standby pages: after the idle release); books add up",
                           f"{held / MiB:.0f} MiB -> {after / MiB:.0f} MiB after erasing {KV8B_SLOTS} slots (and the standby "
                           f"pages' idle release: {waited:.1f} s); in use "
                           f"{st.total.in_use_bytes / MiB:.0f} MiB; books {'add up' if books_ok(st) else 'DO NOT add up'}",
                           "pass" if held > 0 and after == 0 and books_ok(st) else "FAIL"))
        srv.stop()
        self.servers.remove(srv)
        d.stop()
        self.daemons.remove(d)

    def check_kv8b_shared(self) -> None:
        """Two patched servers of the 8B KV shape over one budget of 1.5 times
        what one holds: the second's prompts reclaim from the idle first, the
        first's again from the second; tokens identical to stock's; then the
        first, holding pages, is SIGKILLed. Every request prefills its whole
        prompt (cache_prompt off): a slot that kept its prompt would compute
        only its last token again, alone in a batch, and q4_0's kernels
        round a batch of one differently from a batch of many (on the CPU
        that flipped near ties of this random model)."""
        label = kv8b_label(self.device)
        held1 = getattr(self, "kv8b_held", 0)
        if held1 <= 0:
            raise RuntimeError("needs the first 8B KV check's pages held (it did not run or failed)")
        budget = (held1 + held1 // 2) // PAGE * PAGE
        want = self.ref.get("kv8b")
        d = self.daemon("d9", budget)
        a = self.kv8b_server(self.kvc, d, tag="kvc-kv8b-a")
        b = self.kv8b_server(self.kvc, d, tag="kvc-kv8b-b")
        ta = [r["tokens"] for r in self.kv8b_answers(a, cache_prompt=False)]
        held_a0 = d.held(a.pid)
        tb = [r["tokens"] for r in self.kv8b_answers(b, cache_prompt=False)]
        held_a1, held_b1 = d.held(a.pid), d.held(b.pid)
        st = d.stats()
        ta2 = [r["tokens"] for r in self.kv8b_answers(a, cache_prompt=False)]
        held_a2, held_b2 = d.held(a.pid), d.held(b.pid)
        st2 = d.stats()
        same = ta == tb == ta2 and (want is None or ta == want)
        ok = (same and held_a0 > budget - held_a0 and held_a1 < held_a0 and held_b1 > 0 and held_a2 > held_a1
              and held_b2 < held_b1 and max(st.total.in_use_bytes, st2.total.in_use_bytes) <= budget
              and books_ok(st) and books_ok(st2))
        self.emit(make_row(f"{label}: two servers, one {budget / MiB:.0f} MiB budget (1.5 x one server's pages)",
                           "idle A gives pages to B, then B to A; tokens identical; in use <= budget; books add up",
                           f"A {held_a0 / MiB:.0f} -> {held_a1 / MiB:.0f} -> {held_a2 / MiB:.0f} MiB, B 0 -> "
                           f"{held_b1 / MiB:.0f} -> {held_b2 / MiB:.0f} MiB; in use {st.total.in_use_bytes / MiB:.0f} / "
                           f"{st2.total.in_use_bytes / MiB:.0f} MiB; tokens {'identical' if same else 'DIFFER'}"
                           f"{'' if want is not None else ' (A, B, A; no stock reference)'}",
                           "pass" if ok else "FAIL"))
        pid = a.pid
        held = d.held(pid)
        os.kill(pid, signal.SIGKILL)
        a.proc.wait()
        t0 = time.monotonic()
        gone = wait_until(lambda: d.session(pid) is None, 5, 0.01)
        took = time.monotonic() - t0
        st = d.stats()
        live = sum(s.held_bytes for s in st.sessions)
        ok = bool(gone) and took <= 1.0 and held > 0 and st.total.in_use_bytes == live and books_ok(st)
        self.emit(make_row(f"{label}: SIGKILLed server's pages back in the pool",
                           "session gone within 1 s; in use = what live sessions hold; books add up",
                           f"held {held / MiB:.0f} MiB; session gone after {took:.2f} s; in use "
                           f"{st.total.in_use_bytes / MiB:.0f} MiB (live sessions {live / MiB:.0f}); books "
                           f"{'add up' if books_ok(st) else 'DO NOT add up'}", "pass" if ok else "FAIL"))
        for s in (a, b):
            s.stop()
            self.servers.remove(s)

    def run(self) -> int:
        greedy = {greedy_name(m, f, n): (m, f, n) for m, f, n in GREEDY}
        fns = [self.check_first, self.check_sigkill, self.check_reclaim]
        plan = list(zip(PLAN_NAMES[:3], fns))
        plan += [(n, lambda k=k: self.check_greedy(*k)) for n, k in greedy.items() if k != ("A", "on", 1)]
        plan += list(zip(KV8B_CHECKS, [self.check_kv8b, self.check_kv8b_shared]))
        used0, src = (None, "cpu mode: no device") if self.device != "cuda" else device_used()
        t_models = time.monotonic()
        try:
            self.make_models()
        except Exception as e:  # noqa: BLE001 - one FAIL row, nothing else can run
            self.emit(make_row("test models made with gguf", "two tiny GGUFs", f"{type(e).__name__}: {e}", "FAIL"))
            return 1
        self.emit(make_row("test models (tests/llama/tiny_model.py, gguf)", "made",
                           ", ".join(f"{n}: {p.stat().st_size / MiB:.1f} MiB" for n, p in self.models.items())
                           + f" in {time.monotonic() - t_models:.1f} s", "info"))
        for i, (name, fn) in enumerate(plan):
            if self.time_left() <= 0:
                for r in deadline_rows([n for n, _ in plan[i:]], "stage deadline reached before this check"):
                    self.emit(r)
                break
            t = time.monotonic()
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - the check fails, the next ones still run
                msg = str(e).strip().splitlines()
                self.emit(make_row(name, "runs", f"{type(e).__name__}: {' '.join(msg[:3])[:400]}", "FAIL"))
                keep = getattr(self, "first", (None, None))[1]
                for s in [s for s in self.servers if s is not keep]:  # what the failed check left running
                    s.stop()
                    self.servers.remove(s)
            print(f"      ({time.monotonic() - t:.1f} s)", flush=True)
        self.stop_all()
        if self.device == "cuda":
            # the driver frees a dead process's memory shortly after it exits
            after = device_used()
            end = time.monotonic() + 5
            while after[0] is not None and used0 is not None and after[0] - used0 > PAGE and time.monotonic() < end:
                time.sleep(0.25)
                after = device_used()
            self.emit(memory_back_row(used0, after[0], after[1] if used0 is not None else f"{src}; {after[1]}"))
        else:
            self.emit(make_row("device memory back to its start at the end", "NVML", "skip: cpu mode (no device)", "skip"))
        return 1 if self.failed else 0


def tiny_model_row_bytes(model: str) -> int:
    import tiny_model

    shape = MODELS[model][1]
    return tiny_model.kv_row_bytes(shape.get("n_embd", tiny_model.N_EMBD), shape.get("n_head", tiny_model.N_HEAD),
                                   shape.get("n_head_kv", tiny_model.N_HEAD_KV))


def decode(a) -> int:
    """Decode tokens/s on model A (stage 4) of the unpatched server, the
    patched one through the daemon, the patched one without it (the hook
    built in but idle: tells the build from the pages), the patched one with
    the whole KV mapped at start and never trimmed (KVCACHED_PREMAP: no map
    or trim after the start) and, on CUDA, the unpatched and patched ones
    with CUDA graphs off. Every patched server counts and times its hook
    calls (KVCACHED_HOOK_STATS; read from its log once it exited), giving the
    calls and microseconds inside the hook per generated token. All run at once; each
    round runs every variant at every length (rotating the order, so that
    other load on the host falls on all alike); llama-server's own timings.
    Two lengths split each variant's time into per-token and per-request
    parts (decode_figures)."""
    lengths = sorted({int(x) for x in a.tokens.split(",") if x})
    run = Run(a)
    run.make_models()
    names = [n for n, (_, _, graphs) in DECODE_VARIANTS.items() if graphs or a.device == "cuda"]
    samples: dict[str, dict[int, list[float]]] = {n: {k: [] for k in lengths} for n in names}
    tokens = dict.fromkeys(names, 0)  # every token each server generated (the hook's counters cover them all)
    srv = {}
    try:
        d = run.daemon("dd", 256 * MiB)
        for n in names:
            build, via_daemon, graphs = DECODE_VARIANTS[n]
            env = {} if graphs else {"GGML_CUDA_DISABLE_GRAPHS": "1"}
            env.update(DECODE_ENV.get(n, {}), **(HOOK_STATS_ENV if build == "kvc" else {}))
            srv[n] = run.server(run.orig if build == "orig" else run.kvc, "A", daemon=d if via_daemon else None,
                                parallel=1, fa="on", ctx=4096, tag=n, env=env)
        for n, s in srv.items():
            tokens[n] += s.complete("Hello", 8, id_slot=0)["tokens_predicted"]  # warm-up
        for i in range(a.rounds):
            order = names[i % len(names):] + names[:i % len(names)]
            for k in lengths:
                for n in order:
                    r = srv[n].complete(f"Hello {i}", k, id_slot=0, cache_prompt=False)
                    samples[n][k].append(float(r["timings"]["predicted_per_second"]))
                    tokens[n] += r["tokens_predicted"]
    finally:
        run.close()  # the servers exit: the patched ones print their hook counters
    stats = {n: parse_hook_stats(s.log_text()) for n, s in srv.items() if DECODE_VARIANTS[n][0] == "kvc"}
    figs = decode_figures(samples, a.device, "A")
    figs.update(hook_figures(stats, tokens, a.device, "A"))
    print(json.dumps({"figures": figs, "summary": decode_summary(figs), "raw": samples, "hook_stats": stats,
                      "tokens": tokens}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["checks", "decode", "skip"],
                    help="skip: write a skip row (--reason) for every check, run nothing")
    ap.add_argument("--reason", default="", help="skip: the reason (e.g. 'no CUDA runtime')")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--orig", default="", help="the unpatched llama-server")
    ap.add_argument("--kvc", default="", help="the patched llama-server")
    ap.add_argument("--out", required=True, help="directory for logs, models and (default) rows.jsonl")
    ap.add_argument("--rows", default="", help="append rows here (default OUT/rows.jsonl)")
    ap.add_argument("--deadline", type=float, default=0.0, help="epoch seconds: start no check after it")
    ap.add_argument("--tokens", default="128,1024", help="decode: tokens per run, one or two lengths")
    ap.add_argument("--rounds", type=int, default=5, help="decode: runs of each variant and length")
    a = ap.parse_args(argv)
    if a.mode == "skip":
        rows = pathlib.Path(a.rows) if a.rows else pathlib.Path(a.out) / "rows.jsonl"
        rows.parent.mkdir(parents=True, exist_ok=True)
        with open(rows, "a") as f:
            for name in PLAN_NAMES:
                f.write(json.dumps(make_row(name, "runs on a GPU", f"skip: {a.reason}", "skip")) + "\n")
        return 0
    if a.mode == "decode":
        return decode(a)
    run = Run(a)
    try:
        return run.run()
    finally:
        run.close()


if __name__ == "__main__":
    sys.exit(main())
