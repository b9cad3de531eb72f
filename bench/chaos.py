"""A chaos run through a real Ollama (issue 46 item 1).

    python -m bench.chaos [--quick] [--duration S] [--seed N] [--kinds K,...] [--out DIR]

A real `ollama serve` (the kvcached build, build/ollama/kvc, laid out by
scripts/test-ollama.sh) with kvcached-serve (host backend, 64 KiB pages,
--state-dir, so the page store: a keeper process), four tiny generated
GGUF models of different shapes (tests/llama/tiny_model.py: layers, KV
heads, head width and num_ctx all differ), and eight client threads sending
greedy requests (temperature 0, top_k 1, fixed seed) continuously, while a
fault schedule, random but seeded (printed first, so a run can be replayed
with --seed), does:

  daemon_kill    SIGKILL the daemon, start it again as systemd's Restart=
                 would (same socket, same state dir, page store on)
  daemon_term    SIGTERM it (a clean stop), start it again
  budget_shrink  restart it with a smaller --memory-limit (the budget is
                 read at start only: an operator edits /etc/default/kvcached
                 and restarts); the next budget_grow restarts it with the
                 full budget again
  runner_kill    SIGKILL one llama-server child (Ollama loads it again on the
                 next request for its model)
  unload         keep_alive 0 for one model (the next request loads it)
  squeeze        ask every runner's session to shrink to its guarantee
                 (RequestShrink, what Ollama's scheduler does before it
                 unloads a model)

The reference: each (model, prompt) is answered once by stock Ollama
(build/ollama/stock: Ollama's Go code as published, unpatched llama-server,
no daemon), one request at a time, before the run (--ref-cache keeps it
between runs; the prompts come from their own seed, --prompt-seed). Stock
is the promise the product makes ("the same tokens as without the daemon"),
and tests/ollama shows the kvcached build answers these models token for
token the same; computing it on the kvcached build before any fault would
only compare the product with itself. OLLAMA_NUM_PARALLEL is 1 (--parallel):
llama.cpp's greedy tokens depend on which sequences share a batch (two
slots decoding together round differently from one alone), so with two
slots an answer may differ from stock with no fault at all; one slot per
runner makes every difference a finding. (A run with --parallel 2 and no
faults matched stock on all 52 requests; the oracle must not depend on it.)

The oracle. After every daemon restart, under load, once every runner's
session is back (resumed or reopened):

  books      pooled + in_use + free == budget, per device and in total
             (invariant 7), and in_use == the sum of the sessions' held
             bytes

After every --audit-every'th restart, every --check-every seconds and at
the end, an audit: new requests are held back, the ones in flight finish,
and the books must be the same before and after the pages are read:

  pages      host pages are memfds ("kvcached-page"): the pages a runner
             really references are the memfd inodes in its mappings and its
             fds (/proc/PID/maps, /proc/PID/fd); the daemon's are the ones
             in its own fds and its keeper's. Per runner: the pages it
             references that the daemon also has must be exactly the pages
             the daemon's books say its session holds. A page the daemon
             counts in use that no live runner references is leaked; a
             page a runner maps that the daemon does not have is outside
             the books (after a SIGTERM, by design until the runner frees
             those cells: docs/reliability.md); a session of a dead process
             still holding pages is leaked; a page two runners reference
             at once breaks invariant 1.
  memory     daemon, keeper, ollama and runner RSS sampled every 2 s; the
             slope over the second half of the run (MiB per hour) of each
             at checks (the same load point each time)

Every request (model, prompt, start, latency, ok or the error, whether the
answer equals the reference), every fault, every check and every memory
sample go to DIR/chaos.json; a summary table is printed. Exit 1 when the
goal is missed: a failed request that no fault explains, an answer that
differs, a lost or leaked page, books that do not add up, memory that
grows.

A failed request is *explained* only in one case: its model's runner was
SIGKILLed while it ran (stock Ollama loses that request too: the HTTP 500
comes from Ollama's own code). An answer that differs is never explained
away; those of a runner that was alive when the daemon was stopped with
SIGTERM are counted apart (the daemon zeroed its clients' pages at a clean
stop until 10223a7: docs/reliability.md, "A chaos run through a real
Ollama"). `make test` runs the quick mode without daemon_term (a runner
crash that follows SIGTERM restarts, finding 4 there).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from .common import MiB, ROOT

sys.path.insert(0, str(ROOT / "tests" / "llama"))
sys.path.insert(0, str(ROOT / "tests" / "ollama"))
sys.path.insert(0, str(ROOT / "tests"))

from ollamatest import alive  # noqa: E402 - the Ollama suite's helper (running, not a zombie), on the path above

PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
PAGE = 64 << 10
ALL_KINDS = ("daemon_kill", "daemon_term", "budget", "runner_kill", "unload", "squeeze")

# Four shapes (tiny_model.write keyword arguments) and their num_ctx. Worst
# case KV (OLLAMA_NUM_PARALLEL 2, f16): 32 + 1.5 + 0.5 + 13.5 MiB.
MODELS = {
    "chaos4l": dict(seed=11, shape={}, num_ctx=4096),  # 4 layers, 4 KV heads of 64: 512 B a cell and tensor
    "chaos3l": dict(seed=12, shape=dict(n_layer=3, n_embd=64, n_head=2, n_head_kv=2, head_dim=16, n_ff=128), num_ctx=2048),
    "chaos2l": dict(seed=13, shape=dict(n_layer=2, n_embd=64, n_head=2, n_head_kv=1, head_dim=32, n_ff=128), num_ctx=1024),
    "chaos6l": dict(seed=14, shape=dict(n_layer=6, n_embd=96, n_head=3, n_head_kv=3, head_dim=32, n_ff=192), num_ctx=3072),
}
FULL_BUDGET = 96 * MiB
SHRUNK_BUDGET = 40 * MiB  # below the four worst cases (47.5 MiB), above what all eight slots can use at once

GREEDY = {"temperature": 0, "top_k": 1, "top_p": 1, "seed": 7, "repeat_penalty": 1.0}
WORDS = ["alpha", "beta", "gamma", "delta", "kv", "cache", "page", "daemon", "llama", "token", "slot", "the", "of",
         "restart", "budget", "chaos"]


def prompts(seed: int, n: int) -> list[dict]:
    """n prompts: short (5-80 characters) and long (300-700: up to ~600
    tokens, within every model's context), each with its num_predict."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        n_chars = rng.randint(5, 80) if i % 3 else rng.randint(300, 700)
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < n_chars:
            words.append(rng.choice(WORDS))
        out.append({"prompt": " ".join(words)[:n_chars], "n": rng.choice([8, 16, 24, 32])})
    return out


# ---------------------------------------------------------------------------
# /proc


def rss(pid: int) -> dict:
    out = {}
    try:
        for ln in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if ln.startswith(("VmRSS:", "RssAnon:", "RssFile:", "RssShmem:")):
                k, v = ln.split(":")
                out[k] = int(v.split()[0]) * 1024
    except OSError:
        return {}
    return out


def memfd_inodes(pid: int, maps: bool = True) -> set[int]:
    """Inodes of the "kvcached-page" memfds pid has open or mapped."""
    out: set[int] = set()
    fd_dir = pathlib.Path(f"/proc/{pid}/fd")
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return out
    for n in names:
        try:
            if os.readlink(fd_dir / n).startswith("/memfd:kvcached-page"):
                out.add(os.stat(fd_dir / n).st_ino)
        except OSError:
            pass
    if maps:
        try:
            for ln in pathlib.Path(f"/proc/{pid}/maps").read_text().splitlines():
                if "/memfd:kvcached-page" in ln:
                    out.add(int(ln.split()[4]))
        except OSError:
            pass
    return out


def keeper_pids(state_dir: pathlib.Path) -> list[int]:
    """The page store's keeper process(es) for this state dir."""
    out = []
    for p in pathlib.Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"kvcached_service.server.recovery.keeper" in cmd and any(str(state_dir).encode() in a for a in cmd) and alive(int(p.name)):
            out.append(int(p.name))
    return out


# ---------------------------------------------------------------------------
# the daemon, restarted as a supervisor would


class Supervisor:
    def __init__(self, work: pathlib.Path, budget: int):
        self.work = work
        self.socket = str(work / "kvc.sock")
        self.state = work / "state"
        self.budget = budget
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.log = work / "daemon.log"

    def start(self, budget: int | None = None) -> float:
        from kvcached_service.client.health import wait_serving

        if budget is not None:
            self.budget = budget
        args = [PY, "-m", "kvcached_service.server", "--socket", self.socket, "--backend", "host",
                "--memory-limit", str(self.budget), "--page-size", str(PAGE), "--state-dir", str(self.state),
                "--shutdown-grace", "0.5", "--log-level", "INFO"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
        env["PYTHONPATH"] = str(ROOT)
        with open(self.log, "a") as fh:
            fh.write(f"\n==== chaos: start {self.starts} (budget {self.budget}) at {time.time():.3f} ====\n")
            fh.flush()
            t0 = time.monotonic()
            self.proc = subprocess.Popen(args, env=env, stdout=fh, stderr=subprocess.STDOUT)
        self.starts += 1
        if not wait_serving(self.socket, 60, alive=lambda: self.proc.poll() is None):
            raise RuntimeError(f"daemon not serving 60 s after start {self.starts}: {self.log_tail()}")
        return time.monotonic() - t0

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def kill(self, sig: int) -> None:
        self.proc.send_signal(sig)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def client(self):
        from kvcached_service.client import Client

        return Client.connect(self.socket, timeout=10)


# ---------------------------------------------------------------------------
# the run


class _Done(Exception):
    pass


class Chaos:
    def __init__(self, args, work: pathlib.Path):
        self.args = args
        self.work = work
        self.rng = random.Random(args.seed)
        self.records: list[dict] = []
        self.faults: list[dict] = []
        self.checks: list[dict] = []
        self.samples: list[dict] = []
        self.lock = threading.Lock()
        self.gate = threading.Event()  # set: clients may start requests
        self.gate.set()
        self.inflight = 0
        self.inflight_cv = threading.Condition()
        self.stop = threading.Event()
        self.t0 = time.time()
        self.prompts: list[dict] = []
        self.ref: dict = {}
        self.digests: dict[str, str] = {}
        self.outside_seen: set[int] = set()
        self.kinds = set(args.kinds.split(",")) if args.kinds else set(ALL_KINDS)
        # runner pids alive when a daemon was stopped with SIGTERM: the daemon
        # zeroed their pages (docs/reliability.md, "A chaos run through a real Ollama")
        self.zeroed_runners: dict[int, float] = {}
        self.last_check_t = 0.0

    # ---- setup ------------------------------------------------------------
    def setup_models(self, models_dir: pathlib.Path) -> None:
        import tiny_model
        from ollamatest import Ollama, blob_digest

        o = Ollama("stock", self.work, models_dir, name="stock")
        try:
            for name, m in MODELS.items():
                gguf = tiny_model.write(self.work / f"{name}.gguf", seed=m["seed"], **m["shape"])
                o.create(name, gguf, num_ctx=m["num_ctx"])
            self.digests = {name: blob_digest(models_dir, name) for name in MODELS}
            # the reference: stock Ollama, one request at a time; kept by the
            # digests, prompts and options (--ref-cache) so a replay need not
            # compute it again
            import hashlib

            key = hashlib.sha256(json.dumps([self.digests, self.prompts, GREEDY, o.get("/api/version")],
                                            sort_keys=True).encode()).hexdigest()[:16]
            cache = self.args.ref_cache / f"ref-{key}.json" if self.args.ref_cache else None
            if cache and cache.exists():
                self.ref = {(m, int(i)): v for m, i, v in json.loads(cache.read_text())}
                print(f"chaos: stock reference: {len(self.ref)} answers from {cache}", flush=True)
                return
            t = time.monotonic()
            for name in MODELS:
                for i, p in enumerate(self.prompts):
                    r = o.generate(name, p["prompt"], p["n"])
                    self.ref[(name, i)] = r["response"]
            print(f"chaos: stock reference: {len(self.ref)} answers in {time.monotonic() - t:.1f} s", flush=True)
            if cache:
                cache.parent.mkdir(parents=True, exist_ok=True)
                cache.write_text(json.dumps([[m, i, v] for (m, i), v in self.ref.items()]))
        finally:
            o.stop()

    # ---- clients ----------------------------------------------------------
    def client(self, cid: int) -> None:
        rng = random.Random(self.args.seed * 1000 + cid)
        names = list(MODELS)
        while not self.stop.is_set():
            self.gate.wait()
            if self.stop.is_set():
                break
            with self.inflight_cv:
                if not self.gate.is_set():
                    continue
                self.inflight += 1
            try:
                model = rng.choice(names)
                i = rng.randrange(len(self.prompts))
                p = self.prompts[i]
                rec = {"client": cid, "model": model, "prompt": i, "t": round(time.time() - self.t0, 3), "at": round(time.time(), 3)}
                t = time.monotonic()
                try:
                    r = self.ollama.generate(model, p["prompt"], p["n"])
                    rec.update(ok=True, same=r["response"] == self.ref[(model, i)], tokens=r.get("eval_count"))
                    if not rec["same"]:
                        rec["got"] = r["response"][:200]
                        rec["want"] = self.ref[(model, i)][:200]
                except Exception as e:  # noqa: BLE001
                    body = getattr(e, "body", None) or repr(e)
                    rec.update(ok=False, error=str(body)[:400])
                rec["latency"] = round(time.monotonic() - t, 4)
                rec["runner"] = next((pid for pid, m in self.runners().items() if m == model), None)
                rec["end"] = round(time.time() - self.t0, 3)
                with self.lock:
                    self.records.append(rec)
                if not rec["ok"] or not rec["same"]:
                    print(f"chaos: [{rec['t']:7.1f}s] client {cid} {model} prompt {i}: "
                          f"{'FAILED ' + rec['error'][:200] if not rec['ok'] else 'DIFFERS from stock'}", flush=True)
            finally:
                with self.inflight_cv:
                    self.inflight -= 1
                    self.inflight_cv.notify_all()

    def pause(self, timeout: float = 120) -> bool:
        """Hold new requests back and wait for those in flight."""
        with self.inflight_cv:
            self.gate.clear()
            return self.inflight_cv.wait_for(lambda: self.inflight == 0, timeout)

    def resume(self) -> None:
        self.gate.set()

    # ---- sampling ---------------------------------------------------------
    def runners(self) -> dict[int, str]:
        """pid -> model name of the live llama-server children."""
        by_digest = {d.replace(":", "-"): n for n, d in self.digests.items()}
        out = {}
        for pid in self.ollama.runners():
            try:
                args = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                blob = args[args.index(b"--model") + 1].decode()
            except (OSError, ValueError, IndexError):
                continue
            out[pid] = next((n for d, n in by_digest.items() if blob.endswith(d)), "?")
        return out

    def sample(self, kind: str = "tick") -> dict:
        d = self.sup.proc.pid if self.sup.proc and self.sup.proc.poll() is None else None
        runners = self.runners()
        s = {"t": round(time.time() - self.t0, 2), "kind": kind,
             "daemon": rss(d) if d else {}, "keeper": [rss(k) for k in keeper_pids(self.sup.state)],
             "ollama": rss(self.ollama.proc.pid),
             "runners": {str(pid): {"model": m, **rss(pid)} for pid, m in runners.items()},
             "daemon_start": self.sup.starts}
        return s

    def sampler(self) -> None:
        while not self.stop.wait(2.0):
            with self.lock:
                self.samples.append(self.sample())

    # ---- the oracle -------------------------------------------------------
    def snapshot(self) -> dict:
        with self.sup.client() as c:
            me = c.open_session("chaos-observer")
            try:
                st = me.stats()
            finally:
                me.close()
        return {"stats": st}

    def check(self, why: str, audit: bool, settle_timeout: float = 60) -> dict:
        """The books once every runner's session is back (resumed or
        reopened), under load; with audit, the pages too, at a quiet moment:
        requests held back, the ones in flight done, the books the same
        before and after the pages are read."""
        t_start = time.monotonic()
        drained = self.pause() if audit else None
        rec: dict = {"t": round(time.time() - self.t0, 2), "why": why, "audit": audit, "drained": drained,
                     "daemon_start": self.sup.starts}
        try:
            deadline = time.monotonic() + settle_timeout
            last = None
            while True:
                r = self._measure()
                stable = last is not None and r["key"] == last["key"]
                if r["settled"] and (stable or not audit):
                    break
                if time.monotonic() > deadline:
                    r["unsettled"] = True
                    break
                last = r
                time.sleep(0.5)
            r.pop("key")
            if not audit:  # pages move under load: what they show is not judged
                r["pages_ok"] = None
                r.pop("outside_inodes")
                raise _Done
            inodes = set(r.pop("outside_inodes"))
            new = inodes - self.outside_seen
            self.outside_seen |= inodes
            since = [f for f in self.faults if f["t"] >= self.last_check_t]
            term = any(f.get("signal") == "SIGTERM" for f in since)
            r["outside_new"] = len(new)
            if new and not term:
                r["pages_ok"] = False
                r["pages"].append(f"{len(new)} pages a runner maps are outside the books, and no SIGTERM since the last check")
            rec.update(r)
        except _Done:
            rec.update(r)
        except Exception as e:  # noqa: BLE001
            rec.update(error=repr(e), books_ok=False)
        finally:
            if audit:
                self.resume()
        if audit:
            self.last_check_t = rec["t"]
        rec["took"] = round(time.monotonic() - t_start, 2)
        mem = self.sample("check")
        rec["memory"] = mem
        with self.lock:
            self.checks.append(rec)
            self.samples.append(mem)
        bad = [k for k in ("books_ok", "pages_ok") if rec.get(k) is False]
        print(f"chaos: [{rec['t']:7.1f}s] {'audit' if audit else 'books'} after {why}: books {'exact' if rec.get('books_ok') else 'WRONG'}, "
              f"in use {rec.get('in_use_pages')} pages, runners reference {rec.get('runner_pages')} of them, "
              f"leaked {rec.get('leaked_pages')}, outside the books {rec.get('outside_pages')}"
              f"{', NOT SETTLED' if rec.get('unsettled') else ''}{' ' + str(bad) if bad else ''} ({rec['took']} s)",
              flush=True)
        return rec

    def _measure(self) -> dict:
        st1 = self.snapshot()["stats"]
        runners = self.runners()
        dpid = self.sup.proc.pid
        daemon_pages = memfd_inodes(dpid, maps=False)
        for k in keeper_pids(self.sup.state):
            daemon_pages |= memfd_inodes(k, maps=False)
        ref = {pid: memfd_inodes(pid) for pid in runners}
        st2 = self.snapshot()["stats"]
        def key_of(st):
            return (st.total.in_use_bytes, st.total.pooled_bytes,
                    tuple(sorted((s.id, s.held_bytes) for s in st.sessions if not s.name.startswith("chaos-"))),
                    tuple(sorted((p, len(v)) for p, v in ref.items())))

        key, key2 = key_of(st1), key_of(st2)
        st = st1
        books = []
        for name, p in [("total", st.total), *st.devices.items()]:
            if p.pooled_bytes + p.in_use_bytes + p.free_bytes != p.budget_bytes:
                books.append(f"{name}: pooled {p.pooled_bytes} + in use {p.in_use_bytes} + free {p.free_bytes} != budget {p.budget_bytes}")
        held_sum = sum(s.held_bytes for s in st.sessions)
        if held_sum != st.total.in_use_bytes:
            books.append(f"sessions hold {held_sum} bytes, in use {st.total.in_use_bytes}")
        sessions = collections.defaultdict(list)
        for s in st.sessions:
            sessions[s.pid].append(s)
        per_runner = {}
        runner_pages = outside = 0
        pages_bad = []
        for pid, model in runners.items():
            mine = ref[pid] & daemon_pages
            held = sum(s.pages_held for s in sessions.get(pid, []))
            out = len(ref[pid] - daemon_pages)
            per_runner[str(pid)] = {"model": model, "references": len(mine), "held": held, "outside": out,
                                    "sessions": [s.id for s in sessions.get(pid, [])]}
            runner_pages += len(mine)
            outside += out
            if len(mine) != held:
                pages_bad.append(f"runner {pid} ({model}) references {len(mine)} of the daemon's pages, its sessions hold {held}")
        # invariant 1: a page is never in two live sessions at once (two runners never share a page)
        owners = collections.Counter(i for v in ref.values() for i in v)
        shared = [i for i, n in owners.items() if n > 1]
        if shared:
            pages_bad.append(f"{len(shared)} pages are referenced by two runners at once")
        dead = [s for s in st.sessions if s.held_bytes and s.pid not in runners]
        for s in dead:
            pages_bad.append(f"session {s.id} '{s.name}' of pid {s.pid} (no live runner) holds {s.pages_held} pages")
        in_use_pages = st.total.pages_in_use
        leaked = max(0, in_use_pages - runner_pages)
        # settled: every live runner that ever had a session has one again, no orphan (pid 0) left
        orphans = [s.id for s in st.sessions if not alive(s.pid) or s.pid == 0]
        # a runner with pages but no session is one whose session has not come back yet
        settled = key == key2 and not orphans and all(sessions.get(pid) or not ref[pid] for pid in runners)
        no_session = [str(pid) for pid in runners if not sessions.get(pid)]
        outside_inodes = set()
        for pid in runners:
            outside_inodes |= ref[pid] - daemon_pages
        return {"key": key, "settled": settled, "books_ok": not books, "books": books, "pages_ok": not pages_bad,
                "pages": pages_bad, "in_use_pages": in_use_pages, "runner_pages": runner_pages, "leaked_pages": leaked,
                "outside_pages": outside, "shared_pages": len(shared), "budget": st.total.budget_bytes, "pooled_pages": st.total.pages_pooled,
                "runners": per_runner, "orphans": orphans, "no_session": no_session,
                "outside_inodes": sorted(outside_inodes),
                "sessions": [{"id": s.id, "name": s.name[:24], "pid": s.pid, "held": s.pages_held} for s in st.sessions]}

    # ---- faults -----------------------------------------------------------
    def schedule(self, duration: float) -> list[tuple[float, str]]:
        """The seeded fault schedule: (seconds from the start, kind)."""
        kinds = [k for k in ["daemon_kill"] * 4 + ["daemon_term"] * 2 + ["budget"] * 2 + ["runner_kill"] * 2 + ["unload"] * 2
                 + ["squeeze"] if k in self.kinds]
        out = []
        t = self.args.first_fault
        first = sorted(set(kinds))  # every kind once first (a quick run sees each), in a seeded order
        self.rng.shuffle(first)
        while t < duration - self.args.tail:
            out.append((round(t, 2), first.pop() if first else self.rng.choice(kinds)))
            t += self.rng.uniform(self.args.gap * 0.5, self.args.gap * 1.5)
        return out

    def restart(self, sig: int, budget: int | None = None) -> dict:
        t = time.monotonic()
        out = {"signal": signal.Signals(sig).name}
        if sig == signal.SIGTERM:
            for pid in self.runners():
                self.zeroed_runners.setdefault(pid, time.time() - self.t0)
            out["runners"] = sorted(self.runners())
        self.sup.kill(sig)
        time.sleep(self.rng.uniform(0.1, 1.0))  # RestartSec
        took = self.sup.start(budget)
        return {**out, "down_s": round(time.monotonic() - t, 2), "start_s": round(took, 2)}

    def fault(self, kind: str) -> dict:
        f: dict = {"t": round(time.time() - self.t0, 2), "at": round(time.time(), 3), "kind": kind}
        if kind == "daemon_kill":
            f.update(self.restart(signal.SIGKILL))
        elif kind == "daemon_term":
            f.update(self.restart(signal.SIGTERM))
        elif kind == "budget":
            shrink = self.sup.budget == FULL_BUDGET
            f["kind"] = "budget_shrink" if shrink else "budget_grow"
            f["budget"] = SHRUNK_BUDGET if shrink else FULL_BUDGET
            term = self.rng.random() < 0.5 and "daemon_term" in self.kinds
            f.update(self.restart(signal.SIGTERM if term else signal.SIGKILL, f["budget"]))
        elif kind == "runner_kill":
            runners = self.runners()
            if runners:
                pid = self.rng.choice(sorted(runners))
                f.update(pid=pid, model=runners[pid])
                os.kill(pid, signal.SIGKILL)
            else:
                f["skipped"] = "no runner"
        elif kind == "unload":
            model = self.rng.choice(list(MODELS))
            f["model"] = model
            try:
                r = self.ollama.unload(model)
                f["done_reason"] = r.get("done_reason")
            except Exception as e:  # noqa: BLE001
                f["error"] = repr(e)[:300]
        elif kind == "pause":  # no fault: a quiet moment (every runner idle past its standby release), then all at once
            f["drained"] = self.pause()
            time.sleep(3)
            self.resume()
        elif kind == "squeeze":
            runners = self.runners()
            asked = 0
            with self.sup.client() as c:
                me = c.open_session("chaos-squeeze")
                try:
                    for s in me.stats().sessions:
                        if s.pid in runners and s.held_bytes:
                            asked += me.request_shrink(s.id, 0, timeout_ms=2000)
                finally:
                    me.close()
            f["bytes_asked"] = asked
        f["end"] = round(time.time() - self.t0, 2)
        return f

    # ---- main -------------------------------------------------------------
    def run(self) -> dict:
        from ollamatest import Ollama

        a = self.args
        print(f"chaos: seed {a.seed} (replay: {replay_command(a)})", flush=True)
        self.prompts = prompts(a.prompt_seed, a.prompts)
        models_dir = self.work / "models"
        models_dir.mkdir(parents=True, exist_ok=True)
        self.setup_models(models_dir)
        sched = [] if a.no_faults else self.schedule(a.duration)
        counts = collections.Counter(k for _, k in sched)
        print(f"chaos: fault schedule ({len(sched)} faults: {dict(counts)}): "
              + ", ".join(f"{t:g}s {k}" for t, k in sched), flush=True)

        self.sup = Supervisor(self.work, FULL_BUDGET)
        self.sup.start()
        env = {"OLLAMA_KVCACHED_SOCKET": self.sup.socket, "OLLAMA_NUM_PARALLEL": str(a.parallel),
               "OLLAMA_MAX_LOADED_MODELS": str(len(MODELS)), "OLLAMA_KEEP_ALIVE": "-1",
               "OLLAMA_DEBUG": "0",
               # a Python daemon's start on a loaded 2-core machine can pass 5 s (the default)
               "KVCACHED_WAIT_DAEMON_MS": "20000"}
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        os.chdir(self.work)  # a runner's core dump (core_pattern "core") lands here
        self.ollama = Ollama("kvc", self.work, models_dir, env=env, name="kvc")
        self.t0 = time.time()
        threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(a.clients)]
        sampler = threading.Thread(target=self.sampler, daemon=True)
        try:
            for t in threads:
                t.start()
            sampler.start()
            next_check = a.check_every
            restarts = 0
            for when, kind in sched:
                while time.time() - self.t0 < when:
                    if time.time() - self.t0 >= next_check:
                        self.check("periodic", audit=True)
                        next_check = time.time() - self.t0 + a.check_every
                    time.sleep(0.1)
                f = self.fault(kind)
                with self.lock:
                    self.faults.append(f)
                if f["kind"] in ("runner_kill", "unload") and a.settle:
                    # the daemon sees a client's death within a second (invariant 4); a
                    # restart sooner makes its session an orphan (docs/reliability.md)
                    time.sleep(a.settle)
                print(f"chaos: [{f['t']:7.1f}s] {f['kind']}: "
                      + ", ".join(f"{k} {v}" for k, v in f.items() if k not in ("t", "kind")), flush=True)
                if f["kind"].startswith(("daemon", "budget")):
                    f["check"] = len(self.checks)
                    restarts += 1
                    self.check(f["kind"], audit=restarts % a.audit_every == 0)
            while time.time() - self.t0 < a.duration:
                time.sleep(0.2)
            self.check("end", audit=True)
        finally:
            self.stop.set()
            self.gate.set()
            for t in threads:
                t.join(330)
            result = self.result()
            self.ollama.stop()
            try:
                self.sup.kill(signal.SIGTERM)
            except Exception:  # noqa: BLE001
                pass
            for k in keeper_pids(self.sup.state):
                try:
                    os.kill(k, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        return result

    # ---- figures ----------------------------------------------------------
    def explained(self, rec: dict) -> str | None:
        """Why a failed request failed, when a fault explains it."""
        for f in self.faults:
            if f["kind"] == "runner_kill" and f.get("model") == rec["model"] and rec["t"] - 0.5 <= f["t"] <= rec["end"]:
                return f"its runner was SIGKILLed at {f['t']} s while it ran"
        return None

    def zeroed(self, rec: dict) -> bool:
        """Whether the runner that answered went through a SIGTERM of the
        daemon (which zeroes the pages its clients still map)."""
        t = self.zeroed_runners.get(rec.get("runner"))
        return t is not None and t <= rec["end"]

    def result(self) -> dict:
        recs = list(self.records)
        for r in recs:
            if not r["ok"]:
                r["explained"] = self.explained(r)
            elif not r["same"]:
                r["zeroed"] = self.zeroed(r)
        ok = [r for r in recs if r["ok"]]
        failed = [r for r in recs if not r["ok"]]
        unexplained = [r for r in failed if not r.get("explained")]
        differ = [r for r in ok if not r["same"]]
        differ_zeroed = [r for r in differ if r.get("zeroed")]
        restarts = [f for f in self.faults if f["kind"].startswith(("daemon", "budget"))]
        lat = sorted(r["latency"] for r in ok)
        checks = self.checks
        books_bad = [c for c in checks if not c.get("books_ok")]
        pages_bad = [c for c in checks if c.get("pages_ok") is False]
        unsettled = [c for c in checks if c.get("unsettled")]
        leaked = max((c.get("leaked_pages", 0) for c in checks), default=0)
        final = checks[-1] if checks else {}
        memory = self.memory_slopes()
        # runners loaded while the daemon was away run on ordinary memory for their life (docs/reliability.md)
        fallback = sorted({pid for c in checks for pid in c.get("no_session", [])})
        mem_bad = [k for k, v in memory.items() if v.get("grows")]
        goal = {
            "failed_unexplained": len(unexplained), "differing": len(differ), "books_wrong": len(books_bad),
            "pages_wrong": len(pages_bad), "unsettled_checks": len(unsettled), "leaked_pages_max": leaked,
            "outside_pages_end": final.get("outside_pages"), "memory_grows": mem_bad,
        }
        goal["met"] = (not unexplained and not differ and not books_bad and not pages_bad and not unsettled
                       and not mem_bad and bool(recs))
        return {
            "seed": self.args.seed, "replay": replay_command(self.args), "args": vars(self.args), "started": datetime.datetime.fromtimestamp(self.t0).isoformat(),
            "duration_s": round(time.time() - self.t0, 1),
            "models": {n: {"num_ctx": m["num_ctx"], **m["shape"]} for n, m in MODELS.items()},
            "budget": {"full": FULL_BUDGET, "shrunk": SHRUNK_BUDGET, "page": PAGE},
            "requests": {"total": len(recs), "ok": len(ok), "failed": len(failed), "failed_explained": len(failed) - len(unexplained),
                         "failed_unexplained": len(unexplained), "differing": len(differ),
                         "differing_after_sigterm": len(differ_zeroed),
                         "p50_s": lat[len(lat) // 2] if lat else None, "p99_s": lat[int(len(lat) * 0.99)] if lat else None,
                         "max_s": lat[-1] if lat else None},
            "faults": dict(collections.Counter(f["kind"] for f in self.faults)),
            "daemon_restarts": len(restarts), "daemon_starts": self.sup.starts if hasattr(self, "sup") else 0,
            "checks": len(checks), "audits": sum(1 for c in checks if c.get("audit")), "goal": goal,
            "runners_without_session": fallback, "zeroed_runners": {str(k): v for k, v in self.zeroed_runners.items()}, "memory": memory,
            "fault_log": self.faults, "check_log": checks, "request_log": recs, "samples": self.samples,
        }

    def memory_slopes(self) -> dict:
        """Slope (MiB/h) of each process class's RSS at the checks over the
        second half of the run, and whether it grows: more than 10 % of its
        median over the half's length. Judged in runs of 10 minutes or
        more (a quick run's few points are noise)."""
        pts = collections.defaultdict(list)
        for s in self.samples:
            if s["kind"] != "check":
                continue
            t = s["t"]
            if s["daemon"]:
                pts["daemon"].append((t, s["daemon"].get("VmRSS", 0)))
            if s["keeper"]:
                pts["keeper"].append((t, sum(k.get("VmRSS", 0) for k in s["keeper"])))
            pts["ollama"].append((t, s["ollama"].get("VmRSS", 0)))
            # a runner without its daemon pages (RssShmem: what its cache holds
            # now), averaged over the runners loaded (unloads change how many)
            if s["runners"]:
                pts["runner_anon"].append((t, sum(r.get("RssAnon", 0) for r in s["runners"].values()) / len(s["runners"])))
        out = {}
        for k, v in pts.items():
            half = [p for p in v if p[0] >= v[-1][0] / 2] if v else []
            if len(half) < 3:
                out[k] = {"points": len(half)}
                continue
            xs, ys = [p[0] for p in half], [p[1] for p in half]
            mx, my = statistics.fmean(xs), statistics.fmean(ys)
            den = sum((x - mx) ** 2 for x in xs) or 1
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den  # bytes/s
            med = statistics.median(p[1] for p in v)
            span = xs[-1] - xs[0]
            out[k] = {"points": len(half), "median_mib": round(med / MiB, 1), "slope_mib_per_h": round(slope * 3600 / MiB, 2),
                      "first_mib": round(half[0][1] / MiB, 1), "last_mib": round(half[-1][1] / MiB, 1),
                      "grows": slope * span > 0.10 * med and self.args.duration >= 600}
        return out


def replay_command(a) -> str:
    """The command that runs the same schedule and load again."""
    cmd = f"python -m bench.chaos --seed {a.seed}{' --quick' if a.quick else ''} --duration {a.duration:g} --gap {a.gap:g}"
    if a.kinds:
        cmd += f" --kinds {a.kinds}"
    if a.clients != 8:
        cmd += f" --clients {a.clients}"
    if a.parallel != 1:
        cmd += f" --parallel {a.parallel}"
    if getattr(a, "settle", None) is not None and a.settle != (2.0 if a.quick else 0.0):
        cmd += f" --settle {a.settle:g}"
    return cmd


def summary(r: dict) -> str:
    q = r["requests"]
    g = r["goal"]
    rows = [
        ("seed", r["seed"]), ("replay", r.get("replay", "")), ("duration", f"{r['duration_s']:.0f} s"),
        ("requests", f"{q['total']} ({q['ok']} ok)"),
        ("failed, explained (runner SIGKILLed)", q["failed_explained"]),
        ("failed, unexplained", q["failed_unexplained"]),
        ("answers differing from stock", q["differing"]),
        ("  of them by a runner whose daemon was SIGTERMed", q["differing_after_sigterm"]),
        ("latency p50 / p99 / max", f"{q['p50_s']} / {q['p99_s']} / {q['max_s']} s"),
        ("faults", ", ".join(f"{k} {v}" for k, v in sorted(r["faults"].items()))),
        ("daemon restarts", r["daemon_restarts"]),
        ("checks of the books (of them audits of the pages)", f"{r['checks']} ({r['audits']})"),
        ("checks with books wrong", g["books_wrong"]),
        ("checks with pages wrong", g["pages_wrong"]),
        ("checks not settled", g["unsettled_checks"]),
        ("pages leaked (max at a check)", g["leaked_pages_max"]),
        ("pages outside the books at the end", g["outside_pages_end"]),
        ("runners loaded while the daemon was away (no session)", len(r.get("runners_without_session", []))),
    ]
    for k, v in r["memory"].items():
        if "slope_mib_per_h" in v:
            rows.append((f"RSS {k}", f"median {v['median_mib']} MiB, slope {v['slope_mib_per_h']:+} MiB/h"
                                     f"{' GROWS' if v['grows'] else ''}"))
    rows.append(("goal", "met" if g["met"] else "MISSED"))
    w = max(len(str(k)) for k, _ in rows)
    return "\n".join(f"  {str(k):<{w}}  {v}" for k, v in rows)


def rescore(path: pathlib.Path) -> int:
    """A recorded run judged again by this code (the JSON's records)."""
    import gzip

    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    old = json.loads(raw)
    ch = Chaos(argparse.Namespace(**old["args"]), pathlib.Path(old["args"].get("work", ".")))
    ch.records, ch.faults, ch.checks, ch.samples = old["request_log"], old["fault_log"], old["check_log"], old["samples"]
    ch.zeroed_runners = {int(k): v for k, v in old.get("zeroed_runners", {}).items()}
    ch.t0 = datetime.datetime.fromisoformat(old["started"]).timestamp()
    r = ch.result()
    r["duration_s"] = old["duration_s"]
    r["daemon_starts"] = old.get("daemon_starts")
    print(summary(r))
    return 0 if r["goal"]["met"] else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="about 2 minutes (make test)")
    ap.add_argument("--duration", type=float, help="seconds of load (default 1800; quick: 100)")
    ap.add_argument("--seed", type=int, help="the fault schedule's and the clients' seed (default: from the clock)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--parallel", type=int, default=1, help="OLLAMA_NUM_PARALLEL (default 1: see the module doc)")
    ap.add_argument("--no-faults", action="store_true", help="the same load without faults (a baseline)")
    ap.add_argument("--kinds", help="only these fault kinds (comma-separated: daemon_kill, daemon_term, budget, "
                                    "runner_kill, unload, squeeze)")
    ap.add_argument("--prompts", type=int, default=6, help="prompts per model (default 6)")
    ap.add_argument("--prompt-seed", type=int, default=46, help="the prompts' seed (default 46: the same prompts, so "
                                                                "the same stock reference, in every run)")
    ap.add_argument("--gap", type=float, help="mean seconds between faults (default 18; quick: 9)")
    ap.add_argument("--check-every", type=float, default=300, help="an audit (pages too, at a quiet moment) at least "
                                                                    "this often (seconds)")
    ap.add_argument("--audit-every", type=int, help="audit the pages after every Nth daemon restart (default 5; quick: 2)")
    ap.add_argument("--settle", type=float, help="seconds after a runner's death (runner_kill, unload) before the "
                                                 "next fault (default 0; quick: 2, so a restart never follows a "
                                                 "client's death within the second the daemon needs to see it)")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "build" / "bench" / "chaos")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs, models)")
    ap.add_argument("--ref-cache", type=pathlib.Path, help="a directory keeping stock references between runs")
    ap.add_argument("--summarize", type=pathlib.Path, metavar="JSON", help="judge and summarize a run's records again "
                                                                          "(this code's verdict), run nothing")
    a = ap.parse_args(argv)
    if a.summarize:
        return rescore(a.summarize)
    a.duration = a.duration or (100 if a.quick else 1800)
    a.audit_every = a.audit_every or (2 if a.quick else 5)
    a.settle = (2.0 if a.quick else 0.0) if a.settle is None else a.settle
    a.gap = a.gap or (9 if a.quick else 18)
    unknown = set(a.kinds.split(",")) - set(ALL_KINDS) - {"pause"} if a.kinds else set()
    if unknown:
        ap.error(f"--kinds: unknown {sorted(unknown)}; known: {', '.join(ALL_KINDS)}, pause")
    a.first_fault = 5 if a.quick else 10
    a.tail = 5 if a.quick else 10
    if a.seed is None:
        a.seed = int(time.time()) % 100000
    a.out = a.out.resolve()  # the run changes directory (runners' core dumps land in its work dir)
    a.ref_cache = a.ref_cache.resolve() if a.ref_cache else None
    a.out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="kvc-chaos-"))
    a.work = str(work)
    ch = Chaos(a, work)
    try:
        r = ch.run()
    except BaseException:
        print(f"chaos: failed; work dir kept: {work}", flush=True)
        raise
    a.out_file = str(a.out / f"chaos-{'quick-' if a.quick else ''}{a.seed}.json")
    r["args"] = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(a).items()}
    pathlib.Path(a.out_file).write_text(json.dumps(r, indent=None, separators=(",", ":")))
    print("\nchaos: summary\n" + summary(r), flush=True)
    print(f"chaos: records in {a.out_file}", flush=True)
    if r["goal"]["met"] and not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"chaos: work dir (logs): {work}", flush=True)
    return 0 if r["goal"]["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
