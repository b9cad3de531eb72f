"""Pages cross processes as on a GPU: an fd exported in one process (sent
with SCM_RIGHTS) is imported in another, bytes written in one are read in
the other, and a page stays in use device-wide while any process holds it."""

from __future__ import annotations

import json
import socket

from tdkit import GRAN


def _line(proc) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"child ended early (rc={proc.poll()}):\n{proc.stderr.read()}")
    return json.loads(line)


def test_export_import_data_and_lifetime_across_processes(sim):
    a_sock, b_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    exporter = sim.spawn(f"""
        d = drv(); init()
        sock = {a_sock.fileno()}
        h = create()
        base = reserve(GRAN); map_rw(base, h)
        write(base, b"written by the exporter"); d.cuCtxSynchronize()   # landed before the fd goes
        fd = export(h)
        send_fds(sock, [fd])
        os.close(fd)
        d.cuMemRelease(h)                      # only the mapping holds it here now
        out(sent=True)
        wait_line()                            # importer wrote
        got = read(base, 24)
        d.cuMemUnmap(base, GRAN); d.cuMemAddressFree(base, GRAN)
        out(got=got.decode(), used_after_unmap=used())
        wait_line()
        fini()
    """, pass_fds=(a_sock.fileno(),))
    importer = sim.spawn(f"""
        d = drv(); init()
        sock = {b_sock.fileno()}
        _, fds = recv_fds(sock)
        h = import_fd(fds[0]); os.close(fds[0])
        base = reserve(4 * GRAN)
        map_rw(base + GRAN, h)                 # anywhere in our own reservation
        d.cuMemRelease(h)
        seen = read(base + GRAN, 23)
        write(base + GRAN, b"WRITTEN BY THE IMPORTER!"); d.cuCtxSynchronize()
        out(seen=seen.decode())
        wait_line()                            # exporter let go
        out(used_while_only_we_hold_it=used())
        d.cuMemUnmap(base + GRAN, GRAN)
        out(used_after_we_unmap=used())
        d.cuMemAddressFree(base, 4 * GRAN); fini()
    """, pass_fds=(b_sock.fileno(),))
    try:
        assert _line(exporter) == {"sent": True}
        assert _line(importer) == {"seen": "written by the exporter"}
        exporter.stdin.write("go\n")
        exporter.stdin.flush()
        got = _line(exporter)
        assert got["got"] == "WRITTEN BY THE IMPORTER!"
        if sim.private:
            assert got["used_after_unmap"] == GRAN  # the importer still maps it
        exporter.stdin.write("go\n")
        exporter.stdin.close()
        assert exporter.wait(10) == 0, exporter.stderr.read()
        importer.stdin.write("go\n")
        importer.stdin.flush()
        held = _line(importer)["used_while_only_we_hold_it"]
        after = _line(importer)["used_after_we_unmap"]
        if sim.private:
            assert (held, after) == (GRAN, 0)
        else:  # other processes and contexts use memory too: the page's share
            assert held - after >= GRAN, (held, after)
        importer.stdin.close()
        assert importer.wait(10) == 0, importer.stderr.read()
    finally:
        for p in (exporter, importer):
            if p.poll() is None:
                p.kill()
        a_sock.close()
        b_sock.close()
    for p in (exporter, importer):
        assert sim.leaks_ok(p.pid), sim.report_of(p.pid)


def test_killed_holder_gives_the_page_back(sim):
    """A process that dies holding a page (SIGKILL: no cleanup code runs)
    releases it: the kernel drops its references."""
    base = sim.run("init(); out(used=used())")["used"]  # 0 on the test driver; contexts elsewhere
    holder = sim.spawn("""
        init()
        h = create(); base = reserve(GRAN); map_rw(base, h)
        h2 = create(); fd = export(h2)
        out(used=used())
        wait_line()
    """)
    try:
        held = _line(holder)["used"]
        assert held - base >= 2 * GRAN and (held == 2 * GRAN or not sim.private), (base, held)
        holder.kill()
        holder.wait(10)
    finally:
        if holder.poll() is None:
            holder.kill()
    r = sim.run("init(); out(used=used())")
    assert r["used"] == base
