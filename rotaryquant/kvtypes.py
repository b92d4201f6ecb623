"""KV-cache type specs: "q8_0" (K and V alike) or "q8_0/isoquant3_0" (K type / V type), optionally
"@LAYERS" with per-layer types over those (llama.cpp's --kv-layer-types, items separated by ";" here so that a
list of specs can be comma-separated: "isoquant3_0@full=q8_0/isoquant3_0;0-1=q8_0"; "@model": the allocation
rq-calibrate --kv-bits stored in the model; "@none": K/V alike in every layer; without "@", libllama's default per-layer
types: on a sliding-window model with 3-bit IsoQuant K, 4-bit K on full-attention layers within 3.5 bits/value at
the context's size, whatever its window), and an
optional "+calib" or "+self" suffix: K centring on, as llama.cpp runs by default. "+calib" reads: the model's
K-cache calibration (rq-calibrate); "+self" reads: the file has none, the runtime measures its own (the same
switch; the label says which statistics a row used). Without a suffix, runs pass --no-k-center, so the same
file measures both sides of the A/B in one run. "+wN" anywhere after the types: the recent window of N positions
kept exact (llama.cpp's --kv-window), e.g. "isoquant3_0+w16+calib"."""

from __future__ import annotations

import re
from collections.abc import Iterator

CALIB = "+calib"
SELF = "+self"
MODEL = "model"  # per-layer types: the model's stored allocation (rq-calibrate --kv-bits)
ISO_TYPES = ("isoquant3_0", "isoquant4_0", "isoquant3_64", "isoquant4_64")  # the IsoQuant KV types (ggml's names)


_WINDOW = re.compile(r"\+w(\d+)")
DEFAULT_WINDOW = 16  # llama.cpp's kv_window when none is given (LLAMA_RQ_KV_WINDOW_DEFAULT): IsoQuant V, CPU


def window(spec: str) -> int:
    """The recent window of a spec in positions (llama.cpp's kv_window; 0: none). Callers pass it even when 0: a spec
    names what runs, and without "+wN" that is no window, whatever the runtime's default."""
    m = _WINDOW.search(spec)
    return int(m.group(1)) if m else 0


def with_window(spec: str, n: int) -> str:
    """``spec`` with a window of ``n`` positions (0: none), written as result labels are: "TYPES+wN+calib"."""
    s = _WINDOW.sub("", spec.strip())
    suf = suffix(s)
    return (s[: -len(suf)] if suf else s) + (f"+w{n}" if n else "") + suf


def as_run(spec: str) -> str:
    """What llama.cpp runs on the CPU for ``spec`` when its command names no --kv-window: the default window where
    the V cache is IsoQuant (per-layer V types aside), the spec itself otherwise."""
    return with_window(spec, DEFAULT_WINDOW) if not window(spec) and split(spec)[1] in ISO_TYPES else spec


def suffix(spec: str) -> str:
    """The K-centring suffix of a spec ("" when K centring is off)."""
    s = _WINDOW.sub("", spec.strip())
    return next((x for x in (CALIB, SELF) if s.endswith(x)), "")


def k_center(spec: str) -> bool:
    return bool(suffix(spec))


def _body(spec: str) -> tuple[str, str]:
    s = _WINDOW.sub("", spec.strip())
    s = s[: -len(suffix(s))] if suffix(s) else s
    base, _, layers = s.partition("@")
    return base.strip(), layers.strip()


def split(spec: str) -> tuple[str, str]:
    """The context's K and V types (before any per-layer types)."""
    k, _, v = _body(spec)[0].partition("/")
    return k.strip(), (v or k).strip()


def _layer_items(spec: str) -> list[tuple[str, str]]:
    """(LAYERS, K[/V]) of each per-layer item."""
    out = []
    if _body(spec)[1] == MODEL:  # the model's own, resolved by llama.cpp
        return out
    for item in filter(None, _body(spec)[1].split(";")):
        sel, eq, types = item.partition("=")
        if not eq or not sel.strip():
            raise ValueError(f"{spec}: per-layer item {item!r} is not LAYERS=K[/V]")
        out.append((sel.strip(), types.strip()))
    return out


def layer_types(spec: str) -> str | None:
    """The per-layer types as llama.cpp takes them (kv_layer_types / --kv-layer-types), None when there are none."""
    layers = _body(spec)[1]
    return layers.replace(";", ",") if layers else None


def type_names(spec: str) -> Iterator[str]:
    """Every ggml type name a spec uses: K and V, then those of the per-layer items (a malformed item raises
    ValueError when it is reached). Checked against the library by ``rotaryquant.bindings.validate_kv_spec``."""
    yield from split(spec)
    for _, types in _layer_items(spec):
        for t in types.split("/"):
            yield t.strip()


def uses_iso(spec: str) -> bool:
    return any(t in ISO_TYPES for t in list(type_names(spec)))
