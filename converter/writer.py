"""A streaming GGUFWriter: each tensor is typed, quantised and spilled to disk the moment it arrives.

gguf-py's writer keeps every tensor in memory until the header (which lists all tensors) can be
written. Ours hands each tensor to a *sink* (the planner + quantiser) inside ``add_tensor``, appends
the resulting bytes to a data file in the output folder and keeps only the tensor's name, shape and
type; at the end the header, metadata and tensor infos go into the output file and the data file is
copied after them. Peak memory is therefore about one tensor (plus the converter's own working copy),
whatever the model size. The upstream converter drives it unchanged (``ModelBase.write()``).
"""

from __future__ import annotations

from typing import Any, BinaryIO, Callable, Sequence

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.gguf_writer import GGUFValue

Sink = Callable[[str, np.ndarray, "GGMLQuantizationType | None"], "tuple[np.ndarray, GGMLQuantizationType] | None"]

META_PREFIX = "rotaryquant.converter."


class StreamingWriter(GGUFWriter):
    """GGUFWriter whose ``add_tensor`` routes data through ``sink`` and spills it to ``data_file``.

    ``sink(name, array, raw_dtype)`` returns ``(array, type)`` to write, or None to write the tensor
    as given (tensors the converter does not re-type: integer tables, pre-packed bytes). With
    ``dry_run`` nothing is kept or written (the sink still sees, and plans, every tensor).
    ``before_header`` runs just before the header is written (the final metadata goes in there).
    """

    def __init__(self, arch: str, *, sink: Sink, data_file: BinaryIO | None, dry_run: bool = False,
                 before_header: Callable[["StreamingWriter"], None] | None = None, **kwargs: Any) -> None:
        super().__init__(path=None, arch=arch, use_temp_file=True, **kwargs)
        self.temp_file = data_file  # type: ignore[assignment]  (a real file: np.tofile needs one)
        self.sink = sink
        self.dry_run_plan = dry_run
        self.before_header = before_header
        self.upstream_file_type: int | None = None
        self.written_bytes = 0

    def add_tensor(self, name: str, tensor: np.ndarray, raw_shape: Sequence[int] | None = None,
                   raw_dtype: GGMLQuantizationType | None = None, tensor_endianess: Any = None) -> None:
        res = self.sink(name, tensor, raw_dtype)
        if self.dry_run_plan:
            return
        if res is not None:
            tensor, raw_dtype = res
            raw_shape = None
        super().add_tensor(name, tensor, raw_shape=raw_shape, raw_dtype=raw_dtype,
                           tensor_endianess=tensor_endianess)
        self.written_bytes += tensor.nbytes

    def add_file_type(self, ftype: int) -> None:
        # the upstream converter writes the ftype it was run with (F32 here); the truthful one is set
        # in before_header, once every tensor's type is known
        self.upstream_file_type = int(ftype)

    def set_kv(self, key: str, value: Any, vtype: GGUFValueType, sub_type: GGUFValueType | None = None) -> None:
        """Set (or replace, silently) one metadata entry."""
        self.kv_data[0][key] = GGUFValue(value=value, type=vtype, sub_type=sub_type)

    def write_header_to_file(self, path: Any = None) -> None:
        if self.before_header is not None:
            self.before_header(self)
        super().write_header_to_file(path)
