"""Scenario 6, capacity: a bursty multi-model trace against one KV budget.

The harness generates a seeded trace (several models with different KV
bytes per token, context sizes and parallel slots; on/off bursts with idle
gaps; varied prompt and output lengths) and replays it twice against a
fresh daemon with the same budget:

- static: today's llama.cpp/Ollama behaviour. A model reserves its worst
  case (num_ctx x parallel x bytes per token) when it loads, as one
  Allocate per slot, and holds it until unloaded. A model that does not
  fit waits until enough loaded models have no request in flight or queued
  (and have been idle for `static_idle_s`), which are then unloaded (least
  recently used first), as Ollama's scheduler does; each (re)load costs the
  model's load time.
- elastic: every model is a session with one Region per slot (reserve the
  worst case as address space only). A request grows its slot's region as
  its context grows (prompt, then 256-cell steps while decoding, as
  llama.cpp pads n_kv), with wait=true; a finished request keeps its pages
  (llama.cpp keeps the slot's cache for prefix reuse) until the daemon asks
  for them back: each model answers RECLAIM (on_reclaim) by trimming its
  idle slots. Models load once and stay resident.

Both go through a real daemon (sessions, regions, Allocate/Free, the
elastic run's reclaim through Watch). Time is compressed: the simulated
clock runs `compress` times faster than the wall clock (prefill and decode
are sleeps); every real cost of the daemon is multiplied by the same factor
when read on the simulated clock, which penalises the elastic run, not the
static one. The budget counts KV only: weights are not modelled.
"""

from __future__ import annotations

import collections
import random
import threading
import time

from .common import MiB
from . import common

KiB = 1024
STEP = 256  # cells: llama.cpp pads n_kv to 256

# name, KV bytes/token (scaled 1/8 of the fp16 model's), num_ctx per slot, parallel, load seconds (simulated)
MODELS = [
    ("chat-8b", 16 * KiB, 8192, 2, 4.0),
    ("code-7b", 16 * KiB, 8192, 1, 4.0),
    ("big-32b", 32 * KiB, 8192, 1, 10.0),
    ("small-3b", 8 * KiB, 4096, 4, 2.0),
    ("embed", 2 * KiB, 2048, 4, 1.0),
]
BUDGET = 256 * MiB
PREFILL_TOK_S = 2000.0
DECODE_TOK_S = 25.0
WAIT_MS = 250  # Allocate wait=true deadline (real ms) per attempt
ADMIT_PATIENCE_S = 30.0  # a new request waits this long (real s) for its prompt's KV, then fails
DECODE_PATIENCE_S = 0.5  # a running request waits this long (real s) for one more step, then is preempted


def worst(m) -> int:
    return m[1] * m[2] * m[3]


def make_trace(seed: int, duration: float) -> list[tuple[float, int, int, int]]:
    """[(arrival s, model index, prompt tokens, output tokens)], sorted."""
    rng = random.Random(seed)
    out = []
    rates = [0.25, 0.15, 0.08, 0.3, 0.6]  # requests/s during a burst
    for mi, m in enumerate(MODELS):
        t = rng.uniform(0, 60)
        while t < duration:
            on = rng.expovariate(1 / 45.0)
            end = min(duration, t + on)
            while True:
                t += rng.expovariate(rates[mi])
                if t >= end:
                    break
                ctx = m[2]
                p = int(min(ctx // 2, max(16, rng.lognormvariate(7.4, 0.8))))
                o = 1 if m[0] == "embed" else int(min(ctx - p, max(16, rng.lognormvariate(5.3, 0.8))))
                out.append((t, mi, p, o))
            t = end + rng.expovariate(1 / 75.0)  # idle gap
    out.sort()
    return out


class _Slot:
    def __init__(self, idx: int):
        self.idx = idx
        self.lock = threading.Lock()  # held while a request runs in the slot
        self.region = None
        self.tokens = 0  # mapped tokens (elastic)


class _Model:
    def __init__(self, idx: int, spec):
        self.idx = idx
        self.name, self.bpt, self.ctx, self.parallel, self.load_s = spec
        self.worst = worst(spec)
        self.queue: collections.deque = collections.deque()
        self.state = "unloaded"  # unloaded | loading | loaded
        self.active = 0
        self.last_used = 0.0
        self.session = None
        self.slots = [_Slot(i) for i in range(self.parallel)]
        self.loads = 0


class Replay:
    def __init__(self, daemon, policy: str, trace, compress: float, drain_s: float, static_idle_s: float = 0.0):
        self.d = daemon
        self.policy = policy
        self.trace = trace
        self.C = compress
        self.drain_s = drain_s
        self.static_idle_s = static_idle_s
        self.cv = threading.Condition()
        self.models = [_Model(i, m) for i, m in enumerate(MODELS)]
        self.free = BUDGET  # static: budget not reserved by a loaded/loading model
        self.stop = False
        self.records = []  # (arrival, start, end, ok)
        self.stalls = 0
        self.failed = 0
        self.preemptions = 0
        self.reclaims = 0
        self.reclaimed_pages = 0
        self.evictions = 0
        self.resident_samples = []
        self.client = daemon.client(timeout=60)
        self.page = self.client.devices[0].page_size

    def now(self) -> float:
        return (time.monotonic() - self.t0) * self.C

    def sleep_sim(self, s: float) -> None:
        if s > 0:
            time.sleep(s / self.C)

    # ---- loading ---------------------------------------------------------------
    def _load(self, m: _Model) -> None:
        s = self.client.open_session(m.name, labels={"bench": "capacity"})
        for sl in m.slots:
            sl.region = s.region(m.ctx * m.bpt)
            sl.tokens = 0
        if self.policy == "static":
            for sl in m.slots:
                sl.region.grow_to(m.ctx * m.bpt)
                sl.tokens = m.ctx
        else:
            s.on_reclaim(lambda ev, m=m: self._on_reclaim(m, ev))
        m.session = s
        if self.policy == "static" or m.loads == 0:
            self.sleep_sim(m.load_s)
        with self.cv:
            m.loads += 1
            m.state = "loaded"
            m.last_used = self.now()
            self.cv.notify_all()

    def _unload(self, m: _Model) -> None:
        for sl in m.slots:
            sl.region.close()
            sl.region = None
        m.session.close()
        m.session = None

    def _on_reclaim(self, m: _Model, ev) -> None:
        want = ev.pages
        gave = 0
        for sl in m.slots:
            if gave >= want:
                break
            if sl.region is None or not sl.lock.acquire(blocking=False):
                continue
            try:
                gave += sl.region.release_pages(want - gave)
                sl.tokens = min(sl.tokens, sl.region.mapped_bytes // m.bpt)
            finally:
                sl.lock.release()
        with self.cv:
            self.reclaims += 1
            self.reclaimed_pages += gave

    def scheduler(self) -> None:
        with self.cv:
            while not self.stop:
                waiting = [m for m in self.models if m.state == "unloaded" and m.queue]
                waiting.sort(key=lambda m: m.queue[0][0])
                acted = False
                for m in waiting:
                    need = m.worst if self.policy == "static" else 0
                    if self.free < need:
                        now = self.now()
                        idle = [v for v in self.models if v.state == "loaded" and v.active == 0 and not v.queue
                                and now - v.last_used >= self.static_idle_s]
                        idle.sort(key=lambda v: v.last_used)
                        victims, got = [], self.free
                        for v in idle:
                            if got >= need:
                                break
                            victims.append(v)
                            got += v.worst
                        if got < need:
                            break  # FIFO: the oldest waiting model goes first
                        for v in victims:
                            v.state = "unloaded"
                            self.evictions += 1
                            self.free += v.worst
                            self.cv.release()
                            try:
                                self._unload(v)
                            finally:
                                self.cv.acquire()
                    self.free -= need
                    m.state = "loading"
                    threading.Thread(target=self._load, args=(m,), daemon=True).start()
                    acted = True
                if not acted:
                    self.cv.wait(0.02)

    # ---- serving -----------------------------------------------------------------
    def _grow(self, m: _Model, sl: _Slot, tokens: int, patience_s: float) -> bool:
        """Elastic: back `tokens` cells of the slot, waiting up to patience_s
        (real seconds) for other models to give pages back; False if not."""
        tokens = min(m.ctx, -(-tokens // STEP) * STEP)
        if tokens <= sl.tokens:
            return True
        deadline = time.monotonic() + patience_s
        from kvcached_service import errors

        while True:
            try:
                sl.region.grow_to(tokens * m.bpt, wait=True, wait_timeout_ms=WAIT_MS)
                sl.tokens = tokens
                return True
            except errors.ResourceExhausted:
                with self.cv:
                    self.stalls += 1
                # trim this model's own idle slots (the daemon asks others, not the requester)
                for o in m.slots:
                    if o is not sl and o.region is not None and o.lock.acquire(blocking=False):
                        try:
                            o.region.trim_to(0)
                            o.tokens = 0
                        finally:
                            o.lock.release()
                if time.monotonic() > deadline or self.stop:
                    return False
                time.sleep(0.01)

    def slot_worker(self, m: _Model, sl: _Slot) -> None:
        while True:
            with self.cv:
                while not self.stop and not (m.state == "loaded" and m.queue):
                    self.cv.wait(0.05)
                if self.stop:
                    return
                arrival, p, o = m.queue.popleft()
                m.active += 1
                sl.lock.acquire()
            ok, preempted = True, False
            start = None
            try:
                if self.policy == "elastic":
                    ok = self._grow(m, sl, p + 1, ADMIT_PATIENCE_S)
                start = self.now()
                if ok:
                    self.sleep_sim(p / PREFILL_TOK_S)
                    done = 0
                    while done < o:
                        step = min(STEP, o - done)
                        if self.policy == "elastic" and not self._grow(m, sl, p + done + step, DECODE_PATIENCE_S):
                            # KV oversubscribed: preempt (drop this sequence's cells, run it
                            # again later, as vLLM's recompute preemption does) so the
                            # other running sequences can finish
                            sl.region.trim_to(0)
                            sl.tokens = 0
                            preempted = True
                            break
                        self.sleep_sim(step / DECODE_TOK_S)
                        done += step
            finally:
                sl.lock.release()
                with self.cv:
                    m.active -= 1
                    m.last_used = self.now()
                    if preempted and not self.stop:
                        self.preemptions += 1
                        m.queue.appendleft((arrival, p, o))
                    else:
                        self.records.append((arrival, start, self.now(), ok))
                        if not ok:
                            self.failed += 1
                    self.cv.notify_all()

    def sampler(self) -> None:
        while not self.stop:
            with self.cv:
                self.resident_samples.append(sum(1 for m in self.models if m.state == "loaded"))
            time.sleep(0.02)

    def run(self) -> dict:
        self.t0 = time.monotonic()
        threads = [threading.Thread(target=self.scheduler, daemon=True), threading.Thread(target=self.sampler, daemon=True)]
        for m in self.models:
            for sl in m.slots:
                threads.append(threading.Thread(target=self.slot_worker, args=(m, sl), daemon=True))
        for t in threads:
            t.start()
        end_trace = self.trace[-1][0] if self.trace else 0
        for arrival, mi, p, o in self.trace:
            self.sleep_sim(arrival - self.now())
            with self.cv:
                self.models[mi].queue.append((arrival, p, o))
                self.cv.notify_all()
        limit = end_trace + self.drain_s
        while self.now() < limit:
            with self.cv:
                if len(self.records) >= len(self.trace):
                    break
            time.sleep(0.05)
        with self.cv:
            self.stop = True
            self.cv.notify_all()
            records = list(self.records)
        sim_elapsed = self.now()
        for t in threads:
            t.join(timeout=10)
        for m in self.models:
            if m.session is not None:
                try:
                    self._unload(m)
                except Exception:  # noqa: BLE001 - the daemon is stopped next anyway
                    pass
        self.client.close()
        served = [r for r in records if r[3] and r[1] is not None]
        delays = [r[1] - r[0] for r in served]
        lat = [r[2] - r[0] for r in served]
        res = self.resident_samples or [0]
        return {
            "requests": len(self.trace),
            "served": len(served),
            "failed": self.failed,
            "unserved": len(self.trace) - len(served),
            "queue_delay_s": {"p50": common.pct(delays, 50), "p90": common.pct(delays, 90), "p99": common.pct(delays, 99),
                              "max": max(delays) if delays else float("nan")},
            "latency_s": {"p50": common.pct(lat, 50), "p99": common.pct(lat, 99)},
            "resident_models": {"mean": sum(res) / len(res), "max": max(res), "min_after_start": min(res[len(res) // 4:] or [0])},
            "loads": sum(m.loads for m in self.models),
            "evictions": self.evictions,
            "alloc_stalls": self.stalls,
            "preemptions": self.preemptions,
            "reclaim_callbacks": self.reclaims,
            "reclaimed_pages": self.reclaimed_pages,
            "sim_seconds": sim_elapsed,
        }


def run(c) -> dict:
    duration = c.q(240.0, 1200.0)
    compress = c.q(40.0, 40.0)
    drain = c.q(120.0, 300.0)
    trace = make_trace(7, duration)
    out = {
        "models": [{"name": m[0], "kv_bytes_per_token": m[1], "num_ctx": m[2], "parallel": m[3], "load_s": m[4],
                    "worst_case_bytes": worst(m)} for m in MODELS],
        "budget_bytes": BUDGET,
        "sum_worst_case_bytes": sum(worst(m) for m in MODELS),
        "trace": {"seed": 7, "duration_s": duration, "requests": len(trace), "compress": compress,
                  "prefill_tok_s": PREFILL_TOK_S, "decode_tok_s": DECODE_TOK_S, "drain_s": drain},
    }
    for policy in ("static", "elastic"):
        with c.daemon(f"s6-{policy}", ["--memory-limit", str(BUDGET), "--reclaim-timeout-ms", "1000"],
                      device_bytes=BUDGET + 64 * MiB) as d:
            out[policy] = Replay(d, policy, trace, compress, drain).run()
    return out
