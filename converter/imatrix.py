"""llama.cpp importance matrices (the GGUF files llama-imatrix writes).

Per weight tensor ``NAME`` the file holds ``NAME.in_sum2`` (F32, ne = [n_per_row, n_mat]: summed squared
activations per input column, one row per expert) and ``NAME.counts`` (F32, ne = [1, n_mat]: tokens seen).
llama-quantize divides one by the other (a matrix that saw no token gets all ones); so does this loader,
giving ``{NAME: array (n_mat, n_per_row)}`` ready for the quantisers and the activation-kurtosis rule.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from rotaryquant import gguf_io
from rotaryquant.converter.errors import ConvertError
from rotaryquant.files import publish


def load_imatrix(path: str | Path) -> dict[str, np.ndarray]:
    p = Path(path)
    if not p.is_file():
        raise ConvertError(f"imatrix {p} does not exist", fix="pass the GGUF file llama-imatrix wrote (-o FILE)")
    try:
        r = gguf_io.open_reader(p, fix="pass the GGUF file llama-imatrix writes (the legacy .dat format is not supported)")
    except gguf_io.GGUFError as e:
        raise ConvertError(f"imatrix {e.message}", fix=e.fix) from None
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for t in r.tensors:
        if t.tensor_type != GGMLQuantizationType.F32:
            raise ConvertError(f"imatrix {p}: tensor {t.name} is {t.tensor_type.name}, expected F32")
        a = np.asarray(t.data, dtype=np.float32).reshape(tuple(int(n) for n in reversed(t.shape)))
        if t.name.endswith(".in_sum2"):
            sums[t.name[:-len(".in_sum2")]] = a.reshape(-1, a.shape[-1])
        elif t.name.endswith(".counts"):
            counts[t.name[:-len(".counts")]] = a.reshape(-1)
    if not sums:
        raise ConvertError(f"imatrix {p} holds no *.in_sum2 tensors", fix="is it an imatrix file from llama-imatrix?")
    out: dict[str, np.ndarray] = {}
    for name, s in sums.items():
        c = counts.get(name)
        if c is None or c.size != s.shape[0]:
            raise ConvertError(f"imatrix {p}: {name} has sums for {s.shape[0]} matrices but "
                               f"{'no' if c is None else c.size} counts")
        c = np.round(c).astype(np.float32)[:, None]
        out[name] = np.where(c > 0, s / np.where(c > 0, c, 1), 1.0).astype(np.float32)
    return out


def check_shape(imatrix: np.ndarray, name: str, shape: tuple[int, ...]) -> None:
    """The importance rows must match the tensor's columns and its number of matrices (experts)."""
    n_mat = int(np.prod(shape[:-2])) if len(shape) > 2 else 1
    if imatrix.shape[-1] != shape[-1] or imatrix.shape[0] not in (1, n_mat):
        raise ConvertError(f"imatrix entry for {name} has shape {imatrix.shape}, the tensor has {n_mat} "
                           f"matri{'x' if n_mat == 1 else 'ces'} of {shape[-1]} columns",
                           fix="was the imatrix computed on this model?")


def subset_imatrix(src: str | Path, dst: str | Path, names: list[str] | set[str]) -> Path:
    """Copy only ``names``' entries of the imatrix ``src`` to ``dst`` (written to a temp file, renamed): an
    A/B of one type on a tensor set, where an importance matrix must not also improve (or, through the
    activation-kurtosis rule, re-type) the tensors outside it."""
    src, dst = Path(src), Path(dst)
    load_imatrix(src)                                   # the same checks and errors as a full load
    r = gguf_io.open_reader(src)
    keep = {f"{n}{suffix}" for n in names for suffix in (".in_sum2", ".counts")}
    tensors = [t for t in r.tensors if t.name in keep]
    missing = sorted(set(names) - {t.name[:-len(".in_sum2")] for t in tensors if t.name.endswith(".in_sum2")})
    if missing:
        raise ConvertError(f"imatrix {src} has no entry for {missing[0]}" +
                           (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                           fix="compute the imatrix on this model (llama-imatrix -m MODEL)")
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    os.close(fd)
    try:
        w = GGUFWriter(tmp, "imatrix")
        w.add_string("general.type", "imatrix")
        f = r.get_field("imatrix.datasets")
        w.add_array("imatrix.datasets", [bytes(f.parts[i]).decode() for i in f.data] if f else [src.name])
        for key in ("imatrix.chunk_count", "imatrix.chunk_size"):
            if (f := r.get_field(key)) is not None:
                w.add_uint32(key, int(f.parts[f.data[0]][0]))
        for t in tensors:
            w.add_tensor(t.name, np.asarray(t.data, np.float32).reshape(tuple(int(n) for n in reversed(t.shape))))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        publish(tmp, dst)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return dst
