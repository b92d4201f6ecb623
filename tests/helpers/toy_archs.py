"""Tiny random-weight Hugging Face folders of llama-like architectures other than the product's own (the
numpy backend's verification in tests/converter/test_convert_archs.py); the folders rq-convert's benchmark,
the demo and rq-plan --verify use are the product's: :mod:`rotaryquant.converter.hf_folders`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from rotaryquant.converter.hf_folders import copy_tokenizer, write_safetensors

# (Qwen2ForCausalLM is left out: transformers gives a "qwen2" config its own tokenizer class, whose
# pre-tokenizer hash upstream does not recognise with SmolLM2's vocabulary)
TOY_ARCHS = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM", "MistralForCausalLM")


def toy_folder(arch: str, out: Path, tokenizer_from: Path, *, hidden: int = 128, n_layers: int = 2,
               n_experts: int = 4, ff: int = 256, seed: int = 0) -> Path:
    """A random-weight HF folder of ``arch`` (one of TOY_ARCHS) with the tokenizer of ``tokenizer_from``."""
    if arch not in TOY_ARCHS:
        raise ValueError(f"no toy builder for {arch}; have {', '.join(TOY_ARCHS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(Path(tokenizer_from), out)
    vocab = json.loads((Path(tokenizer_from) / "config.json").read_text())["vocab_size"]
    n_head, n_kv = 4, 2
    hd = hidden // n_head
    mtype = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
             "MixtralForCausalLM": "mixtral", "MistralForCausalLM": "mistral"}[arch]
    cfg = {"architectures": [arch], "model_type": mtype, "hidden_size": hidden, "intermediate_size": ff,
           "num_hidden_layers": n_layers, "num_attention_heads": n_head, "num_key_value_heads": n_kv,
           "head_dim": hd, "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
           "hidden_act": "silu", "tie_word_embeddings": False, "vocab_size": vocab, "bos_token_id": 1,
           "eos_token_id": 2, "torch_dtype": "bfloat16", "attention_bias": arch == "Qwen2ForCausalLM"}
    if arch == "Qwen3MoeForCausalLM":
        cfg.update(num_experts=n_experts, num_experts_per_tok=2, moe_intermediate_size=ff, decoder_sparse_step=1,
                   mlp_only_layers=[], norm_topk_prob=True)
    if arch == "MixtralForCausalLM":
        cfg.update(num_local_experts=n_experts, num_experts_per_tok=2)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    rng = np.random.default_rng(seed)

    def g(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": g(vocab, hidden), "lm_head.weight": g(vocab, hidden),
                                "model.norm.weight": np.ones(hidden, np.float32)}
    for i in range(n_layers):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = 1 + g(hidden)
        t[f"{p}.post_attention_layernorm.weight"] = 1 + g(hidden)
        for proj, rows in (("q_proj", n_head * hd), ("k_proj", n_kv * hd), ("v_proj", n_kv * hd)):
            t[f"{p}.self_attn.{proj}.weight"] = g(rows, hidden)
            if cfg["attention_bias"]:
                t[f"{p}.self_attn.{proj}.bias"] = g(rows)
        t[f"{p}.self_attn.o_proj.weight"] = g(hidden, n_head * hd)
        if arch.startswith("Qwen3"):
            t[f"{p}.self_attn.q_norm.weight"] = 1 + g(hd)
            t[f"{p}.self_attn.k_norm.weight"] = 1 + g(hd)
        if arch == "Qwen3MoeForCausalLM":
            t[f"{p}.mlp.gate.weight"] = g(n_experts, hidden)
            for e in range(n_experts):
                for proj, shape in (("gate_proj", (ff, hidden)), ("up_proj", (ff, hidden)), ("down_proj", (hidden, ff))):
                    t[f"{p}.mlp.experts.{e}.{proj}.weight"] = g(*shape)
        elif arch == "MixtralForCausalLM":
            t[f"{p}.block_sparse_moe.gate.weight"] = g(n_experts, hidden)
            for e in range(n_experts):
                for w, shape in (("w1", (ff, hidden)), ("w3", (ff, hidden)), ("w2", (hidden, ff))):
                    t[f"{p}.block_sparse_moe.experts.{e}.{w}.weight"] = g(*shape)
        else:
            for proj, shape in (("gate_proj", (ff, hidden)), ("up_proj", (ff, hidden)), ("down_proj", (hidden, ff))):
                t[f"{p}.mlp.{proj}.weight"] = g(*shape)
    write_safetensors(out / "model.safetensors", t, dtype="BF16", metadata={"format": "pt"})
    return out
