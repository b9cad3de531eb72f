"""llama-server's router mode (issue 29 item 3): `llama-server --models-dir
DIR --models-max N` serves every GGUF in DIR, each model by a child
llama-server it starts with `--alias NAME --model PATH` and its own
environment. With the hook each child's session is named after its model
and gets its model's own maximum and guarantee (KVCACHED_MAX_BYTES and
KVCACHED_GUARANTEED_BYTES unset in a router child, or auto); its pages go back when the router evicts it (LRU, models-max),
unloads it (POST /models/unload) or stops; greedy tokens are the unpatched
router's. docs/llama-cpp.md, "Router mode".
"""

from __future__ import annotations

import pathlib

import pytest

import tiny_model
from kvtest import assert_books, wait_until
from llamatest import KVC, ORIG, Served, observe, session_of, text

MiB = 1 << 20
PAGE = 64 << 10
CTX = 2048
LAYERS = {"tinyA": 2, "tinyB": 4, "tinyC": 6}   # three models, three KV sizes
ROW = tiny_model.kv_row_bytes()                  # bytes per cell of one K (or V) tensor


def stock(name: str) -> int:
    """The stock KV buffer of a child: K and V of every layer, CTX cells."""
    return 2 * LAYERS[name] * CTX * ROW


def guarantee(name: str) -> int:
    """KVCACHED_GUARANTEED_BYTES=auto: the pages the first 256 cells of one
    stream touch in every K/V tensor (tensors here start on page boundaries)."""
    return 2 * LAYERS[name] * -(-256 * ROW // PAGE) * PAGE


class Router(Served):
    """llama-server in router mode; its children's output goes to its log."""

    what = "router"
    stop_wait = 30.0

    def __init__(self, binary: pathlib.Path, models_dir: pathlib.Path, log: pathlib.Path, *,
                 env: dict[str, str] | None = None, models_max: int = 2):
        self._launch(binary, lambda port: [
            "--models-dir", str(models_dir), "--models-max", str(models_max), "--host", "127.0.0.1", "--port",
            str(port), "-t", "2", "-c", str(CTX), "-np", "1", "-fa", "on", "--no-webui", "-lv", "4"], log, env)

    def complete(self, model: str, prompt: str, n_predict: int = 24) -> list[int]:
        r = self.call("POST", "/completion", {
            "model": model, "prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "seed": 7,
            "ignore_eos": True, "return_tokens": True})
        return r["tokens"]

    def status(self, model: str) -> str:
        for m in self.call("GET", "/models")["data"]:
            if m["id"] == model:
                return m["status"]["value"]
        raise AssertionError(f"no model {model} at the router")

    def unload(self, model: str) -> None:
        self.call("POST", "/models/unload", {"model": model})


@pytest.fixture
def models_dir(tmp_path) -> pathlib.Path:
    d = tmp_path / "models"
    d.mkdir()
    for seed, (name, n_layer) in enumerate(LAYERS.items()):
        tiny_model.write(d / f"{name}.gguf", seed=seed, n_layer=n_layer)
    return d


def sessions(c) -> dict[str, object]:
    return {s.name: s for s in c.stats().sessions if s.name in LAYERS}


# what both routers are asked, in order: ("complete", model, prompt) or ("unload", model)
STEPS = [
    ("complete", "tinyA", text(300, 1)),
    ("complete", "tinyB", text(700, 2)),
    ("complete", "tinyC", text(500, 3)),     # models-max 2: the router evicts tinyA (least recently used)
    ("unload", "tinyB"),
    ("complete", "tinyA", text(300, 1)),     # loaded again
    ("complete", "tinyC", text(900, 4)),
]


def test_router_sessions_per_model_and_pages_back(daemon_factory, models_dir, tmp_path):
    """Three models behind a router with --models-max 2: each child's session
    is named after its model, with the model's own maximum (stock KV buffer
    in pages) and guarantee (KVCACHED_GUARANTEED_BYTES=auto); a child's pages
    go back when the router evicts it, unloads it, and when the router stops;
    the tokens are the unpatched router's."""
    ref = Router(ORIG, models_dir, tmp_path / "router-orig.log")
    want = []
    try:
        for step in STEPS:
            if step[0] == "complete":
                want.append(ref.complete(step[1], step[2]))
            else:
                ref.unload(step[1])
                assert wait_until(lambda: ref.status(step[1]) == "unloaded", timeout=30)
    finally:
        ref.stop()

    d = daemon_factory("host", memory_limit="256MiB", page_size=str(PAGE))
    r = Router(KVC, models_dir, tmp_path / "router-kvc.log",
               env={"KVCACHED_SOCKET": d.socket})  # children: maximum and guarantee per model by default
    got = []
    try:
        with observe(d) as c:
            assert [s.name for s in c.stats().sessions] == ["llama-test-observer"], "the router itself opens none"
            for i, step in enumerate(STEPS):
                if step[0] == "complete":
                    got.append(r.complete(step[1], step[2]))
                    s = sessions(c).get(step[1])
                    assert s is not None and s.held_bytes > 0, (step, sessions(c), r.log_text()[-4000:])
                    assert s.max_bytes == stock(step[1]), (s, stock(step[1]))
                    assert s.guaranteed_bytes == guarantee(step[1]), (s, guarantee(step[1]))
                else:
                    r.unload(step[1])
                    assert wait_until(lambda: step[1] not in sessions(c), timeout=30), sessions(c)
                if i == 2:  # tinyC evicted tinyA: its session and pages are gone
                    assert wait_until(lambda: "tinyA" not in sessions(c), timeout=30), sessions(c)
                    assert "evicting idle LRU name=tinyA" in r.log_text()
                running = sessions(c)
                assert len(running) <= 2, running
                st = c.stats()
                assert st.total.in_use_bytes == sum(s.held_bytes for s in running.values()), (st.total, running)
                assert_books(st)
            assert set(sessions(c)) == {"tinyA", "tinyC"}
            r.stop()
            assert wait_until(lambda: sessions(c) == {}, timeout=30), sessions(c)
            assert wait_until(lambda: c.stats().total.in_use_bytes == 0, timeout=10), c.stats().total
            assert_books(c.stats())
    finally:
        r.stop()
    log = r.log_text()
    for name in LAYERS:
        assert f'"{name}"' in log and f"max {stock(name)} (per model)" in log, log[-4000:]
    assert want == got


def test_session_named_by_alias_and_operator_values_win(daemon_factory, servers, models):
    """A llama-server (router child or not) names its session after --alias
    (the first of a list), else the model file; bytes an operator set win
    over the model's figures."""
    d = daemon_factory("host", memory_limit="256MiB", page_size=str(PAGE))
    a = servers(KVC, models[0], kvc_socket=d.socket, ctx=CTX, parallel=1, extra=["--alias", "chat-small, other"],
                env={"KVCACHED_MAX_BYTES": str(3 * MiB), "KVCACHED_GUARANTEED_BYTES": "auto"})
    b = servers(KVC, models[1], kvc_socket=d.socket, ctx=CTX, parallel=1,
                env={"KVCACHED_MAX_BYTES": "auto", "KVCACHED_GUARANTEED_BYTES": str(PAGE)})
    plain = servers(KVC, models[2], kvc_socket=d.socket, ctx=CTX, parallel=1)
    with observe(d) as c:
        by_pid = {s.pid: s for s in c.stats().sessions}
        sa, sb = by_pid[a.pid], by_pid[b.pid]
        assert sa.name == "chat-small", sa
        assert sa.max_bytes == 3 * MiB and sa.guaranteed_bytes == 2 * tiny_model.N_LAYER * -(-256 * ROW // PAGE) * PAGE, sa
        assert sb.name == models[1].stem, sb
        assert sb.guaranteed_bytes == PAGE and sb.max_bytes == 2 * tiny_model.N_LAYER * CTX * ROW, sb
        # neither set: no maximum and no guarantee, as before (a model with several KV buffers,
        # iSWA or a draft model, would be refused past its first buffer's size by a per-model one)
        sp = by_pid[plain.pid]
        assert sp.max_bytes == 0 and sp.guaranteed_bytes == 0, sp


def test_a_second_kv_cache_past_the_per_model_maximum_is_said(daemon_factory, servers, models):
    """The per-model maximum comes from the process's first KV buffer: a
    draft model (speculative decoding) adds a second KV cache it does not
    cover, and the hook says so once, naming the variable to set."""
    d = daemon_factory("host", memory_limit="256MiB", page_size=str(PAGE))
    srv = servers(KVC, models[0], kvc_socket=d.socket, ctx=CTX, parallel=1, extra=["-md", str(models[1])],
                  env={"KVCACHED_MAX_BYTES": "auto"})
    srv.complete(text(300, 1), 8)
    log = srv.log_text()
    assert log.count("kvcached: CPU KV buffer reserved") == 2, log[-4000:]
    assert log.count("more than the per-model maximum") == 1, log[-4000:]
    assert "(KVCACHED_MAX_BYTES=auto): set bytes, their sum, for this model" in log
    with observe(d) as c:
        s = session_of(c, srv.pid)
        assert s.max_bytes == 2 * tiny_model.N_LAYER * CTX * ROW, s


def test_a_guarantee_the_daemon_cannot_give_is_dropped_not_the_session(daemon_factory, servers, models):
    """KVCACHED_GUARANTEED_BYTES=auto (a router child's default) is best
    effort: a daemon whose budget cannot hold the model's guarantee refuses
    OpenSession, and the hook opens the session without it instead of
    putting the KV cache in ordinary memory (its KV buffers are the
    daemon's regions: a session exists, named after the model)."""
    d = daemon_factory("host", memory_limit=str(12 * PAGE), page_size=str(PAGE))  # the guarantee is 16 pages
    srv = servers(KVC, models[0], kvc_socket=d.socket, ctx=CTX, parallel=1, env={"KVCACHED_GUARANTEED_BYTES": "auto"})
    log = srv.log_text()
    assert "cannot guarantee this model 1.00 MiB" in log and "opening the session without a guarantee" in log, log[-3000:]
    assert "KV cache in ordinary memory" not in log
    with observe(d) as c:
        s = session_of(c, srv.pid)
        assert s is not None and s.name == models[0].stem and s.guaranteed_bytes == 0, s
