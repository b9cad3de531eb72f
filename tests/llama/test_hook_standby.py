"""Standby pages (KVCACHED_STANDBY_BYTES, KVCACHED_STANDBY_IDLE_MS;
docs/llama-cpp.md "Standby pages"): a slot trimmed by its next, shorter
request keeps what it used mapped as standby, so growing again maps nothing
new (no Allocate); a reclaim takes standby first; once no batch ran for
KVCACHED_STANDBY_IDLE_MS (default 1 s) the hook's thread gives standby back;
greedy outputs are the same with standby on and off.

The measurement docs/llama-cpp.md quotes is test_standby_measure (printed
with -s): the same slot alternately grows (a long prompt) and is trimmed (a
short one), per long request the daemon's Allocates (SessionStats
allocations_total) and the wall time, standby off and at 256 MiB (the default).
"""

from __future__ import annotations

import statistics
import time

from kvtest import assert_books, wait_until
from llamatest import KVC, MiB, held, kv_line_values, observe, session_of, text

PAGE = 64 << 10  # as test_llama_server.py
LONG = text(2000, 71)  # ~1600 tokens: ~100 pages of 64 KiB over the tiny model's 8 K/V tensors
SHORT = "Zzz short"
ON = str(256 << 20)  # the default
IDLE_S = 1.0  # KVCACHED_STANDBY_IDLE_MS's default, in seconds


def grow_and_trim(srv, c, rounds: int) -> list[dict]:
    """`rounds` times: the long prompt (the slot grows from the short one's
    cells), then the short prompt (the slot is trimmed). Per long request:
    the Allocates it made, its wall time, what is held and standby after the
    short one, and the tokens."""
    rows = []
    for _ in range(rounds):
        s0 = session_of(c, srv.pid)
        t = time.monotonic()
        r = srv.complete(LONG, 4, id_slot=0)
        dt = time.monotonic() - t
        s1 = session_of(c, srv.pid)
        short = srv.complete(SHORT, 4, id_slot=0)
        s2 = session_of(c, srv.pid)
        rows.append({"allocs": s1.allocations_total - s0.allocations_total, "wall_s": dt, "tokens": r["tokens"],
                     "short_tokens": short["tokens"], "held_after_trim": s2.held_bytes,
                     "standby_after_trim": s2.standby_bytes, "evaluated": r["tokens_evaluated"]})
    return rows


def serve(servers, d, model, standby: str | None, idle_ms: str | None = None):
    env = {} if standby is None else {"KVCACHED_STANDBY_BYTES": standby}
    if idle_ms is not None:
        env["KVCACHED_STANDBY_IDLE_MS"] = idle_ms
    return servers(KVC, model, kvc_socket=d.socket, ctx=8192, parallel=1, env=env)


def test_second_identical_request_makes_no_allocate_and_reclaim_takes_standby_first(daemon_factory, servers, models):
    d = daemon_factory("host", memory_limit="256MiB", page_size=str(PAGE))
    with observe(d) as c:
        off_srv = serve(servers, d, models[0], "0")
        off = grow_and_trim(off_srv, c, 2)
        off_srv.stop()
        assert wait_until(lambda: session_of(c, off_srv.pid) is None, timeout=5)
        # standby off: every grow allocates, a trim gives everything back
        assert all(r["allocs"] >= 1 for r in off), off
        assert all(r["standby_after_trim"] == 0 for r in off), off

        # KVCACHED_STANDBY_IDLE_MS=0: this test waits seconds for log lines and then reclaims the
        # standby bytes exactly, so the idle release (test_standby_goes_back_when_idle) must not take
        # them first; 0 also checks that it never releases on idle
        srv = serve(servers, d, models[0], ON, idle_ms="0")
        on = grow_and_trim(srv, c, 2)
        assert on[0]["allocs"] >= 1, on
        assert on[0]["standby_after_trim"] > 0, on  # the long request's pages stay as standby
        assert on[1]["allocs"] == 0, on  # the second identical request maps nothing new
        # the daemon's held includes standby (and the KV line says held)
        assert on[1]["held_after_trim"] >= on[1]["standby_after_trim"] > 0
        # greedy outputs are identical with standby on and off
        assert [r["tokens"] for r in on] == [r["tokens"] for r in off]
        assert [r["short_tokens"] for r in on] == [r["short_tokens"] for r in off]
        # the KV line says held, standby included (the daemon's figure)
        assert wait_until(lambda: kv_line_values(srv.log_text())[-1] == round(held(c, srv.pid) / MiB, 2), timeout=5), \
            (kv_line_values(srv.log_text())[-3:], held(c, srv.pid))
        # the standby line (at most one per second per buffer name, like the KV line)
        assert wait_until(lambda: "MiB standby (kept mapped for the next request" in srv.log_text(), timeout=3), \
            srv.log_text()[-3000:]

        # a reclaim of exactly the standby bytes: standby goes first, the
        # slot's cells (in use by its cached prompt) stay
        s = session_of(c, srv.pid)
        standby, held0 = s.standby_bytes, s.held_bytes
        assert standby == on[1]["standby_after_trim"] > 0, s  # seconds later: not released on idle
        assert "standby KV pages given back" not in srv.log_text()
        c.request_shrink(s.id, held0 - standby, timeout_ms=5000)
        assert wait_until(lambda: session_of(c, srv.pid).standby_bytes == 0, timeout=5), session_of(c, srv.pid)
        assert held(c, srv.pid) == held0 - standby
        log = srv.log_text()
        assert "of standby KV pages given back first" in log, log[-3000:]
        assert "clearing idle slot for a reclaim request" not in log
        # it still serves the same tokens; the long one allocates again
        s0 = session_of(c, srv.pid)
        assert srv.complete(LONG, 4, id_slot=0)["tokens"] == on[0]["tokens"]
        assert session_of(c, srv.pid).allocations_total > s0.allocations_total
        # a reclaim of everything: standby and then the idle slot
        srv.complete(SHORT, 4, id_slot=0)
        assert session_of(c, srv.pid).standby_bytes > 0
        c.request_shrink(session_of(c, srv.pid).id, 0, timeout_ms=5000)
        assert wait_until(lambda: held(c, srv.pid) == 0, timeout=5), session_of(c, srv.pid)
        assert_books(c.stats())


def test_standby_goes_back_when_idle(daemon_factory, servers, models):
    """The defaults (256 MiB, 1 s idle): a request that comes before the idle
    time grows into the standby pages (no Allocate); once no batch ran for the
    idle time the hook's thread gives every standby page back (held drops to
    what the cells use, the log says so); the next grow allocates again."""
    d = daemon_factory("host", memory_limit="256MiB", page_size=str(PAGE))
    with observe(d) as c:
        srv = serve(servers, d, models[0], None)
        # warm-up leaves standby: the idle release gives it back
        assert wait_until(lambda: held(c, srv.pid) == 0, timeout=IDLE_S + 3), session_of(c, srv.pid)
        first = grow_and_trim(srv, c, 1)[0]
        assert first["allocs"] >= 1, first
        t_trim = time.monotonic()  # the short request (its batch) ended before this
        s = session_of(c, srv.pid)
        if time.monotonic() - t_trim < IDLE_S * 0.8:  # (a loaded machine may be slower: then only the rest)
            assert s.standby_bytes > 0, s  # before the idle time: kept
        # a request before the idle time: the slot grows into its standby pages, no Allocate
        again = grow_and_trim(srv, c, 1)[0]
        assert again["allocs"] == 0, again
        assert again["tokens"] == first["tokens"]
        assert again["standby_after_trim"] > 0, again
        # no batch for the idle time: standby goes back, held is what the cells use
        s = session_of(c, srv.pid)
        in_use = s.held_bytes - s.standby_bytes
        assert in_use > 0, s  # the short prompt's cells stay cached in the slot
        t0 = time.monotonic()
        assert wait_until(lambda: session_of(c, srv.pid).standby_bytes == 0, timeout=IDLE_S + 3), session_of(c, srv.pid)
        assert time.monotonic() - t0 <= IDLE_S + 3
        assert held(c, srv.pid) == in_use
        assert wait_until(lambda: "of standby KV pages given back (KVCACHED_STANDBY_IDLE_MS=1000)" in srv.log_text(),
                          timeout=3), srv.log_text()[-3000:]
        # the KV line follows (what Ollama reads): held without the standby
        assert wait_until(lambda: kv_line_values(srv.log_text())[-1] == round(in_use / MiB, 2), timeout=5), \
            (kv_line_values(srv.log_text())[-3:], in_use)
        # and the next grow allocates again, the same tokens
        s0 = session_of(c, srv.pid)
        assert srv.complete(LONG, 4, id_slot=0)["tokens"] == first["tokens"]
        assert session_of(c, srv.pid).allocations_total > s0.allocations_total
        assert_books(c.stats())


def test_standby_measure(daemon_factory, servers, models):
    """The numbers of docs/llama-cpp.md: 8 rounds of grow-and-trim on one
    slot, standby off and at 256 MiB (the default, with the default idle
    release: the rounds follow each other well within it); the first round
    warms up."""
    d = daemon_factory("host", memory_limit="256MiB", page_size=str(PAGE))
    rounds = 8
    out = {}
    with observe(d) as c:
        for name, standby in (("KVCACHED_STANDBY_BYTES=0", "0"), (f"KVCACHED_STANDBY_BYTES={ON}", ON)):
            srv = serve(servers, d, models[0], standby)
            rows = grow_and_trim(srv, c, rounds)
            srv.stop()
            assert wait_until(lambda: session_of(c, srv.pid) is None, timeout=5)
            out[name] = rows
    print()
    for name, rows in out.items():
        warm = rows[1:]
        print(f"{name:26s} tokens evaluated {warm[0]['evaluated']}: Allocates per grow "
              f"{statistics.mean(r['allocs'] for r in warm):.2f} (first {rows[0]['allocs']}), wall per grow "
              f"median {statistics.median(r['wall_s'] for r in warm) * 1e3:.1f} ms, "
              f"mean {statistics.mean(r['wall_s'] for r in warm) * 1e3:.1f} ms; "
              f"held after trim {warm[-1]['held_after_trim'] / 2**20:.2f} MiB "
              f"(standby {warm[-1]['standby_after_trim'] / 2**20:.2f} MiB)")
    assert [r["tokens"] for r in out[f"KVCACHED_STANDBY_BYTES={ON}"]] == [r["tokens"] for r in out["KVCACHED_STANDBY_BYTES=0"]]
    assert all(r["allocs"] == 0 for r in out[f"KVCACHED_STANDBY_BYTES={ON}"][1:]), out[f"KVCACHED_STANDBY_BYTES={ON}"]
