"""Tensor roles from GGUF tensor names (llama.cpp's naming, the same for every architecture).

| role         | GGUF names                                               |
|--------------|----------------------------------------------------------|
| token_embd   | ``token_embd.weight`` (and ``per_layer_token_embd``)     |
| output       | ``output.weight`` (the LM head)                          |
| ffn_routed   | ``blk.N.ffn_{gate,up,down,gate_up}_exps.weight``, ``*_chexps`` |
| ffn_shared   | ``blk.N.ffn_{gate,up,down}_shexp.weight``                 |
| attention    | ``blk.N.attn_*.weight`` (q, k, v, output, qkv, MLA a/b ...) |
| ffn_dense    | ``blk.N.ffn_{gate,up,down}.weight``                        |
| router       | ``ffn_gate_inp*`` (kept F32, as llama.cpp does)            |
| norm         | ``*_norm.weight`` (kept F32)                               |
| vector       | any other 1-D tensor: biases, scales (kept F32)            |
| other        | any other 2-D+ weight                                      |
"""

from __future__ import annotations

import re

TOKEN_EMBD = "token_embd"
OUTPUT = "output"
ATTENTION = "attention"
FFN_DENSE = "ffn_dense"
FFN_ROUTED = "ffn_routed"
FFN_SHARED = "ffn_shared"
ROUTER = "router"
NORM = "norm"
VECTOR = "vector"
OTHER = "other"

ROLES = (TOKEN_EMBD, OUTPUT, ATTENTION, FFN_DENSE, FFN_ROUTED, FFN_SHARED, OTHER, ROUTER, NORM, VECTOR)
KEPT_F32 = (ROUTER, NORM, VECTOR)
# roles whose type a recipe chooses (the rest keep F32)
QUANTISABLE = (TOKEN_EMBD, OUTPUT, ATTENTION, FFN_DENSE, FFN_ROUTED, FFN_SHARED, OTHER)
# roles the kurtosis rule may promote (embeddings/output follow llama.cpp's own choice)
PROMOTABLE = (ATTENTION, FFN_DENSE, FFN_ROUTED, FFN_SHARED, OTHER)

_ROUTED = re.compile(r"\.ffn_[a-z_]*_(exps|chexps)\.")
_SHARED = re.compile(r"\.ffn_[a-z_]*_shexp\.")
_DENSE = re.compile(r"\.ffn_(gate|up|down|gate_up)\.")


def classify(name: str, n_dims: int) -> str:
    """The role of a GGUF tensor (see the module table)."""
    if name.endswith("_norm.weight") or "_norm." in name:
        return NORM
    if n_dims <= 1:
        return VECTOR
    base = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
    if base in ("token_embd", "per_layer_token_embd"):
        return TOKEN_EMBD
    if base == "output":
        return OUTPUT
    if ".ffn_gate_inp" in name:
        return ROUTER
    if _ROUTED.search(name):
        return FFN_ROUTED
    if _SHARED.search(name):
        return FFN_SHARED
    if ".attn_" in name:
        return ATTENTION
    if _DENSE.search(name):
        return FFN_DENSE
    return OTHER


def layer(name: str) -> int | None:
    """N of a layer tensor's name (``blk.N.``), None for the others."""
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def n_layers(names: list[str] | tuple[str, ...]) -> int | None:
    """Layers of a GGUF's tensor names: the highest N + 1, None when there are none."""
    idx = [i for n in names if (i := layer(n)) is not None]
    return max(idx) + 1 if idx else None
