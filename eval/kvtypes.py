"""KV-cache type specs: "q8_0" (K and V alike) or "q8_0/isoquant3_0" (K type / V type)."""

from __future__ import annotations

ISO_TYPES = ("isoquant3_0", "isoquant4_0")  # the IsoQuant KV types (fused attention, unfused switch)


def split(spec: str) -> tuple[str, str]:
    k, _, v = spec.partition("/")
    return k.strip(), (v or k).strip()


def validate(spec: str) -> str:
    from rotaryquant.bindings import type_from_name

    for t in split(spec):
        type_from_name(t)
    return spec


def uses_iso(spec: str) -> bool:
    return any(t in ISO_TYPES for t in split(spec))
