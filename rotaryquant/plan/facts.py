"""The model as rq-plan sees it: a GGUF header (read by :mod:`rotaryquant.gguf_io`), or an HF folder as
llama.cpp's converter would write it, and the attention facts the costs need."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from rotaryquant import gguf_io, paths
from rotaryquant.converter import hf, kcenter
from rotaryquant.converter.errors import ConvertError
from rotaryquant.converter.writer import StreamingWriter
from rotaryquant.errors import PlanError
from rotaryquant.gguf_io import tensor_bytes

FLOAT_TYPES = (0, 1, 30)  # f32, f16, bf16
INT_TYPES = (24, 25, 26, 27)  # i8, i16, i32, i64


@dataclass
class Header(gguf_io.Header):
    """A GGUF header, and for an HF folder what upstream's converter decided about it."""

    # HF input: upstream's own float-only decisions (tensor -> keep float; None: written as given)
    keep_float: dict[str, bool | None] | None = None
    # HF input: the checkpoint's float types (ggml ids); the skeleton itself holds F32 as upstream hands it over
    source_types: set[int] | None = None

    @property
    def calibrated(self) -> bool:
        return any(k.startswith("rotaryquant.k_center.") for k in self.fields)


def read_header(path: str | Path) -> Header:
    """Parse a GGUF file's metadata and tensor infos; a PlanError that names the file when it cannot."""
    try:
        return gguf_io.read_header(path, cls=Header)
    except gguf_io.GGUFError as e:
        raise PlanError(e.message, fix=e.fix) from None


def write_skeleton(h: Header, types: dict[str, int], out: Path) -> int:
    """``h`` with tensor types changed as ``types`` says, data left as a sparse hole; returns the data size.

    llama.cpp's metadata-only load never reads tensor data, so the skeleton stands for the converted
    file in every memory computation without costing its disk space or the conversion time.
    """
    return gguf_io.write_skeleton(h, types, out)


# --- attention facts ---------------------------------------------------------------------------------

def head_widths(h: Header) -> tuple[int, int]:
    n_embd = int(h.get("embedding_length", 0) or 0)
    heads = h.get("attention.head_count", 1) or 1
    nh = max(int(heads[0] if isinstance(heads, list) else heads), 1)
    dk = int(h.get("attention.key_length", n_embd // nh) or n_embd // nh)
    return dk, int(h.get("attention.value_length", dk) or dk)


def layer_dims(h: Header) -> list[tuple[int, int]]:
    """(n_embd_k_gqa, n_embd_v_gqa) per layer, from the GGUF's attention metadata."""
    n_layer = int(h.get("block_count", 0) or 0)
    n_embd = int(h.get("embedding_length", 0) or 0)
    heads = h.get("attention.head_count", 1) or 1
    kv = h.get("attention.head_count_kv", heads)
    per = lambda x, i: int(x[i] if isinstance(x, list) else x)  # noqa: E731
    out = []
    for i in range(n_layer):
        nh = max(per(heads, i), 1)
        dk = int(h.get("attention.key_length", n_embd // nh) or n_embd // nh)
        dv = int(h.get("attention.value_length", dk) or dk)
        out.append((per(kv, i) * dk, per(kv, i) * dv))
    return out


def calib_possible(h: Header) -> str:
    """'' when rq-calibrate can calibrate this architecture, else why not."""
    if h.arch in kcenter._REFUSED_ARCHS:
        return f"{h.arch} uses {kcenter._REFUSED_ARCHS[h.arch]}"
    if kcenter.k_cache_unhooked(h.arch, h.get):  # MLA, or an arch the library lists
        return f"{h.arch} writes or reuses its K cache in ways K centring does not cover"
    if any(h.get(k) for k in kcenter._SOFTCAP_KEYS):
        return "attention logit soft-capping"
    if h.get("attention.head_count") is None:
        return "no attention layers"
    return ""


# --- inputs -----------------------------------------------------------------------------------------

def resolve(model: str | Path) -> tuple[str, Path]:
    """('gguf', file) or ('hf', folder) for a GGUF, an HF folder or a repo id in the HF cache."""
    p = Path(model).expanduser()
    if p.exists() and not os.access(p, os.R_OK):
        raise PlanError(f"cannot read {p} (permission denied)", fix="check its permissions")
    try:
        return hf.resolve_input(model)
    except ConvertError as e:
        raise PlanError(e.message, fix=e.fix) from None


def hf_header(folder: Path, workdir: Path) -> Header:
    """An HF folder as llama.cpp's converter would write it (metadata, tensor names, shapes), with no data:
    upstream's per-architecture code runs once, exactly as for rq-convert, and nothing is quantised."""
    root = paths.llama_root()
    recs: list[tuple[str, tuple[int, ...], int]] = []
    keep: dict[str, bool | None] = {}
    holder: dict[str, Any] = {}

    def sink(name: str, tensor: Any, raw_dtype: Any) -> None:
        shape = tuple(int(n) for n in tensor.shape)
        if raw_dtype is not None and int(raw_dtype) not in FLOAT_TYPES:
            qt = int(raw_dtype)          # pre-packed by upstream: shape is in bytes
            shape = tuple(int(n) for n in gguf.quant_shape_from_byte_shape(shape, gguf.GGMLQuantizationType(qt)))
        else:
            kind = str(getattr(tensor, "dtype", "float32"))
            qt = 1 if "float16" in kind and "b" not in kind else 0 if "float" in kind else 26
        recs.append((name, shape, qt))
        keep[name] = holder["model"]._rq_keep_float.get(name) if qt in (0, 1) else None
        return None

    try:
        src = hf.inspect_folder(folder, root)
        backend = hf.choose_backend("auto", src.arch)

        def make_writer(arch: str, old: Any) -> StreamingWriter:
            return StreamingWriter(arch, sink=sink, data_file=None, dry_run=True, endianess=old.endianess)

        with hf.quiet_upstream(False):
            model = hf.build_model(src, backend, root, workdir / "source.gguf", make_writer)
            holder["model"] = model
            model.prepare_tensors()
            model.prepare_metadata(vocab_only=False)
    except ConvertError as e:
        raise PlanError(e.message, fix=e.fix) from None
    except Exception as e:  # noqa: BLE001  (upstream raises anything; name the input)
        raise PlanError(f"llama.cpp's converter cannot read {folder} ({type(e).__name__}: {e})",
                        fix="check the folder converts with rq-convert --dry-run") from None
    # gguf-py writes the skeleton's metadata and tensor infos; its data region becomes a sparse hole
    out = workdir / "source.gguf"
    w = gguf.GGUFWriter(path=out, arch=model.gguf_writer.arch)
    w.kv_data = model.gguf_writer.kv_data
    for name, shape, qt in recs:
        ne = tuple(reversed(shape))
        w.add_tensor_info(name, shape, np.dtype(np.float32), tensor_bytes(qt, ne), raw_dtype=gguf.GGMLQuantizationType(qt))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    gguf_io.add_sparse_data(out, w)
    h = read_header(out)
    h.keep_float = keep
    st = {"F32": 0, "F16": 1, "BF16": 30, "F64": 0}
    h.source_types = {st[d] for sh in src.shards for d, shape in sh.tensors.values() if d in st and len(shape) >= 2}
    return h
