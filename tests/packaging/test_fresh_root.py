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
   naming what a Debian 12 lacks and set-up cannot install (python3.12);
   the Go it lacks, set-up installs from the Go module proxy
   (scripts/install-go.sh), which builds a Go program in the root;
4. the quick suite, `scripts/test-python.sh tests/test_config.py`, likewise
   stops at once naming python3.12, before any test runs: the Python suite
   cannot run on Debian 12 without one (see README, Quick start).

With KVC_PKG_UBUNTU_KEYRING, scripts/test-packaging.sh also makes an Ubuntu
24.04 root and every test runs in both (RELEASES says what differs).
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


# What each release is and lacks. Debian 12: python3.11, no python3.12 (and
# no Go, which set-up installs). Ubuntu 24.04 (only when the suite is given
# its archive key: KVC_PKG_UBUNTU_KEYRING, docs/operations.md): python3.12 is
# its python3; no Go and no bookworm sources, which set-up installs or
# replaces (Go from the Go module proxy, Debian's mirrors and keyring).
RELEASES = {
    "bookworm": {"version_id": "12", "python": "Python 3.11", "make_test_missing": ["python3.12"],
                 "quick_suite_says": "preflight: missing: python3.12"},
    "noble": {"version_id": "24.04", "python": "Python 3.12", "make_test_missing": [],
              "quick_suite_says": "test-python: .venv has no test tools"},
}


def _roots() -> list[tuple[str, str]]:
    """KVC_PKG_FRESH_ROOTS: 'release=tarball' pairs, made by scripts/test-packaging.sh."""
    spec = os.environ.get("KVC_PKG_FRESH_ROOTS", "")
    return [tuple(x.split("=", 1)) for x in spec.split()] or [("unset", "")]


@pytest.fixture(scope="module", params=_roots(), ids=lambda p: p[0])
def fresh(request, tmp_path_factory):
    release, tar = request.param
    if not tar:
        pytest.fail("$KVC_PKG_FRESH_ROOTS is not set: run the packaging suite with scripts/test-packaging.sh (it makes the roots)")
    assert release in RELEASES, release
    where = tmp_path_factory.mktemp(f"fresh-{release}") / "root"
    root = FreshRoot(pathlib.Path(tar), where)
    root.release = RELEASES[release]
    yield root
    root.remove()


def ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, f"{r.args[-1][-300:]}: exit {r.returncode}\n{r.stdout[-4000:]}"
    return r.stdout


def installed(fresh: FreshRoot, pkg: str) -> bool:
    r = fresh.run(f"dpkg-query -W -f='${{Status}}' {pkg}", timeout=60)
    return "install ok installed" in r.stdout


def test_the_root_is_a_plain_base_image(fresh):
    os_release = fresh.file("/etc/os-release").read_text()
    assert f'VERSION_ID="{fresh.release["version_id"]}"' in os_release, os_release
    for tool in ("make", "gcc", "git", "curl"):
        assert shutil.which(tool, path=str(fresh.file("/usr/bin"))) is None, f"{tool} is in the fresh root"
    assert not installed(fresh, "python3")  # minbase has no python at all
    assert shutil.which("apt-get", path=str(fresh.file("/usr/bin")))
    assert (fresh.file(CHECKOUT) / "Makefile").is_file()


def test_readme_shows_what_this_test_runs():
    text = README.read_text()
    assert FIRST in text and SERVE in text


def test_make_serve_on_a_fresh_root(fresh, tmp_path):
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
    assert wheel.name.split("-")[1] in out and fresh.release["python"] in out, out
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
        out = ok(fresh.run("/opt/kvcached/bin/python -c 'import kvcached_service.server.transports.relay as r; print(r.library_path())'",
                           timeout=60, cwd="/root"))
        assert re.match(r"/opt/kvcached/lib/python3\.1[0-9]/site-packages/kvcached_service/server/transports/_relay", out.strip()), out
    finally:
        FreshRoot.interrupt(p, signal.SIGTERM)
        assert p.wait(60) == 0, log.read_text()


def after_make_serve(fresh: FreshRoot) -> None:
    """The state a newcomer is in after `make serve` (its set-up done), for a
    test run alone."""
    if not fresh.file(CHECKOUT + "/.venv/bin/kvcached-serve").exists():
        if not installed(fresh, "make"):
            ok(fresh.run(FIRST, timeout=600))
        ok(fresh.run("scripts/setup.sh", timeout=SET_UP))


def test_make_test_stops_at_once_naming_what_is_missing(fresh):
    """No python3.12 on a Debian 12: `make test` says so in seconds, before
    set-up's downloads (torch alone is ~5 GB). No Go is not missing: set-up
    installs it. On an Ubuntu 24.04 nothing is missing (python3.12 is its
    python3; the packaging suite's bookworm sources are Debian's mirrors,
    with debian-archive-keyring, which set-up installs): the preflight says
    what it found, and set-up's packaging step finds the keyring there."""
    after_make_serve(fresh)
    missing = fresh.release["make_test_missing"]
    if not missing:
        r = ok(fresh.run("scripts/preflight.sh all", timeout=60))
        assert "apt lists no bookworm sources: Debian's mirrors, checked with debian-archive-keyring (set-up installs it)" in r, r
        ok(fresh.run("apt-get install -y -qq --no-install-recommends debian-archive-keyring", timeout=300))
        r = ok(fresh.run("scripts/bookworm-mirrors.sh --check && scripts/bookworm-mirrors.sh", timeout=60))
        assert "deb http://deb.debian.org/debian-security bookworm-security main" in r, r
        assert "--keyring=/usr/share/keyrings/debian-archive-keyring.gpg" in r, r
        return
    t0 = time.monotonic()
    r = fresh.run("make test", timeout=300)
    took = time.monotonic() - t0
    assert r.returncode != 0, r.stdout[-3000:]
    for what in missing:
        assert f"preflight: missing: {what}" in r.stdout, r.stdout
    assert f"preflight: {len(missing)} missing for all: nothing was installed or run" in r.stdout, r.stdout
    assert "installing" not in r.stdout, r.stdout
    assert took < 60, f"make test took {took:.0f} s to stop"
    assert not installed(fresh, "cmake") and not list(fresh.file(CHECKOUT).glob(".venv/lib/python3*/site-packages/torch"))


def test_set_up_installs_go_from_the_go_module_proxy(fresh):
    """The root has no Go: the preflight says set-up will install one, and
    set-up's step (scripts/install-go.sh, what `make test`'s set-up runs)
    installs the pinned go1.26.8 from the Go module proxy, linked on the
    PATH, which builds and runs a program; run again, it finds it."""
    after_make_serve(fresh)
    r = fresh.run("command -v go || scripts/preflight.sh ollama", timeout=60)
    assert "preflight: ok for ollama: go: no go on the PATH; set-up installs go1.26.8" in r.stdout, r.stdout
    ok(fresh.run("KVC_GO_WANT=1.26 scripts/install-go.sh", timeout=600))
    prog = fresh.file("/tmp/hello/m.go")
    prog.parent.mkdir(parents=True, exist_ok=True)
    prog.write_text('package main\n\nimport "fmt"\n\nfunc main() { fmt.Println("hello from", 1+1) }\n')
    r = ok(fresh.run("cd /tmp/hello && go version && GOTOOLCHAIN=local go run m.go", timeout=300))
    assert "go version go1.26.8 linux/" in r and "hello from 2" in r, r
    assert ok(fresh.run("scripts/install-go.sh --check", timeout=60)).strip().endswith("go 1.26.8")


def test_the_quick_suite_stops_at_once(fresh):
    """Debian 12: no python3.12. Ubuntu 24.04: python3.12 is there, but
    make serve's .venv has no test tools (make test-python's set-up would
    install them, with torch)."""
    after_make_serve(fresh)
    t0 = time.monotonic()
    r = fresh.run("scripts/test-python.sh tests/test_config.py", timeout=120)
    assert r.returncode == 1, r.stdout
    assert fresh.release["quick_suite_says"] in r.stdout, r.stdout
    assert "test session starts" not in r.stdout and "No module named" not in r.stdout, r.stdout  # stopped before any test ran
    assert time.monotonic() - t0 < 30
