"""Stage 5 of the offline GPU bundle (issue 44): how many 8B models one GPU
keeps resident at Ollama's own defaults, stock against kvcached.

    python tests/helpers/gpu_capacity.py run --device cuda|cpu --orig BIN --kvc BIN --out DIR
        [--deadline EPOCH] [--rows FILE] [--figures FILE] [--shape llama3.1-8b|scaled]
        [--parallel 1,4] [--device-mib N] [--max-models N] [--work DIR]
    python tests/helpers/gpu_capacity.py skip --out DIR --reason TEXT

`run` writes one GGUF (tests/helpers/q4_gguf.py: Llama-3.1-8B's shape with
random q4_0 weights on cuda, the scaled shape on cpu) and then, for each slot
count of --parallel (1, then 4 if time is left):

1. stock: starts the unpatched llama-server one after another, as Ollama
   v0.34.4 starts its runner (OLLAMA_OLLAMA_FLAGS below: its arguments, its
   default context for this device, its batch rule), until the next one would
   not fit by Ollama's own rule (server/sched.go: the estimate, file size +
   f16 KV for num_ctx x slots + the batch surcharge, above 80 % of the free
   memory, the loaded runners counted by their buffer lines) or fails to
   load; each answers one short greedy request;
2. kvcached: the same with the patched llama-server and kvcached-serve
   (cuda backend, budget the device's free memory) until a runner fails to
   load, falls back to ordinary memory or its request fails (the daemon
   refused); then every resident model answers one short request in round
   robin, twice (streamed: time to first token);
3. rows (kind "capacity") and figures: models resident on each side and the
   ratio, device memory per model (NVML: the device's used memory before and
   after each runner, the daemon's pages included), KV held per model (the
   daemon's books), TTFT p50/p99 of the round robin, greedy tokens identical
   to stock on every model both sides had (at least 3), device memory back to
   its start at the end. Every record goes to OUT/capacity.json.

It stops starting runners at --deadline (a share of the time goes to the
stock side, the rest to kvcached and the round robin) and reports what it
reached. The runners are stopped with SIGKILL, as Ollama stops them.

--device cpu: the same scenario scaled for a CPU (the dry run and the CPU
figure): the "scaled" shape (KV at its trained context 3.9x its weights,
as a real 8B's 3.8x), the daemon on the host backend with pages holding as
many cells per K/V tensor as a 2 MiB page does on the GPU (128 KiB), and a
device of --device-mib emulated: its free memory is that size less every
runner's buffers as the runner logs them (what Ollama reads: model, KV,
compute, output; the patched runner's KV as the daemon's books say) and the
daemon's pages. A kvcached runner "fails to load" when its buffers (the
first one's, as logged) do not fit in what is free. Ollama's default
context is the trained context there too (its 262,144 for >= 47 GiB, capped),
-b/-ub scaled too, 64 by default (--batch): the compute buffer, whose KQ
mask grows with context x batch, is then a quarter of the weights, near
what an 8B's is estimated to be on a GPU (at Ollama's smallest, 512, it is
twice the scaled weights), and no surcharge (Ollama's are absolute: 768 MiB or 2 GiB would
dwarf a scaled device); one thread per runner (-t 1). The rows say "cpu,
scaled".
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
for p in (ROOT, ROOT / "tests", ROOT / "tests" / "llama", HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import q4_gguf  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
KIND = "capacity"  # scripts/gpu-bundle/report.py STAGE_NAMES[5]
PREFIX = "stage5."

# ---------------------------------------------------------------- Ollama v0.34.4's rules (unit tested)
# server/routes.go (default context by VRAM), server/sched.go (effectiveContext,
# the pre-load check, the automatic batch), llm/llama_server.go (the flags,
# PredictServerVRAM), ml/device.go.
OLLAMA_VERSION = "v0.34.4"
FIT_PERCENT = 80           # sched.go: predictedForLoad > freeMemory*80/100 -> evict
DEFAULT_MODELS_PER_GPU = 3  # sched.go: defaultModelsPerGPU (OLLAMA_MAX_LOADED_MODELS unset)


def ollama_default_num_ctx(total_vram: int, gpu_overhead: int = 0) -> int:
    """routes.go: 262,144 at >= 47 GiB of VRAM (less OLLAMA_GPU_OVERHEAD), 32,768 at >= 23 GiB, else 4,096."""
    t = total_vram - gpu_overhead
    if t >= 47 * GiB:
        return 262144
    if t >= 23 * GiB:
        return 32768
    return 4096


def effective_ctx(num_ctx: int, train_ctx: int) -> int:
    """sched.go effectiveContext: num_ctx capped at the model's trained context."""
    return train_ctx if 0 < train_ctx < num_ctx else num_ctx


def predict_server_vram(file_bytes: int, shape: dict, ctx_total: int) -> int:
    """llama_server.go PredictServerVRAM: file size + f16 K and V for the
    whole context (num_ctx x slots), head width = n_embd / n_head."""
    hd = shape["n_embd"] // shape["n_head"]
    return file_bytes + 2 * shape["n_layer"] * shape["n_head_kv"] * hd * ctx_total * 2


def batch_surcharge(batch: int) -> int:
    """sched.go generationBatchSurcharge."""
    if batch >= 2048:
        return 2 * GiB
    if batch >= 1024:
        return 768 * MiB
    return 0


def auto_batch(ctx_total: int, predicted: int, available: int, fa_disabled: bool = False) -> int:
    """sched.go automaticGenerationBatch (num_batch not set by the user, a
    completion model): 2048 above 32,768 tokens of context, 1024 above 4,096,
    else 512, lowered while the estimate leaves too little headroom (60 % /
    75 % of the available memory) or the surcharge does not fit in 80 %.
    Flash attention "auto" counts as not disabled."""
    if fa_disabled:
        return 512  # (256 on a constrained CUDA device; flash attention is on "auto" here)
    batch = 2048 if ctx_total > 32768 else 1024 if ctx_total > 4096 else 512

    def fits(b: int) -> bool:
        if predicted == 0 or available == 0:
            return True
        threshold = available * FIT_PERCENT // 100
        if predicted > threshold:
            return False
        head = 60 if b >= 2048 else 75 if b >= 1024 else 100
        if b >= 1024 and predicted > available * head // 100:
            return False
        return batch_surcharge(b) <= threshold - predicted

    while batch > 512 and not fits(batch):
        batch = 1024 if batch > 1024 else 512
    return batch


def ollama_fits(predicted_for_load: int, free: int, loaded: int) -> bool:
    """sched.go: the first runner always starts; the next one when its
    estimate is at most 80 % of the free memory."""
    return loaded == 0 or predicted_for_load <= free * FIT_PERCENT // 100


def ollama_free(nvml_free: int, total: int, accounted: int) -> int:
    """sched.go updateFreeSpace: the smaller of what the device reports and
    its total less what the loaded runners' buffer lines add up to."""
    return max(0, min(nvml_free, total - accounted)) if accounted else nvml_free


def ollama_args(model: str, port: int, num_ctx: int, parallel: int, batch: int) -> list[str]:
    """llm/llama_server.go's flags for a discrete GPU on Linux, num_batch,
    num_gpu, num_thread and the KV type left at their defaults (no
    --load-mode: mmap stays on; no -ngl, -t or cache types)."""
    return ["--model", model, "--port", str(port), "--host", "127.0.0.1", "--no-webui", "--offline",
            "-c", str(num_ctx * parallel), "-np", str(parallel),
            "--log-verbosity", "4", "--no-log-prefix", "--no-log-timestamps",
            "--flash-attn", "auto", "-b", str(batch), "-ub", str(batch), "--context-shift", "--keep", "4"]


def pct(v: list[float], q: float) -> float:
    if not v:
        return float("nan")
    s = sorted(v)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ---------------------------------------------------------------- rows

def make_row(check: str, expected: str, seen: str, verdict: str) -> dict:
    assert verdict in ("pass", "FAIL", "DIFF", "info", "skip"), verdict
    return {"check": check, "expected": expected, "seen": seen, "verdict": verdict, "kind": KIND}


def plan_names(parallels: list[int]) -> list[str]:
    """The rows `skip` writes (and a stopped run's missing phases)."""
    out = ["capacity model written (q4_0)"]
    for p in parallels:
        out += [f"stock, {slots(p)}: models resident", f"kvcached, {slots(p)}: models resident",
                f"{slots(p)}: models resident, kvcached over stock",
                f"{slots(p)}: every resident model answers, round robin twice",
                f"{slots(p)}: greedy tokens identical to stock"]
    out.append("device memory back to its start at the end")
    return out


def slots(p: int) -> str:
    return f"{p} slot{'s' if p > 1 else ''}"


def greedy_row(label: str, pairs: list[tuple[int, list[int], list[int]]], need: int = 3) -> dict:
    """pairs: (model index, stock tokens, kvcached tokens)."""
    check = f"{label}: greedy tokens identical to stock"
    exp = f"identical on every model both sides ran (at least {need})"
    bad = [i for i, a, b in pairs if a != b or not a]
    n = sum(len(a) for _, a, _ in pairs)
    if bad:
        return make_row(check, exp, f"{len(bad)} of {len(pairs)} models differ (model {bad[0] + 1} first)", "FAIL")
    if len(pairs) < need:
        return make_row(check, exp, f"only {len(pairs)} models on both sides ({n} tokens identical)",
                        "FAIL" if not pairs else "info")
    return make_row(check, exp, f"{len(pairs)} models, {n} tokens identical", "pass")


def memory_back_row(before: int | None, after: int | None, page: int = 2 * MiB) -> dict:
    check = "device memory back to its start at the end"
    if before is None or after is None:
        return make_row(check, f"within {page // MiB} MiB of the start", "not measured", "skip")
    d = after - before
    return make_row(check, f"within {page // MiB} MiB of the start (other GPU processes change it too)",
                    f"{before / MiB:.0f} -> {after / MiB:.0f} MiB in use (NVML; {d / MiB:+.1f} MiB)",
                    "pass" if d <= page else "FAIL")


# ---------------------------------------------------------------- the device

class Nvml:
    """Device 0 through NVML (nvidia-ml-py), else nvidia-smi."""

    def __init__(self):
        self.h = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nv = pynvml
            self.h = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.source = "NVML"
        except Exception as e:  # noqa: BLE001
            self.source = f"nvidia-smi (NVML: {type(e).__name__})"

    def mem(self) -> tuple[int, int, int]:
        """(total, free, used) bytes."""
        if self.h is not None:
            m = self.nv.nvmlDeviceGetMemoryInfo(self.h)
            return int(m.total), int(m.free), int(m.used)
        out = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=memory.total,memory.free,memory.used",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30).stdout
        t, f, u = (int(x.strip()) * MiB for x in out.strip().splitlines()[0].split(","))
        return t, f, u

    def procs(self) -> dict[int, int]:
        """pid -> bytes used on device 0 (host pids: may not match a container's)."""
        if self.h is None:
            return {}
        try:
            return {int(p.pid): int(p.usedGpuMemory or 0) for p in self.nv.nvmlDeviceGetComputeRunningProcesses(self.h)}
        except Exception:  # noqa: BLE001
            return {}

    def name(self) -> str:
        if self.h is None:
            return "device 0"
        n = self.nv.nvmlDeviceGetName(self.h)
        return n.decode() if isinstance(n, bytes) else str(n)


class EmulatedDevice:
    """--device cpu: a device of `size` bytes whose use is every live
    runner's logged buffers (the patched runners' KV excluded) plus the
    daemon's pages."""

    source = "emulated (runner buffer lines + daemon pages)"

    def __init__(self, size: int):
        self.size = size
        self.runners: list = []
        self.daemon = None

    def used(self) -> int:
        u = sum(r.buffers(kv=not r.kvc) for r in self.runners if r.alive())
        if self.daemon is not None:
            try:
                t = self.daemon.stats().total
                u += t.pooled_bytes + t.in_use_bytes
            except Exception:  # noqa: BLE001
                pass
        return u

    def mem(self) -> tuple[int, int, int]:
        u = self.used()
        return self.size, max(0, self.size - u), u

    def procs(self) -> dict[int, int]:
        return {}

    def name(self) -> str:
        return f"a CPU (emulated device of {self.size / MiB:.0f} MiB)"


# ---------------------------------------------------------------- processes

class Daemon:
    """kvcached-serve with a page size of our choosing; an observer session
    of the daemon's own uid sees every session's books."""

    def __init__(self, work: pathlib.Path, backend: str, limit: int, page: int, env: dict, logs: pathlib.Path):
        from kvtest import wait_serving

        self.socket = str(work / "d.sock")
        self.log = logs / "daemon.log"
        penv = dict(os.environ, **env)
        penv["PYTHONPATH"] = str(ROOT) + (os.pathsep + penv["PYTHONPATH"] if penv.get("PYTHONPATH") else "")
        args = [sys.executable, "-m", "kvcached_service.server", "--socket", self.socket, "--backend", backend,
                "--memory-limit", str(limit), "--page-size", str(page), "--shutdown-grace", "0.5"]
        if backend == "host":
            args += ["--host-memory", str(max(limit * 2, 512 * MiB))]
        self.fh = open(self.log, "w")
        self.proc = subprocess.Popen(args, env=penv, stdout=self.fh, stderr=subprocess.STDOUT, cwd=ROOT)
        wait_serving(self.socket, self.proc, self.log, timeout=60)
        from kvcached_service.client import Client

        self.client = Client.connect(self.socket, timeout=30)
        self.obs = self.client.open_session("gpu-capacity-observer")

    def stats(self):
        return self.obs.stats()

    def held(self, pid: int) -> int:
        for s in self.stats().sessions:
            if s.pid == pid:
                return s.held_bytes
        return 0

    def stop(self) -> None:
        try:
            self.obs.close()
            self.client.close()
        except Exception:  # noqa: BLE001
            pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.fh.close()


class Runner:
    """One llama-server started with Ollama's flags; SIGKILLed at the end, as Ollama stops it."""

    def __init__(self, binary: pathlib.Path, args: list[str], log: pathlib.Path, env: dict, kvc: bool,
                 timeout: float = 120):
        import llamatest as lt

        self.kvc = kvc
        self.log = log
        self.port = int(args[args.index("--port") + 1])
        penv = {k: v for k, v in os.environ.items()
                if not k.startswith("LLAMA_ARG_") and not k.startswith("KVCACHED_") and "KVCACHED_SOCKET" not in k}
        penv.update(env)
        self.fh = open(log, "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen([str(binary), *args], stdout=self.fh, stderr=subprocess.STDOUT, env=penv)
        self._buffers: dict | None = None
        self.lt = lt
        end = t0 + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited {self.proc.returncode}: {self.tail()}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    c.close()
                    break
                c.close()
            except OSError:
                pass
            if time.monotonic() > end:
                self.kill()
                raise RuntimeError(f"not ready in {timeout:.0f} s: {self.tail()}")
            time.sleep(0.05)
        self.load_s = time.monotonic() - t0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def text(self) -> str:
        if not self.fh.closed:
            self.fh.flush()
        return self.log.read_text(errors="replace")

    def tail(self, n: int = 3) -> str:
        lines = [x for x in self.text().splitlines() if x.strip()]
        keep = [x for x in lines if any(k in x.lower() for k in ("error", "failed", "out of memory", "kvcached"))]
        return " | ".join((keep or lines)[-n:])[:500]

    def buffers(self, kv: bool = True) -> int:
        """Bytes of the buffers the runner logged (Ollama's regex, later lines replacing earlier ones)."""
        if self._buffers is None:
            self._buffers = self.lt.ollama_buffers(self.text())
        return int(sum(v for (c, b, k), v in self._buffers.items() if kv or k != "KV") * MiB)

    def buffer_split(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for (c, b, k), v in self.lt.ollama_buffers(self.text()).items():
            out[k] = out.get(k, 0.0) + v
        return out

    def complete(self, prompt: str, n: int, timeout: float = 120) -> dict:
        body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "top_k": 1, "seed": 7, "ignore_eos": True,
                "cache_prompt": True, "return_tokens": True}
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            c.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
            r = c.getresponse()
            data = r.read()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")
            return json.loads(data)
        finally:
            c.close()

    def stream(self, prompt: str, n: int, timeout: float = 120) -> tuple[float, list[int]]:
        """(seconds from sending to the first token, the tokens) of a streamed greedy completion."""
        body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "top_k": 1, "seed": 7, "ignore_eos": True,
                "cache_prompt": True, "return_tokens": True, "stream": True}
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        t0 = time.monotonic()
        ttft = None
        toks: list[int] = []
        try:
            c.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
            r = c.getresponse()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
            for raw in r:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                ev = json.loads(line[5:].strip())
                got = ev.get("tokens") or ([] if not ev.get("content") else [None])
                if got and ttft is None:
                    ttft = time.monotonic() - t0
                toks += [t for t in got if t is not None]
                if ev.get("stop"):
                    break
        finally:
            c.close()
        if ttft is None:
            raise RuntimeError("no token streamed")
        return ttft, toks

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if not self.fh.closed:
            self.fh.close()


def prompt_for(i: int, rnd: int = 0) -> str:
    """A short prompt (about 30 tokens), different per model and round."""
    import llamatest as lt

    return lt.text(120, 1000 + 37 * i + rnd)


# ---------------------------------------------------------------- the run

class Run:
    def __init__(self, a):
        self.a = a
        self.cpu = a.device == "cpu"
        self.out = pathlib.Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.logs = self.out / "logs"
        self.logs.mkdir(exist_ok=True)
        self.rows_path = pathlib.Path(a.rows) if a.rows else self.out / "rows.jsonl"
        self.fig_path = pathlib.Path(a.figures) if a.figures else self.out / "figures.json"
        self.deadline = a.deadline or (time.time() + 3600)
        self.t_start = time.time()
        self.shape_name = a.shape or ("scaled" if self.cpu else "llama3.1-8b")
        self.shape = q4_gguf.SHAPES[self.shape_name]
        self.parallels = [int(x) for x in a.parallel.split(",") if x]
        self.work = pathlib.Path(a.work) if a.work else self.out / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.sock_dir = pathlib.Path(tempfile.mkdtemp(prefix="kvc-cap-"))  # sockets need short paths
        self.failed = False
        self.figs: dict = {}
        self.record: dict = {"device": a.device, "shape": self.shape_name, "ollama": OLLAMA_VERSION, "phases": []}
        self.n_runner = 0
        self.page = 128 * 1024 if self.cpu else 2 * MiB
        self.dev = EmulatedDevice(a.device_mib * MiB) if self.cpu else Nvml()
        self.env_common: dict[str, str] = {}
        if not self.cpu and os.environ.get("KVCACHED_LIBCUDA"):
            self.env_common["KVCACHED_LIBCUDA"] = os.environ["KVCACHED_LIBCUDA"]

    # -- rows
    def label(self, check: str) -> str:
        return f"cpu, scaled: {check}" if self.cpu else check

    def emit(self, r: dict) -> None:
        r = dict(r, check=self.label(r["check"]))
        if r["verdict"] == "FAIL":
            self.failed = True
        with open(self.rows_path, "a") as f:
            f.write(json.dumps(r) + "\n")
        print(f"{r['verdict']:5} {r['check']}: {r['seen']}", flush=True)

    def fig(self, name: str, value, unit: str, note: str) -> None:
        self.figs[PREFIX + name] = {"value": value, "unit": unit, "device": "cpu" if self.cpu else "cuda",
                                    "driver": "cpu (scaled)" if self.cpu else "real", "note": note}

    def save(self) -> None:
        self.fig_path.write_text(json.dumps(self.figs, indent=1) + "\n")
        (self.out / "capacity.json").write_text(json.dumps(self.record, indent=1) + "\n")

    def left(self) -> float:
        return self.deadline - time.time()

    # -- pieces
    def settle(self, base: int | None, timeout: float = 10.0) -> int:
        """Device memory in use once the driver has freed what dead runners held."""
        used = self.dev.mem()[2]
        if self.cpu or base is None:
            return used
        end = time.monotonic() + timeout
        while used - base > self.page and time.monotonic() < end:
            time.sleep(0.2)
            used = self.dev.mem()[2]
        return used

    def start_runner(self, binary, kvc: bool, parallel: int, num_ctx: int, batch: int, daemon=None, tag="") -> "Runner":
        import llamatest as lt

        self.n_runner += 1
        port = lt.free_port()
        args = ollama_args(str(self.model), port, num_ctx, parallel, batch)
        args += ["-t", "1"] if self.cpu else ["-ngl", "all"]
        env = dict(self.env_common)
        if daemon is not None:
            env["KVCACHED_SOCKET"] = daemon.socket
        log = self.logs / f"runner{self.n_runner:03d}-{tag}.log"
        r = Runner(binary, args, log, env, kvc=kvc, timeout=max(30.0, min(180.0, self.left() + 60)))
        r.args = args
        return r

    def phase_stock(self, parallel: int, deadline: float, base_used: int) -> dict:
        total, free0, _ = self.dev.mem()
        num_ctx = self.num_ctx
        ctx_total = num_ctx * parallel
        predicted = predict_server_vram(self.model_bytes, self.shape, ctx_total)
        runners: list[Runner] = []
        recs: list[dict] = []
        stop = "max models"
        for i in range(self.a.max_models):
            if time.time() > deadline:
                stop = "deadline (stock's share of the stage's time)"
                break
            _, nv_free, used_before = self.dev.mem()
            accounted = sum(r.buffers() for r in runners)
            free = ollama_free(nv_free, total, accounted)
            batch = self.a.batch if self.cpu else auto_batch(ctx_total, predicted, free)
            pfl = predicted + (0 if self.cpu else batch_surcharge(batch))
            if not ollama_fits(pfl, free, len(runners)):
                stop = (f"Ollama's rule: runner {i + 1}'s estimate {pfl / GiB:.2f} GiB > 80 % of "
                        f"{free / GiB:.2f} GiB free")
                break
            try:
                r = self.start_runner(self.a.orig, False, parallel, num_ctx, batch, tag=f"stock-np{parallel}-{i + 1}")
                if self.cpu:
                    self.dev.runners.append(r)
            except Exception as e:  # noqa: BLE001
                stop = f"runner {i + 1} failed to load: {str(e)[:300]}"
                break
            try:
                t = time.monotonic()
                res = r.complete(prompt_for(i), 16)
                took = time.monotonic() - t
            except Exception as e:  # noqa: BLE001
                r.kill()
                stop = f"runner {i + 1} loaded but its request failed: {str(e)[:300]}"
                break
            runners.append(r)
            used_after = self.settle(None)
            recs.append({"i": i + 1, "pid": r.pid, "batch": batch, "predicted": predicted, "predicted_for_load": pfl,
                         "free_for_ollama": free, "load_s": round(r.load_s, 2), "request_s": round(took, 3),
                         "tokens": res.get("tokens", []), "device_delta": used_after - used_before,
                         "buffers_mib": r.buffer_split(), "nvml_proc": self.dev.procs().get(r.pid)})
            print(f"      stock np{parallel} runner {i + 1}: loaded in {r.load_s:.1f} s, batch {batch}, "
                  f"device +{(used_after - used_before) / GiB:.2f} GiB", flush=True)
        procs = self.dev.procs()
        for rec in recs:
            rec["nvml_proc_end"] = procs.get(rec["pid"])
        res = {"side": "stock", "parallel": parallel, "num_ctx": num_ctx, "resident": len(runners), "stop": stop,
               "models": recs, "free_at_start": free0, "total": total, "args": runners[0].args if runners else []}
        for r in runners:
            r.kill()
        if self.cpu:
            self.dev.runners.clear()
        res["used_after_stop"] = self.settle(base_used)
        return res

    def phase_kvc(self, parallel: int, deadline: float, base_used: int) -> dict:
        total, free0, _ = self.dev.mem()
        num_ctx = self.num_ctx
        ctx_total = num_ctx * parallel
        predicted = predict_server_vram(self.model_bytes, self.shape, ctx_total)
        limit = (self.a.device_mib * MiB) if self.cpu else free0
        limit -= limit % self.page
        d = Daemon(self.sock_dir, "host" if self.cpu else "cuda", limit, self.page, self.env_common, self.logs)
        if self.cpu:
            self.dev.daemon = d
        runners: list[Runner] = []
        recs: list[dict] = []
        stop = "max models"
        fixed_est = 0
        try:
            for i in range(self.a.max_models):
                if time.time() > deadline:
                    stop = "deadline"
                    break
                _, nv_free, used_before = self.dev.mem()
                if self.cpu and runners and fixed_est + self.page * 2 * self.shape["n_layer"] > nv_free:
                    stop = (f"runner {i + 1} would not fit: its buffers ({fixed_est / MiB:.1f} MiB, as the first "
                            f"runner logged them) and its first pages > {nv_free / MiB:.1f} MiB free on the emulated device")
                    break
                batch = self.a.batch if self.cpu else auto_batch(ctx_total, predicted, nv_free)
                try:
                    r = self.start_runner(self.a.kvc, True, parallel, num_ctx, batch, daemon=d,
                                          tag=f"kvc-np{parallel}-{i + 1}")
                    if self.cpu:
                        self.dev.runners.append(r)
                except Exception as e:  # noqa: BLE001
                    stop = f"runner {i + 1} failed to load: {str(e)[:300]}"
                    break
                log = r.text()
                if "in ordinary memory" in log or "KV buffer reserved" not in log and "in daemon pages" not in log:
                    r.kill()
                    stop = f"runner {i + 1}: its KV cache is not in daemon pages (the daemon refused?): {r.tail()}"
                    break
                try:
                    t = time.monotonic()
                    res = r.complete(prompt_for(i), 16)
                    took = time.monotonic() - t
                except Exception as e:  # noqa: BLE001
                    r.kill()
                    stop = f"runner {i + 1}'s request failed (the daemon refused?): {str(e)[:200]}; {r.tail()}"
                    break
                runners.append(r)
                if not fixed_est:
                    fixed_est = r.buffers(kv=False)
                used_after = self.settle(None)
                recs.append({"i": i + 1, "pid": r.pid, "batch": batch, "load_s": round(r.load_s, 2),
                             "request_s": round(took, 3), "tokens": res.get("tokens", []),
                             "device_delta": used_after - used_before, "held": d.held(r.pid),
                             "buffers_mib": r.buffer_split(), "nvml_proc": self.dev.procs().get(r.pid)})
                print(f"      kvcached np{parallel} runner {i + 1}: loaded in {r.load_s:.1f} s, batch {batch}, "
                      f"device +{(used_after - used_before) / GiB:.2f} GiB, {recs[-1]['held'] / MiB:.0f} MiB in "
                      "daemon pages", flush=True)
            # every resident model answers one short request, round robin, twice
            ttft: list[float] = []
            errors: list[str] = []
            rounds = []
            for rnd in (1, 2):
                for k, r in enumerate(runners):
                    try:
                        t, toks = r.stream(prompt_for(k, rnd), 8)
                        ttft.append(t)
                        rounds.append({"round": rnd, "i": k + 1, "ttft_s": round(t, 4), "tokens": len(toks),
                                       "alive_same_pid": r.alive()})
                    except Exception as e:  # noqa: BLE001
                        errors.append(f"model {k + 1} round {rnd}: {str(e)[:150]}")
            st = d.stats()
            held = {r.pid: d.held(r.pid) for r in runners}
            procs = self.dev.procs()
            for rec in recs:
                rec["held_end"] = held.get(rec["pid"], 0)
                rec["nvml_proc_end"] = procs.get(rec["pid"])
            res = {"side": "kvcached", "parallel": parallel, "num_ctx": num_ctx, "resident": len(runners),
                   "stop": stop, "models": recs, "free_at_start": free0, "total": total, "daemon_limit": limit,
                   "round_robin": rounds, "rr_errors": errors, "ttft_s": ttft,
                   "reloads": sum(1 for r in runners if not r.alive()),
                   "daemon_in_use": st.total.in_use_bytes, "daemon_pooled": st.total.pooled_bytes,
                   "daemon_nvml": self.dev.procs().get(d.proc.pid), "args": runners[0].args if runners else []}
        finally:
            for r in runners:
                r.kill()
            if self.cpu:
                self.dev.runners.clear()
                self.dev.daemon = None
            d.stop()
        res["used_after_stop"] = self.settle(base_used)
        return res

    # -- reporting
    def report(self, p: int, stock: dict | None, kvc: dict | None) -> None:
        lab = slots(p)
        unit = "MiB"
        mem = "emulated device" if self.cpu else "NVML used"

        def per_model(side: dict) -> float:
            v = [m["device_delta"] for m in side["models"]]
            return statistics.median(v) / MiB if v else float("nan")

        if stock is not None:
            b = stock["models"][0]["batch"] if stock["models"] else 0
            self.emit(make_row(f"stock, {lab}: models resident",
                               f"runners as Ollama {OLLAMA_VERSION} starts them until the next would not fit by its rule",
                               f"{stock['resident']} (stopped: {stock['stop']}); num_ctx {stock['num_ctx']} x {p}, "
                               f"-b/-ub {b}; device memory per model {per_model(stock):.0f} {unit} ({mem}, median); "
                               f"Ollama's estimate {stock['models'][0]['predicted_for_load'] / MiB:.0f} MiB"
                               if stock["models"] else f"0 ({stock['stop']})", "info" if stock["resident"] else "FAIL"))
            self.fig(f"models_resident_stock_np{p}", stock["resident"], "models", f"stock llama-server, Ollama {OLLAMA_VERSION} rules, {self.shape_name}")
            if stock["models"]:
                self.fig(f"device_mib_per_model_stock_np{p}", round(per_model(stock), 1), "MiB", mem)
        if kvc is not None and not kvc["resident"] and kvc["stop"].startswith("deadline"):
            # the stage's time ran out before the first patched runner: nothing to judge
            for name in plan_names([p])[2:-1]:
                self.emit(make_row(name, "runs before the stage deadline",
                                   "skip: the deadline came before the first patched runner", "skip"))
            return
        if kvc is not None:
            helds = [m["held_end"] for m in kvc["models"]]
            held = statistics.median(helds) / MiB if helds else float("nan")
            ok = kvc["resident"] > 0 and all(h > 0 for h in helds)
            self.emit(make_row(f"kvcached, {lab}: models resident",
                               "patched runners + kvcached-serve until a runner fails to load or the daemon refuses; "
                               "each holds its KV in daemon pages",
                               f"{kvc['resident']} (stopped: {kvc['stop']}); device memory per model "
                               f"{per_model(kvc):.0f} {unit} ({mem}, median, daemon pages included); KV held per model "
                               f"{held:.0f} MiB (daemon's books, median; min {min(helds, default=0) / MiB:.0f}); daemon "
                               f"budget {kvc['daemon_limit'] / MiB:.0f} MiB",
                               "pass" if ok else "FAIL"))
            self.fig(f"models_resident_kvcached_np{p}", kvc["resident"], "models", f"patched llama-server + kvcached, {self.shape_name}")
            if kvc["models"]:
                self.fig(f"device_mib_per_model_kvcached_np{p}", round(per_model(kvc), 1), "MiB", mem + ", daemon pages included")
                self.fig(f"kv_held_mib_per_model_kvcached_np{p}", round(held, 2), "MiB", "daemon's books, median")
        if stock is not None and kvc is not None:
            ratio = kvc["resident"] / stock["resident"] if stock["resident"] else float("inf")
            count_cap = min(stock["resident"], DEFAULT_MODELS_PER_GPU)
            # a side the deadline stopped kept at least that many: say so, the ratio is then not the answer
            cut = [side for side, ph in (("stock", stock), ("kvcached", kvc)) if ph["stop"].startswith("deadline")]
            caveat = f"; NOT final: the deadline stopped {' and '.join(cut)} (a lower bound)" if cut else ""
            self.emit(make_row(f"{lab}: models resident, kvcached over stock",
                               "a ratio (issue 44's goal on an H100/H200: >= 4x with 1 slot, >= 10x with 4)",
                               f"{kvc['resident']} / {stock['resident']} = {ratio:.2f}x (Ollama's default count "
                               f"limit, {DEFAULT_MODELS_PER_GPU} per GPU, would keep {count_cap} stock: "
                               f"{kvc['resident'] / max(count_cap, 1):.2f}x){caveat}", "info"))
            self.fig(f"resident_ratio_np{p}", round(ratio, 2) if math.isfinite(ratio) else 0.0, "ratio",
                     "kvcached / stock" + (f"; the deadline stopped {' and '.join(cut)}" if cut else ""))
        if kvc is not None:
            t = kvc["ttft_s"]
            want = 2 * kvc["resident"]
            ok = kvc["resident"] > 0 and len(t) == want and not kvc["rr_errors"] and kvc["reloads"] == 0
            self.emit(make_row(f"{lab}: every resident model answers, round robin twice",
                               "2 answers per resident model, none reloaded (same process)",
                               f"{len(t)} of {want} answered; TTFT p50 {pct(t, 50) * 1e3:.1f} ms, p99 "
                               f"{pct(t, 99) * 1e3:.1f} ms (streamed, send to first token)"
                               + (f"; errors: {'; '.join(kvc['rr_errors'][:3])}" if kvc["rr_errors"] else ""),
                               "pass" if ok else "FAIL"))
            if t:
                self.fig(f"ttft_p50_ms_kvcached_np{p}", round(pct(t, 50) * 1e3, 2), "ms", "round robin over every resident model, twice")
                self.fig(f"ttft_p99_ms_kvcached_np{p}", round(pct(t, 99) * 1e3, 2), "ms", "round robin over every resident model, twice")
        if stock is not None and kvc is not None:
            pairs = [(k, a["tokens"], b["tokens"]) for k, (a, b) in enumerate(zip(stock["models"], kvc["models"]))]
            self.emit(greedy_row(lab, pairs, need=3 if p == 1 else 1))

    def run(self) -> int:
        parallels = self.parallels
        try:
            t = time.monotonic()
            mp = self.work / f"capacity-{self.shape_name}.gguf"
            info = q4_gguf.write(mp, self.shape_name, seed=44)
            self.model, self.model_bytes = mp, mp.stat().st_size
            kv_full = q4_gguf.kv_bytes_per_token(self.shape) * self.shape["n_ctx_train"]
            self.emit(make_row("capacity model written (q4_0)", "the shape, random q4_0 weights, in seconds",
                               f"{self.shape_name}: {self.model_bytes / 1e9:.3f} GB in {time.monotonic() - t:.1f} s; "
                               f"f16 KV at its trained context {self.shape['n_ctx_train']}: {kv_full / MiB:.0f} MiB "
                               f"({kv_full / self.model_bytes:.2f}x the file)", "info"))
            self.record["model"] = {**info, "kv_full_bytes": kv_full}
        except Exception as e:  # noqa: BLE001
            self.emit(make_row("capacity model written (q4_0)", "written", f"{type(e).__name__}: {e}", "FAIL"))
            return 1
        total, free0, used0 = self.dev.mem()
        self.num_ctx = effective_ctx(ollama_default_num_ctx(total) if not self.cpu else 262144, self.shape["n_ctx_train"])
        self.record.update(device_name=self.dev.name(), total=total, free_at_start=free0, used_at_start=used0,
                           memory_source=self.dev.source, num_ctx=self.num_ctx)
        print(f"capacity: {self.dev.name()}: {total / GiB:.1f} GiB, {free0 / GiB:.1f} GiB free; Ollama's num_ctx "
              f"{self.num_ctx}; {self.left():.0f} s to the deadline", flush=True)
        done_p: list[int] = []
        for n, p in enumerate(parallels):
            left = self.left()
            if left <= 0 or (n > 0 and left < self.min_phase_s()):
                for name in plan_names([p])[1:-1]:
                    self.emit(make_row(name, "runs before the stage deadline",
                                       f"skip: {left:.0f} s left (the deadline)", "skip"))
                continue
            now = time.time()
            stock_deadline = now + 0.3 * left
            stock = kvc = None
            try:
                stock = self.phase_stock(p, stock_deadline, used0)
                kvc_deadline = self.deadline - (10 if self.cpu else 20)  # the round robin's share
                kvc = self.phase_kvc(p, kvc_deadline, used0)
            except Exception as e:  # noqa: BLE001
                self.emit(make_row(f"{slots(p)}: the scenario", "runs", f"{type(e).__name__}: {str(e)[:400]}", "FAIL"))
            finally:
                self.record["phases"] += [x for x in (stock, kvc) if x is not None]
                self.report(p, stock, kvc)
                self.save()
            done_p.append(p)
            self.phase_s = time.time() - now
        if self.cpu:
            self.emit(make_row("device memory back to its start at the end", "NVML", "skip: cpu mode (no device)", "skip"))
        else:
            after = self.settle(used0, 15)
            self.record["used_at_end"] = after
            self.emit(memory_back_row(used0, after, self.page))
        self.save()
        return 1 if self.failed else 0

    def min_phase_s(self) -> float:
        """Time a further slot count needs: what the first one took, at least."""
        return getattr(self, "phase_s", 0.0) * 0.8

    def close(self) -> None:
        shutil.rmtree(self.sock_dir, ignore_errors=True)
        if not self.a.keep_model:
            for p in self.work.glob("capacity-*.gguf"):
                p.unlink()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["run", "skip"])
    ap.add_argument("--reason", default="")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--orig", default="")
    ap.add_argument("--kvc", default="")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="")
    ap.add_argument("--figures", default="")
    ap.add_argument("--deadline", type=float, default=0.0, help="epoch seconds: start no runner after it")
    ap.add_argument("--shape", choices=sorted(q4_gguf.SHAPES), default="")
    ap.add_argument("--parallel", default="1,4", help="slot counts, in order (the later ones if time is left)")
    ap.add_argument("--device-mib", type=int, default=256, help="cpu: the emulated device's size")
    ap.add_argument("--batch", type=int, default=64,
                    help="cpu: -b/-ub (default 64: the scaled model's compute buffer is then a quarter of its "
                         "weights, near an 8B's on a GPU; 512 is Ollama's smallest)")
    ap.add_argument("--max-models", type=int, default=64)
    ap.add_argument("--work", default="", help="where the GGUF goes (default OUT/work)")
    ap.add_argument("--keep-model", action="store_true", help="leave the GGUF in --work")
    a = ap.parse_args(argv)
    if a.mode == "skip":
        rows = pathlib.Path(a.rows) if a.rows else pathlib.Path(a.out) / "rows.jsonl"
        rows.parent.mkdir(parents=True, exist_ok=True)
        with open(rows, "a") as f:
            for name in plan_names([int(x) for x in a.parallel.split(",") if x]):
                f.write(json.dumps(make_row(name, "runs on a GPU", f"skip: {a.reason}", "skip")) + "\n")
        return 0
    a.orig, a.kvc = pathlib.Path(a.orig), pathlib.Path(a.kvc)
    run = Run(a)
    try:
        return run.run()
    finally:
        run.close()


if __name__ == "__main__":
    sys.exit(main())
