"""Helpers for the Ollama tests: a real `ollama serve` built by
integrations/ollama/build.sh (scripts/test-ollama.sh lays out the builds),
its llama-server children, and the daemon's view of them.

Layouts (each OUT/bin/ollama + OUT/lib/ollama/{llama-server,llama-quantize}),
of the default Ollama release (integrations/ollama/build.sh --list-versions)
unless named by a version:
  build/ollama/stock        Ollama's Go code as published, unpatched llama-server
  build/ollama/kvc          the Go patch (integrations/ollama/patches), patched llama-server
  build/ollama/stockgo-kvc  Ollama's Go code as published, patched llama-server
  build/ollama/vX-stock     each other supported release X as published, unpatched llama-server
  build/ollama/vX-kvc       the Go patch on each other supported release X, patched llama-server
Each release's llama-server is built on the llama.cpp that release pins
(integrations/ollama/llama-cpp-pins: scripts/test-llama.sh's build/llama for
the default release, build/llama/b<N> for another).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from kvtest import ROOT

BUILD = pathlib.Path(os.environ.get("KVC_OLLAMA_BUILD", ROOT / "build" / "ollama"))


def supported_versions() -> tuple[str, list[str]]:
    """(the default release, the other supported releases), from
    integrations/ollama/build.sh --list-versions (one patches/vX/ each)."""
    out = subprocess.run([str(ROOT / "integrations" / "ollama" / "build.sh"), "--list-versions"],
                         capture_output=True, text=True, check=True, timeout=60).stdout.split("\n")
    default = [ln.split()[0] for ln in out if ln.endswith("(default)")]
    assert len(default) == 1, out
    return default[0], [ln.strip() for ln in out if ln.strip() and not ln.endswith("(default)")]


DEFAULT_VERSION, OTHER_VERSIONS = supported_versions()
LAYOUTS = {name: BUILD / name for name in ("stock", "kvc", "stockgo-kvc")}
LAYOUTS.update({f"v{v}-{k}": BUILD / f"v{v}-{k}" for v in OTHER_VERSIONS for k in ("stock", "kvc")})


def llama_cpp_pin(version: str) -> tuple[str, str]:
    """(the llama.cpp build Ollama vVERSION pins, the build it is built on):
    integrations/ollama/llama-cpp-pins through scripts/build-llama-src.sh."""
    out = subprocess.run([str(ROOT / "scripts" / "build-llama-src.sh"), "--info", "--ollama", version],
                         capture_output=True, text=True, check=True, timeout=60).stdout.split()
    return out[1], "b" + out[2]


def llama_cpp_of(layout: str) -> str:
    """The llama.cpp build a layout's llama-server is (bN): the marker
    scripts/test-llama.sh leaves next to the programs it built."""
    server = (LAYOUTS[layout] / "lib" / "ollama" / "llama-server").resolve()
    return (server.parent / ".kvc-llama-build").read_text().split()[1]

GREEDY = {"temperature": 0, "top_k": 1, "top_p": 1, "seed": 7, "repeat_penalty": 1.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Direct children of pid (from /proc)."""
    out = []
    for p in pathlib.Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid:
            out.append(int(p.name))
    return out


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def exe_name(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


class Ollama:
    """One `ollama serve` of a layout, with its own port and HOME; models in
    `models` (shared between instances: the same blobs, so the same model
    digests)."""

    def __init__(self, layout: str, tmp: pathlib.Path, models: pathlib.Path, *, env: dict[str, str] | None = None,
                 name: str | None = None):
        root = LAYOUTS[layout] if layout in LAYOUTS else pathlib.Path(layout)  # a layout, or an install prefix
        self.exe = root / "bin" / "ollama"
        for need in (self.exe, root / "lib" / "ollama" / "llama-server", root / "lib" / "ollama" / "llama-quantize"):
            if not need.exists():
                pytest.fail(f"{need} is missing: run scripts/test-ollama.sh (it builds and lays out {root})")
        self.layout = layout
        self.name = name or layout
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        home = tmp / f"home-{self.name}"
        home.mkdir(parents=True, exist_ok=True)
        self.log = tmp / f"ollama-{self.name}.log"
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("OLLAMA_", "KVCACHED_", "LLAMA_ARG_", "GGML_"))}
        self.env.update({
            "HOME": str(home),
            "OLLAMA_HOST": self.host,
            "OLLAMA_MODELS": str(models),
            "OLLAMA_NOPRUNE": "1",         # instances share the models directory
            "OLLAMA_NO_CLOUD": "1",
            "OLLAMA_FLASH_ATTENTION": "1",  # K and V elastic (docs/ollama.md)
            "OLLAMA_NUM_PARALLEL": "2",
            "OLLAMA_KEEP_ALIVE": "10m",
            "OLLAMA_DEBUG": "1",
        })
        self.env.update(env or {})
        self.fh = open(self.log, "a")
        self.proc = subprocess.Popen([str(self.exe), "serve"], env=self.env, stdout=self.fh, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"ollama serve exited {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            try:
                self.get("/api/version", timeout=1)
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.monotonic() > deadline:
                    raise AssertionError("ollama serve not answering in 60 s:\n" + self.log_text()[-4000:]) from None
                time.sleep(0.1)

    # ---- HTTP -------------------------------------------------------------
    def url(self, path: str) -> str:
        return f"http://{self.host}{path}"

    def get(self, path: str, timeout: float = 30):
        with urllib.request.urlopen(self.url(path), timeout=timeout) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict, timeout: float = 300):
        req = urllib.request.Request(self.url(path), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise OllamaError(e.code, e.read().decode(errors="replace"), self.log_text()[-3000:]) from None

    def generate(self, model: str, prompt: str, n: int = 32, keep_alive=None, **options) -> dict:
        """Greedy /api/generate, raw prompt (no template), not streamed."""
        body = {"model": model, "prompt": prompt, "raw": True, "stream": False,
                "options": {**GREEDY, "num_predict": n, **options}}
        if keep_alive is not None:
            body["keep_alive"] = keep_alive
        return self.post("/api/generate", body)

    def stream(self, model: str, prompt: str, n: int, **options):
        """Streamed /api/generate: yields the JSON lines as they come."""
        body = {"model": model, "prompt": prompt, "raw": True, "stream": True,
                "options": {**GREEDY, "num_predict": n, **options}}
        req = urllib.request.Request(self.url("/api/generate"), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            for line in r:
                if line.strip():
                    yield json.loads(line)

    def unload(self, model: str) -> dict:
        return self.post("/api/generate", {"model": model, "keep_alive": 0})

    def ps(self) -> dict[str, dict]:
        """Loaded models by name (without the :latest tag)."""
        return {m["name"].removesuffix(":latest"): m for m in self.get("/api/ps")["models"]}

    # ---- CLI --------------------------------------------------------------
    def create(self, name: str, gguf: pathlib.Path, **params) -> None:
        """`ollama create NAME -f Modelfile` with FROM the GGUF."""
        mf = gguf.with_suffix(f".{name}.Modelfile")
        lines = [f"FROM {gguf}"] + [f"PARAMETER {k} {v}" for k, v in params.items()]
        mf.write_text("\n".join(lines) + "\n")
        r = subprocess.run([str(self.exe), "create", name, "-f", str(mf)], env=self.env, capture_output=True,
                           text=True, timeout=300)
        if r.returncode != 0:
            raise AssertionError(f"ollama create {name} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}\n"
                                 + self.log_text()[-3000:])

    # ---- processes and logs -----------------------------------------------
    def runners(self) -> list[int]:
        """pids of the llama-server children (not the --list-devices probes)."""
        out = []
        for pid in children(self.proc.pid):
            if exe_name(pid).startswith("llama-server") and alive(pid):
                try:
                    args = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if b"--model" in args:
                    out.append(pid)
        return out

    def runner_of(self, blob_digest: str) -> int | None:
        for pid in self.runners():
            args = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            model = args[args.index(b"--model") + 1].decode()
            if model.endswith(blob_digest.replace(":", "-")):
                return pid
        return None

    def log_text(self) -> str:
        self.fh.flush()
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # ollama SIGKILLs its runners on shutdown; make sure none is left
        for pid in children(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.fh.close()


class OllamaError(AssertionError):
    def __init__(self, code: int, body: str, log: str):
        super().__init__(f"HTTP {code}: {body}\n--- ollama log ---\n{log}")
        self.code = code
        self.body = body


def blob_digest(models: pathlib.Path, name: str) -> str:
    """The sha256 digest of a model's GGUF layer (what its runner's session
    is named by), from the manifest in the models directory."""
    manifest = models / "manifests" / "registry.ollama.ai" / "library" / name / "latest"
    for layer in json.loads(manifest.read_text())["layers"]:
        if layer["mediaType"] == "application/vnd.ollama.image.model":
            return layer["digest"]
    raise AssertionError(f"no model layer in {manifest}")
