"""First contact on a plain Debian 12 (issue 45 items 3 and 5): a fresh
bookworm root with only what the debian:12 image has (mmdebstrap
--variant=minbase, made and cached by scripts/test-packaging.sh), a copy of
the checkout in it, and what the README's Quick start tells a newcomer to
run there, as root, through chroot (freshroot.py):

1. `apt-get update && apt-get install -y make` (the image has no make),
   then `make serve`: set-up installs what the daemon needs (python3-venv,
   gcc, libc6-dev; the .venv from PyPI, the relay built), the daemon starts
   on the host backend and says it fell back for want of a CUDA driver,
   answers health and GetInfo, serves the README's demo, and stops cleanly on
   Ctrl-C;
2. the manylinux wheel (the packaging suite's, not a build of this root)
   installed with the root's python3.11 into a clean venv and run;
3. `make test` stops within seconds, before set-up downloads anything,
   naming what a Debian 12 lacks and set-up cannot install (python3.12, Go);
4. the quick suite, `scripts/test-python.sh tests/test_config.py`, likewise
   stops at once naming python3.12, before any test runs: the Python suite
   cannot run on Debian 12 without one (see README, Quick start).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import time

import pytest

from freshroot import CHECKOUT, FreshRoot

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
# the newcomer's commands, as README's Quick start shows them
FIRST = "apt-get update && apt-get install -y make"
SERVE = "make serve"
SOCK = "/tmp/kvcached.sock"  # make serve's default
SET_UP = 900  # make serve's set-up on a cold root: apt and pip downloads (about 2 minutes here)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    tar = os.environ.get("KVC_PKG_FRESH_ROOT")
    if not tar:
        pytest.fail("$KVC_PKG_FRESH_ROOT is not set: run the packaging suite with scripts/test-packaging.sh (it makes the root)")
    where = tmp_path_factory.mktemp("fresh") / "root"
    root = FreshRoot(pathlib.Path(tar), where)
    yield root
    root.remove()


def ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, f"{r.args[-1][-300:]}: exit {r.returncode}\n{r.stdout[-4000:]}"
    return r.stdout


def installed(fresh: FreshRoot, pkg: str) -> bool:
    r = fresh.run(f"dpkg-query -W -f='${{Status}}' {pkg}", timeout=60)
    return "install ok installed" in r.stdout


def test_the_root_is_a_plain_debian_12(fresh):
    os_release = fresh.file("/etc/os-release").read_text()
    assert 'VERSION_ID="12"' in os_release and "bookworm" in os_release
    for tool in ("make", "gcc", "git", "curl"):
        assert shutil.which(tool, path=str(fresh.file("/usr/bin"))) is None, f"{tool} is in the fresh root"
    assert not installed(fresh, "python3")  # minbase has no python at all
    assert (fresh.file(CHECKOUT) / "Makefile").is_file()


def test_readme_shows_what_this_test_runs():
    text = README.read_text()
    assert FIRST in text and SERVE in text


def test_make_serve_on_a_fresh_debian_12(fresh, tmp_path):
    ok(fresh.run(FIRST, timeout=600))
    log = tmp_path / "serve.log"
    t0 = time.monotonic()
    p = fresh.start(SERVE, log)
    try:
        deadline = t0 + SET_UP
        while "INFO kvcached: serving on" not in log.read_text():
            assert p.poll() is None, f"make serve exited {p.returncode}:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"make serve did not serve within {SET_UP} s:\n{log.read_text()[-4000:]}"
            time.sleep(1)
        took = time.monotonic() - t0
        text = log.read_text()
        assert "installing Debian packages: python3-venv gcc libc6-dev" in text, text[-4000:]
        assert re.search(r"backend: host \(memfd pages\): no usable CUDA driver .*serving host memory instead of GPU memory", text), text
        assert f"serving on {SOCK}" in text
        # health and GetInfo, from the root's .venv
        out = ok(fresh.run(f".venv/bin/kvcachedctl health --socket {SOCK} --timeout 10", timeout=120))
        assert "SERVING" in out, out
        info = json.loads(ok(fresh.run(
            ".venv/bin/python -c 'import json; from kvcached_service.client import Client\n"
            f"c = Client.connect(\"{SOCK}\"); i = c.info\n"
            "print(json.dumps({\"backend\": i.backend, \"version\": i.version})); c.close()'", timeout=120)).splitlines()[-1])
        assert info["backend"] == "host", info
        # the README's demo
        out = ok(fresh.run(".venv/bin/python examples/share_page.py", timeout=120))
        assert "read from the shared page: 'hello from pid" in out, out
        print(f"make serve: serving {took:.0f} s after it was started (set-up included)")
    finally:
        FreshRoot.interrupt(p)  # Ctrl-C
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            FreshRoot.interrupt(p, signal.SIGKILL)
            p.wait()
    text = log.read_text()
    assert "stopped: every page released" in text, text[-3000:]
    assert not fresh.file(SOCK).exists()


def test_the_manylinux_wheel_in_the_fresh_root(fresh, wheel, tmp_path):
    assert "manylinux" in wheel.name
    if not installed(fresh, "python3-venv"):  # make serve's set-up installs it; alone, the docs' prerequisite
        ok(fresh.run("apt-get update -qq && apt-get install -y -qq python3-venv", timeout=600))
    shutil.copy(wheel, fresh.file("/root") / wheel.name)
    ok(fresh.run(f"python3 -m venv /opt/kvcached && /opt/kvcached/bin/pip install -q /root/{wheel.name}", timeout=600, cwd="/root"))
    out = ok(fresh.run("/opt/kvcached/bin/kvcached-serve --version && python3 --version", timeout=120, cwd="/root"))
    assert wheel.name.split("-")[1] in out and "Python 3.11" in out, out
    log = tmp_path / "wheel-serve.log"
    p = fresh.start("exec /opt/kvcached/bin/kvcached-serve --socket /tmp/wheel.sock --backend host --memory-limit 64MiB", log, cwd="/root")
    try:
        deadline = time.monotonic() + 120
        while True:
            assert p.poll() is None, log.read_text()
            r = fresh.run("/opt/kvcached/bin/kvcachedctl health --socket /tmp/wheel.sock --timeout 2", timeout=60, cwd="/root")
            if r.returncode == 0:
                break
            assert time.monotonic() < deadline, log.read_text() + r.stdout
            time.sleep(0.5)
        out = ok(fresh.run("/opt/kvcached/bin/kvcachedctl stats --json --socket /tmp/wheel.sock", timeout=60, cwd="/root"))
        assert json.loads(out)["devices"][0]["budget_bytes"] == 64 << 20
        # the relay library the daemon loaded is the wheel's, in the venv
        out = ok(fresh.run("/opt/kvcached/bin/python -c 'import kvcached_service.server.relay as r; print(r.library_path())'",
                           timeout=60, cwd="/root"))
        assert out.strip().startswith("/opt/kvcached/lib/python3.11/site-packages/kvcached_service/server/_relay"), out
    finally:
        FreshRoot.interrupt(p, signal.SIGTERM)
        assert p.wait(60) == 0, log.read_text()


def test_make_test_stops_at_once_naming_what_is_missing(fresh):
    """No python3.12 and no Go on a Debian 12: `make test` says so in
    seconds, before set-up's downloads (torch alone is ~5 GB)."""
    if not installed(fresh, "make"):
        ok(fresh.run(FIRST, timeout=600))
    t0 = time.monotonic()
    r = fresh.run("make test", timeout=300)
    took = time.monotonic() - t0
    assert r.returncode != 0, r.stdout[-3000:]
    assert "preflight: missing: python3.12" in r.stdout and "PYTHON312" in r.stdout, r.stdout
    assert "preflight: missing: go >= 1.26" in r.stdout, r.stdout
    assert "preflight: 2 missing for all: nothing was installed or run" in r.stdout, r.stdout
    assert "installing" not in r.stdout, r.stdout
    assert took < 60, f"make test took {took:.0f} s to stop"
    assert not installed(fresh, "cmake") and not list(fresh.file(CHECKOUT).glob(".venv/lib/python3*/site-packages/torch"))


def test_the_quick_suite_stops_at_once_without_python312(fresh):
    t0 = time.monotonic()
    r = fresh.run("scripts/test-python.sh tests/test_config.py", timeout=120)
    assert r.returncode == 1, r.stdout
    assert "preflight: missing: python3.12" in r.stdout and "the 3.12 run cannot be skipped" in r.stdout, r.stdout
    assert "pytest" not in r.stdout.replace("test-python", ""), r.stdout  # stopped before any test ran
    assert time.monotonic() - t0 < 30
