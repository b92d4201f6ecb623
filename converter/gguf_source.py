"""GGUF input (requantisation): every tensor is dequantised to float32 and goes through the same
planner/quantiser as an HF conversion; metadata is copied (the tokenizer and hyper-parameters are
already in llama.cpp's form), except the keys that describe the old quantisation.

Dequantisation: ggml's own ``to_float`` (through rotaryquant.bindings: what llama.cpp itself decodes)
for every quantised type, gguf-py's numpy ``gguf.quants`` as the fallback (it knows our types too: patch
0005 registers ``rotaryquant.quants.gguf_quants``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np

from rotaryquant import bindings, gguf_io
from rotaryquant.converter.errors import ConvertError
from rotaryquant.errors import MissingBuildError

# keys not copied: written afresh by the writer / the converter, or meaningless in one new file
_SKIP_KEYS = ("GGUF.", "general.architecture", "general.file_type", "general.quantization_version",
              "general.alignment", "split.", "rotaryquant.converter.", "quantize.imatrix.")


def open_gguf(path: Path) -> Any:
    """gguf_io.open_reader's reader of a whole model GGUF (not a shard, not an imatrix or LoRA); ConvertError."""
    try:
        r = gguf_io.open_reader(path)
    except gguf_io.GGUFError as e:
        raise ConvertError(e.message, fix=e.fix) from None
    f = r.fields.get("split.count")
    if f is not None and int(f.contents()) > 1:
        raise ConvertError(f"{path} is one shard of a split GGUF", fix="merge it first (llama-gguf-split --merge)")
    if r.fields.get("general.architecture") is None:
        raise ConvertError(f"{path} has no general.architecture", fix="is it a model GGUF (not an imatrix/LoRA)?")
    return r


def architecture(r: Any) -> str:
    return str(r.fields["general.architecture"].contents())


def copy_metadata(r: Any, writer: Any) -> None:
    # lazy: gguf is set-up's install from the tree; rq-calibrate --help skips its 0.1 s import
    from gguf import GGUFValueType

    for key, f in r.fields.items():
        if key.startswith(_SKIP_KEYS) or key in _SKIP_KEYS:
            continue
        vtype = GGUFValueType(f.types[0])
        sub = GGUFValueType(f.types[-1]) if vtype == GGUFValueType.ARRAY and len(f.types) > 1 else None
        if sub == GGUFValueType.ARRAY:
            continue  # nested arrays: no model key uses them
        writer.set_kv(key, f.contents(), vtype, sub)


def dequantize(t: Any) -> np.ndarray:
    """One GGUF tensor as float32 in numpy order (..., rows, cols)."""
    # lazy: gguf is set-up's install from the tree; rq-calibrate --help skips its 0.1 s import
    from gguf import GGMLQuantizationType as QT

    # lazy: gguf is set-up's install from the tree; rq-calibrate --help skips its 0.1 s import
    from gguf import quants

    shape = tuple(int(n) for n in reversed(t.shape))
    qt = t.tensor_type
    if qt == QT.F32:
        return np.asarray(t.data, dtype=np.float32).reshape(shape)
    if qt in (QT.F16, QT.BF16, QT.F64):
        return np.asarray(quants.dequantize(t.data, qt), dtype=np.float32).reshape(shape)
    raw = np.asarray(t.data, dtype=np.uint8).reshape(-1, t.data.shape[-1])
    try:
        # ggml's own to_float: the exact decoder llama.cpp uses, and ~10x faster than gguf-py's numpy one

        return bindings.dequantize(raw, int(qt), shape[-1]).reshape(shape)
    except (ValueError, OSError, RuntimeError, MissingBuildError):  # no build: gguf-py's decoder
        return np.asarray(quants.dequantize(raw, qt), dtype=np.float32).reshape(shape)


def tensors(r: Any) -> Iterator[tuple[str, Any]]:
    for t in r.tensors:
        yield t.name, t


def stored_f32(t: Any) -> bool:
    # lazy: gguf is set-up's install from the tree; rq-calibrate --help skips its 0.1 s import
    from gguf import GGMLQuantizationType as QT

    return t.tensor_type == QT.F32
