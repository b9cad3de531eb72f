"""How the hook is built and shipped (issue 13 item 1): the static link, the
llama-quantize beside llama-server, and apply.py's forms (in place, one
patch, Ollama's compat form) with their failure modes.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import tiny_model
from kvtest import ROOT
from llamatest import KVC, LLAMA_CPP_ORIG, ORIG, QUANTIZE_KVC, QUANTIZE_ORIG, observe, session_of, text

APPLY = ROOT / "integrations" / "llama.cpp" / "apply.py"
# what Ollama's lib/ollama must not need, and what the hook must not export
FOREIGN_LIBS = re.compile(r"kvcached|grpc|protobuf|absl|re2|cares|upb|gpr|address_sorting|ssl|crypto")
FOREIGN_SYMS = re.compile(r"grpc|absl|protobuf|google::|(?<![A-Za-z0-9_])(re2::|ares_|upb_|gpr_)")


def needed(path: pathlib.Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def exported(path: pathlib.Path) -> list[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", "-C", str(path)], capture_output=True, text=True,
                         check=True).stdout
    return [line.split(None, 2)[2] for line in out.splitlines() if len(line.split(None, 2)) == 3]


def test_shipped_binaries_need_and_export_nothing_of_the_client(daemon_factory, servers, models):
    """llama-server and libllama.so of the patched build (shared libraries,
    as Ollama ships them): no NEEDED entry for libkvcached, gRPC, protobuf,
    abseil, re2, c-ares or OpenSSL; no gRPC/abseil/protobuf symbol exported;
    llama-server carries the client (it exports the kvc_* API for libllama's
    hook) and the hook uses it."""
    bindir = KVC.parent
    libllama = bindir / "libllama.so"
    assert libllama.exists(), f"{libllama}: the builds are shared (BUILD_SHARED_LIBS=ON, as Ollama's)"
    for f in [KVC, QUANTIZE_KVC, *sorted(bindir.glob("lib*.so"))]:
        bad = [n for n in needed(f) if FOREIGN_LIBS.search(n)]
        assert not bad, (f.name, bad)
        syms = [s for s in exported(f) if FOREIGN_SYMS.search(s)]
        assert not syms, (f.name, syms[:20])
    assert any(s.startswith("kvc_region_map_ranges") for s in exported(KVC)), "llama-server lacks the C client"
    assert not any(s.startswith("kvc_") for s in exported(libllama)), "libllama must not carry the client"
    # and the hook found the client inside llama-server
    d = daemon_factory("host", memory_limit="64MiB", page_size=str(64 << 10))
    srv = servers(KVC, models[0], kvc_socket=d.socket, ctx=4096, parallel=1)
    srv.complete(text(500, 1), 4)
    assert "C client built into this program" in srv.log_text(), srv.log_text()[-3000:]
    with observe(d) as c:
        assert session_of(c, srv.pid).held_bytes > 0


@pytest.mark.parametrize("quantize", [QUANTIZE_ORIG, QUANTIZE_KVC], ids=["orig", "kvc"])
def test_llama_quantize_is_built_and_works(servers, tmp_path, quantize):
    """llama-quantize sits next to llama-server (Ollama's `ollama create`
    runs `llama-quantize --allow-requantize IN OUT TYPE` from there) and its
    output serves."""
    assert quantize.exists(), quantize
    assert quantize.parent in (KVC.parent, ORIG.parent)
    src = tiny_model.write(tmp_path / "f32.gguf", seed=3)
    out = tmp_path / "q8.gguf"
    p = subprocess.run([str(quantize), "--allow-requantize", str(src), str(out), "q8_0"], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert 0 < out.stat().st_size < src.stat().st_size
    srv = servers(ORIG, out, kvc_socket=None, ctx=2048, parallel=1)
    assert len(srv.complete(text(200, 5), 8)["tokens"]) == 8


def run_apply(*args, check=False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(APPLY), *map(str, args)], capture_output=True, text=True, check=check)


@pytest.fixture
def pristine(tmp_path) -> pathlib.Path:
    """A copy of the files apply.py touches, from the pristine tree."""
    assert (LLAMA_CPP_ORIG / "src" / "llama-kv-cache.cpp").exists(), LLAMA_CPP_ORIG
    t = tmp_path / "llama.cpp"
    for rel in run_apply(LLAMA_CPP_ORIG, "--list", check=True).stdout.split():
        if (LLAMA_CPP_ORIG / rel).exists():
            (t / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(LLAMA_CPP_ORIG / rel, t / rel)
    subprocess.run(["git", "init", "-q", str(t)], check=True)
    return t


def test_emit_compat_writes_ollamas_layout(pristine, tmp_path):
    """--emit-compat DIR: the hook's sources beside Ollama's compat sources
    and a numbered patch with call sites only, which git apply takes (and
    whose reverse check passes after, as Ollama's idempotent applier needs)."""
    out = tmp_path / "compat"
    p = run_apply(pristine, "--emit-compat", out)
    assert p.returncode == 0, p.stderr
    hook = sorted(p.name for p in APPLY.parent.glob("kvcached_kv*"))
    assert len(hook) >= 3 and "kvcached_kv.cpp" in hook and "kvcached_kv.h" in hook
    assert sorted(f.name for f in out.iterdir()) == sorted(["010-kvcached-kv-cache.patch", *hook])
    for name in hook:
        assert (out / name).read_text() == (APPLY.parent / name).read_text()
    patch = (out / "010-kvcached-kv-cache.patch").read_text()
    assert "new file" not in patch
    assert sorted(re.findall(r"^diff --git a/(\S+)", patch, re.M)) == [
        "src/CMakeLists.txt", "src/llama-kv-cache.cpp", "tools/server/CMakeLists.txt",
        "tools/server/server-context.cpp"]
    assert "find_package(kvcached 1.2 CONFIG QUIET)" in patch and "REQUIRED" not in patch
    subprocess.run(["git", "apply", str(out / "010-kvcached-kv-cache.patch")], cwd=pristine, check=True)
    subprocess.run(["git", "apply", "--reverse", "--check", str(out / "010-kvcached-kv-cache.patch")],
                   cwd=pristine, check=True)
    assert '#include "kvcached_kv.h"' in (pristine / "src/llama-kv-cache.cpp").read_text()
    # --patch-name
    p = run_apply(LLAMA_CPP_ORIG, "--emit-compat", tmp_path / "c2", "--patch-name", "020-x.patch")
    assert p.returncode == 0 and (tmp_path / "c2" / "020-x.patch").exists(), p.stderr
    assert run_apply(LLAMA_CPP_ORIG, "--emit-compat", tmp_path / "c3", "--patch-name", "a/b").returncode == 2


def test_in_place_and_refusals(pristine, tmp_path):
    """In place: sources copied to src/, a second run refused; a missing
    anchor names itself and nothing is written; not a llama.cpp tree: a
    clear error."""
    p = run_apply(pristine)
    assert p.returncode == 0, p.stderr
    assert (pristine / "src/kvcached_kv.cpp").exists()
    again = run_apply(pristine)
    assert again.returncode == 1 and "already carries the hook" in again.stderr
    broken = tmp_path / "broken"
    shutil.copytree(LLAMA_CPP_ORIG / "src", broken / "src", ignore=shutil.ignore_patterns("models"))
    shutil.copytree(LLAMA_CPP_ORIG / "tools" / "server", broken / "tools" / "server")
    kv = broken / "src" / "llama-kv-cache.cpp"
    kv.write_text(kv.read_text().replace("bool llama_kv_cache::seq_rm(", "bool llama_kv_cache::seq_remove("))
    before = kv.read_text()
    p = run_apply(broken)
    assert p.returncode == 1
    assert "anchor 'llama_kv_cache::seq_rm'" in p.stderr and "nothing was changed" in p.stderr, p.stderr
    assert kv.read_text() == before and not (broken / "src" / "kvcached_kv.cpp").exists()
    p = run_apply(tmp_path / "nowhere", "--check")
    assert p.returncode == 1 and "not a llama.cpp source tree" in p.stderr


def test_hook_parts_stay_small():
    """Issue 27 item 5: the hook in parts, no file over 500 lines, no
    function over 60 (a function: a definition at column 0 to its closing
    brace at column 0, signature lines included)."""
    files = sorted(APPLY.parent.glob("kvcached_kv*"))
    assert len(files) >= 6, files
    long_functions = []
    for f in files:
        lines = f.read_text().splitlines()
        assert len(lines) <= 500, (f.name, len(lines))
        start = None
        for i, line in enumerate(lines):
            if (start is None and re.match(r"[A-Za-z_].*\(", line) and not line.rstrip().endswith(";")
                    and not line.startswith(("namespace", "extern", "struct", "enum", "using", "#"))):
                start = i
            elif line.startswith("}"):
                if start is not None and i - start + 1 > 60:
                    long_functions.append((f.name, lines[start][:80], i - start + 1))
                start = None
            elif start is not None and not line.startswith((" ", "\t")) and line.rstrip().endswith(";"):
                start = None
    assert not long_functions, long_functions
