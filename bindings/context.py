"""RotaryQuant settings and counters of one llama.cpp context (llama_context_params, llama_rq_get_kv_stats).

The unfused path, K centring, deferred prefill and the recent window are fields of ``llama_context_params``: pass
them to ``llama_cpp.Llama(..., iso_unfused=, k_center=, kv_deferred=, kv_window=)`` (or set them on a params struct with
``apply``); two contexts in one process can differ. Nothing here is process-wide.
"""

from __future__ import annotations

from typing import Any

K_CENTER_MODES = ("off", "auto", "force")  # enum llama_k_center, in order
KV_STATS = ("kv_deferred_cells", "kv_deferred_conversions", "kv_deferred_bytes", "kv_deferred_peak_bytes")


def llama_kwargs(*, unfused: bool = False, k_center: str = "auto", deferred: bool | int = False,
                 window: int | None = None) -> dict[str, Any]:
    """``Llama(...)`` keyword arguments for these settings (k_center: off, auto or force; deferred: a budget in
    cells, True for the whole cache, False for off; window: positions, 0 for none, None for llama.cpp's default)."""
    if k_center not in K_CENTER_MODES:
        raise ValueError(f"k_center={k_center!r} is not one of {', '.join(K_CENTER_MODES)}")
    kc = {"off": False, "auto": None, "force": "force"}[k_center]
    kw: dict[str, Any] = {"iso_unfused": bool(unfused), "k_center": kc, "kv_deferred": deferred}
    if window is not None:
        kw["kv_window"] = int(window)
    return kw


def apply(cparams: Any, *, unfused: bool = False, k_center: str = "auto", deferred: bool | int = False,
          window: int | None = None) -> None:
    """Set the fields on a ``llama_cpp.llama_context_params`` (for code that builds contexts by hand)."""
    if k_center not in K_CENTER_MODES:
        raise ValueError(f"k_center={k_center!r} is not one of {', '.join(K_CENTER_MODES)}")
    budget = -1 if deferred is True else 0 if deferred is False else int(deferred)
    if budget == 1 or budget < -1:
        raise ValueError(f"deferred={deferred!r}: give True, False or a budget of at least 2 cells")
    cparams.iso_unfused = bool(unfused)
    cparams.k_center = K_CENTER_MODES.index(k_center)
    cparams.kv_deferred = budget
    if window is not None and not 0 <= int(window) <= 4096:
        raise ValueError(f"window={window!r}: give 0 (none) to 4096 positions, or None (the default)")
    cparams.kv_window = -1 if window is None else int(window)


def kv_stats(llm_or_ctx: Any) -> dict[str, int]:
    """Deferred-prefill counters of one context (a ``llama_cpp.Llama`` or a raw ``llama_context *``), summed over
    its KV caches: cells released, sequences converted, transient bytes now and at peak."""
    import llama_cpp  # lazy: loads the patched libllama: needs the build

    ctx = getattr(llm_or_ctx, "ctx", llm_or_ctx)
    s = llama_cpp.llama_rq_get_kv_stats(ctx)
    return {"kv_deferred_cells": int(s.deferred_cells), "kv_deferred_conversions": int(s.deferred_conversions),
            "kv_deferred_bytes": int(s.deferred_bytes), "kv_deferred_peak_bytes": int(s.deferred_peak_bytes)}


def unhooked_archs() -> tuple[str, ...]:
    """Architectures whose KV cache K centring and deferred prefill cannot reach, as the C library lists them."""
    import llama_cpp  # lazy: loads the patched libllama: needs the build

    return tuple(a for a in llama_cpp.llama_rq_unhooked_archs().decode().split(",") if a)
