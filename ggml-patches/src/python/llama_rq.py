"""RotaryQuant's arguments of llama_cpp.Llama, as fields of llama_context_params.

Linked into the patched llama-cpp-python as ``llama_cpp/llama_rq.py`` (rotaryquant.build.tree.LINKS); llama.py
calls ``apply`` from ``Llama.__init__``. Each setting holds for that context only."""

from __future__ import annotations

import os
import sys
from typing import Optional, Union

from . import llama_cpp

_K_CENTER = {False: llama_cpp.LLAMA_K_CENTER_OFF, True: llama_cpp.LLAMA_K_CENTER_AUTO,
             "force": llama_cpp.LLAMA_K_CENTER_FORCE}


def k_stats_dir() -> str:
    """Where llama.cpp's tools keep measured K statistics by default: common's fs_get_cache_directory() /
    "rq-k-stats" (LLAMA_CACHE, else the platform's user cache folder / "llama.cpp")."""
    if os.environ.get("LLAMA_CACHE"):
        return os.path.join(os.environ["LLAMA_CACHE"], "rq-k-stats")
    if sys.platform == "win32":
        home = os.environ.get("LOCALAPPDATA", "")
    elif sys.platform == "darwin":
        home = os.path.expanduser("~/Library/Caches")
    else:
        home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(home, "llama.cpp", "rq-k-stats")


def apply(params: llama_cpp.llama_context_params, *, iso_unfused: bool = False,
          k_center: Optional[Union[bool, str]] = None, kv_deferred: Optional[Union[bool, int]] = None,
          kv_layer_types: Optional[str] = None, kv_window: Optional[int] = None,
          k_stats: Optional[Union[str, bool]] = None) -> tuple[Optional[bytes], ...]:
    """Sets params' RotaryQuant fields (ValueError naming what to give instead); returns the byte strings params now
    points into, which the caller keeps alive as long as params.

    iso_unfused: IsoQuant K/V are dequantised to F16 before attention (the unfused A/B baseline).
    k_center: K centring of a quantised K cache (under 6 bits/value for an uncalibrated model): None or True uses the
        model's calibration (rotaryquant.k_center, from rq-calibrate), or K statistics measured once per model file
        when it has none; False turns it off; "force" also for F16 K.
    kv_deferred: True: deferred prefill (prompts attend to an exact F16 transient copy of their K/V until the sequence
        decodes; only with a quantised cache); an int: the same with a transient of at most that many cells; False or
        None: off.
    kv_layer_types: per-layer K/V cache types over type_k/type_v: comma-separated LAYERS=K[/V] with LAYERS one of N,
        N-M, swa, full, * (later items win), e.g. "full=q8_0/isoquant3_0"; "model": what rq-calibrate --kv-bits
        stored in the model; "none": type_k/type_v everywhere; None: the default (with a 3-bit IsoQuant K on a
        sliding-window model, 4-bit K on its full-attention layers while the cache stays within 3.5 bits/value).
    kv_window: with an IsoQuant V cache, each query attends to the keys and values of its last kv_window positions
        through exact F16 copies (0: off; None: 16 where the V cache is IsoQuant and attends fused on the CPU).
    k_stats: where measured K statistics are kept when the model has no calibration (measured once per model file,
        loaded later): a directory (one file per model, named by its content) or a .gguf file; None or True:
        k_stats_dir(), as llama.cpp's tools; False: measured at each model load, not kept."""
    params.iso_unfused = bool(iso_unfused)
    if k_center is not None:
        if k_center not in _K_CENTER:
            raise ValueError(f"k_center={k_center!r}: give None, True, False or 'force'")
        params.k_center = _K_CENTER[k_center]
    if kv_deferred is not None:
        budget = 0 if kv_deferred is False else -1 if kv_deferred is True else int(kv_deferred)
        if budget == 1 or budget < -1:
            raise ValueError(f"kv_deferred={kv_deferred!r}: give True, False or a budget of at least 2 cells")
        params.kv_deferred = budget
    if kv_window is not None and not 0 <= int(kv_window) <= 4096:
        raise ValueError(f"kv_window={kv_window!r}: give 0 (off) to 4096 positions, or None (the default)")
    params.kv_window = -1 if kv_window is None else int(kv_window)
    layers = kv_layer_types.encode() if kv_layer_types else None
    stats = b"" if k_stats is False else k_stats_dir().encode() if k_stats in (None, True) else os.fsencode(k_stats)
    params.kv_layer_types, params.k_stats_path = layers, stats
    return layers, stats


def run_tool() -> None:
    """The console scripts of the RotaryQuant wheel (llama-server, llama-cli, ...): runs the llama.cpp tool of the
    script's name that the wheel ships in llama_cpp/lib, with the same arguments."""
    name = os.path.basename(sys.argv[0])
    exe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib", name)
    if not os.access(exe, os.X_OK):
        sys.exit(f"{name}: {exe} is missing; this llama_cpp was installed without llama.cpp's tools "
                 "(the RotaryQuant wheels ship them: make wheel, then pip install dist/*.whl)")
    os.execv(exe, [exe, *sys.argv[1:]])
