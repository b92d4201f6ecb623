#!/usr/bin/env python3
"""Write a Qwen2-shaped GGUF with random F16 weights (speed benchmarks only: the output is noise).

    PYTHONPATH=<tree>/vendor/llama.cpp/gguf-py python3 scripts/cuda/make-random-model.py OUT.gguf

Default shape: head size 128 (the IsoQuant block), 8 query / 2 KV heads (GQA 4), n_embd 1024,
n_ff 2816 and every matrix's input size a multiple of 256, so that ITQ3_S can take every layer.
Weights ~ N(0, 0.02), norms 1: activations stay finite through all layers. The vocabulary is a
SentencePiece-style list (3 specials, 256 byte tokens, fillers); llama-bench draws random tokens.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--n-embd", type=int, default=1024)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--n-head-kv", type=int, default=2)
    ap.add_argument("--n-ff", type=int, default=2816)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-vocab", type=int, default=32000)
    ap.add_argument("--n-ctx", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=20261129)
    ns = ap.parse_args(argv)

    import gguf  # the vendored gguf-py (knows the RotaryQuant type ids)

    head = ns.n_embd // ns.n_head
    if head * ns.n_head != ns.n_embd or ns.n_head % ns.n_head_kv:
        print("make-random-model: n_embd must be n_head * head size and n_head a multiple of n_head_kv", file=sys.stderr)
        return 2
    rng = np.random.default_rng(ns.seed)

    def w(*shape: int) -> np.ndarray:  # numpy shape (rows, cols) = ggml (ne0 = cols, ne1 = rows)
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    wr = gguf.GGUFWriter(ns.out, "qwen2")
    wr.add_name("rq-random-qwen2")
    wr.add_context_length(ns.n_ctx)
    wr.add_embedding_length(ns.n_embd)
    wr.add_block_count(ns.n_layer)
    wr.add_feed_forward_length(ns.n_ff)
    wr.add_head_count(ns.n_head)
    wr.add_head_count_kv(ns.n_head_kv)
    wr.add_rope_freq_base(1000000.0)
    wr.add_layer_norm_rms_eps(1e-6)
    wr.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"t{i}" for i in range(ns.n_vocab - len(tokens))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * (ns.n_vocab - len(types))
    wr.add_tokenizer_model("llama")
    wr.add_token_list(tokens)
    wr.add_token_scores([0.0] * ns.n_vocab)
    wr.add_token_types(types)
    wr.add_unk_token_id(0)
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    wr.add_add_bos_token(True)

    kv = head * ns.n_head_kv
    ones = np.ones(ns.n_embd, dtype=np.float32)
    wr.add_tensor("token_embd.weight", w(ns.n_vocab, ns.n_embd))
    wr.add_tensor("output_norm.weight", ones)
    wr.add_tensor("output.weight", w(ns.n_vocab, ns.n_embd))
    for i in range(ns.n_layer):
        p = f"blk.{i}."
        wr.add_tensor(p + "attn_norm.weight", ones)
        wr.add_tensor(p + "attn_q.weight", w(ns.n_embd, ns.n_embd))
        wr.add_tensor(p + "attn_q.bias", np.zeros(ns.n_embd, dtype=np.float32))
        wr.add_tensor(p + "attn_k.weight", w(kv, ns.n_embd))
        wr.add_tensor(p + "attn_k.bias", np.zeros(kv, dtype=np.float32))
        wr.add_tensor(p + "attn_v.weight", w(kv, ns.n_embd))
        wr.add_tensor(p + "attn_v.bias", np.zeros(kv, dtype=np.float32))
        wr.add_tensor(p + "attn_output.weight", w(ns.n_embd, ns.n_embd))
        wr.add_tensor(p + "ffn_norm.weight", ones)
        wr.add_tensor(p + "ffn_gate.weight", w(ns.n_ff, ns.n_embd))
        wr.add_tensor(p + "ffn_up.weight", w(ns.n_ff, ns.n_embd))
        wr.add_tensor(p + "ffn_down.weight", w(ns.n_embd, ns.n_ff))

    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    n = ns.n_layer * (2 * ns.n_embd * ns.n_embd + 2 * kv * ns.n_embd + 3 * ns.n_ff * ns.n_embd) + 2 * ns.n_vocab * ns.n_embd
    print(f"make-random-model: {ns.out}: qwen2, {ns.n_layer} layers, head {head}, {ns.n_head}/{ns.n_head_kv} heads, "
          f"{n / 1e6:.0f}M weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
