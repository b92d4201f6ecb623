"""Evaluation text: disjoint slices of the default Shakespeare text, for calibration and evaluation."""

from __future__ import annotations

from pathlib import Path

from rotaryquant import assets


def _slice(name: str, start: float, stop: float) -> Path:
    src = assets.text_path()
    out = src.with_name(f"{src.stem}.{name}.txt")
    if not out.exists():
        data = src.read_bytes()
        a, b = int(len(data) * start), int(len(data) * stop)
        # start and end on line boundaries
        a = data.find(b"\n", a) + 1
        b = data.rfind(b"\n", a, b) + 1
        tmp = out.with_suffix(".partial")
        tmp.write_bytes(data[a:b])
        tmp.replace(out)
    return out


def calibration_text() -> Path:
    """The first 40% of the plays (importance matrices)."""
    return _slice("calib", 0.0, 0.4)


def evaluation_text() -> Path:
    """The last 30% of the plays (perplexity, KLD): never seen by calibration."""
    return _slice("eval", 0.7, 1.0)
