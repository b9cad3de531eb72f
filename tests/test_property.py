"""A stateful property test (hypothesis RuleBasedStateMachine) over the whole
daemon: open sessions, allocate, free, map and unmap region ranges, kill a
client process, SIGKILL and restart the daemon (sessions resume). After
every step the books add up and the invariants hold:

  * pooled + in_use + free == budget (invariant 7)
  * what the daemon says each session holds is what the model says
  * no page is held by two live sessions (invariant 1)
  * every page a session holds still carries the stamp written into it
    (data survives frees of other pages, region changes and daemon restarts)
  * a newly received page reads as zeros (invariant 2)
  * a killed client's pages are back within 1 s (invariant 4)
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from kvtest import assert_books, wait_until
from kvcached_service import errors

MiB = 1 << 20
BUDGET_PAGES = 32
REGION_PAGES = 16


def stamp(sid: int, pid: int) -> bytes:
    return f"s{sid}p{pid}".encode().ljust(24, b"#")


class Tenant:
    def __init__(self, client, n):
        self.s = client.open_session(f"prop-{n}")
        self.pages = {}  # page id -> Page (loose pages)
        self.r = self.s.region(REGION_PAGES * 2 * MiB)

    def held_ids(self) -> set[int]:
        return set(self.pages) | set(self.r.page_ids())


def test_daemon_state_machine(daemon_factory, tmp_path):
    state_dir = str(tmp_path / "state")
    box = {"d": daemon_factory("host", state_dir=state_dir, memory_limit=f"{BUDGET_PAGES * 2}MiB", resume_grace="5")}

    class Machine(RuleBasedStateMachine):
        @initialize()
        def setup(self):
            self.d = box["d"]
            self.c = self.d.client()
            self.tenants: list[Tenant] = []
            self.kills = 0
            self.restarts = 0

        def teardown(self):
            for t in self.tenants:
                try:
                    t.r.close()
                    t.s.close()
                except errors.KVCachedError:
                    pass
            st_ = wait_until(lambda: self.c.stats().total.pages_in_use == 0 and self.c.stats().sessions_open == 0, timeout=5)
            assert st_, self.c.stats().total
            self.c.close()

        def held_total(self) -> int:
            return sum(len(t.held_ids()) for t in self.tenants)

        # ---- rules ---------------------------------------------------------
        @precondition(lambda self: len(self.tenants) < 4)
        @rule()
        def open_session(self):
            self.tenants.append(Tenant(self.c, len(self.tenants)))

        @precondition(lambda self: self.tenants)
        @rule(i=st.integers(0, 3), n=st.integers(1, 12))
        def allocate(self, i, n):
            t = self.tenants[i % len(self.tenants)]
            fits = self.held_total() + n <= BUDGET_PAGES
            try:
                got = t.s.allocate(n)
            except errors.ResourceExhausted:
                assert not fits, f"refused {n} pages with {BUDGET_PAGES - self.held_total()} free"
                return
            assert fits, "allocated beyond the budget"
            for p in got:
                assert p.read(0, 24) == bytes(24), "a received page is not zero"
                p.write(0, stamp(t.s.id, p.id))
                t.pages[p.id] = p

        @precondition(lambda self: any(t.pages for t in self.tenants))
        @rule(data=st.data())
        def free(self, data):
            t = data.draw(st.sampled_from([t for t in self.tenants if t.pages]))
            ids = data.draw(st.lists(st.sampled_from(sorted(t.pages)), min_size=1, unique=True))
            t.s.free([t.pages.pop(i) for i in ids])

        @precondition(lambda self: self.tenants)
        @rule(i=st.integers(0, 3), ranges=st.lists(st.tuples(st.integers(0, REGION_PAGES - 1), st.integers(1, 4)), min_size=1, max_size=3))
        def map_ranges(self, i, ranges):
            t = self.tenants[i % len(self.tenants)]
            ps = 2 * MiB
            spans = [(a * ps, min(b, REGION_PAGES - a) * ps) for a, b in ranges]
            before = set(t.r.page_ids())
            want = {s // ps + k for s, ln in spans for k in range(ln // ps)} - {j for j in range(REGION_PAGES) if t.r.is_mapped(j * ps)}
            fits = self.held_total() + len(want) <= BUDGET_PAGES
            try:
                t.r.map_ranges(spans)
            except errors.ResourceExhausted:
                assert not fits
                assert set(t.r.page_ids()) == before, "a failed map changed the region"
                return
            assert fits
            for j in sorted(want):
                assert t.r.read(j * ps, 24) == bytes(24)
                t.r.write(j * ps, stamp(t.s.id, j))

        @precondition(lambda self: any(t.r.mapped_pages for t in self.tenants))
        @rule(i=st.integers(0, 3), a=st.integers(0, REGION_PAGES - 1), n=st.integers(1, REGION_PAGES))
        def unmap_range(self, i, a, n):
            t = self.tenants[i % len(self.tenants)]
            n = min(n, REGION_PAGES - a)
            t.r.unmap(a * 2 * MiB, n * 2 * MiB)

        @precondition(lambda self: self.kills < 1 and self.held_total() <= BUDGET_PAGES - 4)
        @rule()
        def kill_a_client(self):
            self.kills += 1
            base = self.c.stats().total.pages_in_use
            p = self.d.spawn_client("client_proc.py", "hold", "4")
            json.loads(p.stdout.readline())
            assert self.c.stats().total.pages_in_use == base + 4
            p.send_signal(signal.SIGKILL)
            p.wait()
            t0 = time.monotonic()
            assert wait_until(lambda: self.c.stats().total.pages_in_use == base, timeout=1.0), "a killed client's pages were not back within 1 s"
            assert time.monotonic() - t0 < 1.0

        @precondition(lambda self: self.restarts < 1 and self.tenants)
        @rule()
        def restart_daemon(self):
            self.restarts += 1
            self.d.proc.send_signal(signal.SIGKILL)
            self.d.proc.wait()
            self.d = box["d"] = daemon_factory("host", socket=self.d.socket, state_dir=state_dir,
                                               memory_limit=f"{BUDGET_PAGES * 2}MiB", resume_grace="5")
            for t in self.tenants:
                assert t.s.wait_resumed(20), f"session {t.s.id} did not resume"

        # ---- invariants ------------------------------------------------------
        @invariant()
        def books_and_ownership(self):
            if not hasattr(self, "tenants"):
                return
            st_ = self.c.stats() if not self.tenants else self.tenants[0].s.stats()
            assert_books(st_)
            assert st_.total.pages_in_use == self.held_total()
            seen: set[int] = set()
            by_id = {s.id: s for s in st_.sessions}
            for t in self.tenants:
                ids = t.held_ids()
                assert not ids & seen, "a page is held by two live sessions"
                seen |= ids
                assert by_id[t.s.id].pages_held == len(ids)

        @invariant()
        def data_intact(self):
            for t in getattr(self, "tenants", []):
                for pid, p in t.pages.items():
                    assert p.read(0, 24) == stamp(t.s.id, pid)
                for j in range(REGION_PAGES):
                    if t.r.is_mapped(j * 2 * MiB):
                        assert t.r.read(j * 2 * MiB, 24) == stamp(t.s.id, j)

    run_state_machine_as_test(
        Machine,
        settings=settings(max_examples=int(os.environ.get("KVCACHED_PROPERTY_EXAMPLES", "12")), stateful_step_count=25, deadline=None,
                          suppress_health_check=list(HealthCheck), derandomize=True),
    )
