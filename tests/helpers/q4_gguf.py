"""A random-weight q4_0 llama GGUF of a real model's shape, written in seconds
(stage 5 of the offline GPU bundle, issue 44; no download, no network).

    python tests/helpers/q4_gguf.py OUT.gguf [--shape llama3.1-8b|scaled] [--seed N]

Shapes (SHAPES):
- "llama3.1-8b": Llama-3.1-8B's exact geometry: vocabulary 128,256, n_embd
  4,096, n_ff 14,336, 32 layers, 32 heads, 8 KV heads (of 128), trained
  context 131,072, rope base 500,000 with Llama 3.1's frequency factors
  (rope_freqs.weight: factor 8, low/high frequency factors 1/4, original
  context 8,192). Every matrix q4_0: 4.52 GB (Ollama's llama3.1:8b q4_0 is
  4.7 GB: its output matrix is q6_K). Its f16 KV cache at the trained
  context is 16 GiB: 3.8 times its weights.
- "scaled": the same kind of model on a CPU budget with the same ratio of KV
  to weights (3.9x at its trained context, 16,384): 8 layers, n_embd 256,
  4 heads, 1 KV head of 64 (GQA 4, as the real one), n_ff 896, vocabulary
  16,384; 8.6 MB of q4_0 weights, 32 MiB of f16 KV at the trained context.

Weights: q4_0 blocks (an f16 scale and 32 4-bit values) whose values are
drawn uniformly from -7..7 (symmetric: no bias); one scale per tensor, chosen
as 1/sqrt(fan-in) (the attention's q and k twice that, the output matrix
0.15, so logits have a standard deviation near 10: clear greedy winners, no
overflow). The random nibbles come from one seeded pool that each tensor
reads at its own seeded offset, so the file is the same bytes for the same
seed and costs what writing it costs: the tensors go to disk with pwrite at
their offsets from a thread per core. Norms are f32 near 1.

Vocabulary: SentencePiece-style ("llama" tokenizer) as
tests/llama/tiny_model.py's (byte fallback and printable ASCII), padded to
the shape's size with `<extra_N>` tokens that no text turns into (no merge
reaches them), so llama.cpp tokenizes any text and the embedding and output
matrices have the real shape.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import os
import pathlib
import sys
import time
import types

import numpy as np

QK = 32           # values per q4_0 block
BLOCK = 18        # bytes per q4_0 block: f16 scale + 16 bytes of nibbles
ALIGN = 32        # GGUF data alignment (gguf's default)

SHAPES = {
    "llama3.1-8b": dict(n_vocab=128256, n_embd=4096, n_ff=14336, n_layer=32, n_head=32, n_head_kv=8,
                        n_ctx_train=131072, rope_base=500000.0),
    "scaled": dict(n_vocab=16384, n_embd=256, n_ff=896, n_layer=8, n_head=4, n_head_kv=1,
                   n_ctx_train=16384, rope_base=500000.0),
}
# Llama 3.1's rope scaling (its config.json: rope_scaling), as convert_hf_to_gguf.py turns it into rope_freqs
ROPE_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def head_dim(shape: dict) -> int:
    return shape["n_embd"] // shape["n_head"]


def kv_bytes_per_token(shape: dict, kv_type_bytes: int = 2) -> int:
    """f16 K and V of every layer for one token."""
    return 2 * shape["n_layer"] * head_dim(shape) * shape["n_head_kv"] * kv_type_bytes


def kv_row_bytes(shape: dict) -> int:
    """One cell of one K (or V) tensor, f16."""
    return head_dim(shape) * shape["n_head_kv"] * 2


def tensors(shape: dict) -> list[tuple[str, tuple[int, int] | tuple[int], str, float]]:
    """(name, numpy shape (rows, cols), "q4_0" | "f32", scale) of every
    tensor, in file order. The q4_0 scale is the standard deviation wanted."""
    v, e, f, hd = shape["n_vocab"], shape["n_embd"], shape["n_ff"], head_dim(shape)
    nq, nkv = hd * shape["n_head"], hd * shape["n_head_kv"]
    s = 1.0 / math.sqrt(e)
    out: list = [("rope_freqs.weight", (hd // 2,), "rope", 0.0),
                 ("token_embd.weight", (v, e), "q4_0", 1.0)]
    for i in range(shape["n_layer"]):
        out += [(f"blk.{i}.attn_norm.weight", (e,), "norm", 0.0),
                (f"blk.{i}.attn_q.weight", (nq, e), "q4_0", 2 * s),
                (f"blk.{i}.attn_k.weight", (nkv, e), "q4_0", 2 * s),
                (f"blk.{i}.attn_v.weight", (nkv, e), "q4_0", s),
                (f"blk.{i}.attn_output.weight", (e, nq), "q4_0", 1.0 / math.sqrt(nq)),
                (f"blk.{i}.ffn_norm.weight", (e,), "norm", 0.0),
                (f"blk.{i}.ffn_gate.weight", (f, e), "q4_0", s),
                (f"blk.{i}.ffn_up.weight", (f, e), "q4_0", s),
                (f"blk.{i}.ffn_down.weight", (e, f), "q4_0", 1.0 / math.sqrt(f))]
    out += [("output_norm.weight", (e,), "norm", 0.0), ("output.weight", (v, e), "q4_0", 0.15)]
    return out


def nbytes(shape_np: tuple, kind: str) -> int:
    n = math.prod(shape_np)
    if kind == "q4_0":
        assert shape_np[-1] % QK == 0, shape_np
        return n // QK * BLOCK
    return 4 * n


def weight_bytes(shape: dict) -> int:
    """The tensors' bytes (the file is this plus its header)."""
    return sum(nbytes(t[1], t[2]) for t in tensors(shape))


def rope_freqs(hd: int, base: float) -> np.ndarray:
    """Llama 3.1's rope frequency factors (convert_hf_to_gguf.py, LlamaModel)."""
    sc = ROPE_SCALING
    freqs = 1.0 / (base ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    low_wl = sc["original_max_position_embeddings"] / sc["low_freq_factor"]
    high_wl = sc["original_max_position_embeddings"] / sc["high_freq_factor"]
    out = []
    for fr in freqs:
        wl = 2 * math.pi / fr
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(sc["factor"])
        else:
            smooth = (sc["original_max_position_embeddings"] / wl - sc["low_freq_factor"]) / \
                (sc["high_freq_factor"] - sc["low_freq_factor"])
            out.append(1.0 / ((1 - smooth) / sc["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "llama"))
    import tiny_model

    toks, scores, types_ = tiny_model.vocab()
    extra = n_vocab - len(toks)
    assert extra >= 0, n_vocab
    toks = toks + [f"<extra_{i}>" for i in range(extra)]
    scores = scores + [-1e6] * extra
    types_ = types_ + [1] * extra  # NORMAL
    return toks, scores, types_


def _gguf():
    try:
        import yaml  # noqa: F401
    except ImportError:  # gguf imports yaml for model cards only; a GPU host may lack PyYAML
        sys.modules["yaml"] = types.ModuleType("yaml")
    import gguf

    return gguf


def write(path: str | pathlib.Path, shape: str | dict = "llama3.1-8b", seed: int = 0, name: str = "",
          threads: int | None = None) -> dict:
    """Writes the GGUF; returns {"path", "bytes", "weight_bytes", "seconds", "shape"}."""
    gguf = _gguf()
    t0 = time.monotonic()
    sh = dict(SHAPES[shape]) if isinstance(shape, str) else dict(shape)
    label = shape if isinstance(shape, str) else "custom"
    path = pathlib.Path(path)
    hd = head_dim(sh)
    toks, scores, ttypes = vocab(sh["n_vocab"])

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name or f"random-q4_0-{label}-seed{seed}")
    w.add_context_length(sh["n_ctx_train"])
    w.add_embedding_length(sh["n_embd"])
    w.add_block_count(sh["n_layer"])
    w.add_feed_forward_length(sh["n_ff"])
    w.add_head_count(sh["n_head"])
    w.add_head_count_kv(sh["n_head_kv"])
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(sh["rope_base"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_vocab_size(sh["n_vocab"])
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(ttypes)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)

    plan = tensors(sh)
    offsets, off = [], 0
    for tname, tshape, kind, _ in plan:
        n = nbytes(tshape, kind)
        if kind == "q4_0":
            w.add_tensor_info(tname, tshape, np.dtype(np.float32), n, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        else:
            w.add_tensor_info(tname, tshape, np.dtype(np.float32), n)
        offsets.append(off)
        off += w.ggml_pad(n, ALIGN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    head = w.fout[0].tell()
    w.close()
    data0 = w.ggml_pad(head, ALIGN)
    total = data0 + off

    rng = np.random.default_rng(seed)
    chunk_blocks = 1 << 20  # 18 MiB per write
    biggest = max((math.prod(t[1]) // QK for t in plan if t[2] == "q4_0"), default=1)
    # random nibble bytes, values 1..15 in each half (-7..7 once 8 is taken off): twice the largest write
    pool_n = 32 * min(chunk_blocks, biggest)
    lo = rng.integers(1, 16, pool_n, dtype=np.uint8)
    pool = lo | (rng.integers(1, 16, pool_n, dtype=np.uint8) << 4)
    del lo
    jobs = []
    for (tname, tshape, kind, std), o in zip(plan, offsets):
        if kind == "q4_0":
            nb = math.prod(tshape) // QK
            d = np.array([std / math.sqrt((15 ** 2 - 1) / 12)], dtype=np.float16).view(np.uint8)
            for b0 in range(0, nb, chunk_blocks):
                jobs.append((data0 + o + b0 * BLOCK, min(chunk_blocks, nb - b0), d,
                             int(rng.integers(0, pool_n - min(chunk_blocks, nb) * 16 + 1))))
        elif kind == "rope":
            jobs.append((data0 + o, rope_freqs(hd, sh["rope_base"]), None, 0))
        else:
            jobs.append((data0 + o, (1.0 + 0.1 * rng.standard_normal(tshape[0])).astype(np.float32), None, 0))

    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, total)

        def one(job):
            pos, what, d, poff = job
            if d is None:
                os.pwrite(fd, what.tobytes(), pos)
                return
            blk = np.empty((what, BLOCK), dtype=np.uint8)
            blk[:, :2] = d
            blk[:, 2:] = pool[poff:poff + what * 16].reshape(what, 16)
            os.pwrite(fd, blk.data, pos)

        with concurrent.futures.ThreadPoolExecutor(threads or os.cpu_count() or 1) as ex:
            for _ in ex.map(one, jobs):
                pass
    finally:
        os.close(fd)
    return {"path": str(path), "bytes": total, "weight_bytes": off, "seconds": round(time.monotonic() - t0, 2),
            "shape": label}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3.1-8b")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(write(a.out, a.shape, a.seed))


if __name__ == "__main__":
    main()
