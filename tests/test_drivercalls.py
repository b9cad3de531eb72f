"""The test driver's live call counters (KVCACHED_TESTDRV_CALLS) and their
reader (bench/drivercalls.py): counts per process and per thread, the bytes
a call covered, a fork() child's own file, readable while the process runs;
the public-only build does not read the knob."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtest import PY, ROOT, TESTDRIVER, TESTDRIVER_PUBLIC

sys.path.insert(0, str(ROOT))
from bench import drivercalls  # noqa: E402

# One process: 3 cuDriverGetVersion on the main thread, 5 cuDeviceGetCount
# on another; two 2 MiB pages mapped adjacently, one cuMemSetAccess and one
# cuMemUnmap over both; then a fork()ed child calls cuDriverGetVersion once.
# Between the two halves it prints the counters it read of itself (live).
CHILD = r"""
import ctypes, json, os, sys, threading
sys.path.insert(0, sys.argv[1])
from bench import drivercalls
from kvcached_service.cuda import driver as cu
lib = ctypes.CDLL(os.environ["KVCACHED_LIBCUDA"])
v = ctypes.c_int()
assert lib.cuInit(0) == 0
for _ in range(3):
    lib.cuDriverGetVersion(ctypes.byref(v))
def other():
    for _ in range(5):
        lib.cuDeviceGetCount(ctypes.byref(v))
t = threading.Thread(target=other); t.start(); t.join()
mine = drivercalls.read_file(os.path.join(os.environ["KVCACHED_TESTDRV_CALLS"], str(os.getpid())))
print(json.dumps({"live": mine["calls"]}), flush=True)
drv = cu.load(os.environ["KVCACHED_LIBCUDA"])
ctx = cu.CUcontext()
drv.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)
prop = cu.allocation_prop(0)
page = 2 << 20
base = cu.CUdeviceptr()
drv.cuMemAddressReserve(ctypes.byref(base), 2 * page, page, 0, 0)
hs = []
for i in range(2):
    h = cu.CUmemGenericAllocationHandle()
    drv.cuMemCreate(ctypes.byref(h), page, ctypes.byref(prop), 0)
    drv.cuMemMap(base.value + i * page, page, 0, h, 0)
    hs.append(h)
drv.cuMemSetAccess(base.value, 2 * page, ctypes.byref(cu.access_desc(0)), 1)
drv.cuMemUnmap(base.value, 2 * page)
for h in hs:
    drv.cuMemRelease(h)
drv.cuMemAddressFree(base.value, 2 * page)
drv.cuDevicePrimaryCtxRelease_v2(0)
pid = os.fork()
if pid == 0:
    lib.cuDriverGetVersion(ctypes.byref(v))
    os._exit(0)
os.waitpid(pid, 0)
print(json.dumps({"pid": os.getpid(), "main": threading.get_native_id(), "other": t.native_id, "child": pid}), flush=True)
"""


def _run(lib, tmp_path, calls_dir):
    env = dict(os.environ, KVCACHED_LIBCUDA=str(lib), KVCACHED_TESTDRV_STATE=str(tmp_path / "state"),
               KVCACHED_TESTDRV_CALLS=str(calls_dir), PYTHONPATH=str(ROOT))
    p = subprocess.run([PY, "-c", CHILD, str(ROOT)], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return [json.loads(line) for line in p.stdout.splitlines()]


def test_live_counters_per_process_thread_and_bytes(tmp_path):
    assert TESTDRIVER.exists(), f"CUDA test driver not built: {TESTDRIVER}"
    calls = tmp_path / "calls"
    live, ids = _run(TESTDRIVER, tmp_path, calls)
    # read by the process itself half-way: what it had called so far
    assert live["live"] == {"cuInit": 1, "cuDriverGetVersion": 3, "cuDeviceGetCount": 5}, live
    snap = drivercalls.snapshot(str(calls))
    assert set(snap) == {ids["pid"], ids["child"]}, snap.keys()
    me = snap[ids["pid"]]
    page = 2 << 20
    assert me["calls"]["cuDriverGetVersion"] == 3 and me["calls"]["cuDeviceGetCount"] == 5
    assert me["calls"]["cuMemCreate"] == 2 and me["calls"]["cuMemMap"] == 2
    # one call over the run of two pages: 1 call, 2 pages' bytes
    assert me["calls"]["cuMemSetAccess"] == 1 and me["bytes"]["cuMemSetAccess"] == 2 * page
    assert me["calls"]["cuMemUnmap"] == 1 and me["bytes"]["cuMemUnmap"] == 2 * page
    assert me["bytes"]["cuMemCreate"] == 2 * page and me["bytes"]["cuMemMap"] == 2 * page
    # per thread: the other thread's calls are its own
    assert me["threads"][ids["other"]]["calls"] == {"cuDeviceGetCount": 5}
    assert me["threads"][ids["main"]]["calls"]["cuDriverGetVersion"] == 3
    # the fork()ed child counted in its own file, not in its parent's
    assert snap[ids["child"]]["calls"] == {"cuDriverGetVersion": 1}
    # a delta against an empty snapshot is the whole; split takes a daemon pid and per-op shares
    d = drivercalls.delta(snap, {})
    s = drivercalls.split(d, ids["pid"], ops=2)
    assert s["daemon_per_op"]["calls"]["cuMemCreate"] == 1.0
    assert s["client_per_op"]["calls"] == {"cuDriverGetVersion": 0.5} and s["client_processes"] == 1
    assert {t["tid"] for t in s["daemon_threads"]} == {ids["main"], ids["other"]}


def test_public_only_build_does_not_read_the_knob(tmp_path):
    if not TESTDRIVER_PUBLIC.exists():
        pytest.fail(f"public-only test driver not built: {TESTDRIVER_PUBLIC} (scripts/build-testdriver.sh --public-only; scripts/test-python.sh builds it first)")
    calls = tmp_path / "calls"
    env = dict(os.environ, KVCACHED_LIBCUDA=str(TESTDRIVER_PUBLIC), KVCACHED_TESTDRV_CALLS=str(calls))
    code = "import ctypes,os; l=ctypes.CDLL(os.environ['KVCACHED_LIBCUDA']); assert l.cuInit(0) == 0"
    p = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert not calls.exists()
