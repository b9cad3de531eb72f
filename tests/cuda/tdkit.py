"""Helpers for the CUDA tests, used by the test modules and, imported by the
child processes they start, by the scripts those run.

The test driver reads its configuration once per process (at load), so
every scenario runs in a child process with its own environment; the test
reads its JSON answer from stdout and the driver's leak report from disk.
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import subprocess
import sys
import textwrap
from ctypes import byref

from kvcached_service import errors
from kvcached_service.backends.cuda import CudaUnavailable, open_backend  # noqa: F401  (for child scripts)
from kvcached_service.client.cuda_mapper import CudaMapper  # noqa: F401

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = pathlib.Path(__file__).resolve().parent
GRAN = 2 << 20
STRICTNESS_KNOBS = frozenset(
    "KVCACHED_TESTDRV_" + k
    for k in ("STRICT", "FD_IDENTITY", "ASYNC", "POISON", "FORK", "PEERS", "CONTEXT_BYTES", "OTHER_BYTES", "COST", "CREATE_US")
)


# ---------------------------------------------------------------------------
# test-process side


class Sim:
    """One simulated machine: a state directory and the env of its processes."""

    def __init__(self, lib: pathlib.Path, state: pathlib.Path, reports: pathlib.Path, private: bool = True):
        self.lib = lib
        self.state = state
        self.reports = reports
        # whether `lib` has the test driver's private features (knobs, leak
        # report, fault injection); False for another libcuda
        # (KVCACHED_TEST_LIBCUDA), where the knobs below are ignored
        self.private = private
        self.env = {
            "KVCACHED_LIBCUDA": str(lib),
            "KVCACHED_TESTDRV_STATE": str(state),
            "KVCACHED_TESTDRV_REPORT": str(reports / "report-%p.json"),
            "KVCACHED_TESTDRV_MEMORY": str(64 << 20),
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]),
        }
        # the suite's own strictness knobs (KVCACHED_TESTDRV_FD_IDENTITY=same pytest ...) reach the children;
        # False: the driver's defaults, unless a test names a knob (tests/cuda/test_strictness.py)
        self.inherit_strictness = True

    def need_knobs(self, extra: dict[str, str]) -> None:
        """A test that sets a knob of the test driver needs it: on another
        libcuda it is skipped, naming the knob; on the test driver without
        its private features it fails (kvtest.require_testdriver_features)."""
        knobs = sorted(k for k in extra if k.startswith("KVCACHED_TESTDRV_"))
        if knobs and not self.private:
            from kvtest import require_testdriver_features

            require_testdriver_features(*knobs)

    def devices(self, n: int) -> dict[str, str]:
        """The environment for a test of `n` devices (multi-device: a daemon
        or client on device 1, CUDA_VISIBLE_DEVICES reordering ordinals). On
        the test driver: its KVCACHED_TESTDRV_DEVICES knob. On another
        libcuda: nothing to set, the devices are the machine's; with fewer
        than `n` the test is skipped, naming the count."""
        if self.private:
            return {"KVCACHED_TESTDRV_DEVICES": str(n)}
        have = self.run("d = drv(); d.cuInit(0); c = ctypes.c_int(); d.cuDeviceGetCount(byref(c)); out(n=c.value)")["n"]
        if have < n:
            import pytest

            pytest.skip(f"needs {n} CUDA devices; {self.lib} shows {have} here (CUDA_VISIBLE_DEVICES as set)")
        return {}

    def leaks_ok(self, pid: int) -> bool:
        """The process's leak report is clean; vacuous on another libcuda,
        which writes none (the test's other checks still run)."""
        if not self.private:
            return True
        rep = self.report_of(pid)
        return rep is not None and rep["leaks"] == 0

    def used_now(self) -> int:
        """Device memory in use (cuMemGetInfo, device 0), seen from a fresh
        process with its own context."""
        return self.run("init(); out(used=used()); fini()")["used"]

    def assert_clean(self, r: "Result") -> None:
        """The child left nothing behind. On the test driver: its leak report
        is empty (handles, exported fds, mappings, reservations, contexts).
        On another libcuda, as memory: what the child still held when its
        script ended (Result.end_used, measured then) is what a fresh
        process sees after it exited, i.e. no handle, mapping or exported
        fd of it pinned a page (a quiet device is assumed)."""
        if self.private:
            assert r.report is not None and r.report["leaks"] == 0, r.report
            return
        assert r.end_used is not None, f"the child did not measure its memory at the end\n{r.stderr}"
        after = self.used_now()
        assert r.end_used == after, f"the child still held {(r.end_used - after) >> 20} MiB of device memory at its end"

    def proc_env(self, **extra: str) -> dict[str, str]:
        self.need_knobs(extra)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "CUDA_VISIBLE"))}
        # the driver's strictness knobs (tests/cudadriver/README.md) pass through, so the suite runs in each
        # mode; a test that compares the modes turns that off (inherit_strictness) and names its own knobs
        if self.inherit_strictness:
            env.update({k: v for k, v in os.environ.items() if k in STRICTNESS_KNOBS})
        env.update(self.env)
        env.update(extra)
        return env

    def script(self, body: str) -> list[str]:
        src = "from tdkit import *\n" + textwrap.dedent(body)
        if not self.private:  # the memory it still holds at its end (assert_clean)
            src += "\ntdkit_measure_end()\n"
        return [sys.executable, "-c", src]

    def run(self, body: str, *, expect_rc: int | None = 0, timeout: float = 60, **env: str) -> "Result":
        p = subprocess.Popen(
            self.script(body), env=self.proc_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise
        res = Result(p.pid, p.returncode, stdout, stderr, self.report_of(p.pid))
        if expect_rc is not None and p.returncode != expect_rc:
            raise AssertionError(f"child exited {p.returncode}, expected {expect_rc}\nstdout:\n{stdout}\nstderr:\n{stderr}")
        return res

    def spawn(self, body: str, pass_fds: tuple[int, ...] = (), **env: str) -> subprocess.Popen:
        """A child that talks over stdin/stdout lines; `pass_fds` are inherited."""
        return subprocess.Popen(
            self.script(body), env=self.proc_env(**env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, pass_fds=pass_fds,
        )

    def report_of(self, pid: int) -> dict | None:
        path = self.reports / f"report-{pid}.json"
        return json.loads(path.read_text()) if path.exists() else None


class Result:
    def __init__(self, pid: int, returncode: int, stdout: str, stderr: str, report: dict | None):
        self.pid = pid
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        self.report = report
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        self.out = json.loads(lines[-1]) if lines else None
        ends = [line for line in stdout.splitlines() if line.startswith("#end-used ")]
        self.end_used = int(ends[-1].split()[1]) if ends else None

    def __getitem__(self, key):
        return self.out[key]


# ---------------------------------------------------------------------------
# child side: the driver and small wrappers around it


def out(**kw) -> None:
    """The child's answer: one JSON line on stdout."""
    print(json.dumps(kw), flush=True)


def drv():
    from kvcached_service.cuda import driver as cu

    return cu.load()


def cu_mod():
    from kvcached_service.cuda import driver as cu

    return cu


def code(fn, *args) -> str:
    """Call a driver function; the enumerator name of its result."""
    cu = cu_mod()
    try:
        fn(*args)
        return "CUDA_SUCCESS"
    except cu.CudaDriverError as exc:
        return exc.name


def init(ordinal: int = 0):
    """cuInit, retain the primary context of `ordinal`, make it current."""
    d, cu = drv(), cu_mod()
    d.cuInit(0)
    ctx = cu.CUcontext()
    d.cuDevicePrimaryCtxRetain(byref(ctx), ordinal)
    d.cuCtxSetCurrent(ctx)
    return ctx


def fini(ordinal: int = 0) -> None:
    d = drv()
    d.cuCtxSetCurrent(None)
    d.cuDevicePrimaryCtxRelease_v2(ordinal)


def create(size: int = GRAN, ordinal: int = 0, exportable: bool = True) -> int:
    d, cu = drv(), cu_mod()
    h = cu.CUmemGenericAllocationHandle()
    prop = cu.allocation_prop(ordinal, cu.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if exportable else 0)
    d.cuMemCreate(byref(h), size, byref(prop), 0)
    return h.value


def export(h: int) -> int:
    d, cu = drv(), cu_mod()
    fd = ctypes.c_int(-1)
    d.cuMemExportToShareableHandle(byref(fd), h, cu.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
    return fd.value


def import_fd(fd: int) -> int:
    d, cu = drv(), cu_mod()
    h = cu.CUmemGenericAllocationHandle()
    d.cuMemImportFromShareableHandle(byref(h), ctypes.c_void_p(fd), cu.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return h.value


def reserve(size: int, alignment: int = 0) -> int:
    d, cu = drv(), cu_mod()
    p = cu.CUdeviceptr()
    d.cuMemAddressReserve(byref(p), size, alignment, 0, 0)
    return p.value


def set_access(addr: int, size: int, ordinal: int = 0, flags: int | None = None) -> None:
    d, cu = drv(), cu_mod()
    desc = cu.access_desc(ordinal, cu.CU_MEM_ACCESS_FLAGS_PROT_READWRITE if flags is None else flags)
    d.cuMemSetAccess(addr, size, byref(desc), 1)


def map_rw(addr: int, h: int, size: int = GRAN, ordinal: int = 0) -> None:
    drv().cuMemMap(addr, size, 0, h, 0)
    set_access(addr, size, ordinal)


def write(addr: int, data: bytes) -> None:
    buf = ctypes.create_string_buffer(data, len(data))
    drv().cuMemcpyHtoD_v2(addr, buf, len(data))


def read(addr: int, n: int) -> bytes:
    buf = ctypes.create_string_buffer(n)
    drv().cuMemcpyDtoH_v2(buf, addr, n)
    return buf.raw


def mem_info() -> tuple[int, int]:
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    drv().cuMemGetInfo_v2(byref(free), byref(total))
    return free.value, total.value


def used() -> int:
    free, total = mem_info()
    return total - free


def tdkit_measure_end() -> None:
    """Appended to a child's script on another libcuda: the device memory in
    use while everything the script left is still alive (Sim.assert_clean).
    Its own context is current for the measurement, as in Sim.used_now."""
    try:
        d, cu = drv(), cu_mod()
        d.cuInit(0)
        ctx = cu.CUcontext()
        d.cuDevicePrimaryCtxRetain(byref(ctx), 0)
        d.cuCtxSetCurrent(ctx)
        print(f"#end-used {used()}", flush=True)
        d.cuDevicePrimaryCtxRelease_v2(0)
    except Exception:  # noqa: BLE001 - no driver, or a forked child: nothing to measure (assert_clean says so)
        pass


def send_fds(sock_fd: int, fds: list[int], payload: bytes = b"p") -> None:
    import socket

    s = socket.socket(fileno=os.dup(sock_fd))
    try:
        socket.send_fds(s, [payload], fds)
    finally:
        s.close()


def recv_fds(sock_fd: int, maxfds: int = 253) -> tuple[bytes, list[int]]:
    import socket

    s = socket.socket(fileno=os.dup(sock_fd))
    try:
        msg, fds, _flags, _addr = socket.recv_fds(s, 1024, maxfds)
        return msg, fds
    finally:
        s.close()


def wait_line() -> str:
    """Block until the test writes a line to our stdin."""
    return sys.stdin.readline().strip()


_worker = None


def on_worker(fn):
    """Run fn on this process's one worker thread (as the daemon runs every
    backend call of a device on that device's worker); re-raise its error."""
    global _worker
    from concurrent.futures import ThreadPoolExecutor

    if _worker is None:
        _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cuda-worker")
    return _worker.submit(fn).result()


def describe(exc: BaseException) -> dict:
    return dict(
        cls=type(exc).__name__,
        exhausted=isinstance(exc, errors.ResourceExhausted),
        internal=isinstance(exc, errors.Internal),
        message=str(exc),
    )
