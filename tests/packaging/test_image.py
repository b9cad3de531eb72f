"""The image the Dockerfile builds (scripts/test-packaging.sh: podman build
--isolation chroot --format docker on a Debian base made with mmdebstrap),
run from its filesystem as its user (imagerun.py: no container can start on
these machines): the host's Python client and kvcachedctl use it through the
bind-mounted socket directory, its HEALTHCHECK command runs inside it, its
metrics are scraped in its network namespace. It asks for CUDA by default:
without a driver it exits 1 and says why; with the CUDA test driver mounted
where the NVIDIA container runtime puts libcuda.so.1 it serves the cuda
backend."""

from __future__ import annotations

import json
import os
import pathlib
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from imagerun import ImageRun
from kvtest import TESTDRIVER, leak_problems

ROOT = pathlib.Path(__file__).resolve().parents[2]
UID, GID = 10001, 2000
MIB = 1 << 20
SOCK = "kvcached.sock"
# Generous: a daemon start is ~2 s here; CI machines may be busy building.
START_TIMEOUT = 90


@pytest.fixture
def container(podman, image):
    runs: list[ImageRun] = []

    def make() -> ImageRun:
        runs.append(ImageRun(podman, image))
        return runs[-1]

    yield make
    for r in runs:
        r.remove()


@pytest.fixture
def sockdir():
    """The node's /run/kvcached as the DaemonSet's init container leaves it:
    owned by the daemon's uid and the socket group, mode 0750."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="kvc-pkg-run-"))
    os.chown(d, UID, GID)
    d.chmod(0o750)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def wait_healthy(c: ImageRun, log: pathlib.Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    last = None
    while time.monotonic() < deadline:
        assert c.proc.poll() is None, f"the image's daemon exited {c.proc.returncode}:\n{log.read_text()}"
        last = c.healthcheck()
        if last.returncode == 0:
            return
        time.sleep(0.3)
    pytest.fail(f"HEALTHCHECK never passed (last: {last.stdout}{last.stderr}):\n{log.read_text()}")


def stop(c: ImageRun, log: pathlib.Path, sockdir: pathlib.Path) -> None:
    c.proc.send_signal(signal.SIGTERM)  # docker stop (STOPSIGNAL SIGTERM)
    assert c.proc.wait(60) == 0, log.read_text()
    assert not (sockdir / SOCK).exists() and not (sockdir / f"{SOCK}.fd").exists()


def scrape(c: ImageRun) -> str:
    """GET /metrics on the image's 0.0.0.0:9461 from inside its network
    namespace (what `-p 127.0.0.1:9461:9461` publishes)."""
    code = "import urllib.request as u, sys; sys.stdout.write(u.urlopen('http://127.0.0.1:9461/metrics', timeout=10).read().decode())"
    r = c.in_netns([sys.executable, "-c", code])
    assert r.returncode == 0, r.stderr
    return r.stdout


# Host-side clients see the socket directory at /run/kvcached, as in the docs
# (`-v /run/kvcached:/run/kvcached`; client pods mount the same hostPath):
# the fd channel path the daemon reports is its own, so both sides must see
# the directory at the same path. Each client process gets a private mount
# namespace with SOCKDIR bound there (the machine's /run is left alone).
HOST_SOCK = f"/run/kvcached/{SOCK}"


def on_host(sockdir: pathlib.Path, argv: list[str], **kw) -> subprocess.Popen:
    script = ("mount -t tmpfs -o mode=0755 tmpfs /run && mkdir /run/kvcached "
              f"&& mount --bind '{sockdir}' /run/kvcached && exec \"$@\"")
    env = {k: v for k, v in os.environ.items() if k not in ("KVCACHED_SOCKET", "OLLAMA_KVCACHED_SOCKET")}
    return subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script, "sh", *argv],
                            env={**env, "PYTHONPATH": str(ROOT)}, text=True, **kw)


def host_run(sockdir: pathlib.Path, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    p = on_host(sockdir, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


# The Python client: allocate, check, report, hold the pages until told to go on.
CLIENT = r"""
import json, os, sys
from kvcached_service.client import Client
with Client.connect(sys.argv[1]) as c, c.open_session(sys.argv[2]) as s:
    n = int(sys.argv[3])
    if c.info.backend == "host":
        pages = s.allocate(n)
        zero = all(p.read() == bytes(p.size) for p in pages)
        pages[0].write(100, b"from the host")
        back = pages[0].read(100, 13).decode()
        ids = [p.id for p in pages]
    else:  # cuda: the fds only (mapping them needs the driver in this process)
        resp, fds = s.allocate_fds(n)
        for fd in fds:
            os.close(fd)
        zero, back, ids = None, None, list(resp.page_ids)
    print(json.dumps({"backend": c.info.backend, "version": c.info.version, "zero": zero, "back": back,
                      "held": s.my_stats().held_bytes, "device": next(iter(s.my_stats().held_bytes_by_device), "")}), flush=True)
    sys.stdin.readline()
    print(json.dumps({"freed": s.free_ids(ids), "held": s.my_stats().held_bytes}), flush=True)
"""


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(x.name, frozenset(x.labels.items())): x.value for f in text_string_to_metric_families(text) for x in f.samples}


def metric(text: str, name: str, **labels: str) -> float:
    got = samples(text)
    key = (name, frozenset(labels.items()))
    assert key in got, f"no {name}{labels} in:\n" + "\n".join(l for l in text.splitlines() if name in l)
    return got[key]


def grp_name(gid: int) -> str:
    import grp

    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def ctl_as(sockdir: pathlib.Path, user: pwd.struct_passwd, groups: list[int], *args: str) -> subprocess.CompletedProcess:
    """kvcachedctl on the host as another uid (modules imported first: the
    venv need not be readable by that uid)."""
    code = (
        "import os, sys, grpc, kvcached_service.client, kvcached_service.ctl.cli as c\n"
        "from grpc_health.v1 import health_pb2, health_pb2_grpc\n"
        f"os.setgroups({groups!r}); os.setgid({user.pw_gid}); os.setuid({user.pw_uid})\n"
        "sys.exit(c.main(sys.argv[1:]))\n"
    )
    return host_run(sockdir, [sys.executable, "-c", code, *args])


class HostClient:
    """The Python client on the host holding pages of the image's daemon."""

    def __init__(self, sockdir: pathlib.Path, name: str, pages: int):
        self.p = on_host(sockdir, [sys.executable, "-c", CLIENT, HOST_SOCK, name, str(pages)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = self.p.stdout.readline()
        assert line, f"the client failed: {self.p.stderr.read()}"
        self.got = json.loads(line)

    def finish(self) -> dict:
        self.p.stdin.write("\n")
        self.p.stdin.flush()
        out = json.loads(self.p.stdout.readline())
        assert self.p.wait(60) == 0, self.p.stderr.read()
        return out


def test_image_config(container):
    """What `docker run` reads from the image; the HEALTHCHECK survives
    because the build uses --format docker (OCI drops it)."""
    cfg = container().config
    assert cfg["User"] == f"{UID}:{GID}"
    assert cfg["Entrypoint"] == ["kvcached-serve"]
    assert cfg["Cmd"][:2] == ["--socket", f"/run/kvcached/{SOCK}"] and "--channel-ops-only" in cfg["Cmd"]
    hc = cfg["Healthcheck"]
    assert hc["Test"] == ["CMD", "kvcachedctl", "health", "--timeout", "3"]
    assert hc["Interval"] == 30 * 10**9 and hc["Timeout"] == 5 * 10**9 and hc["Retries"] == 3
    env = dict(e.split("=", 1) for e in cfg["Env"])
    assert env["KVCACHED_BACKEND"] == "cuda" and env["PROMETHEUS_DISABLE_CREATED_SERIES"] == "true"
    assert env["KVCACHED_SOCKET"] == f"/run/kvcached/{SOCK}" and env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "/run/kvcached" in cfg["Volumes"] and "9461/tcp" in cfg["ExposedPorts"]
    assert cfg["StopSignal"] == "SIGTERM"


def test_image_serves_the_host_client(container, sockdir, tmp_path):
    """`docker run -e KVCACHED_BACKEND=host -v SOCKDIR:/run/kvcached IMAGE`:
    runs as 10001:2000 on a read-only root; the host's Python client
    allocates zeroed pages, kvcachedctl reads the stats, the HEALTHCHECK
    passes, metrics are served; SIGTERM ends it cleanly."""
    c = container()
    log = tmp_path / "image.log"
    c.start(sockdir, log, env={"KVCACHED_BACKEND": "host", "KVCACHED_MEMORY_LIMIT": "64MiB"})
    wait_healthy(c, log)
    hc = c.healthcheck()
    assert hc.returncode == 0 and f"/run/kvcached/{SOCK}: SERVING" in hc.stdout, hc.stdout + hc.stderr
    status = pathlib.Path(f"/proc/{c.proc.pid}/status").read_text()
    assert f"Uid:\t{UID}\t{UID}\t{UID}\t{UID}" in status and f"Gid:\t{GID}\t{GID}\t{GID}\t{GID}" in status, status
    assert "backend: host (memfd pages), as configured" in log.read_text()
    for name in (SOCK, f"{SOCK}.fd"):
        st = (sockdir / name).stat()
        assert stat.S_ISSOCK(st.st_mode) and (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (UID, GID, 0o660), name
    # the image's root is read-only (the DaemonSet's readOnlyRootFilesystem)
    r = c.exec_in(["/bin/sh", "-c", "touch /opt/kvcached/x"])
    assert r.returncode != 0 and "Read-only file system" in r.stderr, r.stderr

    client = HostClient(sockdir, "image-test", 4)
    got = client.got
    assert got["backend"] == "host" and got["zero"] is True and got["back"] == "from the host"
    assert got["held"] == 4 * 2 * MIB
    text = scrape(c)
    assert metric(text, "kvcached_device_in_use_bytes", device="HOST-0") == 4 * 2 * MIB
    assert metric(text, "kvcached_session_held_bytes", session="image-test", device="HOST-0") == 4 * 2 * MIB
    assert metric(text, "kvcached_build_info", backend="host", version=got["version"]) == 1
    assert not [n for n, _ in samples(text) if n.endswith("_created")]
    assert client.finish() == {"freed": 4, "held": 0}

    # kvcachedctl on the host: root, a uid in the socket group, a uid outside it
    r = host_run(sockdir, [sys.executable, "-m", "kvcached_service.ctl", "--socket", HOST_SOCK, "stats", "--json"])
    assert r.returncode == 0, r.stderr
    dev = json.loads(r.stdout)["devices"][0]
    assert dev["budget_bytes"] == 64 * MIB and dev["in_use_bytes"] == 0
    nobody = pwd.getpwnam("nobody")
    r = ctl_as(sockdir, nobody, [GID], "stats", "--socket", HOST_SOCK)
    assert r.returncode == 0 and "HOST-0" in r.stdout, r.stderr
    r = ctl_as(sockdir, nobody, [], "stats", "--socket", HOST_SOCK)
    assert r.returncode == 3 and "permission denied: cannot enter /run/kvcached" in r.stderr, r.stderr
    assert "mode 0750" in r.stderr and f"join group '{grp_name(GID)}'" in r.stderr, r.stderr

    stop(c, log, sockdir)


def test_image_healthcheck_fails_without_a_serving_daemon(container, sockdir, tmp_path):
    c = container()
    log = tmp_path / "image.log"
    c.start(sockdir, log, entrypoint=["/bin/sleep", "300"])  # the container up, no daemon in it
    deadline = time.monotonic() + 30
    while not os.readlink(f"/proc/{c.proc.pid}/exe").endswith("/sleep"):  # set-up done, sleep exec'd
        assert time.monotonic() < deadline and c.proc.poll() is None, log.read_text()
        time.sleep(0.1)
    r = c.healthcheck()
    assert r.returncode == 3, r.stdout + r.stderr
    assert f"no kvcached socket at /run/kvcached/{SOCK} (from $KVCACHED_SOCKET)" in r.stderr, r.stderr


def test_image_asks_for_cuda_and_exits_1_without_a_driver(container, sockdir, tmp_path):
    """The default: no silent fallback to host memory."""
    c = container()
    log = tmp_path / "image.log"
    c.start(sockdir, log)
    rc = c.proc.wait(START_TIMEOUT)
    text = log.read_text()
    assert rc == 1, text
    assert "cannot start: --backend cuda: the CUDA driver is not usable" in text, text
    assert not (sockdir / SOCK).exists()


def test_image_on_the_cuda_test_driver(container, sockdir, tmp_path):
    """libcuda.so.1 mounted where the NVIDIA container runtime puts it (here
    the project's test driver): the image's default settings serve CUDA
    pages; at shutdown every driver object is released."""
    if not TESTDRIVER.exists():
        pytest.fail(f"{TESTDRIVER} missing: scripts/build-testdriver.sh (scripts/test-packaging.sh runs it)")
    c = container()
    log = tmp_path / "image.log"
    c.start(sockdir, log, libcuda=TESTDRIVER, env={"KVCACHED_MEMORY_LIMIT": "256MiB",
                                                   "KVCACHED_TESTDRV_MEMORY": str(1 << 30),
                                                   "KVCACHED_TESTDRV_REPORT": "/run/kvcached/leaks.json"})
    wait_healthy(c, log)
    assert "backend: cuda (driver VMM API), 1 device(s)" in log.read_text()
    client = HostClient(sockdir, "image-cuda", 5)
    got = client.got
    assert got["backend"] == "cuda" and got["held"] == 5 * 2 * MIB and got["device"].startswith("GPU-"), got
    text = scrape(c)
    assert metric(text, "kvcached_device_in_use_bytes", device=got["device"]) == 5 * 2 * MIB
    assert metric(text, "kvcached_build_info", backend="cuda", version=got["version"]) == 1
    assert client.finish() == {"freed": 5, "held": 0}
    stop(c, log, sockdir)
    assert leak_problems(sockdir / "leaks.json") == []
