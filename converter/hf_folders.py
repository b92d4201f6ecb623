"""Hugging Face folders made locally, for ``make demo``, the converter benchmark, ``rq-plan --verify`` and the
tests: the packaged SmolLM2 GGUF turned back into an HF folder, and a tiny random-weight Qwen2-MoE folder with a
shared expert (no model hub is reachable; the real models are the packaged ones that ``rotaryquant.assets``
fetches). rq-convert's input, made here: no module of the conversion imports this one.

numpy + ``tokenizers`` only (no torch): tensors are dequantised with gguf-py, llama.cpp's Q/K row
permutation is undone, names are mapped back to transformers' ``LlamaForCausalLM`` names, and the
byte-level BPE tokenizer is rebuilt from the GGUF vocabulary and merges.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from rotaryquant import gguf_io
from rotaryquant.converter.dtypes import SAFETENSORS_DTYPES, f32_to_bf16_bits

__all__ = ["write_safetensors", "smollm2_hf_folder", "qwen2moe_toy_folder", "heavy_tailed", "copy_tokenizer"]


def _as_st(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return f32_to_bf16_bits(np.asarray(a, dtype=np.float32))
    return np.ascontiguousarray(a, dtype=SAFETENSORS_DTYPES[dtype][0])


def write_safetensors(path: Path, tensors: Iterable[tuple[str, np.ndarray]] | dict[str, np.ndarray],
                      dtype: str = "BF16", metadata: dict[str, str] | None = None) -> Path:
    """Write a .safetensors file. ``tensors``: name -> float array (converted to ``dtype``), or pairs.

    Two passes over an iterable would need it twice, so arrays are converted and kept: fine for the
    small folders this module makes (one shard per layer group keeps the peak low for SmolLM2).
    """
    items = list(tensors.items()) if isinstance(tensors, dict) else list(tensors)
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    arrays = []
    off = 0
    for name, a in items:
        dt = dtype if np.issubdtype(np.asarray(a).dtype, np.floating) else \
            {np.dtype(np.int64): "I64", np.dtype(np.int32): "I32"}.get(np.asarray(a).dtype, dtype)
        st = _as_st(a, dt)
        header[name] = {"dtype": dt, "shape": list(np.asarray(a).shape), "data_offsets": [off, off + st.nbytes]}
        off += st.nbytes
        arrays.append(st)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    path = Path(path)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for st in arrays:
            f.write(st.tobytes())
    return path


# --- SmolLM2 GGUF -> HF ---------------------------------------------------------------------------

_LLAMA_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's LlamaModel.permute (rows of each head: interleaved -> halves)."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _gguf_tensors(reader, keep_layers: int) -> Iterator[tuple[str, np.ndarray]]:
    from gguf.quants import dequantize  # lazy: gguf is set-up's install from the tree

    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= keep_layers:
            continue
        yield t.name, np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
            tuple(int(n) for n in reversed(t.shape)))


def _tokenizer_files(reader, out: Path) -> None:
    """tokenizer.json / tokenizer_config.json for a GGUF with a byte-level BPE ("gpt2") vocabulary."""
    # lazy: heavy (transformers' tokenizer library), needed only when a folder is made
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre")
    if model != "gpt2" or pre not in ("smollm",):
        raise ValueError(f"rebuilding a tokenizer is implemented for gpt2/smollm vocabularies, not {model}/{pre}")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    specials = [AddedToken(tokens[i], special=True, normalized=False) for i, ty in enumerate(types) if ty == 3]
    tok.add_special_tokens(specials)
    tok.save(str(out / "tokenizer.json"))

    def tid(key: str) -> str | None:
        i = _field(reader, key)
        return None if i is None else tokens[int(i)]

    cfg = {"add_prefix_space": False, "clean_up_tokenization_spaces": False, "model_max_length": 8192,
           "tokenizer_class": "GPT2Tokenizer", "bos_token": tid("tokenizer.ggml.bos_token_id"),
           "eos_token": tid("tokenizer.ggml.eos_token_id"), "unk_token": tid("tokenizer.ggml.unknown_token_id"),
           "pad_token": tid("tokenizer.ggml.padding_token_id"), "vocab_size": len(tokens),
           "additional_special_tokens": [t.content for t in specials]}
    if (tmpl := _field(reader, "tokenizer.chat_template")) is not None:
        cfg["chat_template"] = tmpl
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())


def smollm2_hf_folder(gguf_path: Path, out: Path, *, n_layers: int | None = None, dtype: str = "BF16",
                      layers_per_shard: int = 8) -> Path:
    """Rebuild an HF LlamaForCausalLM folder from the packaged SmolLM2 GGUF.

    ``n_layers`` keeps only the first layers (a small real-weight model for fast tests). Weights are
    written ``dtype`` (BF16 like the published checkpoint) in shards with a weight map, so the
    sharded-checkpoint path is exercised too.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    r = gguf_io.open_reader(gguf_path)
    arch = _field(r, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path} is a {arch} model; only llama GGUFs can be rebuilt")
    n_head = int(_field(r, "llama.attention.head_count"))
    n_kv = int(_field(r, "llama.attention.head_count_kv"))
    n_block = int(_field(r, "llama.block_count"))
    keep = n_block if n_layers is None else min(n_layers, n_block)
    names = {t.name for t in r.tensors}
    tied = "output.weight" not in names
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": int(_field(r, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_field(r, "tokenizer.ggml.eos_token_id", 2)), "hidden_act": "silu",
        "hidden_size": int(_field(r, "llama.embedding_length")),
        "intermediate_size": int(_field(r, "llama.feed_forward_length")),
        "max_position_embeddings": int(_field(r, "llama.context_length")),
        "num_attention_heads": n_head, "num_hidden_layers": keep, "num_key_value_heads": n_kv,
        "rms_norm_eps": float(_field(r, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(r, "llama.rope.freq_base", 10000.0)), "rope_scaling": None,
        "tie_word_embeddings": tied, "torch_dtype": {"BF16": "bfloat16", "F16": "float16"}.get(dtype, "float32"),
        "vocab_size": int(_field(r, "llama.vocab_size")), "use_cache": True,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}))
    _tokenizer_files(r, out)

    shards: dict[int, list[tuple[str, np.ndarray]]] = {}
    for name, w in _gguf_tensors(r, keep):
        if name.startswith("blk."):
            _, b, role, _ = name.split(".")
            bid = int(b)
            if bid >= keep:
                continue
            if role == "attn_q":
                w = _unpermute(w, n_head)
            elif role == "attn_k":
                w = _unpermute(w, n_kv)
            hf = f"model.layers.{bid}.{_LLAMA_NAMES[role]}.weight"
            shard = 1 + bid // layers_per_shard
        else:
            hf = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}.get(name)
            if hf is None:
                continue  # rope_freqs and the like are regenerated by the converter
            shard = 0
        shards.setdefault(shard, []).append((hf, w))
    n = len(shards)
    weight_map = {}
    for i, k in enumerate(sorted(shards)):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        write_safetensors(out / fname, shards[k], dtype=dtype, metadata={"format": "pt"})
        weight_map.update({hf: fname for hf, _ in shards[k]})
        shards[k] = []
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return out


# --- a tiny random Qwen2-MoE with a shared expert ---------------------------------------------------

def heavy_tailed(rng: np.random.Generator, shape: tuple[int, ...], std: float, p: float = 0.1, s: float = 4.0):
    """Gaussian scale mixture N(0, 1) * (s with probability p else 1): excess kurtosis
    3 (1 - p + p s^4) / (1 - p + p s^2)^2 - 3 (9.72 for p = 0.1, s = 4 — the paper's shared expert: 10.10)."""
    scale = np.where(rng.random(shape) < p, s, 1.0)
    norm = np.sqrt(1 - p + p * s * s)
    return (rng.standard_normal(shape) * scale / norm * std).astype(np.float32)


def qwen2moe_toy_folder(out: Path, tokenizer_from: Path, *, hidden: int = 256, n_layers: int = 2,
                        n_experts: int = 4, n_used: int = 2, moe_ff: int = 256, shared_ff: int = 512,
                        heavy_shared: bool = True, seed: int = 0, dtype: str = "BF16") -> Path:
    """A random-weight Qwen2MoeForCausalLM folder (per-expert tensors, a shared expert with its gate).

    The shared expert's weights are heavy-tailed (``heavy_tailed``, kurtosis ~9.7) and the routed experts
    Gaussian (kurtosis ~0), mimicking the paper's kappa = 10.10 vs 0.41. The tokenizer files are copied
    from ``tokenizer_from`` (the rebuilt SmolLM2 folder), so the vocabulary is 49152 entries.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(Path(tokenizer_from), out)
    vocab = json.loads((Path(tokenizer_from) / "config.json").read_text())["vocab_size"]
    n_head, n_kv, head_dim = 4, 2, hidden // 4
    cfg = {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": hidden,
        "intermediate_size": moe_ff * 2, "moe_intermediate_size": moe_ff,
        "shared_expert_intermediate_size": shared_ff, "num_experts": n_experts,
        "num_experts_per_tok": n_used, "num_hidden_layers": n_layers, "num_attention_heads": n_head,
        "num_key_value_heads": n_kv, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": False, "max_position_embeddings": 4096, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "vocab_size": vocab,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", "use_sliding_window": False,
        "output_router_logits": False, "router_aux_loss_coef": 0.001, "attention_dropout": 0.0,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    rng = np.random.default_rng(seed)

    def g(*shape: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": g(vocab, hidden),
                                "model.norm.weight": np.ones(hidden, np.float32),
                                "lm_head.weight": g(vocab, hidden)}
    for i in range(n_layers):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = np.ones(hidden, np.float32)
        t[f"{p}.post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
        t[f"{p}.self_attn.q_proj.weight"] = g(n_head * head_dim, hidden)
        t[f"{p}.self_attn.q_proj.bias"] = g(n_head * head_dim)
        t[f"{p}.self_attn.k_proj.weight"] = g(n_kv * head_dim, hidden)
        t[f"{p}.self_attn.k_proj.bias"] = g(n_kv * head_dim)
        t[f"{p}.self_attn.v_proj.weight"] = g(n_kv * head_dim, hidden)
        t[f"{p}.self_attn.v_proj.bias"] = g(n_kv * head_dim)
        t[f"{p}.self_attn.o_proj.weight"] = g(hidden, n_head * head_dim)
        t[f"{p}.mlp.gate.weight"] = g(n_experts, hidden)
        for e in range(n_experts):
            t[f"{p}.mlp.experts.{e}.gate_proj.weight"] = g(moe_ff, hidden)
            t[f"{p}.mlp.experts.{e}.up_proj.weight"] = g(moe_ff, hidden)
            t[f"{p}.mlp.experts.{e}.down_proj.weight"] = g(hidden, moe_ff)
        for proj, shape in (("gate_proj", (shared_ff, hidden)), ("up_proj", (shared_ff, hidden)),
                            ("down_proj", (hidden, shared_ff))):
            t[f"{p}.mlp.shared_expert.{proj}.weight"] = (heavy_tailed(rng, shape, 0.02) if heavy_shared
                                                         else g(*shape))
        t[f"{p}.mlp.shared_expert_gate.weight"] = g(1, hidden)
    write_safetensors(out / "model.safetensors", t, dtype=dtype, metadata={"format": "pt"})
    return out
