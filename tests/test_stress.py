"""32 client processes allocating, verifying and freeing for 10 s: no error,
no leak, no deadlock, and every page read as zeros when it arrived."""

from __future__ import annotations

import json

from kvtest import assert_books, wait_until


def test_32_processes_for_10_seconds(daemon_factory, backend):
    d = daemon_factory(backend, memory_limit="512MiB")  # 256 pages: 32 clients x up to 6 pages fit
    procs = [d.spawn_client("client_proc.py", "loop", "10", str(1 + i % 6)) for i in range(32)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.splitlines()[-1]))
    assert all(r["errors"] == 0 for r in results), results
    total_rounds = sum(r["rounds"] for r in results)
    assert all(r["rounds"] > 0 for r in results)
    with d.client() as c:
        assert wait_until(lambda: c.stats().sessions_open == 0)
        st = c.stats()
        assert st.total.pages_in_use == 0
        assert_books(st)
    print(f"{backend}: {total_rounds} allocate/verify/free rounds by 32 processes in 10 s")
