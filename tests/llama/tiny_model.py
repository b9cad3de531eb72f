"""A tiny random-weight llama GGUF for llama-server tests (no download).

    python tests/llama/tiny_model.py OUT.gguf [--seed N]

Architecture "llama": 4 layers, n_embd 256, 4 heads of 64 (no GQA), FFN 512,
F32 weights drawn from a seeded generator, so the same seed always gives the
same bytes. Vocabulary: SentencePiece-style ("llama" tokenizer) with
<unk>/<s>/</s>, the 256 byte-fallback tokens <0x00>..<0xFF> and the printable
ASCII characters (and "▁" + letter), enough for llama.cpp to tokenize any
text. The output projection is scaled up so greedy decoding has clear
winners (no near ties that rounding could flip).

KV bytes per token (F16 cache): 4 layers x (K 256 + V 256) x 2 B = 4 KiB.

Other shapes (layers, width, heads, GQA) are keyword arguments of write();
kv_row_bytes() gives the bytes of one cell of one K or V tensor.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

N_LAYER = 4
N_EMBD = 256
N_HEAD = 4
N_HEAD_KV = 4
N_FF = 512
N_CTX_TRAIN = 16384

KV_BYTES_PER_TOKEN_F16 = N_LAYER * 2 * (N_EMBD // N_HEAD * N_HEAD_KV) * 2


def vocab() -> tuple[list[str], list[float], list[int]]:
    import gguf

    T = gguf.TokenType
    toks: list[str] = ["<unk>", "<s>", "</s>"]
    types: list[int] = [T.UNKNOWN, T.CONTROL, T.CONTROL]
    for b in range(256):
        toks.append(f"<0x{b:02X}>")
        types.append(T.BYTE)
    normal = ["\u2581"] + [chr(c) for c in range(33, 127)] + ["\u2581" + chr(c) for c in range(ord("a"), ord("z") + 1)]
    for t in normal:
        toks.append(t)
        types.append(T.NORMAL)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(normal))]
    return toks, scores, [int(t) for t in types]


def kv_row_bytes(n_embd: int = N_EMBD, n_head: int = N_HEAD, n_head_kv: int = N_HEAD_KV, kv_type: str = "f16",
                 head_dim: int | None = None) -> int:
    """Bytes of one cell of one K (or V) tensor: n_embd_k_gqa elements."""
    n = (head_dim or n_embd // n_head) * n_head_kv
    if kv_type == "f16":
        return 2 * n
    if kv_type == "q8_0":
        assert n % 32 == 0, n
        return n // 32 * 34
    raise ValueError(kv_type)


def write(path: str | pathlib.Path, seed: int = 0, name: str = "tiny-llama", *, n_layer: int = N_LAYER,
          n_embd: int = N_EMBD, n_head: int = N_HEAD, n_head_kv: int = N_HEAD_KV, n_ff: int = N_FF,
          head_dim: int | None = None, text_only: bool = False) -> pathlib.Path:
    """text_only: the output rows of the control and byte tokens are zero, so
    greedy decoding picks a whole-character token every time (their logits
    are 0, the best of the 127 others is positive): output that is always
    valid UTF-8. llama.cpp b10760's server (Ollama v0.34.0's pin) answers a
    stream whose text ends in a partial UTF-8 sequence with an error ("does
    not match the expected Content-only format"); b11076 and 0c1e570 do not.
    head_dim: the heads' width when it is not n_embd / n_head (GGUF
    key_length/value_length): a real model's KV geometry (layers, KV heads,
    head width) on a narrow, cheap residual stream."""
    import gguf

    N_LAYER, N_EMBD, N_HEAD, N_HEAD_KV, N_FF = n_layer, n_embd, n_head, n_head_kv, n_ff  # noqa: N806
    path = pathlib.Path(path)
    rng = np.random.default_rng(seed)
    toks, scores, types = vocab()
    n_vocab = len(toks)
    head_dim = head_dim or N_EMBD // N_HEAD
    n_q = head_dim * N_HEAD

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"{name}-seed{seed}")
    w.add_context_length(N_CTX_TRAIN)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(head_dim)
    if n_q != N_EMBD:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(n_vocab)

    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)

    def mat(rows: int, cols: int, std: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    s = 1.0 / np.sqrt(N_EMBD)
    w.add_tensor("token_embd.weight", mat(n_vocab, N_EMBD, 1.0))
    for i in range(N_LAYER):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm(N_EMBD))
        w.add_tensor(f"blk.{i}.attn_q.weight", mat(n_q, N_EMBD, 2 * s))
        w.add_tensor(f"blk.{i}.attn_k.weight", mat(head_dim * N_HEAD_KV, N_EMBD, 2 * s))
        w.add_tensor(f"blk.{i}.attn_v.weight", mat(head_dim * N_HEAD_KV, N_EMBD, s))
        w.add_tensor(f"blk.{i}.attn_output.weight", mat(N_EMBD, n_q, 1.0 / np.sqrt(n_q)))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm(N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(N_FF, N_EMBD, s))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(N_FF, N_EMBD, s))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(N_EMBD, N_FF, 1.0 / np.sqrt(N_FF)))
    w.add_tensor("output_norm.weight", norm(N_EMBD))
    out = mat(n_vocab, N_EMBD, 0.5)
    if text_only:
        out[: 3 + 256] = 0.0  # <unk>, <s>, </s> and the byte tokens: never the argmax
    w.add_tensor("output.weight", out)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(write(a.out, a.seed))


if __name__ == "__main__":
    main()
