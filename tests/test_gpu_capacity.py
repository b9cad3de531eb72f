"""Stage 5 of the offline GPU bundle (issue 44) without a GPU or a build:
Ollama v0.34.4's rules as tests/helpers/gpu_capacity.py applies them, the
random q4_0 GGUF of tests/helpers/q4_gguf.py (read back with gguf), the row
logic, and stage5.sh's skip rows. The scenario itself runs on the CPU builds
in the bundle's dry run (scripts/test-gpu-bundle.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvtest import HELPERS, ROOT

sys.path.insert(0, str(HELPERS))
import gpu_capacity as gc  # noqa: E402
import q4_gguf  # noqa: E402

GiB, MiB = gc.GiB, gc.MiB
L8B = q4_gguf.SHAPES["llama3.1-8b"]


def test_ollama_default_context_by_vram_capped_at_the_trained_context():
    assert gc.ollama_default_num_ctx(140 * GiB) == 262144
    assert gc.ollama_default_num_ctx(47 * GiB) == 262144
    assert gc.ollama_default_num_ctx(46 * GiB) == 32768
    assert gc.ollama_default_num_ctx(80 * GiB, gpu_overhead=40 * GiB) == 32768
    assert gc.ollama_default_num_ctx(16 * GiB) == 4096
    assert gc.effective_ctx(262144, L8B["n_ctx_train"]) == 131072
    assert gc.effective_ctx(4096, 131072) == 4096
    assert gc.effective_ctx(8192, 0) == 8192


def test_ollama_estimate_for_llama31_8b_is_file_plus_16_gib_per_slot():
    f = 4_521_688_768
    assert gc.predict_server_vram(f, L8B, 131072) == f + 16 * GiB
    assert gc.predict_server_vram(f, L8B, 4 * 131072) == f + 64 * GiB
    assert q4_gguf.kv_bytes_per_token(L8B) * 131072 == 16 * GiB


def test_ollama_batch_rule_and_the_80_percent_fit():
    pred = 4_521_688_768 + 16 * GiB
    # an empty H200: 2048 (the estimate is under 60 % of what is free), with its 2 GiB surcharge
    assert gc.auto_batch(131072, pred, 139 * GiB) == 2048
    assert gc.batch_surcharge(2048) == 2 * GiB and gc.batch_surcharge(1024) == 768 * MiB and gc.batch_surcharge(512) == 0
    # less free: 1024 while the estimate is under 75 %, then 512
    assert gc.auto_batch(131072, pred, 30 * GiB) == 1024
    assert gc.auto_batch(131072, pred, 26 * GiB) == 512
    assert gc.auto_batch(8192, pred, 139 * GiB) == 1024 and gc.auto_batch(4096, pred, 139 * GiB) == 512
    assert gc.auto_batch(131072, pred, 139 * GiB, fa_disabled=True) == 512
    assert gc.ollama_fits(100 * GiB, 1 * GiB, loaded=0)  # the first always starts
    assert gc.ollama_fits(80 * GiB, 100 * GiB, loaded=2) and not gc.ollama_fits(80 * GiB + 1, 100 * GiB, loaded=2)
    # the loaded runners' buffer lines cap what Ollama thinks is free
    assert gc.ollama_free(100 * GiB, 140 * GiB, 50 * GiB) == 90 * GiB
    assert gc.ollama_free(80 * GiB, 140 * GiB, 50 * GiB) == 80 * GiB
    assert gc.ollama_free(80 * GiB, 140 * GiB, 0) == 80 * GiB


def test_ollama_flags():
    a = gc.ollama_args("/m.gguf", 5000, 131072, 4, 2048)
    s = " ".join(a)
    assert s.startswith("--model /m.gguf --port 5000 --host 127.0.0.1 --no-webui --offline -c 524288 -np 4 ")
    assert "--flash-attn auto -b 2048 -ub 2048 --context-shift --keep 4" in s
    assert "--log-verbosity 4 --no-log-prefix --no-log-timestamps" in s


def test_pct_and_rows():
    assert gc.pct([1, 2, 3, 4], 50) == 2.5 and gc.pct([5], 99) == 5
    ok = gc.greedy_row("1 slot", [(0, [1, 2], [1, 2]), (1, [3], [3]), (2, [4], [4])])
    assert ok["verdict"] == "pass" and "3 models, 4 tokens identical" in ok["seen"]
    bad = gc.greedy_row("1 slot", [(0, [1, 2], [1, 2]), (1, [3], [5])])
    assert bad["verdict"] == "FAIL" and "model 2" in bad["seen"]
    assert gc.greedy_row("1 slot", [(0, [1], [1])])["verdict"] == "info"  # too few to say
    assert gc.greedy_row("1 slot", [])["verdict"] == "FAIL"
    assert gc.memory_back_row(100 * MiB, 101 * MiB)["verdict"] == "pass"
    assert gc.memory_back_row(100 * MiB, 110 * MiB)["verdict"] == "FAIL"
    assert gc.memory_back_row(None, 1)["verdict"] == "skip"
    names = gc.plan_names([1, 4])
    assert len(names) == 1 + 5 * 2 + 1 and names[1] == "stock, 1 slot: models resident"


def test_shapes_have_a_real_8b_ratio_of_kv_to_weights():
    for name in ("llama3.1-8b", "scaled"):
        sh = q4_gguf.SHAPES[name]
        ratio = q4_gguf.kv_bytes_per_token(sh) * sh["n_ctx_train"] / q4_gguf.weight_bytes(sh)
        assert 3.5 < ratio < 4.2, (name, ratio)
    assert 4.3e9 < q4_gguf.weight_bytes(L8B) < 4.7e9


def test_q4_gguf_scaled_reads_back_with_the_shape(tmp_path):
    pytest.importorskip("gguf")
    import gguf

    info = q4_gguf.write(tmp_path / "s.gguf", "scaled", seed=3)
    again = q4_gguf.write(tmp_path / "t.gguf", "scaled", seed=3)
    assert (tmp_path / "s.gguf").read_bytes() == (tmp_path / "t.gguf").read_bytes()  # seeded
    assert info["bytes"] == again["bytes"] == (tmp_path / "s.gguf").stat().st_size
    r = gguf.GGUFReader(str(tmp_path / "s.gguf"))
    sh = q4_gguf.SHAPES["scaled"]
    f = {k: r.fields[k].parts[-1].tolist() for k in ("llama.context_length", "llama.attention.head_count_kv",
                                                      "llama.vocab_size", "llama.block_count")}
    assert f == {"llama.context_length": [sh["n_ctx_train"]], "llama.attention.head_count_kv": [sh["n_head_kv"]],
                 "llama.vocab_size": [sh["n_vocab"]], "llama.block_count": [sh["n_layer"]]}
    t = {x.name: x for x in r.tensors}
    assert len(t) == 2 + 9 * sh["n_layer"] + 2
    assert t["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_0
    assert sum(x.n_bytes for x in r.tensors) <= info["weight_bytes"]
    from gguf.quants import dequantize

    q = dequantize(t["blk.0.attn_q.weight"].data, t["blk.0.attn_q.weight"].tensor_type)
    assert np.isfinite(q).all() and abs(q.mean()) < 0.01 and 0.1 < q.std() < 0.15  # 2 / sqrt(256) = 0.125
    rope = np.asarray(t["rope_freqs.weight"].data)
    assert rope.shape == (sh["n_embd"] // sh["n_head"] // 2,) and rope[0] == 1.0 and rope[-1] == 8.0


def test_stage5_without_a_cuda_runtime_or_builds_writes_skip_rows(tmp_path):
    for case, extra in (("testdriver", {"VERIFY_DRIVER": "testdriver"}),
                        ("real-no-builds", {"VERIFY_DRIVER": "real", "BUNDLE": str(tmp_path / "nob")})):
        out = tmp_path / case
        env = {k: v for k, v in os.environ.items() if not k.startswith(("STAGE5_", "VERIFY_"))}
        env.update(STAGE_OUT=str(out), PYTHON=sys.executable, REPO=str(ROOT), **extra)
        p = subprocess.run(["bash", str(ROOT / "scripts/gpu-bundle/stage5.sh")], env=env, capture_output=True,
                           text=True, timeout=120, cwd=ROOT)
        assert p.returncode == 0, p.stdout + p.stderr
        rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
        assert len(rows) == len(gc.plan_names([1, 4])), rows
        assert all(r["verdict"] == "skip" and r["kind"] == "capacity" for r in rows), rows
        want = "no CUDA runtime" if case == "testdriver" else "no llama-server builds"
        assert all(want in r["seen"] for r in rows), rows
