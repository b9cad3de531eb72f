"""kvcachedctl: plan on GGUF files written here (gguf.GGUFWriter) and on a
fake Ollama model store; stats / sessions / top / set-limits / shrink /
health against a real daemon; socket resolution; admin refusal as another
uid."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import gguf
import numpy as np
import pytest

from kvcached_service.ctl import cli
from kvcached_service.ctl.plan import PlanError, parse_model_name

ROOT = pathlib.Path(__file__).resolve().parent.parent
MIB = 1 << 20
GIB = 1 << 30


def ctl(*args: str, env: dict | None = None, timeout: float = 60, user: pwd.struct_passwd | None = None) -> subprocess.CompletedProcess:
    """Run kvcachedctl as a separate process (python -m, so the test does not
    depend on where the console script went)."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("KVCACHED_SOCKET", "OLLAMA_KVCACHED_SOCKET", "OLLAMA_MODELS")}
    full_env["PYTHONPATH"] = str(ROOT)
    full_env.update(env or {})
    if user is None:
        cmd = [sys.executable, "-m", "kvcached_service.ctl", *args]
    else:
        # Import everything while privileged (the venv may not be readable
        # by that uid), then become the user and run main().
        code = (
            "import os, sys, grpc, kvcached_service.client, kvcached_service.ctl.cli as c\n"
            "from grpc_health.v1 import health_pb2, health_pb2_grpc\n"
            f"os.setgroups([]); os.setgid({user.pw_gid}); os.setuid({user.pw_uid})\n"
            "sys.exit(c.main(sys.argv[1:]))\n"
        )
        cmd = [sys.executable, "-c", code, *args]
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)


# ---- GGUF files -------------------------------------------------------------
def write_gguf(path: pathlib.Path, arch: str = "llama", *, layers: int = 32, embd: int = 4096, heads: int = 32,
               heads_kv=8, key_length: int | None = None, value_length: int | None = None, name: str = "test-model",
               context: int = 8192) -> pathlib.Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(layers)
    w.add_embedding_length(embd)
    w.add_context_length(context)
    w.add_head_count(heads)
    if heads_kv is not None:
        w.add_head_count_kv(heads_kv)
    if key_length is not None:
        w.add_key_length(key_length)
    if value_length is not None:
        w.add_value_length(value_length)
    w.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def plan_json(*args: str, env: dict | None = None) -> dict:
    r = ctl("plan", *args, "--json", env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def caches(p: dict) -> dict[str, dict]:
    return {c["cache"]: c for c in p["caches"]}


def test_plan_llama3_8b_shape(tmp_path):
    """Llama-3-8B's shape: 32 layers, 8 KV heads of 128: 128 KiB per token in f16."""
    f = write_gguf(tmp_path / "llama.gguf")
    p = plan_json(str(f), "--ctx", "8192", "--parallel", "4")
    assert (p["arch"], p["n_layer"], p["n_head"], p["n_head_kv"], p["key_length"], p["value_length"]) == ("llama", 32, 32, 8, 128, 128)
    assert p["elements_per_token"] == 32 * (8 * 128) * 2 == 65536
    c = caches(p)
    assert c["f16"]["bytes_per_token"] == 65536 * 2 == 128 * 1024
    assert c["q8_0"]["bytes_per_token"] == 65536 // 32 * 34
    assert c["q4_0"]["bytes_per_token"] == 65536 // 32 * 18
    cells = 8192 * 4
    assert c["f16"]["cells"] == cells
    assert c["f16"]["bytes"] == cells * 128 * 1024 == 4 * GIB
    # each of the 64 K/V tensors (64 MiB, page aligned) grows from its own start:
    # 2 MiB / 2 KiB per cell = 1024 cells per page
    assert c["f16"]["tokens_per_page"] == 1024
    assert c["f16"]["pages_per_1k_tokens"] == 64
    assert c["f16"]["pages"] == 64 * 32 == 2048
    # q8_0: a row of 1024 elements = 32 blocks = 1088 bytes; packed, the full
    # cache is its bytes in pages: 64 x 32768 x 1088 / 2 MiB = 1088
    assert c["q8_0"]["pages"] == 64 * 32768 * 1088 // (2 * MIB) == 1088
    assert c["q8_0"]["paged_bytes"] == 1088 * 2 * MIB
    # 1000 cells of each 34 MiB tensor: starts at k x 34 MiB (page aligned), 1.04 MiB each
    assert c["q8_0"]["pages_per_1k_tokens"] == 64


def test_plan_explicit_head_dims_and_per_layer_kv_heads(tmp_path):
    """key_length/value_length override n_embd/n_head; head_count_kv may be per layer."""
    kv = [4, 4, 2, 0]  # the last layer has no KV (recurrent/hybrid layers do this)
    f = write_gguf(tmp_path / "odd.gguf", arch="gemma3", layers=4, embd=2560, heads=8, heads_kv=kv, key_length=256, value_length=128)
    p = plan_json(str(f), "--ctx", "1000", "--page-size", "1MiB")
    elems = sum(256 * h + 128 * h for h in kv)
    assert p["elements_per_token"] == elems
    c = caches(p)
    assert c["f16"]["bytes_per_token"] == elems * 2
    rows_q4 = [(256 * h) // 32 * 18 for h in kv if h] + [(128 * h) // 32 * 18 for h in kv if h]
    assert c["q4_0"]["bytes_per_token"] == sum(rows_q4)
    rows_f16 = [256 * h * 2 for h in kv if h] + [128 * h * 2 for h in kv if h]
    # 6 tensors (layer 3 has none) packed: 1000 x 7,680 B = 7.3 MiB -> 8 pages
    assert c["f16"]["pages"] == -(-1000 * sum(rows_f16) // MIB) == 8
    # q4_0: 1000 x 2,160 B = 2.06 MiB -> 3 pages (one page per tensor would be 6)
    assert c["q4_0"]["pages"] == -(-1000 * sum(rows_q4) // MIB) == 3


def test_plan_defaults_kv_heads_to_heads_and_prints_a_table(tmp_path):
    f = write_gguf(tmp_path / "mha.gguf", layers=2, embd=256, heads=4, heads_kv=None, name="tiny-mha")
    r = ctl("plan", str(f), "--ctx", "2048", "--parallel", "2")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "tiny-mha" in out and "2 layers" in out and "4 KV heads" in out
    lines = {l.split()[0]: l for l in out.splitlines() if l.split() and l.split()[0] in ("f16", "q8_0", "q4_0")}
    assert set(lines) == {"f16", "q8_0", "q4_0"}
    assert lines["f16"].split()[1] == f"{2 * 2 * 256 * 2:,}"  # 2 layers x (K+V) x 256 x 2 bytes
    assert "4,096 cells" in out


def test_plan_rejects_a_file_that_is_not_gguf(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"this is not a GGUF file at all" * 10)
    r = ctl("plan", str(bad))
    assert r.returncode == 1
    assert "not a readable GGUF file" in r.stderr


def test_plan_rejects_a_model_without_attention(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    w.add_block_count(4)
    w.add_embedding_length(256)
    w.add_tensor("x", np.zeros((2, 2), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = ctl("plan", str(tmp_path / "mamba.gguf"))
    assert r.returncode == 1 and "mamba.attention.head_count" in r.stderr


# ---- the Ollama model store --------------------------------------------------
def ollama_store(root: pathlib.Path, name: str, gguf_path: pathlib.Path, host="registry.ollama.ai", ns="library", tag="latest") -> str:
    data = gguf_path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    config = b'{"model_format":"gguf"}'
    cdigest = hashlib.sha256(config).hexdigest()
    (root / "blobs" / f"sha256-{cdigest}").write_bytes(config)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": f"sha256:{cdigest}", "size": len(config)},
        "layers": [
            {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64, "size": 1},
            {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": len(data)},
        ],
    }
    mdir = root / "manifests" / host / ns / name
    mdir.mkdir(parents=True, exist_ok=True)
    (mdir / tag).write_text(json.dumps(manifest))
    return digest


def test_plan_resolves_ollama_names_through_OLLAMA_MODELS(tmp_path):
    store = tmp_path / "models"
    small = write_gguf(tmp_path / "a.gguf", layers=16, embd=2048, heads=32, heads_kv=8, name="small")
    big = write_gguf(tmp_path / "b.gguf", layers=40, embd=5120, heads=40, heads_kv=8, name="big")
    d_small = ollama_store(store, "tiny", small, tag="1b")
    ollama_store(store, "tiny", big)  # tiny:latest
    ollama_store(store, "model", small, ns="someone", tag="q4")
    env = {"OLLAMA_MODELS": str(store)}
    p = plan_json("tiny:1b", env=env)
    assert p["n_layer"] == 16 and p["model"] == "tiny:1b"
    assert p["path"] == str(store / "blobs" / f"sha256-{d_small}")
    assert plan_json("tiny", env=env)["n_layer"] == 40  # default tag: latest
    assert plan_json("registry.ollama.ai/library/tiny:latest", env=env)["n_layer"] == 40
    assert plan_json("someone/model:q4", env=env)["n_layer"] == 16
    assert caches(plan_json("tiny:1b", env=env))["f16"]["bytes_per_token"] == 16 * 2 * (8 * 64) * 2


def test_plan_uses_the_default_store_under_HOME(tmp_path):
    home = tmp_path / "home"
    ollama_store(home / ".ollama" / "models", "llama3", write_gguf(tmp_path / "m.gguf"), tag="8b")
    p = plan_json("llama3:8b", env={"HOME": str(home)})
    assert p["n_layer"] == 32


def test_plan_explains_a_missing_model_or_blob(tmp_path):
    store = tmp_path / "models"
    r = ctl("plan", "nosuch:7b", env={"OLLAMA_MODELS": str(store)})
    assert r.returncode == 1
    assert str(store / "manifests/registry.ollama.ai/library/nosuch/7b") in r.stderr
    digest = ollama_store(store, "gone", write_gguf(tmp_path / "g.gguf"))
    (store / "blobs" / f"sha256-{digest}").unlink()
    r = ctl("plan", "gone", env={"OLLAMA_MODELS": str(store)})
    assert r.returncode == 1 and f"sha256:{digest}" in r.stderr and "missing" in r.stderr
    mdir = store / "manifests/registry.ollama.ai/library/nomodel"
    mdir.mkdir(parents=True)
    (mdir / "latest").write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.license", "digest": "sha256:00"}]}))
    r = ctl("plan", "nomodel", env={"OLLAMA_MODELS": str(store)})
    assert r.returncode == 1 and "application/vnd.ollama.image.model" in r.stderr


def test_parse_model_name():
    assert parse_model_name("llama3") == ("registry.ollama.ai", "library", "llama3", "latest")
    assert parse_model_name("llama3.1:8b-instruct-q4_K_M") == ("registry.ollama.ai", "library", "llama3.1", "8b-instruct-q4_K_M")
    assert parse_model_name("me/m:t") == ("registry.ollama.ai", "me", "m", "t")
    assert parse_model_name("localhost:5000/ns/m") == ("localhost:5000", "ns", "m", "latest")
    with pytest.raises(PlanError):
        parse_model_name("a/b/c/d")


# ---- against a daemon -------------------------------------------------------
def sock_env(d) -> dict:
    return {"KVCACHED_SOCKET": d.socket}


def test_stats_table_and_json_match_getstats(daemon_factory):
    d = daemon_factory("host", memory_limit="64MiB")
    with d.client() as c, c.open_session("llama3:8b") as s:
        s.allocate(5)
        st = c.stats()
        r = ctl("stats", "--json", env=sock_env(d))
        assert r.returncode == 0, r.stderr
        j = json.loads(r.stdout)
        (uuid, pool), = st.devices.items()
        dev = j["devices"][0]
        assert dev["uuid"] == uuid
        for k in ("budget_bytes", "in_use_bytes", "pooled_bytes", "free_bytes", "pages_created_total"):
            assert dev[k] == getattr(pool, k), k
        assert j["sessions_open"] == 1 and j["backend"] == "host"
        r = ctl("stats", env=sock_env(d))
        assert r.returncode == 0, r.stderr
        row = next(l for l in r.stdout.splitlines() if l.startswith(uuid))
        assert row.split()[1:5] == ["64", "MiB", "10", "MiB"]  # budget 64 MiB, in use 10 MiB
        assert "16%" in row
        assert "1 session open" in r.stdout


def test_socket_from_either_variable_ollama_first(daemon_factory, tmp_path):
    d = daemon_factory("host")
    r = ctl("stats", env={"OLLAMA_KVCACHED_SOCKET": d.socket})
    assert r.returncode == 0 and d.socket in r.stdout, r.stderr
    r = ctl("stats", env={"KVCACHED_SOCKET": d.socket})
    assert r.returncode == 0 and d.socket in r.stdout, r.stderr
    # OLLAMA_KVCACHED_SOCKET wins over KVCACHED_SOCKET (the order of the Go
    # and C clients and the llama.cpp hook); --socket over both
    r = ctl("stats", env={"OLLAMA_KVCACHED_SOCKET": d.socket, "KVCACHED_SOCKET": "/nonexistent"})
    assert r.returncode == 0, r.stderr
    r = ctl("stats", env={"KVCACHED_SOCKET": d.socket, "OLLAMA_KVCACHED_SOCKET": str(tmp_path / "gone.sock")})
    assert r.returncode == 3 and "gone.sock (from $OLLAMA_KVCACHED_SOCKET)" in r.stderr, r.stderr
    r = ctl("stats", "--socket", str(tmp_path / "none.sock"), env={"OLLAMA_KVCACHED_SOCKET": d.socket})
    assert r.returncode == 3
    assert "no kvcached socket at" in r.stderr and "none.sock" in r.stderr


def test_socket_option_before_or_after_the_command(daemon_factory, tmp_path):
    d = daemon_factory("host")
    for args in (["--socket", d.socket, "stats"], ["stats", "--socket", d.socket],
                 [f"--socket={d.socket}", "health"], ["health", f"--socket={d.socket}"],
                 ["--timeout", "7", "stats", "--socket", d.socket, "--json"]):
        r = ctl(*args)
        assert r.returncode == 0, (args, r.stderr)
    # after the command wins over before it
    r = ctl("--socket", str(tmp_path / "none.sock"), "stats", "--socket", d.socket)
    assert r.returncode == 0, r.stderr
    r = ctl("--socket", d.socket, "stats", "--socket", str(tmp_path / "none.sock"))
    assert r.returncode == 3 and "none.sock" in r.stderr
    r = ctl("--timeout", "0", "stats")
    assert r.returncode == 2 and "must be positive" in r.stderr


def quick(*args, **kw) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = ctl(*args, **kw)
    return r, time.monotonic() - t0


# The bound for "at once": --timeout is 60 s and the answer must come in well
# under half of it (a python start is ~0.5 s; 30 s leaves room for a loaded
# CI machine). Before the socket check, a missing socket took the full timeout.
AT_ONCE = 30.0


def test_missing_socket_and_directory_named_at_once(tmp_path):
    for cmd in ("stats", "health", "sessions", "top"):
        r, dt = quick(cmd, "--socket", str(tmp_path / "none.sock"), "--timeout", "60")
        assert r.returncode == 3, (cmd, r.stdout, r.stderr)
        assert f"no kvcached socket at {tmp_path / 'none.sock'}: no such file" in r.stderr, r.stderr
        assert dt < AT_ONCE, (cmd, dt)
    r, dt = quick("stats", "--socket", str(tmp_path / "nodir" / "x.sock"), "--timeout", "60")
    assert r.returncode == 3 and f"no such directory {tmp_path / 'nodir'}" in r.stderr and dt < AT_ONCE, r.stderr


def test_not_a_socket_and_a_stale_socket_named_at_once(tmp_path):
    f = tmp_path / "file.sock"
    f.write_text("")
    r, dt = quick("stats", "--socket", str(f), "--timeout", "60")
    assert r.returncode == 3 and "is a regular file, not a Unix socket" in r.stderr and dt < AT_ONCE, r.stderr
    r, dt = quick("health", "--socket", str(tmp_path), "--timeout", "60")
    assert r.returncode == 3 and "is a directory, not a Unix socket" in r.stderr and dt < AT_ONCE, r.stderr
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))  # bound, never listening: what a killed daemon leaves behind
    try:
        r, dt = quick("stats", "--socket", str(stale), "--timeout", "60")
        assert r.returncode == 3 and "nothing listens on" in r.stderr and "stale socket" in r.stderr, r.stderr
        assert dt < AT_ONCE
    finally:
        s.close()


def test_a_daemon_that_does_not_answer(tmp_path):
    """Something accepts connections but never speaks gRPC: the message says
    so after --timeout (here 1 s)."""
    path = tmp_path / "mute.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.listen(16)
    try:
        r = ctl("stats", "--socket", str(path), "--timeout", "1")
        assert r.returncode == 3, r.stderr
        assert "accepts connections but does not answer gRPC within 1 s" in r.stderr, r.stderr
        r = ctl("health", "--socket", str(path), "--timeout", "1")
        assert r.returncode == 3 and "not healthy" in r.stdout, r.stdout + r.stderr
    finally:
        s.close()


def test_permission_denied_on_the_socket_and_its_directory(daemon_factory, tmp_path):
    """Run as `nobody`: a socket it may not open and a directory it may not
    enter are named as such (with owner, group, mode and what to do), at once,
    while the daemon runs."""
    if os.getuid() != 0:
        pytest.fail("this test runs kvcachedctl as another uid and needs root (CI and dev machines run as root)")
    nobody = pwd.getpwnam("nobody")
    d = daemon_factory("host", shared_dir=True, socket_mode="0660")  # directory 0755, socket 0660 root:root
    r, dt = quick("stats", "--socket", d.socket, "--timeout", "60", user=nobody)
    assert r.returncode == 3, r.stderr
    assert f"permission denied on the socket {d.socket} (owner root, group root, mode 0660)" in r.stderr, r.stderr
    assert f"you are uid {nobody.pw_uid}" in r.stderr and "join group 'root'" in r.stderr
    assert dt < AT_ONCE
    r = ctl("health", "--socket", d.socket, user=nobody)
    assert r.returncode == 3 and "permission denied on the socket" in r.stderr, r.stderr
    # the systemd layout: a 0750 directory the user may not enter
    private = pathlib.Path(tempfile.mkdtemp(prefix="kvc-private-"))
    try:
        private.chmod(0o750)
        d2 = daemon_factory("host", socket=str(private / "kvcached.sock"))
        r, dt = quick("stats", "--socket", d2.socket, "--timeout", "60", user=nobody)
        assert r.returncode == 3, r.stderr
        assert f"permission denied: cannot enter {private} (owner root, group root, mode 0750)" in r.stderr, r.stderr
        assert dt < AT_ONCE
        # root gets through both
        assert ctl("stats", "--socket", d2.socket).returncode == 0
        d2.stop()
    finally:
        shutil.rmtree(private, ignore_errors=True)


def test_sizes_are_parsed_by_pydantic_bytesize():
    assert cli.parse_size("2MiB") == 2 << 20
    assert cli.parse_size("1.5GB") == 1_500_000_000
    assert cli.parse_size("4096") == 4096
    assert cli.parse_size("8 gib") == 8 << 30
    for bad in ("lots", "-1", "", "1e3", "2MiBs"):
        with pytest.raises(ValueError, match="not a size"):
            cli.parse_size(bad)


def test_resolve_socket_order(monkeypatch, tmp_path):
    assert cli.resolve_socket("/a", {"KVCACHED_SOCKET": "/b", "OLLAMA_KVCACHED_SOCKET": "/c"}) == "/a"
    assert cli.resolve_socket(None, {"KVCACHED_SOCKET": "/b", "OLLAMA_KVCACHED_SOCKET": "/c"}) == "/c"
    assert cli.resolve_socket(None, {"KVCACHED_SOCKET": "/b"}) == "/b"
    assert cli.resolve_socket(None, {"KVCACHED_SOCKET": "/b", "OLLAMA_KVCACHED_SOCKET": ""}) == "/b"
    assert cli.socket_source(None, {"KVCACHED_SOCKET": "/b"}) == ("/b", "$KVCACHED_SOCKET")
    monkeypatch.setattr(cli, "DEFAULT_SOCKET", str(tmp_path / "kvcached.sock"))
    monkeypatch.setattr(cli, "SYSTEMD_SOCKET", str(tmp_path / "run.sock"))
    assert cli.resolve_socket(None, {}) == str(tmp_path / "kvcached.sock")
    (tmp_path / "run.sock").touch()  # only the systemd socket exists
    assert cli.resolve_socket(None, {}) == str(tmp_path / "run.sock")


def test_sessions_lists_every_session_for_an_admin(daemon_factory):
    d = daemon_factory("host", memory_limit="64MiB")
    with d.client() as c, c.open_session("llama3:8b", guaranteed_bytes=4 * MIB) as a, c.open_session("qwen2.5") as b:
        a.allocate(3)
        b.allocate(1)
        r = ctl("sessions", env=sock_env(d))
        assert r.returncode == 0, r.stderr
        rows = {l.split()[1]: l.split() for l in r.stdout.splitlines()[1:] if l.strip() and not l.startswith("(")}
        assert set(rows) == {"llama3:8b", "qwen2.5"}, r.stdout  # kvcachedctl's own session is not listed
        assert rows["llama3:8b"][0] == str(a.id) and rows["llama3:8b"][4:6] == ["6", "MiB"]
        r = ctl("sessions", "--json", env=sock_env(d))
        j = {s["name"]: s for s in json.loads(r.stdout)}
        assert j["llama3:8b"]["held_bytes"] == 6 * MIB and j["llama3:8b"]["guaranteed_bytes"] == 4 * MIB
        assert j["qwen2.5"]["pid"] == os.getpid()


def test_top_refreshes_a_bounded_number_of_times(daemon_factory):
    d = daemon_factory("host", memory_limit="64MiB")
    with d.client() as c, c.open_session("busy-model") as s:
        s.allocate(2)
        r = ctl("top", "--iterations", "3", "--interval", "0.1", env=sock_env(d), timeout=30)
        assert r.returncode == 0, r.stderr
        frames = r.stdout.split("kvcachedctl top")
        assert len(frames) == 4, r.stdout  # 3 frames (and the empty text before the first)
        for f in frames[1:]:
            assert "busy-model" in f and "HOST-0" in f and "1 session open" in f
        assert "\x1b[2J" not in r.stdout  # not a terminal: frames are appended, not redrawn


def test_set_limits_and_shrink_by_name_and_id(daemon_factory):
    d = daemon_factory("host", memory_limit="64MiB")
    with d.client() as c, c.open_session("llama3:8b") as s, c.open_session("other") as o:
        s.allocate(6)
        reclaims = []
        got = threading.Event()
        s.on_reclaim(lambda ev: (reclaims.append(ev), got.set()))
        r = ctl("set-limits", "llama3:8b", "--guaranteed", "4MiB", "--max", "48MiB", "--priority", "-2", env=sock_env(d))
        assert r.returncode == 0, r.stderr
        assert "guaranteed 4 MiB, max 48 MiB, priority -2" in r.stdout
        mine = s.my_stats()
        assert (mine.guaranteed_bytes, mine.max_bytes, mine.priority) == (4 * MIB, 48 * MIB, -2)
        r = ctl("shrink", str(s.id), "--to", "4MiB", "--timeout-ms", "500", env=sock_env(d))
        assert r.returncode == 0, r.stderr
        assert "give back 4 pages" in r.stdout
        # the session neither answers nor frees: shrink waits out the 500 ms and says so
        assert "HOST-0: neither answered nor gave back everything before the deadline; the daemon's books: it holds 12 MiB" in r.stdout, r.stdout
        assert got.wait(10), "the session never got the reclaim request"
        assert reclaims[0].pages == 4 and reclaims[0].reason == "admin"
        r = ctl("shrink", str(s.id), "--to", "4MiB", "--no-wait", env=sock_env(d))
        assert r.returncode == 0 and "HOST-0: no answer yet (not waited for)" in r.stdout, r.stdout
        # already small enough: nothing asked
        r = ctl("shrink", "other", "--to", "0", env=sock_env(d))
        assert r.returncode == 0 and "nothing asked" in r.stdout
        # errors name the problem
        r = ctl("set-limits", "nobody-here", "--max", "1GiB", env=sock_env(d))
        assert r.returncode == 1 and "no open session named 'nobody-here'" in r.stderr
        r = ctl("set-limits", "other", env=sock_env(d))
        assert r.returncode == 2 and "at least one of" in r.stderr
        r = ctl("set-limits", "other", "--guaranteed", "8MiB", "--max", "4MiB", env=sock_env(d))
        assert r.returncode == 1 and "exceeds max_bytes" in r.stderr
        r = ctl("shrink", "other", "--to", "lots", env=sock_env(d))
        assert r.returncode == 2 and "not a size" in r.stderr
        o.close()


def test_shrink_prints_the_sessions_answer_as_soon_as_it_comes(daemon_factory):
    """kvcachedctl shrink returns once the session answered (issue 19, item
    5: the llama.cpp hook answers at once with what it gave and keeps) and
    prints what could and could not be given back, and why."""
    d = daemon_factory("host", memory_limit="64MiB", reclaim_timeout_ms="20000")
    with d.client() as c, c.open_session("busy-model") as s:
        pages = s.allocate(8)

        def on_reclaim(ev):
            s.free([pages.pop()])
            s.answer_reclaim(ev, 2 * MIB, len(pages) * 2 * MIB, "the rest is in use by busy slots")

        s.on_reclaim(on_reclaim)
        t0 = time.monotonic()
        r = ctl("shrink", "busy-model", "--to", "2MiB", env=sock_env(d))
        took = time.monotonic() - t0
        assert r.returncode == 0, r.stderr
        assert took < 10, f"shrink took {took:.1f} s: it waited for the 20 s deadline"
        assert "asked session" in r.stdout and "to give back 7 pages, down to 2 MiB" in r.stdout, r.stdout
        assert ("HOST-0: answered: gave back 2 MiB, keeps 14 MiB (the rest is in use by busy slots); "
                "the daemon's books: it holds 14 MiB") in r.stdout, r.stdout
        s.free(pages)


def test_admin_commands_need_an_admin(daemon_factory):
    nobody = pwd.getpwnam("nobody")
    if os.getuid() != 0:
        pytest.fail("this test runs kvcachedctl as another uid and needs root (CI and dev machines run as root)")
    d = daemon_factory("host", shared_dir=True, socket_mode="0666")
    with d.client() as c, c.open_session("victim") as s:
        for args in (["set-limits", "victim", "--max", "8MiB"], ["shrink", str(s.id), "--to", "0"], ["sessions"]):
            r = ctl(*args, env=sock_env(d), user=nobody)
            assert r.returncode == 1, (args, r.stdout, r.stderr)
            assert "needs an admin session" in r.stderr and f"uid {nobody.pw_uid}" in r.stderr, r.stderr
        assert s.my_stats().max_bytes == 0  # unchanged
        # stats needs no session: anyone who can open the socket may read it
        r = ctl("stats", env=sock_env(d), user=nobody)
        assert r.returncode == 0, r.stderr
        # top degrades to devices only
        r = ctl("top", "--iterations", "1", env=sock_env(d), user=nobody)
        assert r.returncode == 0 and "not an admin" in r.stdout and "victim" not in r.stdout


def test_health(daemon_factory, tmp_path):
    d = daemon_factory("host")
    r = ctl("health", env=sock_env(d))
    assert r.returncode == 0 and "SERVING" in r.stdout, r.stdout + r.stderr
    r = ctl("health", "--service", "kvcached.v1.KVCached", env=sock_env(d))
    assert r.returncode == 0, r.stdout
    r = ctl("health", "--socket", str(tmp_path / "missing.sock"), "--timeout", "1")
    assert r.returncode == 3 and "no kvcached socket at" in r.stderr
    d.stop()
    r = ctl("health", "--timeout", "1", env=sock_env(d))
    assert r.returncode == 3 and "no kvcached socket at" in r.stderr  # the daemon removed its socket


def test_console_script_is_installed():
    exe = pathlib.Path(sys.executable).parent / "kvcachedctl"
    assert exe.exists(), "kvcachedctl console script missing: reinstall the package (scripts/setup.sh)"
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0
    for cmd in ("stats", "sessions", "top", "set-limits", "shrink", "plan", "health"):
        assert cmd in r.stdout


def test_stats_and_sessions_show_standby_apart_from_held(daemon_factory):
    """A session's standby pages (freed with the standby flag, still its
    own) are held, and shown in a column of their own by `stats` (per
    device) and `sessions`, as GetStats says them."""
    d = daemon_factory("host", memory_limit="64MiB", page_size="2MiB")
    with d.client() as c, c.open_session("standby-model") as s:
        r = s.region(16 * MIB)
        r.map(0, 8 * MIB)
        assert r.trim_to(2 * MIB, standby=True) == 3
        me = next(x for x in s.stats().sessions if x.id == s.id)
        assert me.held_bytes == 8 * MIB and me.standby_bytes == 6 * MIB
        out = ctl("sessions", env=sock_env(d))
        assert out.returncode == 0, out.stderr
        header = out.stdout.splitlines()[0].split()
        assert header[4:6] == ["held", "standby"], out.stdout
        row = next(l.split() for l in out.stdout.splitlines()[1:] if "standby-model" in l)
        assert row[4:8] == ["8", "MiB", "6", "MiB"], out.stdout  # held, then standby
        st = ctl("stats", env=sock_env(d))
        assert st.returncode == 0, st.stderr
        (uuid,) = c.stats().devices
        row = next(l.split() for l in st.stdout.splitlines() if l.startswith(uuid))
        assert row[1:7] == ["64", "MiB", "8", "MiB", "6", "MiB"], st.stdout  # budget, in use, standby
        j = json.loads(ctl("stats", "--json", env=sock_env(d)).stdout)
        assert j["devices"][0]["standby_bytes"] == 6 * MIB
