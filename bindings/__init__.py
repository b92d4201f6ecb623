"""Python glue to the patched llama.cpp: our type ids, ggml (de)quantisation, IsoQuant counters, per-context settings.

``llama_cpp`` itself is the user API (``llama_cpp.Llama(..., type_k=..., type_v=..., flash_attn=True)``);
set-up installs it on top of our build, so nothing here replaces it.
"""

from rotaryquant.bindings.context import KV_STATS, apply, kv_stats, llama_kwargs, unhooked_archs
from rotaryquant.bindings.ggml import (
    COUNTERS,
    GGMLType,
    RQTypeError,
    counters,
    cpu_avx512,
    cpu_split,
    dequantize,
    iso_roundtrip,
    iso_variant,
    lib_dir,
    quantize,
    reset_counters,
    row_size,
    rq_version,
    set_cpu_avx512,
    set_cpu_split,
    set_iso_skip_inverse,
    set_iso_variant,
    type_from_name,
    type_name,
    type_names,
    validate_kv_spec,
)
from rotaryquant.bindings.tools import bin_dir, binary
from rotaryquant.kvtypes import ISO_TYPES  # the IsoQuant types: a table of names, kvtypes' (no library needed)

__all__ = [
    "COUNTERS", "ISO_TYPES", "KV_STATS", "GGMLType", "RQTypeError", "apply", "bin_dir", "binary", "counters",
    "cpu_avx512", "cpu_split", "dequantize", "iso_roundtrip", "iso_variant", "kv_stats", "lib_dir", "llama_kwargs", "quantize", "reset_counters",
    "row_size", "rq_version", "set_cpu_avx512", "set_cpu_split", "set_iso_skip_inverse", "set_iso_variant", "type_from_name",
    "type_name", "type_names",
    "unhooked_archs", "validate_kv_spec",
]
