"""The driver API as the project uses it, checked through the public API only
(no knob, no leak report, no fault injection): so they run on any libcuda
(KVCACHED_TEST_LIBCUDA: the public-only build of the test driver, a real
driver) as well as on the test driver. Memory is measured with cuMemGetInfo
(device-wide, so as deltas from the start of each scenario), devices come
from cuDeviceGetCount, and leaks are checked by Sim.assert_clean (the test
driver's leak report there, memory elsewhere). Each scenario runs in its own
child process."""

from __future__ import annotations

import os
import socket

from tdkit import GRAN


def test_devices_come_from_the_driver(sim):
    r = sim.run("""
        d = drv(); cu = cu_mod(); d.cuInit(0); d.cuInit(0)       # cuInit twice is fine
        n = ctypes.c_int(); d.cuDeviceGetCount(byref(n))
        devs = []
        for i in range(n.value):
            dev = cu.CUdevice(); d.cuDeviceGet(byref(dev), i)
            u = cu.CUuuid(); d.cuDeviceGetUuid_v2(byref(u), dev)
            name = ctypes.create_string_buffer(256); d.cuDeviceGetName(name, 256, dev)
            devs.append(dict(uuid=cu.format_uuid(u), name=name.value.decode()))
        bad = code(d.cuDeviceGet, byref(cu.CUdevice()), n.value)
        out(n=n.value, devs=devs, bad=bad)
    """)
    assert r["n"] >= 1
    uuids = [x["uuid"] for x in r["devs"]]
    assert len(set(uuids)) == r["n"] and all(u.startswith("GPU-") and len(u) == 40 for u in uuids), uuids
    assert all(x["name"] for x in r["devs"])
    assert r["bad"] == "CUDA_ERROR_INVALID_DEVICE"


def test_vmm_and_posix_fd_export_are_supported(sim):
    r = sim.run("""
        d = drv(); cu = cu_mod(); d.cuInit(0)
        def attr(a):
            v = ctypes.c_int(-1); d.cuDeviceGetAttribute(byref(v), a, 0); return v.value
        out(vmm=attr(cu.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED),
            fd=attr(cu.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED))
    """)
    assert (r["vmm"], r["fd"]) == (1, 1)


def test_total_memory_matches_mem_get_info(sim):
    r = sim.run("""
        d = drv(); cu = cu_mod(); init()
        t = ctypes.c_size_t(); d.cuDeviceTotalMem_v2(byref(t), 0)
        free, total = mem_info()
        fini()
        out(total_mem=t.value, total=total, free=free)
    """)
    assert r["total_mem"] == r["total"] > 0
    assert 0 < r["free"] <= r["total"]


def test_granularity_is_a_power_of_two_dividing_the_default_page(sim):
    r = sim.run("""
        d = drv(); cu = cu_mod(); d.cuInit(0)
        def g(kind):
            v = ctypes.c_size_t(); d.cuMemGetAllocationGranularity(byref(v), byref(cu.allocation_prop(0)), kind); return v.value
        out(minimum=g(cu.CU_MEM_ALLOC_GRANULARITY_MINIMUM), recommended=g(cu.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
    """)
    m = r["minimum"]
    assert m > 0 and m & (m - 1) == 0 and (2 << 20) % m == 0
    assert r["recommended"] % m == 0


def test_create_takes_device_memory_and_release_gives_it_back(sim):
    r = sim.run("""
        d = drv(); init()
        start = used()
        hs = [create() for _ in range(3)]
        held = used() - start
        for h in hs:
            d.cuMemRelease(h)
        back = used() - start
        fini()
        out(held=held, back=back)
    """)
    assert r["held"] >= 3 * GRAN
    assert r["back"] == 0
    sim.assert_clean(r)


def test_create_refuses_a_size_that_is_not_a_granularity_multiple(sim):
    r = sim.run("""
        d = drv(); init()
        out(odd=code(create, GRAN + 4096), zero=code(create, 0))
        fini()
    """)
    assert r["odd"] == "CUDA_ERROR_INVALID_VALUE"
    assert r["zero"] == "CUDA_ERROR_INVALID_VALUE"
    sim.assert_clean(r)


def test_release_twice_is_refused(sim):
    r = sim.run("""
        d = drv(); init()
        h = create()
        out(first=code(d.cuMemRelease, h), second=code(d.cuMemRelease, h))
        fini()
    """)
    assert (r["first"], r["second"]) == ("CUDA_SUCCESS", "CUDA_ERROR_INVALID_VALUE")
    sim.assert_clean(r)


def test_device_memory_in_use_is_seen_by_every_process(sim):
    """cuMemGetInfo is device-wide: another process sees our pages, and
    sees them go when we exit."""
    holder = sim.spawn("""
        init()
        start = used()
        hs = [create() for _ in range(4)]
        out(held=used() - start)
        wait_line()
    """)
    try:
        first = holder.stdout.readline()
        assert first.startswith("{"), first + holder.stderr.read()
        before = sim.used_now()
        holder.stdin.write("done\n")
        holder.stdin.flush()
        assert holder.wait(30) == 0, holder.stderr.read()
    finally:
        if holder.poll() is None:
            holder.kill()
    after = sim.used_now()
    assert before - after >= 4 * GRAN, (before, after)


def test_reservation_is_aligned_and_freed_only_when_unmapped(sim):
    r = sim.run("""
        d = drv(); init()
        base = reserve(8 * GRAN, 4 * GRAN)
        h = create()
        d.cuMemMap(base, GRAN, 0, h, 0)
        busy = code(d.cuMemAddressFree, base, 8 * GRAN)
        d.cuMemUnmap(base, GRAN)
        freed = code(d.cuMemAddressFree, base, 8 * GRAN)
        d.cuMemRelease(h); fini()
        out(aligned=base % (4 * GRAN) == 0, busy=busy, freed=freed)
    """)
    assert r["aligned"]
    assert r["busy"] != "CUDA_SUCCESS" and r["freed"] == "CUDA_SUCCESS"
    sim.assert_clean(r)


def test_copy_round_trip_and_memset(sim):
    r = sim.run("""
        d = drv(); init()
        h = create(); base = reserve(GRAN); map_rw(base, h)
        write(base, b"hello device")
        got = read(base, 12)
        d.cuMemsetD8_v2(base + 6, ord("D"), 6)
        d.cuCtxSynchronize()
        after = read(base, 12)
        d.cuMemUnmap(base, GRAN); d.cuMemAddressFree(base, GRAN); d.cuMemRelease(h); fini()
        out(got=got.decode(), after=after.decode())
    """)
    assert r["got"] == "hello device"
    assert r["after"] == "hello DDDDDD"
    sim.assert_clean(r)


def test_one_handle_mapped_twice_shares_its_bytes(sim):
    r = sim.run("""
        d = drv(); init()
        h = create(); a = reserve(GRAN); b = reserve(GRAN)
        map_rw(a, h); map_rw(b, h)
        write(a, b"one page, two views")
        got = read(b, 19)
        for x in (a, b):
            d.cuMemUnmap(x, GRAN); d.cuMemAddressFree(x, GRAN)
        d.cuMemRelease(h); fini()
        out(got=got.decode())
    """)
    assert r["got"] == "one page, two views"
    sim.assert_clean(r)


def test_adjacent_pages_take_one_set_access_and_one_copy_across(sim):
    r = sim.run("""
        d = drv(); init()
        hs = [create(), create()]; base = reserve(2 * GRAN)
        for i, h in enumerate(hs):
            d.cuMemMap(base + i * GRAN, GRAN, 0, h, 0)
        set_access(base, 2 * GRAN)
        write(base + GRAN - 4, b"ACROSS")
        d.cuMemUnmap(base, GRAN); d.cuMemUnmap(base + GRAN, GRAN)
        # the second page alone still holds its half
        d.cuMemMap(base, GRAN, 0, hs[1], 0); set_access(base, GRAN)
        tail = read(base, 2)
        d.cuMemUnmap(base, GRAN); d.cuMemAddressFree(base, 2 * GRAN)
        for h in hs:
            d.cuMemRelease(h)
        fini()
        out(tail=tail.decode())
    """)
    assert r["tail"] == "SS"
    sim.assert_clean(r)


def test_copy_needs_access_and_a_mapping(sim):
    r = sim.run("""
        d = drv(); init()
        h = create(); base = reserve(GRAN)
        d.cuMemMap(base, GRAN, 0, h, 0)
        no_access = code(read, base, 4)
        set_access(base, GRAN)
        ok = code(read, base, 4)
        d.cuMemUnmap(base, GRAN)
        unmapped = code(read, base, 4)
        d.cuMemAddressFree(base, GRAN); d.cuMemRelease(h); fini()
        out(no_access=no_access, ok=ok, unmapped=unmapped)
    """)
    assert r["ok"] == "CUDA_SUCCESS"
    assert r["no_access"] != "CUDA_SUCCESS" and r["unmapped"] != "CUDA_SUCCESS"
    sim.assert_clean(r)


def test_export_import_in_one_process_names_the_same_page(sim):
    r = sim.run("""
        d = drv(); init()
        h = create(); base = reserve(2 * GRAN); map_rw(base, h)
        write(base, b"exported")
        fds = [export(h), export(h)]                    # two exports of one page: two fds
        h2 = import_fd(fds[1])
        for fd in fds:
            os.close(fd)
        map_rw(base + GRAN, h2)
        got = read(base + GRAN, 8)
        d.cuMemUnmap(base, GRAN); d.cuMemUnmap(base + GRAN, GRAN); d.cuMemAddressFree(base, 2 * GRAN)
        d.cuMemRelease(h); d.cuMemRelease(h2); fini()
        out(got=got.decode(), two=fds[0] != fds[1])
    """)
    assert r["got"] == "exported" and r["two"]
    sim.assert_clean(r)


def test_an_export_alone_keeps_the_page_until_it_is_closed(sim):
    r = sim.run("""
        d = drv(); init()
        start = used()
        h = create(); fd = export(h); d.cuMemRelease(h)
        kept = used() - start
        h2 = import_fd(fd); os.close(fd)
        imported = used() - start
        d.cuMemRelease(h2)
        gone = used() - start
        h = create(); fd = export(h); d.cuMemRelease(h); os.close(fd)
        closed = used() - start
        fini()
        out(kept=kept, imported=imported, gone=gone, closed=closed)
    """)
    assert r["kept"] >= GRAN and r["imported"] >= GRAN
    assert r["gone"] == 0 and r["closed"] == 0
    sim.assert_clean(r)


def test_unexportable_handles_and_other_fds_are_refused(sim):
    r = sim.run("""
        d = drv(); cu = cu_mod(); init()
        h = create(exportable=False)
        rd, wr = os.pipe()
        fd = ctypes.c_int(-1)
        none_type = code(d.cuMemExportToShareableHandle, byref(fd), h, cu.CU_MEM_HANDLE_TYPE_NONE, 0)
        out(export=code(export, h), none_type=none_type, pipe=code(import_fd, rd))
        os.close(rd); os.close(wr); d.cuMemRelease(h); fini()
    """)
    assert r["export"] != "CUDA_SUCCESS" and r["none_type"] != "CUDA_SUCCESS"
    assert r["pipe"] != "CUDA_SUCCESS"
    sim.assert_clean(r)


def test_an_export_crosses_processes_and_outlives_its_exporter(sim):
    """The exporter sends an fd (SCM_RIGHTS) and exits without cleaning up;
    the receiver imports it and reads the exporter's bytes."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        p = sim.spawn(f"""
            init()
            h = create(); base = reserve(GRAN); map_rw(base, h)
            write(base, b"from a dead exporter"); drv().cuCtxSynchronize()
            send_fds({a.fileno()}, [export(h)])
            os._exit(0)
        """, pass_fds=(a.fileno(),))
        assert p.wait(30) == 0, p.stderr.read()
        _, fds, _, _ = socket.recv_fds(b, 16, 4)
        assert len(fds) == 1
        r = sim.spawn(f"""
            d = drv(); init()
            h = import_fd({fds[0]}); os.close({fds[0]})
            base = reserve(GRAN); map_rw(base, h)
            got = read(base, 20)
            d.cuMemUnmap(base, GRAN); d.cuMemAddressFree(base, GRAN); d.cuMemRelease(h); fini()
            out(got=got.decode())
        """, pass_fds=(fds[0],))
        stdout, stderr = r.communicate(timeout=30)
        os.close(fds[0])
        assert r.returncode == 0, stderr
        assert '"got": "from a dead exporter"' in stdout, stdout
    finally:
        a.close()
        b.close()


def test_primary_context_is_counted(sim):
    r = sim.run("""
        d = drv(); cu = cu_mod(); d.cuInit(0)
        c1, c2 = cu.CUcontext(), cu.CUcontext()
        d.cuDevicePrimaryCtxRetain(byref(c1), 0); d.cuDevicePrimaryCtxRetain(byref(c2), 0)
        d.cuCtxSetCurrent(c1)
        d.cuDevicePrimaryCtxRelease_v2(0)
        still = code(d.cuCtxSynchronize)                 # one reference left
        cur = cu.CUcontext(); d.cuCtxGetCurrent(byref(cur))
        d.cuDevicePrimaryCtxRelease_v2(0); d.cuCtxSetCurrent(None)
        out(same=c1.value == c2.value, still=still, current=cur.value == c1.value)
    """)
    assert r["same"] and r["current"]
    assert r["still"] == "CUDA_SUCCESS"
    sim.assert_clean(r)


def test_error_names_and_strings(sim):
    r = sim.run("""
        d = drv()
        out(name=d.error_name(2), string=d.error_string(201), success=d.error_name(0))
    """)
    assert r["name"] == "CUDA_ERROR_OUT_OF_MEMORY"
    assert r["success"] == "CUDA_SUCCESS"
    assert "context" in r["string"].lower()


def test_cuda_visible_devices_selects_by_uuid_and_hides_all_when_empty(sim):
    body = """
        d = drv(); cu = cu_mod()
        init_code = code(d.cuInit, 0)
        uuids = []
        if init_code == "CUDA_SUCCESS":
            n = ctypes.c_int(); d.cuDeviceGetCount(byref(n))
            for i in range(n.value):
                u = cu.CUuuid(); d.cuDeviceGetUuid_v2(byref(u), i); uuids.append(cu.format_uuid(u))
        out(init=init_code, uuids=uuids)
    """
    every = sim.run(body)["uuids"]
    one = sim.run(body, CUDA_VISIBLE_DEVICES=every[-1])
    assert one["uuids"] == [every[-1]]
    none = sim.run(body, CUDA_VISIBLE_DEVICES="")
    assert none["init"] == "CUDA_ERROR_NO_DEVICE"


def test_an_exported_fd_gives_no_page_bytes(sim):
    """Whatever an export is on this driver (a page directory, a device
    node), reading, mapping or writing it gives nobody the page's bytes,
    and it still imports afterwards."""
    r = sim.run("""
        import errno, mmap, stat
        d = drv(); init()
        h = create(); base = reserve(2 * GRAN); map_rw(base, h); write(base, b"SECRETSECRET"); d.cuCtxSynchronize()
        fd = export(h)
        res = {}
        def attempt(name, fn):
            try:
                v = fn()
                res[name] = "ok:" + (bytes(v[:8]).hex() if isinstance(v, (bytes, bytearray)) else str(v))
            except (OSError, ValueError) as exc:
                res[name] = "error"
        attempt("pread", lambda: os.pread(fd, 8, 0))
        attempt("mmap", lambda: mmap.mmap(fd, GRAN, mmap.MAP_SHARED, mmap.PROT_READ)[:8])
        h2 = import_fd(fd); os.close(fd)
        map_rw(base + GRAN, h2)
        res["import_after"] = read(base + GRAN, 12).decode()
        d.cuMemUnmap(base, GRAN); d.cuMemUnmap(base + GRAN, GRAN); d.cuMemAddressFree(base, 2 * GRAN)
        d.cuMemRelease(h); d.cuMemRelease(h2); fini()
        out(**res)
    """)
    secret = b"SECRETSE".hex()
    assert r["pread"] in ("error", "ok:") and r["mmap"] == "error", r.out  # ok: an empty read, never the bytes
    assert secret not in str(r.out)
    assert r["import_after"] == "SECRETSECRET"
    sim.assert_clean(r)


def test_importing_one_fd_twice_gives_two_handles_each_released_once(sim):
    r = sim.run("""
        d = drv(); init()
        start = used()
        h = create(); fd = export(h)
        a, b = import_fd(fd), import_fd(fd)
        os.close(fd)
        rel = [code(d.cuMemRelease, x) for x in (a, b, h)]
        out(rel=rel, end=used() - start)
        fini()
    """)
    assert r["rel"] == ["CUDA_SUCCESS"] * 3
    assert r["end"] == 0
    sim.assert_clean(r)


def test_exports_carry_pages_across_processes_and_alone_keep_them(sim):
    """Two pages exported three times (one page twice) and passed to another
    process: fstat says the same thing on both sides (SCM_RIGHTS passes the
    open file descriptions), the importer reads both pages after the
    exporter let go of its handles, and once the last export and mapping are
    gone both pages are free again.

    Memory is measured as deltas inside one process, with no other process
    making or dropping a context meanwhile: the importer makes its context
    only after the exporter measured, and the exporter's first copy is made
    before it measures (a context is tens of MiB on a real GPU and may grow
    at its first copy: 72 MiB more than the two pages were seen on an H200
    when the importer's context was made meanwhile)."""
    a_sock, b_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    exporter = sim.spawn(f"""
        d = drv(); init()
        # a first copy may grow the context (staging memory): done before measuring
        w = create(); wb = reserve(GRAN); map_rw(wb, w); write(wb, b"warm"); read(wb, 4); d.cuCtxSynchronize()
        d.cuMemUnmap(wb, GRAN); d.cuMemAddressFree(wb, GRAN); d.cuMemRelease(w)
        start = used()
        hs = [create(), create()]
        base = reserve(2 * GRAN)
        for i, h in enumerate(hs):
            map_rw(base + i * GRAN, h); write(base + i * GRAN, b"page %d" % i)
        d.cuCtxSynchronize()
        fds = [export(hs[0]), export(hs[1]), export(hs[0])]
        ids = [[os.fstat(fd).st_dev, os.fstat(fd).st_ino] for fd in fds]
        for i in range(2):
            d.cuMemUnmap(base + i * GRAN, GRAN)
        d.cuMemAddressFree(base, 2 * GRAN)
        for h in hs:
            d.cuMemRelease(h)
        out(ids=ids, held=used() - start)
        send_fds({a_sock.fileno()}, fds)
        wait_line()
        for fd in fds:
            os.close(fd)
        fini()
        out(done=True)
    """, pass_fds=(a_sock.fileno(),))
    importer = sim.spawn(f"""
        msg, fds = recv_fds({b_sock.fileno()})
        d = drv(); init()
        out(ids=[[os.fstat(fd).st_dev, os.fstat(fd).st_ino] for fd in fds])
        wait_line()
        base = reserve(3 * GRAN)
        got = []
        for i, fd in enumerate(fds):
            h = import_fd(fd); os.close(fd)
            map_rw(base + i * GRAN, h); d.cuMemRelease(h)
            got.append(read(base + i * GRAN, 6).decode())
        out(got=got)
        wait_line()
        mapped = used()  # the exporter is done: only these mappings keep the pages
        for i in range(3):
            d.cuMemUnmap(base + i * GRAN, GRAN)
        d.cuMemAddressFree(base, 3 * GRAN)
        out(freed=mapped - used())
        fini()
    """, pass_fds=(b_sock.fileno(),))

    def line(p):
        text = p.stdout.readline()
        assert text.startswith("{"), text + p.stderr.read()
        return __import__("json").loads(text)

    def go(p):
        p.stdin.write("go\n")
        p.stdin.flush()

    try:
        ex, im = line(exporter), line(importer)
        assert ex["held"] == 2 * GRAN  # the exports alone keep both pages
        assert ex["ids"][0] == ex["ids"][2] and im["ids"] == ex["ids"]
        go(importer)
        assert line(importer)["got"] == ["page 0", "page 1", "page 0"]
        go(exporter)
        assert line(exporter) == {"done": True}
        go(importer)
        assert line(importer)["freed"] == 2 * GRAN  # both pages freed by the last unmap
        for p in (exporter, importer):
            p.stdin.close()
            assert p.wait(10) == 0, p.stderr.read()
    finally:
        for p in (exporter, importer):
            if p.poll() is None:
                p.kill()
        a_sock.close()
        b_sock.close()
    for p in (exporter, importer):
        assert sim.leaks_ok(p.pid), sim.report_of(p.pid)


def test_memset_needs_access(sim):
    r = sim.run("""
        d = drv(); init()
        h = create(); base = reserve(GRAN)
        d.cuMemMap(base, GRAN, 0, h, 0)
        before = code(d.cuMemsetD8_v2, base, 1, 16)
        set_access(base, GRAN)
        after = code(d.cuMemsetD8_v2, base, 1, 16)
        d.cuCtxSynchronize()
        d.cuMemUnmap(base, GRAN); d.cuMemAddressFree(base, GRAN); d.cuMemRelease(h); fini()
        out(before=before, after=after)
    """)
    assert r["before"] != "CUDA_SUCCESS" and r["after"] == "CUDA_SUCCESS"
    sim.assert_clean(r)


# ---------------------------------------------------------------------------
# the daemon on this driver, with client processes (CudaMapper)

CLIENT = r'''
import json, os, sys
from kvcached_service.client import Client
n = int(sys.argv[1]); mode = sys.argv[2]
with Client.from_env(timeout=30) as c, c.open_session("public-api") as s:
    resp, fds = s.allocate_fds(n)
    size = resp.page_size
    m = s.mapper(resp.device)
    base = m.reserve(n * size)
    for i, fd in enumerate(fds):
        m.map(base + i * size, fd, size)
    zeros = [m.read(base + i * size, 4096) == bytes(4096) for i in range(n)]
    for i in range(n):
        m.write(base + i * size, b"page %d" % i)
    back = [m.read(base + i * size, 6) == b"page %d" % i for i in range(n)]
    print(json.dumps({"zeros": zeros, "back": back, "size": size, "ids": list(resp.page_ids)}), flush=True)
    if mode == "hold":
        sys.stdin.readline()      # the test kills us here
    for i in range(n):
        m.unmap(base + i * size, size, None)
    m.release(base, n * size)
    s.free_ids(resp.page_ids)
    print(json.dumps({"freed": True}), flush=True)
'''


def _client(d, n: int, mode: str):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", CLIENT, str(n), mode], env=d.client_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_daemon_pages_map_in_a_client_zeroed_and_come_back(daemon_factory):
    from kvtest import assert_books

    d = daemon_factory("cuda")
    p = _client(d, 4, "free")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    first, last = [__import__("json").loads(x) for x in out.splitlines()[-2:]]
    assert first["zeros"] == [True] * 4 and first["back"] == [True] * 4
    assert first["size"] % GRAN == 0 and last == {"freed": True}
    with d.client() as c:
        st = c.stats()
        assert_books(st)
        assert st.total.pages_in_use == 0


def test_a_killed_clients_pages_return_within_a_second(daemon_factory):
    import json
    import signal
    import time

    from kvtest import assert_books, wait_until

    d = daemon_factory("cuda")
    p = _client(d, 3, "hold")
    try:
        got = json.loads(p.stdout.readline() or "null")
        assert got and got["back"] == [True] * 3, p.stderr.read() if not got else got
        with d.client() as c:
            assert c.stats().total.pages_in_use == 3
            p.send_signal(signal.SIGKILL)
            p.wait(10)
            t0 = time.monotonic()
            assert wait_until(lambda: c.stats().total.pages_in_use == 0, timeout=5)
            assert time.monotonic() - t0 < 1.5
            assert_books(c.stats())
    finally:
        if p.poll() is None:
            p.kill()


def test_pages_freed_by_one_client_read_as_zeros_in_the_next(daemon_factory):
    d = daemon_factory("cuda", pool_idle_seconds=30)
    for _ in range(2):  # the second client gets the first one's freed pages back, zeroed
        p = _client(d, 2, "free")
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert __import__("json").loads(out.splitlines()[0])["zeros"] == [True, True]


def _used(d) -> int:
    """Device memory in use as a fresh process on the daemon's device sees it."""
    import json
    import subprocess
    import sys

    from tdkit import HERE, ROOT

    env = dict(d.client_env(), PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]))
    p = subprocess.run([sys.executable, "-c", "from tdkit import *\ninit(); out(used=used()); fini()"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.splitlines()[-1])["used"]


def test_the_daemons_pages_are_device_memory_seen_by_every_process(daemon_factory):
    """Pages the daemon lends are in cuMemGetInfo as another process sees
    it (its pool created them; nothing else on the device changed)."""
    import json

    d = daemon_factory("cuda", pool_idle_seconds=30)
    before = _used(d)
    p = _client(d, 4, "hold")
    try:
        got = json.loads(p.stdout.readline() or "null")
        assert got, p.stderr.read()
        during = _used(d)
    finally:
        p.stdin.close()
        p.wait(30)
    assert during - before >= 4 * got["size"], (before, during)


def test_mapping_rules(sim):
    """A mapping starts at offset 0 of its handle, covers whole
    granularity units, does not overlap another, and is unmapped whole;
    unmapping it again is a no-op."""
    r = sim.run("""
        d = drv(); init()
        h = create(2 * GRAN); base = reserve(4 * GRAN)
        res = dict(offset=code(d.cuMemMap, base, GRAN, GRAN, h, 0),
                   ok=code(d.cuMemMap, base, 2 * GRAN, 0, h, 0))
        res["overlap"] = code(d.cuMemMap, base + GRAN, GRAN, 0, h, 0)
        res["part"] = code(d.cuMemUnmap, base, GRAN)
        res["whole"] = code(d.cuMemUnmap, base, 2 * GRAN)
        res["again"] = code(d.cuMemUnmap, base, 2 * GRAN)
        d.cuMemAddressFree(base, 4 * GRAN); d.cuMemRelease(h); fini()
        out(**res)
    """)
    # the codes NVIDIA's driver gave on an H200 (driver 580.159.04,
    # docs/gpu-results); the test driver gives the same. Unmapping a
    # reserved range with nothing mapped in it is a no-op there.
    assert r.out == {"offset": "CUDA_ERROR_NOT_SUPPORTED", "ok": "CUDA_SUCCESS", "overlap": "CUDA_ERROR_NOT_SUPPORTED",
                     "part": "CUDA_ERROR_INVALID_VALUE", "whole": "CUDA_SUCCESS", "again": "CUDA_SUCCESS"}
    sim.assert_clean(r)


def test_set_access_needs_a_mapping_and_address_free_is_once(sim):
    r = sim.run("""
        d = drv(); init()
        base = reserve(2 * GRAN)
        unmapped = code(set_access, base, GRAN)
        first = code(d.cuMemAddressFree, base, 2 * GRAN)
        second = code(d.cuMemAddressFree, base, 2 * GRAN)
        fini()
        out(unmapped=unmapped, first=first, second=second)
    """)
    assert r["unmapped"] != "CUDA_SUCCESS"
    assert r["first"] == "CUDA_SUCCESS" and r["second"] != "CUDA_SUCCESS"
    sim.assert_clean(r)


def test_bad_devices_are_refused(sim):
    r = sim.run("""
        d = drv(); cu = cu_mod(); init()
        n = ctypes.c_int(); d.cuDeviceGetCount(byref(n))
        v = ctypes.c_int()
        out(attr=code(d.cuDeviceGetAttribute, byref(v), cu.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, n.value),
            create=code(create, GRAN, n.value),
            ctx=code(d.cuDevicePrimaryCtxRetain, byref(cu.CUcontext()), n.value))
        fini()
    """)
    assert r["attr"] != "CUDA_SUCCESS" and r["create"] != "CUDA_SUCCESS" and r["ctx"] != "CUDA_SUCCESS", r.out
    sim.assert_clean(r)


def test_the_daemon_reports_the_drivers_device(daemon_factory, sim):
    """The device the daemon serves is the driver's: its UUID and total
    memory, page size a granularity multiple."""
    r = sim.run("""
        d = drv(); cu = cu_mod(); d.cuInit(0)
        u = cu.CUuuid(); d.cuDeviceGetUuid_v2(byref(u), 0)
        t = ctypes.c_size_t(); d.cuDeviceTotalMem_v2(byref(t), 0)
        out(uuid=cu.format_uuid(u), total=t.value)
    """)
    d = daemon_factory("cuda")
    with d.client() as c:
        dev = c.device()
    assert dev.kind == "cuda"
    assert dev.uuid.startswith("GPU-")
    if not sim.private:  # one machine: the same device (the test driver gives each test its own machine)
        assert dev.uuid == r["uuid"]


def test_the_daemon_refuses_more_than_its_budget(daemon_factory):
    import pytest

    from kvcached_service import errors
    from kvtest import assert_books

    d = daemon_factory("cuda", memory_limit="8MiB")
    with d.client() as c, c.open_session("greedy") as s:
        with pytest.raises(errors.ResourceExhausted):
            s.allocate(5)  # 5 x 2 MiB in an 8 MiB budget
        pages = s.allocate(4)
        assert len(pages) == 4
        assert_books(c.stats())
        s.free(pages)
