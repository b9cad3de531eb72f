"""The client processes of scripts/gpu-check.sh (one mode per process).

  wait SOCKET PID           wait until the daemon serves (health SERVING) or exits
  devfree                   print the daemon's device's free memory (cuMemGetInfo_v2)
  reader HANDOFF            listen on HANDOFF; import the writer's pages, read
                            them; after the writer freed them, allocate again
                            (must read zeros); then a Region grow/trim check
  writer HANDOFF            allocate pages, write a pattern through CudaMapper,
                            pass the fds to the reader (SCM_RIGHTS), free
  books                     the daemon's books: nothing in use, everything adds up

Every mode prints lines "ok <what>" / "FAIL <what>: <why>" and one final
JSON line; the exit status is 0 only if nothing failed. The socket comes
from KVCACHED_SOCKET, the driver from KVCACHED_LIBCUDA (default libcuda.so.1).
"""

from __future__ import annotations

import array
import ctypes
import json
import os
import socket
import sys
import time

PAGES = 4
MiB = 1 << 20
failures: list[str] = []


def ok(what: str) -> None:
    print(f"ok   {what}", flush=True)


def check(cond: bool, what: str, why: str = "") -> bool:
    if cond:
        ok(what)
    else:
        failures.append(what)
        print(f"FAIL {what}" + (f": {why}" if why else ""), flush=True)
    return cond


def pattern(i: int, size: int) -> bytes:
    unit = bytes([(i * 37 + 11) % 251, 0xA5, i & 0xFF, 0x5A]) * 1024  # 4 KiB
    return unit * (size // len(unit))


def client():
    from kvcached_service.client import Client

    c = Client.from_env(timeout=30)
    dev = c.device()
    if dev.kind != "cuda":
        print(f"FAIL the daemon serves {dev.kind!r} pages, not cuda", flush=True)
        sys.exit(1)
    return c


def mode_wait(sock: str, pid: str) -> None:
    from kvcached_service.client.health import wait_serving

    def alive() -> bool:
        try:
            os.kill(int(pid), 0)
            return True
        except ProcessLookupError:
            return False

    if wait_serving(sock, 60, alive=alive, interval=0.1):
        return
    if not alive():
        sys.exit("the daemon exited")
    sys.exit("daemon not serving within 60 s")


def mode_devfree() -> None:
    from kvcached_service.client.cuda_mapper import CudaMapper

    with client() as c:
        m = CudaMapper(c.device().uuid)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        with m._current():
            m._drv.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        m.close()
    print(json.dumps({"free": free.value, "total": total.value}))


def mode_writer(path: str) -> None:
    with client() as c, c.open_session("gpu-check-writer") as s:
        resp, fds = s.allocate_fds(PAGES)
        size = resp.page_size
        check(len(fds) == PAGES, f"writer: Allocate({PAGES}) gave {PAGES} page fds of {size >> 20} MiB")
        m = s.mapper(resp.device)
        dups = [os.dup(fd) for fd in fds]
        base = m.reserve(PAGES * size)
        for i, fd in enumerate(fds):
            m.map(base + i * size, fd, size)  # import, map, set access, release the handle
            m.write(base + i * size, pattern(i, size))
        back = [m.read(base + i * size, size) == pattern(i, size) for i in range(PAGES)]
        check(all(back), "writer: pattern written with cuMemcpyHtoD reads back with cuMemcpyDtoH", str(back))
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        msg = json.dumps({"device": resp.device, "size": size, "ids": list(resp.page_ids)}).encode()
        conn.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", dups))])
        for fd in dups:
            os.close(fd)
        check(conn.recv(16) == b"read", "writer: the reader took the pages")
        for i in range(PAGES):
            m.unmap(base + i * size, size, None)
        m.release(base, PAGES * size)
        s.free_ids(resp.page_ids)
        ok(f"writer: unmapped and freed pages {list(resp.page_ids)}")
        conn.sendall(b"freed")
        conn.close()
    print(json.dumps({"role": "writer", "ids": list(resp.page_ids), "failures": failures}))


def mode_reader(path: str) -> None:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    with client() as c, c.open_session("gpu-check-reader") as s:
        print("listening", flush=True)
        srv.settimeout(120)
        conn, _ = srv.accept()
        conn.settimeout(120)
        msg, anc, _, _ = conn.recvmsg(4096, socket.CMSG_SPACE(4 * PAGES))
        info = json.loads(msg)
        fds = array.array("i")
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % 4])
        size = info["size"]
        m = s.mapper(info["device"])
        ok(f"reader: found device {info['device']} as this process's ordinal {m.ordinal}")
        base = m.reserve(PAGES * size)
        for i, fd in enumerate(fds):
            m.map(base + i * size, fd, size)
        got = [m.read(base + i * size, size) == pattern(i, size) for i in range(PAGES)]
        check(len(fds) == PAGES and all(got), "reader: another process's pages, imported from their fds, hold its bytes", str(got))
        for i in range(PAGES):
            m.unmap(base + i * size, size, None)
        m.release(base, PAGES * size)
        conn.sendall(b"read")
        check(conn.recv(16) == b"freed", "reader: the writer freed its pages")
        pages = s.allocate(PAGES)
        ids = {p.id for p in pages}
        check(bool(ids & set(info["ids"])), "reader: the freed pages came back to this uid", f"{sorted(ids)} vs {info['ids']}")
        zeros = [p.read() == bytes(p.size) for p in pages]
        check(all(zeros), "reader: pages freed by another session read as zeros (the daemon zeroed them)", str(zeros))
        s.free(pages)

        # a Region: reserve, grow a prefix, trim, grow again
        with s.region(16 * size) as r:
            r.grow_to(3 * size)
            r.write(0, b"head")
            r.write(3 * size - 4, b"tail")
            r.grow_to(8 * size)
            check(r.mapped_pages == 8 and r.read(0, 4) == b"head" and r.read(3 * size - 4, 4) == b"tail",
                  "region: grown from 3 to 8 pages, earlier data kept")
            check(r.read(5 * size, size) == bytes(size), "region: newly mapped pages read as zeros")
            r.trim_to(2 * size)
            check(r.mapped_pages == 2 and s.my_stats().pages_held == 2 and r.read(0, 4) == b"head",
                  "region: trimmed to 2 pages, 6 given back, data kept")
            r.grow_to(4 * size)
            check(r.read(3 * size - 4, 4) == bytes(4), "region: a range given back and mapped again reads as zeros")
        check(s.my_stats().pages_held == 0, "region: closing it gave every page back")
    print(json.dumps({"role": "reader", "failures": failures}))


def mode_books() -> None:
    with client() as c:
        deadline = time.monotonic() + 10
        while True:
            st = c.stats()
            t = st.total
            if (t.pages_in_use == 0 and t.pages_pooled == 0 and st.sessions_open == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        check(t.pooled_bytes + t.in_use_bytes + t.free_bytes == t.budget_bytes,
              "daemon books: pooled + in use + free = budget", str(t))
        check(t.pages_in_use == 0 and st.sessions_open == 0, "daemon books: no page in use, no session open", str(t))
        check(t.pages_pooled == 0 and t.pages_created_total == t.pages_released_total,
              f"daemon books: all {t.pages_created_total} pages created were released to the driver (idle pool trimmed)", str(t))
    print(json.dumps({"role": "books", "created": t.pages_created_total, "failures": failures}))


def main() -> int:
    mode, args = sys.argv[1], sys.argv[2:]
    try:
        {"wait": mode_wait, "devfree": mode_devfree, "writer": mode_writer, "reader": mode_reader, "books": mode_books}[mode](*args)
    except SystemExit:
        raise
    except BaseException as exc:  # a crash is a failure with its reason
        print(f"FAIL {mode}: {type(exc).__name__}: {exc}", flush=True)
        return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
