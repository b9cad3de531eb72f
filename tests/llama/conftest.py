"""Fixtures of the llama.cpp suite (helpers in llamatest.py)."""

from __future__ import annotations

import pathlib

import pytest

import tiny_model
from llamatest import Server


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[int, pathlib.Path]:
    d = tmp_path_factory.mktemp("models")
    return {seed: tiny_model.write(d / f"tiny{seed}.gguf", seed=seed) for seed in (0, 1, 2)}


@pytest.fixture
def servers(tmp_path):
    started: list[Server] = []

    def start(binary, model, **kw) -> Server:
        s = Server(binary, model, tmp_path / f"server{len(started)}.log", **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()
