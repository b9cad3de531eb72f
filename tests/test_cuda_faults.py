"""Failure injection at every driver call the daemon makes, on the CUDA test
driver (`KVCACHED_TESTDRV_FAIL=function:N[:ERROR]`, passed to the daemon
process only), plus the conformance pieces the shared suite does not cover
on CUDA (data across two client processes) and the backend choice when the
driver is unusable.

How every call is covered: `SCENARIO` is one fixed run (start-up, Allocate,
Free, Allocate again, Free, shutdown). A clean run's leak report says how
often the daemon called each driver function ("calls"). For each function,
the scenario is repeated once per call number N with that call failing, and
the outcome is checked for the phase the failure landed in:

  start-up   the daemon exits 1, its log names the driver call and the error
  Allocate   the client gets RESOURCE_EXHAUSTED (CUDA_ERROR_OUT_OF_MEMORY) or
             INTERNAL naming the call and the error; nothing is left in use;
             the same Allocate right after works
  Free       (zeroing the returned pages failed) Free still succeeds, the
             pages are released, never handed out again
  shutdown   a one-off failure is retried: the daemon exits 0 with an empty
             leak report (a persistent one: see test_persistent_release_failure)

and in every case: the books add up after every step, the leak report at
exit is empty, the injection is in the report's "injected" list, sockets are
removed. `DAEMON_CALLS` must equal the set of functions a clean run calls,
so a driver call added to the daemon fails test_every_daemon_call_is_injected
until it is covered here.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtest import require_testdriver_features, PY, ROOT, SERVE, TESTDRIVER, assert_books, gpu_state, leak_problems, testdriver_env, wait_until


# the tests here that need neither fault injection nor the leak report
ANY_LIBCUDA = {"test_cuda_data_written_by_one_process_is_read_by_another"}


@pytest.fixture(autouse=True)
def _needs_testdriver(request):
    """Fault injection and leak reports are the test driver's private
    features: skipped, naming them, on another libcuda (KVCACHED_TEST_LIBCUDA);
    failed on the test driver without them."""
    if request.node.originalname not in ANY_LIBCUDA:
        require_testdriver_features("KVCACHED_TESTDRV_FAIL", "leak report")
from kvcached_service import errors

MiB = 1 << 20
PAGE = 2 * MiB

# Every driver function a clean SCENARIO run makes the daemon call.
DAEMON_CALLS = sorted(
    [
        "cuInit",
        "cuDeviceGetCount",
        "cuDeviceGet",
        "cuDeviceGetUuid_v2",
        "cuDeviceGetName",
        "cuDeviceTotalMem_v2",
        "cuMemGetInfo_v2",
        "cuDeviceGetAttribute",
        "cuMemGetAllocationGranularity",
        "cuDevicePrimaryCtxRetain",
        "cuDevicePrimaryCtxRelease_v2",
        "cuCtxSetCurrent",
        "cuMemCreate",
        "cuMemExportToShareableHandle",
        "cuMemAddressReserve",
        "cuMemAddressFree",
        "cuMemMap",
        "cuMemUnmap",
        "cuMemSetAccess",
        "cuStreamCreate",
        "cuEventCreate",
        "cuMemsetD8Async",
        "cuEventRecord",
        "cuEventSynchronize",
        "cuEventDestroy_v2",
        "cuStreamDestroy_v2",
        "cuMemRelease",
    ]
)

# Injected one at a time: {function: [(call number, phase it hit, error)]},
# filled by test_fault_at_every_call_of and checked at the end.
_INJECTED: dict[str, list[tuple[int, str, str]]] = {}
_BASELINE: dict[str, int] = {}

N1, N2 = 3, 2  # pages of the first and second Allocate


# ---------------------------------------------------------------------------
# running one daemon with (or without) an injected failure


class Run:
    """What happened in one SCENARIO run."""

    def __init__(self) -> None:
        self.phase = "none"  # where a failure surfaced: start-up, allocate, free, none (shutdown or invisible)
        self.errors: list[tuple[str, errors.KVCachedError]] = []
        self.rc: int | None = None
        self.log = ""
        self.report: dict | None = None
        self.released_by_free = 0


def _serving_or_exit(d, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if d.proc.poll() is not None:
            return False
        if os.path.exists(d.socket):
            with grpc.insecure_channel(f"unix:{d.socket}") as ch:
                try:
                    r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return True
                except grpc.RpcError:
                    pass
        time.sleep(0.02)
    raise AssertionError(f"daemon neither served nor exited within {timeout} s:\n{d.log_text()}")


def _stop(d, run: Run) -> None:
    if d.proc.poll() is None:
        d.stop()
    run.rc = d.proc.returncode
    run.log = d.log_text()
    run.report = json.loads(d.report.read_text()) if d.report.exists() else None


def _expect_driver_error(err: errors.KVCachedError, fail: str | None) -> None:
    """An Allocate that hit the injected failure: the right class and a
    message naming the call and the error."""
    if fail is None:
        raise AssertionError(f"Allocate failed without an injected failure: {err!r}")
    fn, _, name = fail
    if name == "CUDA_ERROR_OUT_OF_MEMORY":
        assert isinstance(err, errors.ResourceExhausted), f"{fn} OOM must be RESOURCE_EXHAUSTED, got {err!r}"
    else:
        assert isinstance(err, errors.Internal), f"{fn} {name} must be INTERNAL, got {err!r}"
    assert fn in err.message and name in err.message, f"message must name {fn} and {name}: {err.message!r}"


def _pattern(page_id: int) -> bytes:
    return page_id.to_bytes(8, "little") * 512  # 4 KiB


def scenario(daemon_factory, fail: tuple[str, int, str] | None, also: tuple[str, ...] = (), **settings) -> Run:
    """start-up, Allocate N1 (write, read), Free, Allocate N2 (must read
    zeros, must not contain a released page), Free, shutdown. A failed
    Allocate is retried once (the daemon must keep serving). `also`: more
    KVCACHED_TESTDRV_FAIL entries, injected besides `fail`."""
    env = {}
    if fail is not None:
        env["KVCACHED_TESTDRV_FAIL"] = ",".join([f"{fail[0]}:{fail[1]}:{fail[2]}", *also])
    settings.setdefault("shutdown_grace", "0")
    # the device's free memory is read at start-up only (and when an Allocate finds a capped budget short,
    # which this scenario never does): the call counts stay the same from run to run
    settings.setdefault("memory_poll_seconds", "0")
    d = daemon_factory("cuda", env=env, wait=False, **settings)
    run = Run()
    if not _serving_or_exit(d):
        run.phase = "start-up"
        _stop(d, run)
        return run
    try:
        with d.client() as c, c.open_session("faults") as s:

            def books(in_use_pages: int) -> object:
                st = c.stats()
                assert_books(st)
                assert st.total.pages_in_use == in_use_pages, (st.total, run.errors)
                return st

            def allocate(n: int):
                try:
                    return s.allocate(n)
                except errors.KVCachedError as exc:
                    run.phase = "allocate"
                    run.errors.append(("allocate", exc))
                    _expect_driver_error(exc, fail)
                    books(held)  # nothing half-allocated stays in use
                    return s.allocate(n)  # the daemon keeps serving: the same call works now

            held = 0
            books(0)
            first = allocate(N1)
            held = N1
            for p in first:
                p.write(0, _pattern(p.id))
            assert all(p.read(0, 4096) == _pattern(p.id) for p in first)
            books(N1)
            before = c.stats().total
            ids1 = {p.id for p in first}
            assert s.free(first) == N1  # Free never fails for a driver error: zeroing failures release the pages
            held = 0
            # answered before zeroing: the pages are zeroed in the background (or released when that fails)
            wait_until(lambda: c.stats().total.pages_zeroing == 0, timeout=10)
            if "pages failed" in d.log_text():
                # zeroing failed: the pages are released once this client let
                # go of the handles it keeps (DROP, DROPPED: docs/protocol.md)
                wait_until(lambda: c.stats().total.pages_released_total > before.pages_released_total, timeout=10)
            after = books(0).total
            run.released_by_free = after.pages_released_total - before.pages_released_total
            if run.released_by_free:
                run.phase = "free"
                assert after.pages_pooled == before.pages_pooled + N1 - run.released_by_free
            second = allocate(N2)
            held = N2
            for p in second:
                assert p.read(0, 4096) == bytes(4096), f"page {p.id} handed out again does not read as zeros"
            if run.released_by_free:
                # the released pages (those whose zeroing failed) must not come back
                pooled_ids = ids1 & {p.id for p in second}
                assert len(pooled_ids) <= N1 - run.released_by_free, "a page whose zeroing failed was handed out again"
            books(N2)
            s.free(second)
            books(0)
    finally:
        _stop(d, run)
    return run


def check_clean_exit(run: Run, fail: tuple[str, int, str] | None) -> None:
    assert run.report is not None, f"the test driver wrote no leak report\n{run.log}"
    if fail is not None:
        hits = [(i["function"], i["call"]) for i in run.report["injected"]]
        assert (fail[0], fail[1]) in hits, f"the failure {fail} was never injected (injected: {hits}): the call counts drifted"
    assert run.report["leaks"] == 0, f"leaks after {fail} ({run.phase}): {run.report['counts']}\n{_objects(run.report)}\n{_tail(run.log)}"
    assert run.rc == 0, f"daemon exited {run.rc} after {fail} ({run.phase}):\n{_tail(run.log)}"


def _objects(report: dict) -> str:
    return json.dumps({k: report[k] for k in ("handles", "exported_fds", "mappings", "reservations", "primary_contexts") if report[k]})


def _tail(log: str, n: int = 25) -> str:
    return "\n".join(log.splitlines()[-n:])


def default_error(fn: str) -> str:
    """The test driver's default injected error per function (its README)."""
    return {
        "cuMemCreate": "CUDA_ERROR_OUT_OF_MEMORY",
        "cuMemAddressReserve": "CUDA_ERROR_OUT_OF_MEMORY",
        "cuMemMap": "CUDA_ERROR_OUT_OF_MEMORY",
        "cuDevicePrimaryCtxRetain": "CUDA_ERROR_OUT_OF_MEMORY",
        "cuInit": "CUDA_ERROR_NO_DEVICE",
        "cuCtxSetCurrent": "CUDA_ERROR_INVALID_CONTEXT",
        "cuDeviceGet": "CUDA_ERROR_INVALID_DEVICE",
    }.get(fn, "CUDA_ERROR_UNKNOWN")


def baseline(daemon_factory) -> dict[str, int]:
    """Calls per driver function in a clean SCENARIO run (computed once)."""
    if not _BASELINE:
        run = scenario(daemon_factory, None)
        check_clean_exit(run, None)
        _BASELINE.update({k: v for k, v in run.report["calls"].items() if v})
    return _BASELINE


# ---------------------------------------------------------------------------
# the tests


def test_every_daemon_call_is_injected(daemon_factory):
    """The list below the parametrised test must be exactly what the daemon
    calls; a new driver call fails here until it gets injected too."""
    calls = baseline(daemon_factory)
    new = sorted(set(calls) - set(DAEMON_CALLS))
    gone = sorted(set(DAEMON_CALLS) - set(calls))
    assert not new, f"the daemon now calls {new}: add them to DAEMON_CALLS so failures there are injected"
    assert not gone, f"the daemon no longer calls {gone} in the scenario: remove them from DAEMON_CALLS"


@pytest.mark.parametrize("fn", DAEMON_CALLS)
def test_fault_at_every_call_of(daemon_factory, fn):
    n = baseline(daemon_factory).get(fn, 0)
    assert n > 0, f"a clean run never calls {fn}"
    problems = []
    for k in range(1, n + 1):
        fail = (fn, k, default_error(fn))
        run = scenario(daemon_factory, fail)
        _INJECTED.setdefault(fn, []).append((k, run.phase, fail[2]))
        try:
            if run.phase == "start-up":
                assert run.rc == 1, f"start-up failure must exit 1, got {run.rc}"
                line = next((ln for ln in run.log.splitlines() if "cannot start" in ln), "")
                assert fn in line and fail[2] in line, f"start-up message must name {fn} and {fail[2]}: {line!r}\n{_tail(run.log)}"
                assert run.report is not None and run.report["leaks"] == 0, f"leaks after a refused start: {run.report and run.report['counts']}"
                assert (fn, k) in [(i["function"], i["call"]) for i in run.report["injected"]]
            else:
                if run.phase == "free":
                    assert "zeroing" in run.log and fn in run.log, "a zeroing failure on Free must be logged naming the call"
                check_clean_exit(run, fail)
        except AssertionError as exc:
            problems.append(f"{fn} call {k}/{n} ({run.phase}): {exc}")
    assert not problems, "\n\n".join(problems)


def test_injections_covered_every_phase():
    """Runs after the parametrised tests (file order): every function was
    injected at every call, and the phases a failure can land in were all hit."""
    missing = [fn for fn in DAEMON_CALLS if fn not in _INJECTED]
    assert not missing, f"never injected (did test_fault_at_every_call_of run?): {missing}"
    phases = {phase for hits in _INJECTED.values() for _, phase, _ in hits}
    assert {"start-up", "allocate", "free", "none"} <= phases, phases
    # OOM from cuMemCreate / cuMemMap reached the client as RESOURCE_EXHAUSTED, others as INTERNAL
    assert any(ph == "allocate" and e == "CUDA_ERROR_OUT_OF_MEMORY" for h in _INJECTED.values() for _, ph, e in h)
    assert any(ph == "allocate" and e != "CUDA_ERROR_OUT_OF_MEMORY" for h in _INJECTED.values() for _, ph, e in h)


@pytest.mark.parametrize("fn,error", [("cuMemCreate", "CUDA_ERROR_UNKNOWN"), ("cuMemMap", "CUDA_ERROR_INVALID_VALUE"), ("cuMemExportToShareableHandle", "CUDA_ERROR_OUT_OF_MEMORY")])
def test_allocate_error_class_follows_the_driver_error(daemon_factory, fn, error):
    """The class comes from the CUresult, not from the function."""
    fail, also = (fn, 1, error), ()
    if fn == "cuMemExportToShareableHandle":
        # Export call 1 is the device worker's ready export of the first page
        # it creates: a failure there is absorbed (no ready fd for that
        # Allocate's pages, the delivery exports them instead). Call 2 is that
        # delivery's export, which the Allocate must report.
        fail, also = (fn, 2, error), (f"{fn}:1:{error}",)
    run = scenario(daemon_factory, fail, also)
    assert run.phase == "allocate", run.phase
    (_, err), = run.errors
    assert isinstance(err, errors.ResourceExhausted if error == "CUDA_ERROR_OUT_OF_MEMORY" else errors.Internal), err
    check_clean_exit(run, fail)


def test_fault_in_the_middle_of_a_large_allocate_rolls_everything_back(daemon_factory):
    """40 pages made in one batch: fail the 37th cuMemCreate, the 35th map
    into the zeroing arena, the zeroing memset; nothing is left allocated,
    exported or mapped."""
    for fail in ("cuMemCreate:37", "cuMemMap:35", "cuMemsetD8Async:1"):
        d = daemon_factory("cuda", env={"KVCACHED_TESTDRV_FAIL": fail}, shutdown_grace="0")
        with d.client() as c, c.open_session("big") as s:
            with pytest.raises(errors.KVCachedError) as info:
                s.allocate(40)
            assert fail.split(":")[0] in info.value.message
            st = c.stats()
            assert_books(st)
            assert st.total.pages_in_use == 0 and st.total.pages_pooled == 0, st.total
            pages = s.allocate(40)  # and the daemon serves the same request now
            s.free(pages)
        run = Run()
        _stop(d, run)
        check_clean_exit(run, (fail.split(":")[0], int(fail.split(":")[1]), ""))


def test_warm_page_creation_failure_is_logged_and_the_daemon_serves(daemon_factory):
    d = daemon_factory("cuda", env={"KVCACHED_TESTDRV_FAIL": "cuMemCreate:2"}, prealloc="8MiB", shutdown_grace="0")
    with d.client() as c, c.open_session("warm") as s:
        pages = s.allocate(4)
        s.free(pages)
        assert_books(c.stats())
    assert "warm page creation failed" in d.log_text() and "cuMemCreate" in d.log_text()
    run = Run()
    _stop(d, run)
    check_clean_exit(run, ("cuMemCreate", 2, ""))


def test_persistent_release_failure_at_shutdown_is_reported(daemon_factory):
    """Every cuMemRelease fails: the daemon cannot give the pages back. It
    must still finish shutdown (window and context released, sockets
    removed), exit non-zero, and say in its log which call failed; the leak
    report then shows exactly the pages (handles) and nothing else."""
    d = daemon_factory("cuda", env={"KVCACHED_TESTDRV_FAIL": "cuMemRelease:1+"}, shutdown_grace="0")
    with d.client() as c, c.open_session("keep") as s:
        s.free(s.allocate(2))
    run = Run()
    _stop(d, run)
    assert run.rc != 0, "a shutdown that leaked device memory must not exit 0"
    assert "cuMemRelease failed: CUDA_ERROR_UNKNOWN" in run.log
    assert "cannot start" not in run.log, "a failure at shutdown is not a start-up failure:\n" + _tail(run.log)
    assert "shutdown incomplete: " in run.log and "Traceback" not in run.log, _tail(run.log)
    assert not os.path.exists(d.socket) and not os.path.exists(d.fd_socket), "sockets left behind"
    counts = run.report["counts"]
    assert counts["handles"] == 2, counts
    assert {k: v for k, v in counts.items() if k != "handles"} == {"exported_fds": 0, "mappings": 0, "reservations": 0, "primary_contexts": 0}, counts


# ---------------------------------------------------------------------------
# the backend choice when CUDA cannot be used


@pytest.mark.parametrize(
    "knob,needle",
    [
        ("KVCACHED_TESTDRV_NO_VMM", "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0"),
        ("KVCACHED_TESTDRV_NO_POSIX_FD", "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 0"),
    ],
)
def test_backend_cuda_refuses_and_auto_falls_back(tmp_path, knob, needle):
    env = dict(os.environ, **testdriver_env(), PYTHONPATH=str(ROOT))
    env[knob] = "1"
    env["KVCACHED_TESTDRV_REPORT"] = str(tmp_path / "report-%p.json")
    sock = str(tmp_path / "x.sock")
    proc = subprocess.run(SERVE + ["--socket", sock, "--backend", "cuda", "--memory-limit", "64MiB"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 1, proc.stderr
    assert "--backend cuda: the CUDA driver is not usable" in proc.stderr
    assert needle in proc.stderr, proc.stderr
    assert "device 0 (GPU-" in proc.stderr, "the refusal must name the device"
    assert not os.path.exists(sock)
    for rep in tmp_path.glob("report-*.json"):
        assert json.loads(rep.read_text())["leaks"] == 0

    # auto: falls back to host, says so (with the reason), and serves
    proc = subprocess.Popen(SERVE + ["--socket", sock, "--memory-limit", "64MiB", "--shutdown-grace", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        from kvtest import wait_until
        from kvcached_service.client import Client

        assert wait_until(lambda: os.path.exists(sock), timeout=30), "auto daemon did not come up"
        with Client.connect(sock) as c:
            assert c.info.backend == "host"
            with c.open_session("fallback") as s:
                s.free(s.allocate(1))
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "backend: host (memfd pages): no usable CUDA driver" in out
    assert needle in out, "the fallback line must say why CUDA was not used"


# ---------------------------------------------------------------------------
# conformance on CUDA beyond tests/test_*.py: data across client processes


HANDOFF = r'''
import array, json, os, socket, sys
from kvcached_service.client import Client
from kvcached_service.client.cuda_mapper import CudaMapper
role, path = sys.argv[1], sys.argv[2]
c = Client.from_env()
s = c.open_session(role)
def pattern(i):
    return bytes([(i * 37 + 11) % 251]) * 4096 + i.to_bytes(8, "little")
if role == "writer":
    resp, fds = s.allocate_fds(3)
    m = s.mapper(resp.device)
    base = m.reserve(3 * resp.page_size)
    dups = [os.dup(fd) for fd in fds]
    for i, fd in enumerate(fds):
        m.map(base + i * resp.page_size, fd, resp.page_size)
        m.write(base + i * resp.page_size + resp.page_size - 4104, pattern(i))
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    msg = json.dumps({"device": resp.device, "size": resp.page_size, "ids": list(resp.page_ids)}).encode()
    conn.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", dups))])
    for fd in dups:
        os.close(fd)
    assert conn.recv(16) == b"read"
    for i in range(3):
        m.unmap(base + i * resp.page_size, resp.page_size, None)
    m.release(base, 3 * resp.page_size)
    s.free_ids(resp.page_ids)
    conn.sendall(b"freed")
    print(json.dumps({"ids": list(resp.page_ids)}))
else:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path); srv.listen(1)
    print("listening", flush=True)
    conn, _ = srv.accept()
    msg, anc, _, _ = conn.recvmsg(4096, socket.CMSG_SPACE(64))
    info = json.loads(msg)
    fds = array.array("i"); fds.frombytes(anc[0][2])
    m = s.mapper(info["device"])
    size = info["size"]
    base = m.reserve(3 * size)
    got = []
    for i, fd in enumerate(fds):
        m.map(base + i * size, fd, size)
        got.append(m.read(base + i * size + size - 4104, 4104) == pattern(i))
    for i in range(3):
        m.unmap(base + i * size, size, None)
    m.release(base, 3 * size)
    conn.sendall(b"read")
    assert conn.recv(16) == b"freed"
    pages = s.allocate(3)   # same uid: the writer's pages come back, zeroed by the daemon
    zeros = [p.read() == bytes(p.size) for p in pages]
    ids = [p.id for p in pages]
    s.free(pages)
    print(json.dumps({"read": got, "zeros": zeros, "ids": ids}))
s.close()
'''


def test_cuda_data_written_by_one_process_is_read_by_another(daemon_factory, tmp_path):
    """One client process writes through its CudaMapper and passes the
    daemon's fds on (SCM_RIGHTS); another imports them with its own mapper
    and reads the bytes. After the writer frees, the reader gets the same
    pages from the daemon, zeroed."""
    d = daemon_factory("cuda")
    script = tmp_path / "handoff.py"
    script.write_text(HANDOFF)
    path = str(tmp_path / "handoff.sock")
    reader = subprocess.Popen([PY, str(script), "reader", path], env=d.client_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert reader.stdout.readline().strip() == "listening", reader.stderr.read()
    writer = subprocess.run([PY, str(script), "writer", path], env=d.client_env(), capture_output=True, text=True, timeout=60)
    assert writer.returncode == 0, writer.stderr
    out, err = reader.communicate(timeout=60)
    assert reader.returncode == 0, err
    r = json.loads(out.splitlines()[-1])
    w = json.loads(writer.stdout.splitlines()[-1])
    assert r["read"] == [True, True, True], "bytes written in one process were not read in the other"
    assert r["zeros"] == [True, True, True], "pages freed by the writer did not read as zeros in the reader"
    assert set(r["ids"]) == set(w["ids"]), "same uid: the freed pages should have been reused"
    with d.client() as c:
        st = c.stats()
        assert_books(st)
        assert st.total.pages_in_use == 0
