"""The sdist and the wheel (python -m build, made by scripts/test-packaging.sh)
installed, not editable, into clean venvs of the system's python3, and the
daemon, kvcachedctl and the Python client run from there, outside the
source tree. The install commands are the ones docs/operations.md shows."""

from __future__ import annotations

import json
import os
import platform
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

DIST_NAME = "kvcached-service"
DOC = ROOT / "docs" / "operations.md"
# What the docs tell a user to run, in this order ({wheel}/{sdist} are the
# file names in dist/, /opt/kvcached the venv). Each is run below with the
# venv in a temporary directory.
WHEEL_STEPS = [
    "python3 -m venv /opt/kvcached",
    "/opt/kvcached/bin/pip install dist/{wheel}",
    "/opt/kvcached/bin/kvcached-serve --version",
    "/opt/kvcached/bin/kvcachedctl --version",
]
SDIST_STEPS = [
    "python3 -m venv /opt/kvcached",
    "/opt/kvcached/bin/pip install dist/{sdist}",
    "/opt/kvcached/bin/kvcached-serve --version",
]


# What scripts/test-packaging.sh's auditwheel repair makes: any CPython >= 3.10
# (abi3) on a glibc >= 2.17 (manylinux2014 is the legacy name of the same tag).
M = platform.machine()
WHEEL_TAG = f"cp310-abi3-manylinux2014_{M}.manylinux_2_17_{M}"
# What _relay.abi3.so may need at run time: libc and libpthread (glibc's own;
# auditwheel's manylinux policy allows both), nothing of the build machine.
RELAY_NEEDED = {"libc.so.6", "libpthread.so.0"}


def system_python() -> str:
    """The machine's python3, not this venv's: a user's clean start."""
    for p in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(p, os.X_OK):
            return p
    pytest.fail("no system python3 found")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith(("KVCACHED_", "OLLAMA_"))}
    env["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    env.update(extra)
    return env


def run_steps(steps: list[str], venv: pathlib.Path, dist: pathlib.Path, cwd: pathlib.Path, **names: str) -> dict[str, str]:
    out = {}
    for step in steps:
        cmd = step.format(**names).replace("/opt/kvcached", str(venv)).replace("dist/", f"{dist}/").split()
        if cmd[0] == "python3":
            cmd[0] = system_python()
        r = subprocess.run(cmd, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{step}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
        out[step] = r.stdout
    return out


def test_docs_show_the_install_commands_this_suite_runs(wheel, sdist):
    text = DOC.read_text()
    for step in WHEEL_STEPS + SDIST_STEPS:
        shown = step.format(wheel=wheel.name, sdist=sdist.name)
        assert shown in text, f"docs/operations.md does not show: {shown}"
    assert "python3 -m build" in text  # what scripts/test-packaging.sh runs (with --outdir)


def test_the_distribution_name_and_metadata(wheel, sdist):
    version = subprocess.run([sys.executable, "-c", "import kvcached_service; print(kvcached_service.__version__)"],
                             capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.strip()
    # relay.c, built, and repaired by auditwheel to the lowest tag its symbols allow
    assert wheel.name == f"kvcached_service-{version}-{WHEEL_TAG}.whl"
    assert sdist.name == f"kvcached_service-{version}.tar.gz"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(f"kvcached_service-{version}.dist-info/METADATA").decode()
        eps = z.read(f"kvcached_service-{version}.dist-info/entry_points.txt").decode()
    assert f"Name: {DIST_NAME}\n" in meta and f"Version: {version}\n" in meta
    assert "License-Expression: Apache-2.0" in meta
    for dep in ("grpcio", "protobuf", "pydantic", "prometheus-client"):
        assert f"Requires-Dist: {dep}" in meta, dep
    assert "kvcached-serve = kvcached_service.server.ops.main:main" in eps
    assert "kvcachedctl = kvcached_service.ctl:main" in eps
    # the import package with its generated stubs; nothing else at the top level
    assert {n.split("/")[0] for n in names} == {"kvcached_service", f"kvcached_service-{version}.dist-info"}
    for must in ("kvcached_service/_generated/kvcached/v1/kvcached_pb2.py", "kvcached_service/_generated/kvcached/v1/kvcached_pb2_grpc.py",
                 "kvcached_service/ctl/cli.py", "kvcached_service/server/ops/main.py", "kvcached_service/client/client.py",
                 "kvcached_service/server/transports/_relay.abi3.so"):
        assert must in names, must
    with tarfile.open(sdist) as t:
        members = [m.name.split("/", 1)[1] for m in t.getmembers() if "/" in m.name]
    assert "pyproject.toml" in members and "README.md" in members
    assert "kvcached_service/_generated/kvcached/v1/kvcached_pb2.py" in members
    assert "kvcached_service/server/transports/relay.c" in members and not [m for m in members if m.endswith(".so")]
    assert not [m for m in members if m.startswith((".venv", "build/", "tests/", ".git"))]


def test_the_wheel_is_manylinux_2_17(wheel, tmp_path):
    """auditwheel's own reading of the wheel, and the relay library's ELF
    needs: no glibc symbol version above 2.17, only libc and libpthread, no
    rpath (a pyenv interpreter's link line carries one; the suite builds with
    a plain LDSHARED)."""
    with zipfile.ZipFile(wheel) as z:
        wheel_meta = z.read(f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info/WHEEL").decode()
        so = tmp_path / "_relay.abi3.so"
        so.write_bytes(z.read("kvcached_service/server/transports/_relay.abi3.so"))
    assert f"Tag: cp310-abi3-manylinux_2_17_{M}" in wheel_meta and f"Tag: cp310-abi3-manylinux2014_{M}" in wheel_meta, wheel_meta
    r = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(wheel)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    said = " ".join(r.stdout.split())  # auditwheel wraps its lines by their length
    assert f'is consistent with the following platform tag: "manylinux_2_17_{M}"' in said, r.stdout
    dyn = subprocess.run(["readelf", "-d", "-W", str(so)], capture_output=True, text=True, check=True).stdout
    needed = {l.split("[", 1)[1].rstrip("]") for l in dyn.splitlines() if "(NEEDED)" in l}
    assert needed == RELAY_NEEDED, dyn
    assert "(RPATH)" not in dyn and "(RUNPATH)" not in dyn, dyn
    syms = subprocess.run(["objdump", "-T", str(so)], capture_output=True, text=True, check=True).stdout
    versions = {tuple(int(x) for x in v.split(".")) for v in re.findall(r"\bGLIBC_([0-9.]+)\b", syms)}
    assert versions and max(versions) <= (2, 17), sorted(versions)


def wait_healthy(ctl: str, sock: str, proc: subprocess.Popen, log: pathlib.Path, cwd: pathlib.Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"kvcached-serve exited {proc.returncode}:\n{log.read_text()}"
        r = subprocess.run([ctl, "health", "--socket", sock, "--timeout", "2"], cwd=cwd, env=clean_env(),
                           capture_output=True, text=True, timeout=30)
        if r.returncode == 0:
            return
        time.sleep(0.2)
    pytest.fail(f"kvcached-serve never became healthy:\n{log.read_text()}")


CLIENT = r"""
import json, sys, kvcached_service
from kvcached_service.client import Client
with Client.connect(sys.argv[1]) as c, c.open_session("wheel-test") as s:
    pages = s.allocate(3)
    zero = all(p.read() == bytes(p.size) for p in pages)
    pages[0].write(0, b"kvcached")
    back = pages[0].read(0, 8)
    held = s.my_stats().held_bytes
    s.free(pages)
    print(json.dumps({"module": kvcached_service.__file__, "zero": zero, "back": back.decode(),
                      "held": held, "backend": c.info.backend}))
"""


def test_wheel_installs_into_a_clean_venv_and_runs(wheel, dist, tmp_path):
    venv = tmp_path / "venv"
    out = run_steps(WHEEL_STEPS, venv, dist, tmp_path, wheel=wheel.name)
    version = wheel.name.split("-")[1]
    assert version in out["/opt/kvcached/bin/kvcached-serve --version"]
    assert out["/opt/kvcached/bin/kvcachedctl --version"].strip() == f"kvcachedctl {version}"
    # installed, not editable: the package lives in the venv, no path to the source tree
    site = subprocess.run([str(venv / "bin/python"), "-c", "import kvcached_service, sys; print(kvcached_service.__file__)"],
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert site.returncode == 0 and site.stdout.startswith(str(venv / "lib")), site.stdout + site.stderr
    assert not list(venv.glob("lib/python*/site-packages/__editable__*"))
    assert not list(venv.glob("lib/python*/site-packages/*.pth")) or all(
        str(ROOT) not in p.read_text() for p in venv.glob("lib/python*/site-packages/*.pth"))

    # the daemon from the venv, the client and kvcachedctl from the venv
    sock = str(tmp_path / "kvc.sock")
    log = tmp_path / "serve.log"
    with open(log, "w") as lf:
        proc = subprocess.Popen([str(venv / "bin/kvcached-serve"), "--socket", sock, "--backend", "host",
                                 "--memory-limit", "64MiB"], cwd=tmp_path, env=clean_env(), stdout=lf, stderr=subprocess.STDOUT)
    try:
        wait_healthy(str(venv / "bin/kvcachedctl"), sock, proc, log, tmp_path)
        r = subprocess.run([str(venv / "bin/python"), "-c", CLIENT, sock], cwd=tmp_path, env=clean_env(),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert got["module"].startswith(str(venv)) and got["zero"] and got["back"] == "kvcached"
        assert got["held"] == 3 * 2 * 1024 * 1024 and got["backend"] == "host"
        r = subprocess.run([str(venv / "bin/kvcachedctl"), "stats", "--json", "--socket", sock], cwd=tmp_path,
                           env=clean_env(), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        stats = json.loads(r.stdout)
        assert stats["devices"][0]["budget_bytes"] == 64 << 20 and stats["devices"][0]["in_use_bytes"] == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
        assert not os.path.exists(sock)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sdist_installs_into_a_clean_venv(sdist, dist, tmp_path):
    venv = tmp_path / "venv"
    out = run_steps(SDIST_STEPS, venv, dist, tmp_path, sdist=sdist.name)
    assert sdist.name.split("-")[1].removesuffix(".tar.gz") in out["/opt/kvcached/bin/kvcached-serve --version"]
    r = subprocess.run([str(venv / "bin/kvcachedctl"), "--socket", str(tmp_path / "none.sock"), "stats"], cwd=tmp_path,
                       env=clean_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and "no kvcached socket at" in r.stderr, r.stderr
    r = subprocess.run([str(venv / "bin/kvcached-serve"), "--print-config", "--backend", "host"], cwd=tmp_path,
                       env=clean_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["backend"] == "host", r.stderr
