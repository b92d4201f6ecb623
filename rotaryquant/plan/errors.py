"""rq-plan's error (``rotaryquant.errors.PlanError``: llama.cpp's accounting below the planner raises it too), and
the sizes rq-plan reads and prints."""

from __future__ import annotations

import re

from rotaryquant.errors import PlanError

MiB = 1 << 20

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": MiB, "mib": MiB, "mb": 10**6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}


def parse_size(text: str) -> int:
    """'16G' / '16GiB' -> 16 GiB, '16GB' -> 16e9 bytes, '512M' -> 512 MiB, '1073741824' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise PlanError(f"cannot read the size {text!r}", fix="write e.g. 16G (GiB), 16GB (10^9 bytes) or 512M")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise PlanError(f"size {text!r} is not positive", fix="give a budget such as 16G")
    return n


def mib(n: float) -> float:
    return n / MiB
