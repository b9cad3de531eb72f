"""Test helpers shared by the suites: starting a real kvcached-serve, the
CUDA test driver's environment, and book-keeping assertions.

`daemon_factory(**settings)` starts one and waits until its health service
answers SERVING; at teardown it sends SIGTERM and asserts a clean exit
(status 0, socket files removed, and on the test driver an empty leak
report).
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PY = sys.executable
SERVE = [PY, "-m", "kvcached_service.server"]
TESTDRIVER = ROOT / "build" / "testdriver" / "libcuda.so.1"
HELPERS = pathlib.Path(__file__).resolve().parent / "helpers"


def libcuda() -> pathlib.Path:
    """The libcuda every CUDA test runs on: $KVCACHED_TEST_LIBCUDA (a path,
    e.g. the real /usr/lib/x86_64-linux-gnu/libcuda.so.1 on a GPU host),
    else the project's test driver (scripts/build-testdriver.sh)."""
    other = os.environ.get("KVCACHED_TEST_LIBCUDA")
    return pathlib.Path(other) if other else TESTDRIVER


_features: bool | None = None

_PROBE = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
dev, total = ctypes.c_int(), ctypes.c_size_t()
ok = lib.cuInit(0) == 0 and lib.cuDeviceGet(ctypes.byref(dev), 0) == 0
ok = ok and lib.cuDeviceTotalMem_v2(ctypes.byref(total), dev) == 0
print(total.value if ok else -1)
"""


def testdriver_features() -> bool:
    """Whether libcuda() has the test driver's private features (knobs,
    fault injection, leak report): a child process loads it with a leak
    report path and an unusual device size, and both must show. Cached for
    the pytest session. The project's test driver has them; NVIDIA's driver
    and the test driver built with -DKVCACHED_TESTDRV_PUBLIC_ONLY do not."""
    global _features
    if _features is None:
        lib = libcuda()
        with tempfile.TemporaryDirectory(prefix="kvc-probe-") as tmp:
            report = pathlib.Path(tmp) / "report.json"
            size = 1234 << 21
            env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_TESTDRV_")}
            env.update(KVCACHED_TESTDRV_STATE=str(pathlib.Path(tmp) / "state"), KVCACHED_TESTDRV_MEMORY=str(size),
                       KVCACHED_TESTDRV_REPORT=str(report))
            proc = subprocess.run([PY, "-c", _PROBE, str(lib)], env=env, capture_output=True, text=True, timeout=60)
            if proc.returncode != 0:
                pytest.fail(f"cannot load {lib} (KVCACHED_TEST_LIBCUDA): {proc.stderr.strip()}")
            _features = proc.stdout.strip() == str(size) and report.exists()
    return _features


def is_testdriver() -> bool:
    """Whether libcuda() is the project's own test driver (not another
    libcuda named by KVCACHED_TEST_LIBCUDA)."""
    return libcuda().resolve() == TESTDRIVER.resolve()


def require_testdriver_features(*what: str) -> None:
    """Skip, naming the reason, when libcuda() is another libcuda
    (KVCACHED_TEST_LIBCUDA) without the test driver's private features
    (`what`: the knobs or reports the test needs). On the test driver itself
    a missing feature is a failure, never a skip: a test driver that lost
    its knobs must not turn its tests into skips."""
    if not testdriver_features():
        if is_testdriver():
            pytest.fail(f"the CUDA test driver {libcuda()} lacks its private features "
                        f"({', '.join(what) or 'knobs'}): rebuild it (scripts/build-testdriver.sh)")
        pytest.skip(f"needs the CUDA test driver's private features ({', '.join(what) or 'knobs'}); "
                    f"KVCACHED_TEST_LIBCUDA={libcuda()} does not have them")


TESTDRIVER_PUBLIC = ROOT / "build" / "testdriver-public" / "libcuda.so.1"


def require_uids_share_the_device(backend: str = "cuda") -> None:
    """For a CUDA test with clients of two uids (one imports pages the
    other's daemon made): skipped, naming why, on the public-only build of
    the test driver (scripts/build-testdriver.sh --public-only), which reads
    no state directory and so simulates one machine per uid; on a GPU, and
    on the test driver (its state directory is shared, mode 1777), every uid
    uses the same device."""
    if backend == "cuda" and libcuda().resolve() == TESTDRIVER_PUBLIC.resolve():
        pytest.skip("the public-only test driver simulates one machine per uid: another uid cannot import "
                    "this uid's pages there (on a GPU every uid shares the device)")


def backends() -> list[str]:
    """Backends the conformance tests run on. The CUDA test driver must be
    built (scripts/build-testdriver.sh, run by `make test`): if it is
    missing, the cuda parameter fails loudly instead of being skipped."""
    return ["host", "cuda"]


_gpu_state: pathlib.Path | None = None


def gpu_state() -> pathlib.Path:
    """The simulated machine of this pytest session. The test driver reads
    its state directory once per process, and in-process clients must share
    the daemon's machine, so every CUDA daemon of the session uses this one
    (tests run one after another). Other uids may use it (mode 1777)."""
    global _gpu_state
    if _gpu_state is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        _gpu_state = pathlib.Path(tempfile.mkdtemp(prefix="kvc-gpu-", dir=base))
        _gpu_state.chmod(0o1777)
        atexit.register(shutil.rmtree, _gpu_state, True)
    return _gpu_state


def testdriver_env(**extra: str) -> dict[str, str]:
    """The environment of a CUDA daemon or client: libcuda() and, for the
    test driver, its simulated machine (the knobs are ignored elsewhere)."""
    lib = libcuda()
    if not lib.exists():
        hint = "(KVCACHED_TEST_LIBCUDA)" if lib != TESTDRIVER else "(run scripts/build-testdriver.sh)"
        pytest.fail(f"CUDA driver library {lib} is missing {hint}")
    env = {
        "KVCACHED_LIBCUDA": str(lib),
        "KVCACHED_TESTDRV_STATE": str(gpu_state()),
        "KVCACHED_TESTDRV_MEMORY": str(1 << 30),
    }
    env.update(extra)
    os.environ.update(env)  # for clients inside this pytest process
    return env


testdriver_env.__test__ = False  # a helper whose name pytest would collect where it is imported


class Daemon:
    def __init__(self, proc: subprocess.Popen, socket: str, log: pathlib.Path, env: dict, report: pathlib.Path | None):
        self.proc = proc
        self.socket = socket
        self.fd_socket = socket + ".fd"
        self.log = log
        self.env = env  # the environment clients of this daemon need
        self.report = report

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def sigkill(self) -> None:
        """Kill the daemon as a crash would, and reap it."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def client(self, timeout: float = 10.0):
        from kvcached_service.client import Client

        return Client.connect(self.socket, timeout=timeout)

    def client_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env)
        env["KVCACHED_SOCKET"] = self.socket
        env["PYTHONPATH"] = str(ROOT)
        return env

    def run_client(self, script: str, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        """Run tests/helpers/<script> as a separate client process."""
        proc = subprocess.run(
            [PY, str(HELPERS / script), *args], env=self.client_env(), capture_output=True, text=True, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{script} {args} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
        return proc

    def spawn_client(self, script: str, *args: str, **kw) -> subprocess.Popen:
        return subprocess.Popen(
            [PY, str(HELPERS / script), *args], env=self.client_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw
        )

    def stop(self, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("daemon did not stop within 20 s of SIGTERM\n" + self.log_text())
        return self.proc.returncode


def wait_serving(socket: str, proc: subprocess.Popen, log: pathlib.Path, timeout: float = 30) -> None:
    from kvcached_service.client.health import wait_serving as serving

    if not serving(socket, timeout, alive=lambda: proc.poll() is None):
        if proc.poll() is not None:
            raise AssertionError(f"daemon exited with {proc.returncode} during start-up:\n{log.read_text()}")
        raise AssertionError(f"daemon not SERVING within {timeout} s:\n{log.read_text()}")


def leak_problems(report: pathlib.Path) -> list[str]:
    """Problems in a test-driver leak report (empty list = clean)."""
    if not report.exists():
        return [f"test driver wrote no leak report at {report}"]
    data = json.loads(report.read_text())
    if data["leaks"]:
        return [f"test driver reports {data['leaks']} leaked objects at daemon exit: {data['counts']}"]
    return []


def wait_until(pred, timeout: float = 5.0, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    return pred()


def assert_books(stats) -> None:
    """Invariant 7: pooled + in_use + free == budget, per device and total."""
    for name, p in [("total", stats.total), *stats.devices.items()]:
        assert p.pooled_bytes + p.in_use_bytes + p.free_bytes == p.budget_bytes, (name, p)


class Survivor:
    """A session holding pages with data in them across a daemon restart
    (2 MiB pages): 10 region pages, each stamped "page i", and 2 loose
    pages, the first stamped; a third loose page freed before."""

    def __init__(self, client, name: str = "survivor"):
        MiB = 1 << 20
        self.s = client.open_session(name)
        self.r = self.s.region(32 * MiB)
        self.r.map(0, 20 * MiB)
        for i in range(10):
            self.r.write(i * 2 * MiB, f"page {i}".encode())
        loose = self.s.allocate(3)
        loose[0].write(0, b"loose page")
        self.s.free(loose[2:])
        self.loose = loose[:2]

    def page_ids(self) -> set[int]:
        return set(self.r.page_ids()) | {p.id for p in self.loose}

    def assert_intact(self) -> None:
        """Every stamp reads back."""
        for i in range(10):
            assert self.r.read(i * 2 * (1 << 20), len(f"page {i}")) == f"page {i}".encode(), i
        assert self.loose[0].read(0, 10) == b"loose page"


def watch_in_background(session) -> tuple[list, "threading.Event"]:
    """A thread reading `session.events()` until the stream ends: the events
    so far (then the KVCachedError that ended it, if one did) and an Event
    set when it ended."""
    import threading

    from kvcached_service import errors

    events: list = []
    done = threading.Event()

    def watch():
        try:
            for ev in session.events():
                events.append(ev)
        except errors.KVCachedError as exc:
            events.append(exc)
        done.set()

    threading.Thread(target=watch, daemon=True).start()
    return events, done

