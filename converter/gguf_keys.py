"""Our own metadata keys in a GGUF (``rotaryquant.k_center.*``, ``rotaryquant.kv_alloc.*``): reading them back,
and the progress bar that rq-calibrate's passes and rewrites show."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm import tqdm

from rotaryquant import gguf_io


def read_keys(path: Path, prefix: str) -> dict[str, Any] | None:
    """The keys of a GGUF under ``prefix``, without it (None when it has none)."""
    r = gguf_io.open_reader(path)
    out = {k[len(prefix):]: f.contents() for k, f in r.fields.items() if k.startswith(prefix)}
    return out or None


def bar(total: int, enabled: bool, unit: str = "tok", desc: str = "calibrating K") -> Any:
    return tqdm(total=total, unit=unit, desc=desc, disable=not enabled, leave=False)
