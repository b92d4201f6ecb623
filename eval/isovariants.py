"""Accuracy of the ISOQUANT3_0 numpy reference per rotation variant x norm_mode, on synthetic data.

The tables of docs/isoquant-design.md "Measurements". Besides the four variants of the spec (v3 and v1
include the sign vector S) it measures "v3-noS" / "v1-noS", the format before S was added: quantising
S*x and multiplying the dequantised vector by S again cancels S exactly (S*S = 1, and a sign flip
commutes with every rounding), so these rows are bit-identical to the pre-S format without needing a
separate code path.

Data sets (``n`` vectors of 128 each, all seeds fixed):
  gauss      N(0, I)
  keys       key-like: (z + mu) * s, s = 1 except 4 outlier channels (7, 35, 77, 120)
             scaled 10/13/16/20, and a mean mu shared by all keys (0.5 N(0,1) per
             channel, +1 on the outlier channels)
  gauss+DC   N(0, I) + 1 on every channel (a constant offset: the plain WHT's blind spot)
  values t4  Student-t, df = 4
Attention: n/256 contexts x 256 keys x 32 queries, p = softmax(beta q.k / sqrt(128)), p_hat from
quantised keys; output o = sum p_j v_j vs o_hat = sum p_hat_j v_hat_j (K and V quantised).
KL(p || p_hat) and |o_hat - o| / |o| averaged over the queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rotaryquant.quants import isoquant as iq

D = 128
N = 20_000
T = 256
NQ = 32
SEED = 12345
OUT_CH = np.array([7, 35, 77, 120])
VARIANTS = ("v3", "v2", "v1", "none", "v3-noS", "v1-noS")
DEFAULT_MODES = ("raw", "preserve")
# attention settings: name -> (K data set, V data set)
SETTINGS = {"gauss K / gauss V": ("gauss", "gauss"),
            "key-like K / t4 V": ("keys", "values t4"),
            "gauss+DC K / t4 V": ("gauss+DC", "values t4")}


@dataclass
class Data:
    sets: dict[str, np.ndarray]   # name -> (n, D) float32
    mean: np.ndarray              # the keys' shared mean (queries of key-like K share it)
    scale: np.ndarray             # the keys' per-channel scale


def datasets(n: int = N, seed: int = SEED) -> Data:
    rng = np.random.default_rng(seed)
    gauss = rng.standard_normal((n, D)).astype(np.float32)
    scale = np.ones(D)
    scale[OUT_CH] = [10.0, 13.0, 16.0, 20.0]
    mean = 0.5 * rng.standard_normal(D)
    mean[OUT_CH] += 1.0
    keys = ((rng.standard_normal((n, D)) + mean) * scale).astype(np.float32)
    gauss_dc = (rng.standard_normal((n, D)) + 1.0).astype(np.float32)
    vals = rng.standard_t(4, (n, D)).astype(np.float32)
    return Data({"gauss": gauss, "keys": keys, "gauss+DC": gauss_dc, "values t4": vals}, mean, scale)


def roundtrip(x: np.ndarray, variant: str, mode: str) -> np.ndarray:
    """Quantise and dequantise ``x`` (n, 128); "-noS" variants are the pre-S format, exactly."""
    if variant.endswith("-noS"):
        v = variant[:-4]
        s = iq.SIGNS
        return iq.dequantize_blocks(iq.quantize_blocks(x * s, variant=v, norm_mode=mode), variant=v) * s
    return iq.dequantize_blocks(iq.quantize_blocks(x, variant=variant, norm_mode=mode), variant=variant)


def vec_metrics(x: np.ndarray, xh: np.ndarray) -> dict[str, float]:
    """Relative MSE, the inner-product error e against an independent q (mean, std) and the gain
    g = <x, x_hat> / |x|^2 (mean, std), over the rows of ``x``."""
    x64, xh64 = x.astype(np.float64), xh.astype(np.float64)
    n2 = (x64 * x64).sum(1)
    rel = ((x64 - xh64) ** 2).sum(1) / n2
    q = np.random.default_rng(7).standard_normal(x.shape)
    e = (q * (xh64 - x64)).sum(1) / (np.linalg.norm(q, axis=1) * np.sqrt(n2))
    gain = (x64 * xh64).sum(1) / n2
    return {"rel_mse": float(rel.mean()), "e_bias": float(e.mean()), "e_std": float(e.std()),
            "gain_mean": float(gain.mean()), "gain_std": float(gain.std())}


def softmax(s: np.ndarray) -> np.ndarray:
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    return p / p.sum(-1, keepdims=True)


def calibrate_beta(K: np.ndarray, Q: np.ndarray, target: float) -> float:
    """The inverse temperature at which the mean largest attention weight is ``target`` (bisection)."""
    lo, hi = 1e-3, 1e3
    for _ in range(60):
        b = np.sqrt(lo * hi)
        if softmax(b * np.einsum("cqd,ctd->cqt", Q, K) / np.sqrt(D)).max(-1).mean() < target:
            lo = b
        else:
            hi = b
    return float(b)


def attn(K, V, Kh, Vh, Q, beta: float) -> tuple[np.ndarray, np.ndarray]:
    """Per query: KL(p || p_hat) and the relative output error |o_hat - o| / |o|."""
    p = softmax(beta * np.einsum("cqd,ctd->cqt", Q, K) / np.sqrt(D))
    ph = softmax(beta * np.einsum("cqd,ctd->cqt", Q, Kh) / np.sqrt(D))
    kl = (p * (np.log(np.maximum(p, 1e-300)) - np.log(np.maximum(ph, 1e-300)))).sum(-1)
    o = np.einsum("cqt,ctd->cqd", p, V)
    oh = np.einsum("cqt,ctd->cqd", ph, Vh)
    return kl.ravel(), (np.linalg.norm(oh - o, axis=-1) / np.linalg.norm(o, axis=-1)).ravel()


def paired(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Relative change of per-query ``a`` vs ``b`` in percent: mean and 2 standard errors (+ = a worse)."""
    d = a - b
    return float(d.mean() / b.mean() * 100), float(2 * d.std() / np.sqrt(d.size) / b.mean() * 100)


def _queries(kn: str, data: Data, nctx: int) -> np.ndarray:
    qr = np.random.default_rng(99)
    if kn == "gauss":
        return qr.standard_normal((nctx, NQ, D))
    if kn == "gauss+DC":
        return qr.standard_normal((nctx, NQ, D)) + 1.0
    return (qr.standard_normal((nctx, NQ, D)) + data.mean) * data.scale  # the keys' channel structure


def run(*, modes: tuple[str, ...] = DEFAULT_MODES, n: int = N, progress=None) -> dict:
    """Every table of the measurement as plain data (see ``to_markdown``)."""
    bad = [m for m in modes if m not in iq.NORM_MODES]
    if bad:
        raise ValueError(f"unknown norm_mode {bad[0]!r}: choose from {', '.join(iq.NORM_MODES)}")
    if n < T:
        raise ValueError(f"n must be at least {T} vectors (one attention context), got {n}")
    data = datasets(n)
    recon = {}
    for dn, x in data.sets.items():
        if progress:
            progress(f"round trip: {dn}")
        for v in VARIANTS:
            for m in modes:
                recon[dn, v, m] = roundtrip(x, v, m)
    vectors = [{"data": dn, "variant": v, "mode": m, **vec_metrics(data.sets[dn], recon[dn, v, m])}
               for dn in data.sets for v in VARIANTS for m in modes]
    nctx = n // T
    attention = []
    for name, (kn, vn) in SETTINGS.items():
        if progress:
            progress(f"attention: {name}")
        K = data.sets[kn][: nctx * T].astype(np.float64).reshape(nctx, T, D)
        V = data.sets[vn][: nctx * T].astype(np.float64).reshape(nctx, T, D)
        Q = _queries(kn, data, nctx)
        p1 = float(softmax(np.einsum("cqd,ctd->cqt", Q, K) / np.sqrt(D)).max(-1).mean())
        betas = {"β=1": 1.0, "peaky": calibrate_beta(K, Q, 0.5)}
        per, rows = {}, []
        for v in VARIANTS:
            for m in modes:
                Kh = recon[kn, v, m][: nctx * T].astype(np.float64).reshape(nctx, T, D)
                Vh = recon[vn, v, m][: nctx * T].astype(np.float64).reshape(nctx, T, D)
                row = {"variant": v, "mode": m, "kl": {}, "out_err": {}}
                for bn, b in betas.items():
                    per[v, m, bn] = attn(K, V, Kh, Vh, Q, b)
                    row["kl"][bn], row["out_err"][bn] = float(per[v, m, bn][0].mean()), float(per[v, m, bn][1].mean())
                rows.append(row)
        pairs = [(("v3", m), ("v3", "preserve")) for m in modes if m != "preserve"]
        pairs += [(("v3-noS", "preserve"), ("v3", "preserve")), (("v1", "preserve"), ("v3", "preserve"))]
        cmp = []
        for a, b in pairs:
            if a + ("β=1",) not in per or b + ("β=1",) not in per:  # "preserve" not measured
                continue
            cells = [{"beta": bn, "metric": metric,
                      **dict(zip(("change_pct", "se2_pct"), paired(per[a + (bn,)][j], per[b + (bn,)][j])))}
                     for bn in betas for j, metric in enumerate(("kl", "out_err"))]
            cmp.append({"compared": "/".join(a), "reference": "/".join(b), "cells": cells})
        attention.append({"setting": name, "k": kn, "v": vn, "contexts": nctx, "keys": T, "queries": NQ,
                          "mean_max_p_beta1": p1, "betas": betas, "rows": rows, "paired": cmp})
    return {"meta": {"n": n, "d": D, "seed": SEED, "variants": list(VARIANTS), "modes": list(modes),
                     "datasets": list(data.sets), "lloyd_mse": D * float(iq._tables.LLOYD_MSE_PER_COORD)},
            "vectors": vectors, "attention": attention}


def to_markdown(res: dict) -> str:
    meta = res["meta"]
    names, modes = meta["datasets"], meta["modes"]
    vec = {(r["data"], r["variant"], r["mode"]): r for r in res["vectors"]}
    out = [(f"### Relative MSE ‖x − x̂‖²/‖x‖² (mean over {meta['n'] / 1000:g}k vectors;"
           f" Lloyd–Max prediction {meta['lloyd_mse']:.4f})"), "",
           "| variant | norm_mode | " + " | ".join(names) + " |",
           "|---|---|" + "---|" * len(names)]
    for v in meta["variants"]:
        for m in modes:
            out.append(f"| {v} | {m} | " + " | ".join(f"{vec[dn, v, m]['rel_mse']:.4f}" for dn in names) + " |")
    out += ["", ("### Inner-product error e = (⟨q,x̂⟩ − ⟨q,x⟩)/(‖q‖‖x‖), q ~ N(0, I) independent;"
            " gain g = ⟨x,x̂⟩/‖x‖² (variant v3)"), "",
            "| data | norm_mode | bias(e) ×1e-4 | std(e) ×1e-3 | mean(g) | std(g) |",
            "|---|---|---|---|---|---|"]
    for dn in names:
        for m in modes:
            r = vec[dn, "v3", m]
            out.append(f"| {dn} | {m} | {r['e_bias'] * 1e4:+.2f} | {r['e_std'] * 1e3:.2f} | {r['gain_mean']:.4f} | "
                       f"{r['gain_std']:.4f} |")
    for a in res["attention"]:
        betas = a["betas"]
        out += ["", (f"### Attention, {a['setting']}: {a['contexts']} contexts × {a['keys']} keys × {a['queries']} "
                f"queries; β=1 gives mean max p = {a['mean_max_p_beta1']:.3f}; 'peaky' β = {betas['peaky']:.3g}"
                " gives mean max p = 0.5"), "",
                "| variant | norm_mode | KL β=1 | out-err β=1 | KL peaky | out-err peaky |",
                "|---|---|---|---|---|---|"]
        for r in a["rows"]:
            cells = [c for bn in betas for c in (f"{r['kl'][bn]:.3g}", f"{r['out_err'][bn]:.3f}")]
            out.append(f"| {r['variant']} | {r['mode']} | " + " | ".join(cells) + " |")
        out += ["", (f"Paired relative change (mean ± 2 s.e. over the {a['contexts'] * a['queries']} queries;"
                " + = worse than the reference):"), "",
                "| compared | reference | KL β=1 | out-err β=1 | KL peaky | out-err peaky |",
                "|---|---|---|---|---|---|"]
        for p in a["paired"]:
            out.append(f"| {p['compared']} | {p['reference']} | " + " | ".join(
                f"{c['change_pct']:+.1f} ± {c['se2_pct']:.1f} %" for c in p["cells"]) + " |")
    return "\n".join(out) + "\n"
