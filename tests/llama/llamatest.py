"""Helpers for the llama.cpp suite: llama-server processes, the daemon's view
of them, and how Ollama reads their logs.

Two builds of the same llama.cpp (scripts/test-llama.sh builds them):
LLAMA_SERVER_ORIG (unpatched) and LLAMA_SERVER_KVC (integrations/llama.cpp
applied), both with llama-quantize beside them. A missing binary fails the
tests; nothing is skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import tiny_model
from kvtest import ROOT

BUILD = ROOT / "build" / "llama"
ORIG = pathlib.Path(os.environ.get("LLAMA_SERVER_ORIG", BUILD / "build-orig/bin/llama-server"))
KVC = pathlib.Path(os.environ.get("LLAMA_SERVER_KVC", BUILD / "build-kvc/bin/llama-server"))
QUANTIZE_ORIG = pathlib.Path(os.environ.get("LLAMA_QUANTIZE_ORIG", BUILD / "build-orig/bin/llama-quantize"))
QUANTIZE_KVC = pathlib.Path(os.environ.get("LLAMA_QUANTIZE_KVC", BUILD / "build-kvc/bin/llama-quantize"))
LLAMA_CPP_ORIG = pathlib.Path(
    os.environ.get("LLAMA_CPP_ORIG", BUILD / "src/llama.cpp"))

MiB = 1 << 20
PAD = 256  # llama.cpp pads n_kv to 256 cells
# KVCACHED_STANDBY_IDLE_MS's default, in seconds: a trim (warm-up, slot erase,
# a shorter prompt) keeps pages as standby until no batch ran for this long
# (docs/llama-cpp.md "Standby pages"). A check that needs every page back when
# idle waits for that release: at most IDLE_RELEASE_WAIT seconds.
STANDBY_IDLE_S = 1.0
IDLE_RELEASE_WAIT = STANDBY_IDLE_S + 3

# Ollama's llm/llama_server.go (v0.34.0) bufferSizeRegex, verbatim: it reads
# these lines from the child's stderr as long as the child lives and keys
# them by (component, backend, kind); a later line replaces the earlier one.
OLLAMA_BUFFER_RE = re.compile(
    r"(?m)(?:^|\n)[^\n:]*?([A-Za-z_][A-Za-z0-9_]*):\s+(\S+)\s+(model|KV|compute|output|RS)\s+buffer size\s*=\s*([\d.]+)\s*MiB")
# the flags Ollama passes about logging (llm/llama_server.go)
OLLAMA_LOG_FLAGS = ["--log-verbosity", "4", "--no-log-prefix", "--no-log-timestamps"]


def ollama_buffers(log: str) -> dict[tuple[str, str, str], float]:
    """What Ollama's memoryParsingWriter holds after reading `log`: MiB by
    (component, backend, kind), later lines replacing earlier ones."""
    out: dict[tuple[str, str, str], float] = {}
    for m in OLLAMA_BUFFER_RE.finditer(log):
        out[(m.group(1), m.group(2), m.group(3))] = float(m.group(4))
    return out


def kv_line_values(log: str, backend: str = "CPU") -> list[float]:
    """Every "<backend> KV buffer size" value in the log, in order."""
    return [float(m.group(4)) for m in OLLAMA_BUFFER_RE.finditer(log)
            if m.group(1) == "llama_kv_cache" and m.group(2) == backend and m.group(3) == "KV"]


def text(n_chars: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "kv", "cache", "page", "daemon", "llama", "token", "slot", "the", "of"]
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < n_chars:
        out.append(words[rng.integers(len(words))])
    return " ".join(out)[:n_chars]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HTTPError(AssertionError):
    def __init__(self, path: str, code: int, body: str):
        super().__init__(f"{path}: HTTP {code}: {body[:2000]}")
        self.code = code
        self.body = body


class Served:
    """A llama-server process (plain or router) on a port of its own, ready
    once /health answers; its output in `log`. The environment is the test's
    without any LLAMA_ARG_* or KVCACHED_* variable, plus `env`."""

    what = "llama-server"
    stop_wait = 20.0

    def _launch(self, binary: pathlib.Path, args, log: pathlib.Path, env: dict[str, str] | None) -> None:
        """`args(port)`: the arguments after the binary."""
        if not binary.exists():
            pytest.fail(f"{binary} is missing: run scripts/test-llama.sh (it builds both llama-servers)")
        self.port = free_port()
        self.log = log
        penv = {k: v for k, v in os.environ.items()
                if not k.startswith("LLAMA_ARG_") and not k.startswith("KVCACHED_") and "KVCACHED_SOCKET" not in k}
        penv.update(env or {})
        self.fh = open(log, "w")
        self.proc = subprocess.Popen([str(binary), *args(self.port)], stdout=self.fh, stderr=subprocess.STDOUT, env=penv)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.what} exited {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"{self.what} not ready in 60 s:\n" + self.log_text()[-4000:])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_text(self) -> str:
        if not self.fh.closed:
            self.fh.flush()
        return self.log.read_text(errors="replace")

    def call(self, method: str, path: str, body: dict | None = None, timeout: float = 120):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise HTTPError(path, e.code, e.read().decode(errors="replace")) from None

    def post(self, path: str, body: dict, timeout: float = 120):
        return self.call("POST", path, body, timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_wait)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.fh.closed:
            self.fh.close()


class Server(Served):
    def __init__(self, binary: pathlib.Path, model: pathlib.Path, log: pathlib.Path, *, kvc_socket: str | None,
                 ctx: int = 8192, parallel: int = 2, fa: str = "on", extra: list[str] | None = None,
                 env: dict[str, str] | None = None, log_flags: list[str] | None = None, threads: int = 2):
        penv = {"KVCACHED_SOCKET": kvc_socket} if kvc_socket else {}
        penv.update(env or {})
        self._launch(binary, lambda port: [
            "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-c", str(ctx), "-np",
            str(parallel), "-fa", fa, "--no-webui", *(log_flags if log_flags is not None else ["-lv", "4"]),
            *(extra or [])], log, penv)

    def complete(self, prompt, n_predict: int = 32, timeout: float = 120, **kw):
        """Greedy completion; a list of prompts runs as parallel tasks (one per slot)."""
        body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "seed": 7,
                "ignore_eos": True, "cache_prompt": True, "return_tokens": True}
        body.update(kw)
        return self.post("/completion", body, timeout=timeout)

    def erase_slot(self, slot: int) -> None:
        """POST /slots/N?action=erase (llama-server needs --slot-save-path for it)."""
        self.post(f"/slots/{slot}?action=erase", {})


@contextlib.contextmanager
def observe(d):
    """An admin session of the test (root is the daemon's admin): its
    GetStats lists every session."""
    with d.client() as client:
        s = client.open_session("llama-test-observer")
        try:
            yield s
        finally:
            s.close()


def session_of(client, pid: int):
    for s in client.stats().sessions:
        if s.pid == pid:
            return s
    return None


def held(client, pid: int) -> int:
    s = session_of(client, pid)
    return s.held_bytes if s else 0


def tokens_of(res) -> list[list[int]]:
    res = res if isinstance(res, list) else [res]
    return [r["tokens"] for r in res]


def used_cells(r: dict) -> int:
    """Cells a finished completion left in its slot."""
    return r["tokens_evaluated"] + r["tokens_predicted"] - 1


def cells_read(used: int) -> int:
    """Cells every graph reads for `used` cells in use (llama.cpp's n_kv,
    padded to 256): what the hook keeps mapped per tensor and stream."""
    return -(-used // PAD) * PAD if used else 0


def held_bound(cells_per_stream: list[int], rows: list[int], page: int) -> int:
    """The most a cache may hold (K and V elastic): for every tensor (rows:
    bytes per cell of each K and V tensor) and stream, the cells read times
    the row, plus one page."""
    return sum(cells_read(c) * row + page for row in rows for c in cells_per_stream)


PROMPTS = [
    "Hello",
    text(300, 1),
    text(1200, 2),
]


def write_model(path: pathlib.Path, seed: int, **shape) -> pathlib.Path:
    return tiny_model.write(path, seed=seed, **shape)
