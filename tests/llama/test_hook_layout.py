"""Never more memory than stock (issue 27 item 1).

The hook packs a cache's K and V tensors back to back, as ggml-alloc does
for stock llama.cpp, in one reservation, so tensors smaller than a page
share pages and the reservation is the stock KV buffer. The hard rule: on
every shape and context, the bytes the daemon says the runner holds never
exceed the stock KV buffer size rounded up to one page, at any point
(sampled every few milliseconds while prompts run), at 2 MiB pages, with
f16 and q8_0 caches.

Shapes: the three small models of the issue's report (where the old layout,
one page-aligned range per tensor, held 4-8x stock), a 0.5B-like, a 1B-like
and an 8B-like model (their real layer count, KV heads and head width, on a
narrow residual stream so the random weights stay small, and with as many
query heads as KV heads: the query heads never reach the cache, whose
tensors are n_head_kv x head_dim wide, and the real 7x/4x more made the
long prompts' attention take most of the suite's time). Each run writes
build/llama/layout-<shape>-<kv>.json: per prompt, the stock bytes, what the
old layout would hold for the same cells (`before`, computed by
`layout_held` below, which gives the issue's own measured figures for its
shapes) and what the daemon held (`after`).
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

import tiny_model
from kvtest import ROOT, wait_until
from llamatest import KVC, MiB, ORIG, PAD, held, observe, session_of, text, used_cells

PAGE2M = 2 << 20

# name: model shape (tiny_model.write keywords), -c, -np
SHAPES = {
    # the issue's three: 3 layers x 2 KV heads of 16 (64 B rows), 4096 cells x 2 streams
    "3L-2kv-d16": (dict(n_layer=3, n_embd=64, n_head=2, n_head_kv=2, head_dim=16, n_ff=128), 8192, 2),
    # 2 layers x 1 KV head of 32 (64 B rows), 2048 cells x 2 streams
    "2L-1kv-d32": (dict(n_layer=2, n_embd=64, n_head=2, n_head_kv=1, head_dim=32, n_ff=128), 4096, 2),
    # 6 layers x 3 KV heads of 32 (192 B rows), 8192 cells x 2 streams
    "6L-3kv-d32": (dict(n_layer=6, n_embd=96, n_head=3, n_head_kv=3, head_dim=32, n_ff=192), 16384, 2),
    # Qwen2-0.5B: 24 layers, 2 KV heads of 64 (256 B rows; 14 query heads there); num_ctx 4096, one slot
    "0.5B-like": (dict(n_layer=24, n_embd=128, n_head=2, n_head_kv=2, head_dim=64, n_ff=128), 4096, 1),
    # Llama-3.2-1B: 16 layers, 8 KV heads of 64 (1 KiB rows; 32 query heads there); 8192 cells x 2 slots
    "1B-like": (dict(n_layer=16, n_embd=128, n_head=8, n_head_kv=8, head_dim=64, n_ff=128), 16384, 2),
    # Llama-3-8B: 32 layers, 8 KV heads of 128 (2 KiB rows; 32 query heads there); num_ctx 4096, one slot
    "8B-like": (dict(n_layer=32, n_embd=128, n_head=8, n_head_kv=8, head_dim=128, n_ff=128), 4096, 1),
}
# llama.cpp refuses a q8_0 cache for heads narrower than its 32-element
# block ("K cache type q8_0 with block size 32 does not divide
# n_embd_head_k=16"), so 3L-2kv-d16 runs with f16 only
CASES = [(shape, kv) for shape in SHAPES for kv in ("f16", "q8_0")
         if not (kv == "q8_0" and SHAPES[shape][0].get("head_dim", 0) % 32)]
PROMPT_FRACTIONS = (0.0, 0.03, 0.2, 0.6)  # of a stream's cells (0.0: a two-word prompt)


def round_up(n: int, page: int) -> int:
    return -(-n // page) * page


def layout_held(rows: list[int], used: list[int], kv_size: int, page: int, packed: bool) -> int:
    """Bytes of the pages that back the cells graphs read (`used` cells per
    stream, padded to 256) of every tensor: tensors [row, kv_size,
    len(used)] one after another, packed (now) or each at a page-aligned
    offset (the old layout). A page shared by two ranges counts once."""
    spans, off = [], 0
    for row in rows:
        for s, u in enumerate(used):
            c = min(kv_size, round_up(u, PAD)) if u else 0
            if c:
                lo = off + s * kv_size * row
                spans.append((lo // page, -(-(lo + c * row) // page)))
        size = row * kv_size * len(used)
        off += size if packed else round_up(size, page)
    pages, end = 0, 0
    for lo, hi in sorted(spans):
        lo = max(lo, end)
        if hi > lo:
            pages, end = pages + hi - lo, hi
    return pages * page


def kv_geometry(log: str) -> tuple[int, int]:
    """(cells per stream, streams) from llama.cpp's "llama_kv_cache: size" line."""
    m = re.search(r"llama_kv_cache: size = .*?\(\s*(\d+) cells,\s*\d+ layers,\s*(\d+)/\d+ seqs", log)
    assert m, log[-3000:]
    return int(m.group(1)), int(m.group(2))


def stock_kv_mib(log: str) -> float:
    m = re.search(r"CPU KV buffer size =\s*([\d.]+) MiB", log)
    assert m, log[-3000:]
    return float(m.group(1))


class HeldSampler:
    """The most the daemon said the runner held, sampled every few ms."""

    def __init__(self, d, pid: int):
        self.d, self.pid, self.most, self.samples = d, pid, 0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with observe(self.d) as c:
            while not self.stop.is_set():
                self.most = max(self.most, held(c, self.pid))
                self.samples += 1
                time.sleep(0.003)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(10)


@pytest.fixture(scope="module")
def shape_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("layout-models")
    return {name: tiny_model.write(d / f"{name}.gguf", seed=11, **kw) for name, (kw, _, _) in SHAPES.items()}


@pytest.mark.timeout(1800)  # its requests may take 900 s each on a loaded 2-core machine (pytest's default is 300 s)
@pytest.mark.parametrize("shape,kv_type", CASES)
def test_held_never_exceeds_stock(daemon_factory, servers, shape_models, shape, kv_type):
    kw, ctx, parallel = SHAPES[shape]
    model = shape_models[shape]
    row = tiny_model.kv_row_bytes(kw["n_embd"], kw["n_head"], kw["n_head_kv"], kv_type, kw.get("head_dim"))
    rows = [row] * (2 * kw["n_layer"])
    extra = ["-ctk", kv_type, "-ctv", kv_type]

    ref = servers(ORIG, model, kvc_socket=None, ctx=ctx, parallel=parallel, fa="on", extra=extra)
    kv_size, n_stream = kv_geometry(ref.log_text())
    stock = sum(rows) * kv_size * n_stream
    assert stock_kv_mib(ref.log_text()) == round(stock / MiB, 2), "the stock buffer is not the tensors' sum"
    ref.stop()
    bound = round_up(stock, PAGE2M)

    d = daemon_factory("host", memory_limit=f"{bound // MiB + 64}MiB", page_size=str(PAGE2M))
    srv = servers(KVC, model, kvc_socket=d.socket, ctx=ctx, parallel=parallel, fa="on", extra=extra)
    assert f"reserved {stock / MiB:.2f} MiB in daemon pages" in srv.log_text(), srv.log_text()[-3000:]
    report = {"shape": shape, "kv_type": kv_type, "model": kw, "cells": kv_size, "streams": n_stream,
              "row_bytes": row, "tensors": len(rows), "page": PAGE2M, "stock_bytes": stock, "rows": []}
    with observe(d) as c, HeldSampler(d, srv.pid) as sampler:
        assert session_of(c, srv.pid) is not None, srv.log_text()[-3000:]
        for i, f in enumerate(PROMPT_FRACTIONS):
            prompts = [text(int(kv_size * f * 0.8), 100 + i + 7 * s) if f else f"Hello {s}" for s in range(n_stream)]
            # up to 2 x 3,900 prompt tokens on 2 threads: minutes on a loaded 2-core machine (this test bounds
            # memory, not speed; 120 s timed out beside stress-ng --cpu 2)
            res = srv.complete(prompts if n_stream > 1 else prompts[0], 8, timeout=900)
            res = res if isinstance(res, list) else [res]
            used = [used_cells(r) for r in res] + [0] * (n_stream - len(res))
            seen = sampler.samples
            assert wait_until(lambda: sampler.samples > seen + 1, timeout=5)  # (the sampler saw this state too)
            h = held(c, srv.pid)
            before = layout_held(rows, used, kv_size, PAGE2M, packed=False)
            after_model = layout_held(rows, used, kv_size, PAGE2M, packed=True)
            report["rows"].append({"cells_used": used, "stock_bytes": stock, "before_bytes": before,
                                   "after_bytes": h, "after_model_bytes": after_model,
                                   "most_seen_bytes": sampler.most})
            assert sum(u * row for u in used) * len(rows) <= h, (shape, used, h)
            assert h <= bound and sampler.most <= bound, (shape, kv_type, used, h, sampler.most, bound)
            # what the hook holds is what the packed layout needs for the cells read
            assert h <= after_model, (shape, used, h, after_model)
    out = ROOT / "build" / "llama" / f"layout-{shape}-{kv_type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))


def test_layout_model_gives_the_issues_figures():
    """`before` above is the old layout's held bytes: for the issue's shapes
    and the 0.5B shape it gives the figures measured on the old hook (12, 8,
    24 and 96 MiB after a short prompt), and the packed layout stays within
    stock rounded up to one page."""
    cases = [  # rows, cells per stream, streams, old held (MiB), stock (MiB)
        ([64] * 6, 4096, 2, 12, 3),
        ([64] * 4, 2048, 2, 8, 1),
        ([192] * 12, 8192, 2, 24, 36),
        ([256] * 48, 4096, 1, 96, 48),
    ]
    for rows, kv_size, n_stream, old_mib, stock_mib in cases:
        used = [20] + [0] * (n_stream - 1)
        assert layout_held(rows, used, kv_size, PAGE2M, packed=False) == old_mib * MiB
        new = layout_held(rows, used, kv_size, PAGE2M, packed=True)
        assert new <= round_up(stock_mib * MiB, PAGE2M), (rows[0], new)
