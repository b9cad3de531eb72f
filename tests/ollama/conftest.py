"""Fixtures of the Ollama suite: tiny GGUFs (tests/llama/tiny_model.py),
imported once with `ollama create` into a models directory every `ollama
serve` of the module shares, and Ollama instances stopped at teardown."""

from __future__ import annotations

import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "llama"))  # tiny_model

import tiny_model  # noqa: E402
from ollamatest import Ollama, blob_digest  # noqa: E402

# Two models: the tiny llama of tests/llama (4 layers, n_embd 256: 4 KiB of
# F16 KV per token), seeds 0 and 1. num_ctx 4096 x OLLAMA_NUM_PARALLEL 2:
# 32 MiB of KV per model at full context (what llama.cpp reserves without
# the daemon).
MODELS = {"tiny0": 0, "tiny1": 1}
# The same two models with text-only output (tiny_model.write(text_only=True):
# greedy never picks a byte token), for Ollama v0.34.0 on its pinned llama.cpp
# b10760, whose server fails a stream that ends in a partial UTF-8 sequence.
TEXT_MODELS = {"text0": 0, "text1": 1}
# A model whose K/V tensors are far smaller than a 2 MiB page (issue 27's
# first shape: 3 layers, 2 KV heads of 16, 64 B per cell and tensor): at
# num_ctx 4096 x 2 slots, 6 tensors of 0.5 MiB, 3 MiB of stock KV.
SMALL = "small3l"
SMALL_SHAPE = dict(n_layer=3, n_embd=64, n_head=2, n_head_kv=2, head_dim=16, n_ff=128)
NUM_CTX = 4096
WORST_CASE_KV = 2 * NUM_CTX * tiny_model.KV_BYTES_PER_TOKEN_F16  # 2 slots
SMALL_ROW = tiny_model.kv_row_bytes(SMALL_SHAPE["n_embd"], SMALL_SHAPE["n_head"], SMALL_SHAPE["n_head_kv"],
                                   head_dim=SMALL_SHAPE["head_dim"])  # 64 B
SMALL_STOCK_KV = 2 * SMALL_SHAPE["n_layer"] * 2 * NUM_CTX * SMALL_ROW  # K and V per layer, 2 slots


@pytest.fixture(scope="session")
def model_store(tmp_path_factory):
    """(models dir, {name: blob digest}): the tiny GGUFs imported with
    `ollama create` by a stock Ollama (the blobs do not depend on the build)."""
    tmp = tmp_path_factory.mktemp("ollama-models")
    models = tmp / "models"
    models.mkdir()
    o = Ollama("stock", tmp, models, name="create")
    try:
        for name, seed in MODELS.items():
            gguf = tiny_model.write(tmp / f"{name}.gguf", seed=seed)
            o.create(name, gguf, num_ctx=NUM_CTX)
        o.create(SMALL, tiny_model.write(tmp / f"{SMALL}.gguf", seed=3, **SMALL_SHAPE), num_ctx=NUM_CTX)
        for name, seed in TEXT_MODELS.items():
            o.create(name, tiny_model.write(tmp / f"{name}.gguf", seed=seed, text_only=True), num_ctx=NUM_CTX)
    finally:
        o.stop()
    return (models, {name: blob_digest(models, name) for name in MODELS}, blob_digest(models, SMALL),
            {name: blob_digest(models, name) for name in TEXT_MODELS})


@pytest.fixture
def ollamas(tmp_path, model_store):
    """start(layout, **env) -> a running Ollama on the shared models."""
    models = model_store[0]
    started: list[Ollama] = []

    def start(layout: str, name: str | None = None, **env) -> Ollama:
        o = Ollama(layout, tmp_path, models, env={k: str(v) for k, v in env.items()}, name=name or f"{layout}{len(started)}")
        started.append(o)
        return o

    yield start
    for o in started:
        o.stop()


@pytest.fixture
def digests(model_store) -> dict[str, str]:
    return model_store[1]


@pytest.fixture
def small_digest(model_store) -> str:
    return model_store[2]


@pytest.fixture
def text_digests(model_store) -> dict[str, str]:
    return model_store[3]
