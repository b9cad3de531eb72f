"""Shared pieces of the benchmark harness: starting a daemon subprocess,
percentiles, daemon RSS, and the in-process baselines (the same pages made
and mapped without a daemon: memfd on the host, the CUDA VMM API on CUDA).

Each backend's suite runs in its own process (bench/suite.py) whose
environment selects the driver library (KVCACHED_LIBCUDA) and the test
driver's simulated machine, so the in-process baselines and the daemon use
the same driver.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
PY = sys.executable
TESTDRIVER = ROOT / "build" / "testdriver" / "libcuda.so.1"
# bench/run.py --tree REF: the daemon and the clients of another revision
# (its kvcached_service extracted into build/bench/trees/<commit>/), the
# bench's own code from this checkout. Processes started from that directory
# import its kvcached_service first (python -m puts the cwd first on the path).
TREE = pathlib.Path(os.environ["KVCACHED_BENCH_TREE"]) if os.environ.get("KVCACHED_BENCH_TREE") else None
CODE = TREE or ROOT

MiB = 1 << 20
GiB = 1 << 30


# ---- numbers -----------------------------------------------------------------
def pct(values, p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of a non-empty list."""
    v = sorted(values)
    if not v:
        return float("nan")
    k = max(0, min(len(v) - 1, int(round(p / 100 * (len(v) - 1)))))
    return v[k]


def summary_us(samples_s) -> dict:
    """p50/p99/mean of durations given in seconds, reported in microseconds."""
    us = [s * 1e6 for s in samples_s]
    return {"n": len(us), "p50_us": pct(us, 50), "p99_us": pct(us, 99), "mean_us": statistics.fmean(us) if us else float("nan")}


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def nofile_limits(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                parts = line.split()
                return int(parts[3]), int(parts[4])
    return -1, -1


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process (all its threads) used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_parts_kib(pid: int) -> dict:
    """VmRSS split as the kernel reports it: RssAnon (the daemon's heap),
    RssFile, RssShmem (touched shared pages: on the test driver, the page
    files' host views)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(line.split()[1])
    return out


# ---- the daemon ----------------------------------------------------------------
class Daemon:
    """kvcached-serve as a subprocess on a private socket."""

    def __init__(self, workdir: pathlib.Path, name: str, backend: str, args: list[str], env: dict | None = None,
                 tree: pathlib.Path | None = None, prefix: tuple[str, ...] = (), ready_timeout: float = 60):
        """`tree`: run the daemon of another revision (a directory holding
        its kvcached_service package, bench/run.py --compare) instead of
        this checkout's (or bench/run.py --tree's). `prefix`: a command the
        daemon runs under (bench/instructions.py: valgrind), which may need a
        longer `ready_timeout`."""
        tree = tree or TREE
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix=f"{name}-", dir=workdir))
        self.socket = str(self.dir / "kvc.sock")
        self.log_path = self.dir / "daemon.log"
        cmd = [*prefix, PY, "-m", "kvcached_service.server", "--socket", self.socket, "--backend", backend,
               "--log-level", "WARNING", *args]
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env["PYTHONPATH"] = str(tree or ROOT)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=tree or ROOT)
        self.pid = self.proc.pid
        self._wait_ready(ready_timeout)

    def _wait_ready(self, timeout: float = 60) -> None:
        import grpc
        from kvcached_service.client.health import wait_serving

        if wait_serving(self.socket, timeout, alive=lambda: self.proc.poll() is None):
            return
        if self.proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {self.proc.returncode} at start:\n{self.log_path.read_text()}")
        raise RuntimeError(f"daemon not serving within {timeout} s:\n{self.log_path.read_text()}")

    def client(self, timeout: float = 30.0):
        from kvcached_service.client import Client

        return Client.connect(self.socket, timeout=timeout)

    def rss_kib(self) -> int:
        return rss_kib(self.pid)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "Daemon":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def client_env(daemon: Daemon) -> dict:
    env = dict(os.environ)
    env["KVCACHED_SOCKET"] = daemon.socket
    env["PYTHONPATH"] = str(ROOT)
    return env


# ---- in-process baselines --------------------------------------------------------
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munmap.restype = ctypes.c_int
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value


class HostInProc:
    """Pages made and mapped in this process, no daemon: memfd_create +
    ftruncate + mmap(MAP_SHARED|MAP_FIXED) into a reservation made once
    (as an engine reserves its KV address space once); release is
    munmap-to-reservation + close."""

    kind = "host"

    def __init__(self, page_size: int):
        self.page_size = page_size

    def reserve(self, size: int) -> int:
        addr = _libc.mmap(None, size, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), "reserve failed")
        return addr

    def free_reservation(self, base: int, size: int) -> None:
        _libc.munmap(base, size)

    def create_map(self, addr: int):
        fd = os.memfd_create("bench-page", os.MFD_CLOEXEC)
        os.ftruncate(fd, self.page_size)
        got = _libc.mmap(addr, self.page_size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
        if got in (None, _MAP_FAILED):
            os.close(fd)
            raise OSError(ctypes.get_errno(), "mmap failed")
        return (addr, fd)

    def unmap_release(self, h) -> None:
        addr, fd = h
        _libc.mmap(addr, self.page_size, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE, -1, 0)
        os.close(fd)

    def touch(self, addr: int) -> None:
        ctypes.memset(addr, 1, 1)

    def close(self) -> None:
        pass


class CudaInProc:
    """Pages made and mapped in this process through the CUDA VMM API, no
    daemon: cuMemCreate + cuMemMap + cuMemSetAccess into a reservation made
    once; release is cuMemUnmap + cuMemRelease. No export handle type (an
    in-process engine such as kvcached needs none). Not thread-safe: one
    instance per thread."""

    kind = "cuda"

    def __init__(self, page_size: int, ordinal: int = 0):
        from kvcached_service.cuda import driver as cu

        self.cu = cu
        self.drv = cu.load()
        self.drv.cuInit(0)
        self.page_size = page_size
        self.ordinal = ordinal
        ctx = cu.CUcontext()
        self.drv.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), ordinal)
        self.drv.cuCtxSetCurrent(ctx)
        self.prop = cu.allocation_prop(ordinal, cu.CU_MEM_HANDLE_TYPE_NONE)
        self.desc = cu.access_desc(ordinal)
        gran = ctypes.c_size_t()
        self.drv.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(self.prop), cu.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        self.granularity = gran.value

    def reserve(self, size: int) -> int:
        base = self.cu.CUdeviceptr()
        self.drv.cuMemAddressReserve(ctypes.byref(base), size, self.granularity, 0, 0)
        return base.value

    def free_reservation(self, base: int, size: int) -> None:
        self.drv.cuMemAddressFree(base, size)

    def create_map(self, addr: int):
        h = self.cu.CUmemGenericAllocationHandle()
        self.drv.cuMemCreate(ctypes.byref(h), self.page_size, ctypes.byref(self.prop), 0)
        self.drv.cuMemMap(addr, self.page_size, 0, h, 0)
        self.drv.cuMemSetAccess(addr, self.page_size, ctypes.byref(self.desc), 1)
        return (addr, h.value)

    def unmap_release(self, h) -> None:
        addr, handle = h
        self.drv.cuMemUnmap(addr, self.page_size)
        self.drv.cuMemRelease(handle)

    def touch(self, addr: int) -> None:
        buf = ctypes.create_string_buffer(b"\x01", 1)
        self.drv.cuMemcpyHtoD_v2(addr, buf, 1)

    def close(self) -> None:
        self.drv.cuDevicePrimaryCtxRelease_v2(self.ordinal)


def inproc(kind: str, page_size: int):
    return HostInProc(page_size) if kind == "host" else CudaInProc(page_size)


def daemon_backend(kind: str) -> str:
    """The daemon's --backend for a bench backend label."""
    return "host" if kind == "host" else "cuda"


def detect_gpu() -> dict:
    """Is a real NVIDIA driver with a device here? Loads libcuda.so.1 (not
    the test driver) in a child process and asks for the device count."""
    code = (
        "import ctypes,json\n"
        "try:\n"
        " l=ctypes.CDLL('libcuda.so.1')\n"
        "except OSError as e:\n"
        " print(json.dumps({'gpu':False,'reason':'libcuda.so.1 does not load: '+str(e)}));raise SystemExit\n"
        "r=l.cuInit(0)\n"
        "n=ctypes.c_int(0)\n"
        "r2=l.cuDeviceGetCount(ctypes.byref(n)) if r==0 else r\n"
        "ok=(r==0 and r2==0 and n.value>0)\n"
        "print(json.dumps({'gpu':ok,'reason':'' if ok else f'cuInit={r} cuDeviceGetCount={r2} devices={n.value}','devices':n.value}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    try:
        out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60, env=env)
        import json

        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as exc:  # noqa: BLE001 - any failure means no usable GPU
        return {"gpu": False, "reason": f"probe failed: {exc}"}
