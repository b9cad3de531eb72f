"""llama-server with its KV cache in kvcached-serve pages (issue 8): token
identity, pages following the context, SIGKILL, the hook off without the
variable, two servers sharing a budget, held bytes vs context.

Two builds of the same llama.cpp (scripts/test-llama.sh builds them):
LLAMA_SERVER_ORIG (unpatched) and LLAMA_SERVER_KVC (integrations/llama.cpp
applied). Models are tiny random-weight GGUFs written here (tiny_model.py).
A missing binary fails the tests; nothing is skipped. Helpers and fixtures:
llamatest.py, conftest.py.
"""

from __future__ import annotations

import json
import re
import signal
import time

import pytest

import tiny_model
from kvtest import ROOT, assert_books, wait_until
from llamatest import IDLE_RELEASE_WAIT, KVC, ORIG, PAD, PROMPTS, held, observe, session_of, text, tokens_of

PAGE = 64 << 10          # daemon page size in these tests (a multiple of the host granularity)
ROW = tiny_model.N_EMBD * 2   # bytes per cell of one K (or V) tensor, F16
N_TENSORS = 2 * tiny_model.N_LAYER


def need_bytes(cells_per_stream: list[int]) -> int:
    """Daemon bytes the hook maps for these used cells (per stream), with
    flash attention (K and V elastic): per tensor and stream, the cells
    padded to 256, rounded up to whole pages."""
    total = 0
    for used in cells_per_stream:
        cells = -(-used // PAD) * PAD if used else 0
        total += N_TENSORS * (-(-cells * ROW // PAGE) * PAGE)
    return total


@pytest.mark.parametrize("fa", ["on", "off"])
def test_greedy_tokens_identical_to_unpatched(daemon_factory, servers, models, fa):
    """Token for token the same as the unpatched build, one prompt at a time
    and two prompts in parallel slots; with flash attention (K and V
    elastic) and without (V transposed, mapped whole)."""
    d = daemon_factory("host", memory_limit="256MiB", page_size=str(PAGE))
    runs = {}
    for name, binary, sock in [("orig", ORIG, None), ("kvc", KVC, d.socket)]:
        srv = servers(binary, models[0], kvc_socket=sock, fa=fa)
        out = [tokens_of(srv.complete(p, 48)) for p in PROMPTS]
        out.append(tokens_of(srv.complete([PROMPTS[1], PROMPTS[2]], 48)))
        out.append(tokens_of(srv.complete([text(2500, 3), "Short one"], 64)))
        runs[name] = out
        if name == "kvc":
            log = srv.log_text()
            assert "kvcached: CPU KV buffer reserved" in log, log[-3000:]
            with observe(d) as c:
                assert held(c, srv.pid) > 0
        srv.stop()
    for a, b in zip(runs["orig"], runs["kvc"]):
        assert all(len(t) > 0 for t in a)
        assert a == b


def test_pages_grow_with_context_and_shrink(daemon_factory, servers, models):
    d = daemon_factory("host", memory_limit="256MiB", page_size=str(PAGE))
    srv = servers(KVC, models[0], kvc_socket=d.socket, ctx=8192, parallel=2)
    with observe(d) as c:
        assert session_of(c, srv.pid) is not None, "llama-server opened no daemon session"
        # warm-up's pages stay as standby until no batch ran for KVCACHED_STANDBY_IDLE_MS
        assert wait_until(lambda: held(c, srv.pid) == 0, timeout=IDLE_RELEASE_WAIT), \
            ("warm-up pages were not given back", session_of(c, srv.pid))
        # the KV buffer size line reports physical bytes (nothing mapped yet)
        assert re.search(r"CPU KV buffer size =\s+0\.00 MiB", srv.log_text())
        seen = []
        for n_chars in (200, 1000, 2500):
            r = srv.complete(text(n_chars, n_chars), 16, id_slot=0)
            used = r["tokens_evaluated"] + r["tokens_predicted"]
            h = held(c, srv.pid)
            assert need_bytes([used - 1]) <= h <= need_bytes([used + PAD]), (used, h)
            seen.append(h)
        assert seen[0] < seen[1] < seen[2], seen
        # slot 1 runs a second context: both streams are backed
        r1 = srv.complete(text(1000, 5), 16, id_slot=1)
        h2 = held(c, srv.pid)
        assert h2 > seen[2]
        # slot 0 takes a short unrelated prompt: its cells past the new prompt are no longer in use at
        # once (kept as standby for the next grow), and go back once no batch ran for the idle time
        r = srv.complete("Zzz short", 8, id_slot=0)
        s3 = session_of(c, srv.pid)
        used1 = r1["tokens_evaluated"] + r1["tokens_predicted"]
        used0 = r["tokens_evaluated"] + r["tokens_predicted"]
        in_use = s3.held_bytes - s3.standby_bytes
        assert in_use < h2, (h2, s3)
        assert in_use <= need_bytes([used0 + PAD, used1 + PAD]), (in_use, s3)
        assert wait_until(lambda: session_of(c, srv.pid).standby_bytes == 0, timeout=IDLE_RELEASE_WAIT), \
            session_of(c, srv.pid)
        h3 = held(c, srv.pid)
        assert h3 == in_use < h2, (h2, h3, in_use)
        # the daemon asks for pages (admin shrink = a reclaim request): the
        # idle slots are cleared and everything goes back
        sid = session_of(c, srv.pid).id
        c.request_shrink(sid, 0, timeout_ms=5000)
        assert wait_until(lambda: held(c, srv.pid) == 0, timeout=5), held(c, srv.pid)
        assert "clearing idle slot for a reclaim request" in srv.log_text()
        # and it still serves, the same tokens as before the trim
        r_again = srv.complete("Zzz short", 8, id_slot=0)
        assert r_again["tokens"] == r["tokens"]
        assert held(c, srv.pid) > 0
        assert_books(c.stats())


def test_long_prompt_maps_in_one_allocate(daemon_factory, servers, models):
    d = daemon_factory("host", memory_limit="256MiB", page_size=str(PAGE))
    srv = servers(KVC, models[0], kvc_socket=d.socket, ctx=8192, parallel=1)
    with observe(d) as c:
        s0 = session_of(c, srv.pid)
        # ~1900 tokens: one decode call (n_batch 2048), four ubatches of 512
        r = srv.complete(text(1900, 11), 1)
        assert r["tokens_evaluated"] > 1500
        s1 = session_of(c, srv.pid)
        assert s1.allocations_total - s0.allocations_total == 1, (s0.allocations_total, s1.allocations_total)
        assert s1.held_bytes == need_bytes([r["tokens_evaluated"]])


def test_sigkill_returns_every_page_within_1s(daemon_factory, servers, models):
    d = daemon_factory("host", memory_limit="256MiB", page_size=str(PAGE))
    srv = servers(KVC, models[0], kvc_socket=d.socket)
    srv.complete([text(2000, 21), text(1500, 22)], 8)
    with observe(d) as c:
        assert held(c, srv.pid) > 0
        t = time.monotonic()
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait()
        assert wait_until(lambda: session_of(c, srv.pid) is None, timeout=1.0, interval=0.01)
        st = c.stats()
        assert st.total.in_use_bytes == 0, st.total
        assert time.monotonic() - t < 1.5
        assert_books(st)


def kv_lines(log: str) -> list[str]:
    keep = []
    for line in log.splitlines():
        if re.search(r"KV buffer size|llama_kv_cache: size =|compute buffer size|CPU_Mapped model buffer", line):
            keep.append(re.sub(r"^[\d.]+ [A-Z] ", "", line))  # drop the timestamp
    return keep


def test_without_variable_behaves_like_unpatched(servers, models):
    outs = {}
    logs = {}
    for name, binary in [("orig", ORIG), ("kvc", KVC)]:
        srv = servers(binary, models[0], kvc_socket=None)
        outs[name] = [tokens_of(srv.complete(p, 24)) for p in PROMPTS]
        outs[name].append(tokens_of(srv.complete([PROMPTS[1], PROMPTS[2]], 24)))
        logs[name] = srv.log_text()
        srv.stop()
    assert outs["orig"] == outs["kvc"]
    assert "kvcached:" not in logs["kvc"]  # the hook stayed silent: no session, no region
    lo, lk = kv_lines(logs["orig"]), kv_lines(logs["kvc"])
    assert any("KV buffer size" in x for x in lo), logs["orig"][-3000:]
    assert lo == lk  # same KV buffer, same compute buffers: allocates exactly as before


def test_two_servers_share_a_budget_reclaim_moves_pages(daemon_factory, servers, models):
    """Each server's full context is 4096 cells x 4 KiB = 16 MiB; the budget
    (24 MiB) is smaller than both. The idle one gives pages to the busy one."""
    full = need_bytes([4096])
    budget = 24 << 20
    assert budget < 2 * full
    d = daemon_factory("host", memory_limit="24MiB", page_size=str(PAGE))
    ref = {}
    for seed in (1, 2):  # expected tokens from the unpatched build
        srv = servers(ORIG, models[seed], kvc_socket=None, ctx=4096, parallel=1)
        ref[seed] = [srv.complete(text(4400, 30 + seed), 16)["tokens"], srv.complete(text(3800, 40 + seed), 16)["tokens"]]
        srv.stop()
    a = servers(KVC, models[1], kvc_socket=d.socket, ctx=4096, parallel=1)
    b = servers(KVC, models[2], kvc_socket=d.socket, ctx=4096, parallel=1)
    with observe(d) as c:
        # b serves a long prompt and goes idle holding most of its context
        r = b.complete(text(4400, 32), 16)
        assert r["tokens"] == ref[2][0]
        hb = held(c, b.pid)
        assert hb >= need_bytes([r["tokens_evaluated"]]) and hb > budget // 2, hb
        # a needs as much: only possible if b gives back
        r = a.complete(text(4400, 31), 16)
        assert r["tokens"] == ref[1][0]
        ha = held(c, a.pid)
        assert ha >= need_bytes([r["tokens_evaluated"]]) and ha > budget // 2, ha
        assert held(c, b.pid) < hb, "idle server kept its pages"
        st = c.stats()
        assert st.total.in_use_bytes <= budget
        assert_books(st)
        assert "clearing idle slot for a reclaim request" in b.log_text()
        # and back: b serves again, a is now the idle one
        r = b.complete(text(3800, 42), 16)
        assert r["tokens"] == ref[2][1]
        assert held(c, a.pid) < ha
        assert held(c, b.pid) >= need_bytes([r["tokens_evaluated"]])
        assert a.complete(text(3800, 41), 16)["tokens"] == ref[1][1]
        assert "clearing idle slot for a reclaim request" in a.log_text()
        assert_books(c.stats())


@pytest.mark.parametrize("page", [PAGE, 2 << 20])
def test_report_kv_bytes_held_vs_context(daemon_factory, servers, models, page):
    """KV bytes held vs context for one slot of an 8192-cell context (the
    unpatched build reserves all of it: 32 MiB for this model). Written to
    build/llama/kv-held-vs-context-<page>.json and printed."""
    d = daemon_factory("host", memory_limit="256MiB", page_size=str(page))
    srv = servers(KVC, models[0], kvc_socket=d.socket, ctx=8192, parallel=1)
    reserved = tiny_model.KV_BYTES_PER_TOKEN_F16 * 8192
    rows = []
    with observe(d) as c:
        # after start: 0 once the idle release gave warm-up's standby pages back
        wait_until(lambda: held(c, srv.pid) == 0, timeout=IDLE_RELEASE_WAIT)
        rows.append({"tokens": 0, "held_bytes": held(c, srv.pid)})
        for n_chars in (100, 600, 1200, 2500, 5000, 9000):
            r = srv.complete(text(n_chars, 100 + n_chars), 8, id_slot=0)
            rows.append({"tokens": r["tokens_evaluated"] + r["tokens_predicted"] - 1, "held_bytes": held(c, srv.pid)})
    for row in rows:
        row["unpatched_bytes"] = reserved
        row["kv_bytes_of_tokens"] = row["tokens"] * tiny_model.KV_BYTES_PER_TOKEN_F16
    out = ROOT / "build" / "llama" / f"kv-held-vs-context-{page >> 10}KiB.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"page_bytes": page, "reserved_bytes": reserved, "rows": rows}, indent=1))
    print(f"\npage {page >> 10} KiB: tokens in cache -> MiB held (unpatched: {reserved / 2**20:.0f} MiB)")
    for row in rows:
        print(f"  {row['tokens']:6d} -> {row['held_bytes'] / 2**20:6.2f} MiB")
    helds = [r["held_bytes"] for r in rows]
    assert helds[0] == 0
    assert all(a <= b for a, b in zip(helds, helds[1:])), helds
    for row in rows[1:]:
        assert row["kv_bytes_of_tokens"] <= row["held_bytes"] <= reserved, row
