"""CudaBackend on the test driver: pages, zeroing, rollback under failure
injection at every driver call of create_pages, start-up checks. Backend
methods run on a thread of their own (on_worker), as the daemon's
per-device worker runs them."""

from __future__ import annotations

import pytest

from tdkit import GRAN

def test_create_zero_release(sim):
    r = sim.run(f"""
        b = open_backend()
        spec = b.devices()[0]
        on_worker(lambda: b.worker_init(0))
        fresh = on_worker(lambda: b.create_pages(0, 2, 2 * GRAN, zero=False))
        zeroed = on_worker(lambda: b.create_pages(0, 3, GRAN, zero=True))
        free_total = b.memory_info(0)             # from another thread: scoped context
        m = CudaMapper(spec.uuid)
        base = m.reserve(7 * GRAN)
        addr = base
        for p in fresh + zeroed:
            m.map(addr, b.export_fds(0, [p])[0], p.size); addr += p.size
        fresh_bytes = m.read(base, 4).hex()
        zero_ok = all(m.read(base + 4 * GRAN + i * GRAN, GRAN) == bytes(GRAN) for i in range(3))
        m.write(base + 4 * GRAN + 10, b"dirty")
        on_worker(lambda: b.zero_pages(0, zeroed + fresh))
        after_zero = all(m.read(base + off, GRAN) == bytes(GRAN) for off in range(0, 7 * GRAN, GRAN))
        addr = base
        for p in fresh + zeroed:
            m.unmap(addr, p.size, None); addr += p.size
        m.release(base, 7 * GRAN); m.close()
        on_worker(lambda: b.release_pages(0, fresh + zeroed))
        fds = [p.fd for p in fresh + zeroed]
        end = b.memory_info(0)
        on_worker(lambda: b.worker_exit(0)); b.close()
        out(spec=[spec.uuid, spec.kind, spec.granularity, spec.total_bytes], free_total=free_total,
            fresh=fresh_bytes, zero_ok=zero_ok, after_zero=after_zero, fds=fds, end=end)
    """)
    assert r["zero_ok"] and r["after_zero"]
    assert r["fds"] == [-1] * 5
    if sim.private:  # the test driver's configured machine
        assert r["spec"] == ["GPU-7e57d71e-0000-4000-8000-000000000000", "cuda", GRAN, 64 << 20]
        assert r["free_total"] == [(64 << 20) - 7 * GRAN, 64 << 20]
        assert r["fresh"] == "dbdbdbdb"  # not zeroed: the driver's fresh memory shows
        assert r["end"] == [64 << 20, 64 << 20]
    else:  # another driver: its own names and sizes; 7 pages came back
        assert r["spec"][0].startswith("GPU-") and r["spec"][1] == "cuda" and r["spec"][2] <= GRAN
        assert r["free_total"][1] == r["end"][1] == r["spec"][3]
        assert r["end"][0] - r["free_total"][0] >= 7 * GRAN, (r["free_total"], r["end"])
    sim.assert_clean(r)


def test_out_of_memory_is_resource_exhausted_and_rolls_back(sim):
    r = sim.run("""
        b = open_backend(); on_worker(lambda: b.worker_init(0))
        keep = on_worker(lambda: b.create_pages(0, 2, GRAN, zero=True))
        try:
            on_worker(lambda: b.create_pages(0, 3, GRAN, zero=True))
            err = None
        except Exception as exc:
            err = describe(exc)
        info = b.memory_info(0)
        on_worker(lambda: b.release_pages(0, keep)); on_worker(lambda: b.worker_exit(0)); b.close()
        out(err=err, info=info)
    """, KVCACHED_TESTDRV_MEMORY=str(4 * GRAN))
    assert r["err"]["exhausted"] and not r["err"]["internal"]
    assert "CUDA_ERROR_OUT_OF_MEMORY" in r["err"]["message"] and "cuMemCreate" in r["err"]["message"]
    assert r["info"] == [2 * GRAN, 4 * GRAN]  # the 2 created before the failure are gone
    sim.assert_clean(r)


CREATE = """
    b = open_backend(); on_worker(lambda: b.worker_init(0))
    try:
        pages = on_worker(lambda: b.create_pages(0, 40, GRAN, zero=True))
        err = None
    except Exception as exc:
        pages, err = [], describe(exc)
    info = b.memory_info(0)
    on_worker(lambda: b.release_pages(0, pages))
    on_worker(lambda: b.worker_exit(0))
    b.close()
    out(err=err, info=info, n=len(pages))
"""

CREATE_CALLS = (  # the export is not here: a failed kept export only means deliveries export (below)
    "cuMemCreate",
    "cuMemAddressReserve",
    "cuMemMap",
    "cuMemSetAccess",
    "cuStreamCreate",
    "cuEventCreate",
    "cuMemsetD8Async",
    "cuEventRecord",
    "cuEventSynchronize",
)


def test_pages_keep_one_export_for_life_and_deliveries_send_it(sim):
    """A page is exported once when it is created (for at most
    kept_export_cap pages per device) and keeps that fd for its life:
    zeroing does not touch it, export_fds hands out duplicates of it with no
    driver call; a page over the cap is exported for each delivery, on the
    worker, a new fd each time. The fds are the same page as the handle."""
    r = sim.run("""
        b = open_backend(); on_worker(lambda: b.worker_init(0))
        b.kept_export_cap = 5
        pages = on_worker(lambda: b.create_pages(0, 8, GRAN, zero=True))
        kept = [p.fd >= 0 for p in pages]                       # 5 kept exports, no more
        ready = [b.exports_ready(pages[:5]), b.exports_ready(pages)]
        own = [p.fd for p in pages[:5]]
        first = b.export_fds(0, pages[:5])                      # duplicates: no driver call
        first += on_worker(lambda: b.export_fds(0, pages[5:]))  # the rest exported on the worker
        second = on_worker(lambda: b.export_fds(0, pages))      # delivered again: new fds
        distinct = len(set(first + second + own)) == 21
        on_worker(lambda: b.zero_pages(0, pages[:2]))           # freed and zeroed: same kept fds
        after = [p.fd for p in pages[:5]] == own
        h1, h2 = import_fd(own[0]), import_fd(second[0])        # both are the same page
        m = CudaMapper(b.devices()[0].uuid)
        base = m.reserve(2 * GRAN)
        m.map(base, os.dup(first[0]), GRAN); m.map(base + GRAN, os.dup(second[0]), GRAN)
        m.write(base, b"same page")
        same = m.read(base + GRAN, 9) == b"same page"
        m.unmap(base, GRAN, None); m.unmap(base + GRAN, GRAN, None); m.release(base, 2 * GRAN); m.close()
        drv().cuMemRelease(h1); drv().cuMemRelease(h2)
        for fd in first + second:
            os.close(fd)
        on_worker(lambda: b.release_pages(0, pages)); on_worker(lambda: b.worker_exit(0)); b.close()
        out(kept=kept, ready=ready, after=after, distinct=distinct, same=same, fds=[p.fd for p in pages])
    """)
    assert r["kept"] == [True] * 5 + [False] * 3
    assert r["ready"] == [True, False]
    assert r["after"] and r["distinct"] and r["same"]
    if sim.private:  # 5 at creation, none for the kept ones, 3 + 3 for the others' two deliveries
        assert r.report["calls"]["cuMemExportToShareableHandle"] == 11, r.report["calls"]
    assert r["fds"] == [-1] * 8  # release closed the kept ones
    sim.assert_clean(r)


def test_a_failed_kept_export_only_means_deliveries_export(sim):
    r = sim.run("""
        b = open_backend(); on_worker(lambda: b.worker_init(0))
        pages = on_worker(lambda: b.create_pages(0, 3, GRAN, zero=False))
        kept = [p.fd >= 0 for p in pages]
        fds = on_worker(lambda: b.export_fds(0, pages))
        for fd in fds:
            os.close(fd)
        on_worker(lambda: b.release_pages(0, pages)); on_worker(lambda: b.worker_exit(0)); b.close()
        out(kept=kept, n=len(fds))
    """, KVCACHED_TESTDRV_FAIL="cuMemExportToShareableHandle:2:CUDA_ERROR_UNKNOWN")
    assert r["kept"] == [True, False, False] and r["n"] == 3  # the first kept; after the failure, none tried
    assert r.report["leaks"] == 0, r.report


def test_zeroing_is_one_async_memset_per_run_and_one_event(sim):
    """Pages stay mapped in the daemon's zeroing arena for their life: a
    zeroing batch is one cuMemsetD8Async per run of adjacent slots and one
    event (no map, set-access, unmap or context synchronize); the bytes
    every client sees are zero once zero_pages returns."""
    r = sim.run("""
        b = open_backend(); on_worker(lambda: b.worker_init(0))
        pages = on_worker(lambda: b.create_pages(0, 6, GRAN, zero=False))
        m = CudaMapper(b.devices()[0].uuid)
        base = m.reserve(6 * GRAN)
        fds = b.export_fds(0, pages)
        m.map_run(base, fds, GRAN)
        for i in range(6):
            m.write(base + i * GRAN + 7, b"dirty")
        on_worker(lambda: b.zero_pages(0, [pages[0], pages[1], pages[2], pages[4]]))  # runs: 0-2, 4
        zeros = [m.read(base + i * GRAN, GRAN) == bytes(GRAN) for i in range(6)]
        for i in range(6):
            m.unmap(base + i * GRAN, GRAN, None)
        m.release(base, 6 * GRAN); m.close()
        on_worker(lambda: b.release_pages(0, pages)); on_worker(lambda: b.worker_exit(0)); b.close()
        out(zeros=zeros)
    """)
    assert r["zeros"] == [True, True, True, False, True, False]
    if sim.private:  # the whole process: the arena maps 6 pages with one set-access, the mapper 6 with one
        c = r.report["calls"]
        assert (c["cuMemsetD8Async"], c["cuEventRecord"], c["cuEventSynchronize"]) == (2, 1, 1), c
        assert c.get("cuMemsetD8_v2", 0) == 0, c  # (the mapper's writes synchronize: cuCtxSynchronize is theirs)
        assert (c["cuMemMap"], c["cuMemSetAccess"], c["cuMemUnmap"]) == (12, 2, 7), c  # release: one unmap for the run
    sim.assert_clean(r)


def test_export_failure_closes_the_fds_it_made(sim):
    for n in (1, 3, 5):
        r = sim.run("""
            b = open_backend(); on_worker(lambda: b.worker_init(0))
            b.kept_export_cap = 0                                 # every export is a driver call
            pages = on_worker(lambda: b.create_pages(0, 5, GRAN, zero=False))
            try:
                b.export_fds(0, pages); err = None
            except Exception as exc:
                err = describe(exc)
            on_worker(lambda: b.release_pages(0, pages)); on_worker(lambda: b.worker_exit(0)); b.close()
            out(err=err)
        """, KVCACHED_TESTDRV_FAIL=f"cuMemExportToShareableHandle:{n}:CUDA_ERROR_OUT_OF_MEMORY")
        assert r["err"]["exhausted"] and "cuMemExportToShareableHandle" in r["err"]["message"], r["err"]
        assert r.report["leaks"] == 0, (n, r.report)


def test_rollback_at_every_driver_call_of_create_pages(sim):
    """40 pages, zeroed (one memset per run of slots): every call of every driver
    function create_pages makes fails once in turn. Each time: a clean
    typed error naming the driver error, nothing left allocated, exported,
    mapped or reserved, and the device all free."""
    base = sim.run(CREATE, KVCACHED_TESTDRV_MEMORY=str(64 * GRAN))
    assert base["err"] is None and base["n"] == 40
    assert base.report["leaks"] == 0
    calls = base.report["calls"]
    cases = [(fn, n) for fn in CREATE_CALLS for n in sorted({1, 2, calls[fn] // 2 + 1, calls[fn]}) if n <= calls[fn]]
    assert all(calls[fn] >= 1 for fn in CREATE_CALLS), calls
    for fn, n in cases:
        for err in ("CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_UNKNOWN"):
            r = sim.run(CREATE, KVCACHED_TESTDRV_MEMORY=str(64 * GRAN), KVCACHED_TESTDRV_FAIL=f"{fn}:{n}:{err}")
            case = f"{fn} call {n} -> {err}"
            assert r["err"] is not None, case
            assert r["n"] == 0, case
            assert err in r["err"]["message"] and fn in r["err"]["message"], (case, r["err"])
            if err == "CUDA_ERROR_OUT_OF_MEMORY":
                assert r["err"]["exhausted"] and not r["err"]["internal"], (case, r["err"])
            else:
                assert r["err"]["internal"] and not r["err"]["exhausted"], (case, r["err"])
            assert r["info"] == [64 * GRAN, 64 * GRAN], case
            assert r.report["leaks"] == 0, (case, r.report)
            assert [i["function"] for i in r.report["injected"]] == [fn], case


def test_release_keeps_going_and_close_retries(sim):
    r = sim.run("""
        b = open_backend(); on_worker(lambda: b.worker_init(0))
        pages = on_worker(lambda: b.create_pages(0, 3, GRAN, zero=False))
        try:
            on_worker(lambda: b.release_pages(0, pages))
            err = None
        except Exception as exc:
            err = describe(exc)
        info = b.memory_info(0)
        on_worker(lambda: b.worker_exit(0))
        b.close()                                  # retries the page whose release failed
        out(err=err, info=info, fds=[p.fd for p in pages])
    """, KVCACHED_TESTDRV_FAIL="cuMemRelease:1")
    assert r["err"]["internal"] and "cuMemRelease" in r["err"]["message"]
    assert r["fds"] == [-1, -1, -1]
    assert r["info"][0] == r["info"][1] - GRAN  # only the failed one is still held
    sim.assert_clean(r)


def test_close_releases_pages_the_pool_did_not(sim):
    r = sim.run("""
        b = open_backend(); on_worker(lambda: b.worker_init(0))
        pages = on_worker(lambda: b.create_pages(0, 2, GRAN, zero=True))
        on_worker(lambda: b.worker_exit(0))
        b.close()
        out(fds=[p.fd for p in pages])
    """)
    assert r["fds"] == [-1, -1]
    sim.assert_clean(r)


def test_bad_page_size_is_invalid_argument(sim):
    r = sim.run("""
        b = open_backend(); on_worker(lambda: b.worker_init(0))
        try:
            on_worker(lambda: b.create_pages(0, 1, GRAN + 4096, zero=False)); err = None
        except Exception as exc:
            err = type(exc).__name__ + ": " + str(exc)
        on_worker(lambda: b.worker_exit(0)); b.close()
        out(err=err)
    """)
    assert r["err"].startswith("InvalidArgument") and "granularity" in r["err"]


STARTUP = """
    try:
        b = open_backend(); err = None; b.close()
    except CudaUnavailable as exc:
        err = describe(exc)
    out(err=err)
"""


@pytest.mark.parametrize(
    "env, needles",
    [
        ({"KVCACHED_TESTDRV_NO_VMM": "1"}, ["device 0", "virtual memory management", "GPU-7e57d71e-0000"]),
        (
            {"KVCACHED_TESTDRV_DEVICES": "2", "KVCACHED_TESTDRV_NO_POSIX_FD": "dev1"},
            ["device 1", "POSIX file descriptors", "GPU-7e57d71e-0001"],
        ),
        ({"KVCACHED_TESTDRV_FAIL": "cuMemGetAllocationGranularity:1:CUDA_ERROR_NOT_SUPPORTED"},
         ["device 0", "granularity", "CUDA_ERROR_NOT_SUPPORTED"]),
        ({"KVCACHED_TESTDRV_FAIL": "cuDeviceGetAttribute:1:CUDA_ERROR_UNKNOWN"},
         ["device 0", "cuDeviceGetAttribute", "CUDA_ERROR_UNKNOWN"]),
        ({"KVCACHED_TESTDRV_FAIL": "cuInit:1"}, ["cuInit", "CUDA_ERROR_NO_DEVICE"]),
        ({"KVCACHED_TESTDRV_DEVICES": "0"}, ["cuInit", "CUDA_ERROR_NO_DEVICE"]),
        ({"KVCACHED_LIBCUDA": "/nonexistent/libcuda.so.1"}, ["cannot load", "/nonexistent/libcuda.so.1", "KVCACHED_LIBCUDA"]),
    ],
)
def test_startup_refuses_and_says_why(sim, env, needles):
    r = sim.run(STARTUP, **env)
    assert r["err"] is not None, env
    for needle in needles:
        assert needle in r["err"]["message"], (needle, r["err"]["message"])


def test_startup_ok_on_several_devices_with_visible_devices(sim):
    r = sim.run("""
        b = open_backend()
        out(devs=[[d.uuid, d.ordinal] for d in b.devices()])
        b.close()
    """, KVCACHED_TESTDRV_DEVICES="3", CUDA_VISIBLE_DEVICES="2,1")
    assert r["devs"] == [["GPU-7e57d71e-0002-4000-8000-000000000002", 0], ["GPU-7e57d71e-0001-4000-8000-000000000001", 1]]
