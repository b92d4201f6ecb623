"""KV-cache type specs: "q8_0" (K and V alike) or "q8_0/isoquant3_0" (K type / V type), with an
optional "+calib" suffix: use the model's K-cache calibration (rq-calibrate). Without it, runs pass
--no-k-center, so the same calibrated file measures both sides of the A/B in one run."""

from __future__ import annotations

from rotaryquant.bindings.ggml import ISO_TYPES  # the IsoQuant KV types

CALIB = "+calib"


def k_center(spec: str) -> bool:
    return spec.strip().endswith(CALIB)


def split(spec: str) -> tuple[str, str]:
    s = spec.strip()
    s = s[: -len(CALIB)] if s.endswith(CALIB) else s
    k, _, v = s.partition("/")
    return k.strip(), (v or k).strip()


def validate(spec: str) -> str:
    from rotaryquant.bindings import type_from_name

    for t in split(spec):
        type_from_name(t)
    return spec


def uses_iso(spec: str) -> bool:
    return any(t in ISO_TYPES for t in split(spec))
