#!/usr/bin/env python3
"""Accuracy measurements of ISOQUANT3_0 for docs/isoquant-design.md (variant x norm_mode).

Usage (from the repository root; all seeds fixed, ~1 min on one core):

    python3 scripts/measure_isoquant.py               # v3/v2/v1/none x raw/preserve
    python3 scripts/measure_isoquant.py --all-modes   # also the lsq / unbiased research modes

Prints markdown tables to stdout.  Besides the four variants of the spec (v3 and v1
include the sign vector S) it measures "v3-noS" / "v1-noS", the format before S was
added: quantising S*x and multiplying the dequantised vector by S again cancels S
exactly (S*S = 1, and a sign flip commutes with every rounding), so these rows are
bit-identical to the pre-S format without needing a separate code path.

Data sets (20,000 vectors of 128 each):
  gauss      N(0, I)
  keys       key-like: (z + mu) * s, s = 1 except 4 outlier channels (7, 35, 77, 120)
             scaled 10/13/16/20, and a mean mu shared by all keys (0.5 N(0,1) per
             channel, +1 on the outlier channels)
  gauss+DC   N(0, I) + 1 on every channel (a constant offset: the plain WHT's blind spot)
  values t4  Student-t, df = 4
Attention: 78 contexts x 256 keys x 32 queries, p = softmax(beta q.k / sqrt(128)),
p_hat from quantised keys; output o = sum p_j v_j vs o_hat = sum p_hat_j v_hat_j (K and V
quantised).  KL(p || p_hat) and |o_hat - o| / |o| averaged over the queries.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rotaryquant.quants import isoquant as iq  # noqa: E402

D = 128
N = 20_000
T = 256
NQ = 32

rng = np.random.default_rng(12345)
gauss = rng.standard_normal((N, D)).astype(np.float32)
OUT_CH = np.array([7, 35, 77, 120])
SCALE = np.ones(D)
SCALE[OUT_CH] = [10.0, 13.0, 16.0, 20.0]
MEAN = 0.5 * rng.standard_normal(D)
MEAN[OUT_CH] += 1.0
keys = ((rng.standard_normal((N, D)) + MEAN) * SCALE).astype(np.float32)
gauss_dc = (rng.standard_normal((N, D)) + 1.0).astype(np.float32)
vals = rng.standard_t(4, (N, D)).astype(np.float32)
DATA = {"gauss": gauss, "keys": keys, "gauss+DC": gauss_dc, "values t4": vals}

VARS = ["v3", "v2", "v1", "none", "v3-noS", "v1-noS"]


def roundtrip(x, variant, mode):
    if variant.endswith("-noS"):  # the pre-S format, exactly (see the module docstring)
        v = variant[:-4]
        s = iq.SIGNS
        return iq.dequantize_blocks(iq.quantize_blocks(x * s, variant=v, norm_mode=mode),
                                    variant=v) * s
    return iq.dequantize_blocks(iq.quantize_blocks(x, variant=variant, norm_mode=mode),
                                variant=variant)


def vec_metrics(x, xh):
    x64, xh64 = x.astype(np.float64), xh.astype(np.float64)
    n2 = (x64 * x64).sum(1)
    rel = ((x64 - xh64) ** 2).sum(1) / n2
    q = np.random.default_rng(7).standard_normal(x.shape)
    e = (q * (xh64 - x64)).sum(1) / (np.linalg.norm(q, axis=1) * np.sqrt(n2))
    gain = (x64 * xh64).sum(1) / n2  # <x, x_hat> / |x|^2
    return rel.mean(), e.mean(), e.std(), gain.mean(), gain.std()


def softmax(s):
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    return p / p.sum(-1, keepdims=True)


def calibrate_beta(K, Q, target):
    lo, hi = 1e-3, 1e3
    for _ in range(60):
        b = np.sqrt(lo * hi)
        if softmax(b * np.einsum("cqd,ctd->cqt", Q, K) / np.sqrt(D)).max(-1).mean() < target:
            lo = b
        else:
            hi = b
    return b


def attn(K, V, Kh, Vh, Q, beta):
    p = softmax(beta * np.einsum("cqd,ctd->cqt", Q, K) / np.sqrt(D))
    ph = softmax(beta * np.einsum("cqd,ctd->cqt", Q, Kh) / np.sqrt(D))
    kl = (p * (np.log(np.maximum(p, 1e-300)) - np.log(np.maximum(ph, 1e-300)))).sum(-1)
    o = np.einsum("cqt,ctd->cqd", p, V)
    oh = np.einsum("cqt,ctd->cqd", ph, Vh)
    return kl.ravel(), (np.linalg.norm(oh - o, axis=-1) / np.linalg.norm(o, axis=-1)).ravel()


def paired(per, a, b, betas):
    """Relative change of a vs b (mean +- 2 s.e. over queries; + = a worse than b)."""
    cells = []
    for bn in betas:
        for j in (0, 1):
            base = per[b + (bn,)][j]
            dlt = per[a + (bn,)][j] - base
            cells.append(f"{dlt.mean() / base.mean() * 100:+.1f} ± "
                         f"{2 * dlt.std() / np.sqrt(dlt.size) / base.mean() * 100:.1f} %")
    return cells


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--all-modes", action="store_true",
                    help="also measure the lsq / unbiased research norm modes")
    args = ap.parse_args(argv)
    modes = list(iq.NORM_MODES) if args.all_modes else ["raw", "preserve"]

    t0 = time.time()
    recon = {(dn, v, m): roundtrip(x, v, m) for dn, x in DATA.items() for v in VARS for m in modes}
    vm = {k: vec_metrics(DATA[k[0]], xh) for k, xh in recon.items()}
    pred = D * iq._tables.LLOYD_MSE_PER_COORD

    print(f"### Relative MSE ‖x − x̂‖²/‖x‖² (mean over {N // 1000}k vectors;"
          f" Lloyd–Max prediction {pred:.4f})\n")
    print("| variant | norm_mode | " + " | ".join(DATA) + " |")
    print("|---|---|" + "---|" * len(DATA))
    for v in VARS:
        for m in modes:
            print(f"| {v} | {m} | " + " | ".join(f"{vm[dn, v, m][0]:.4f}" for dn in DATA) + " |")

    print("\n### Inner-product error e = (⟨q,x̂⟩ − ⟨q,x⟩)/(‖q‖‖x‖), q ~ N(0, I) independent;"
          " gain g = ⟨x,x̂⟩/‖x‖² (variant v3)\n")
    print("| data | norm_mode | bias(e) ×1e-4 | std(e) ×1e-3 | mean(g) | std(g) |")
    print("|---|---|---|---|---|---|")
    for dn in DATA:
        for m in modes:
            _, eb, es, g, gs = vm[dn, "v3", m]
            print(f"| {dn} | {m} | {eb * 1e4:+.2f} | {es * 1e3:.2f} | {g:.4f} | {gs:.4f} |")

    nctx = N // T
    settings = {"gauss K / gauss V": ("gauss", "gauss"),
                "key-like K / t4 V": ("keys", "values t4"),
                "gauss+DC K / t4 V": ("gauss+DC", "values t4")}
    for name, (kn, vn) in settings.items():
        K = DATA[kn][: nctx * T].astype(np.float64).reshape(nctx, T, D)
        V = DATA[vn][: nctx * T].astype(np.float64).reshape(nctx, T, D)
        qr = np.random.default_rng(99)
        if kn == "gauss":
            Q = qr.standard_normal((nctx, NQ, D))
        elif kn == "gauss+DC":
            Q = qr.standard_normal((nctx, NQ, D)) + 1.0
        else:  # queries share the keys' channel structure (outliers + shared mean)
            Q = (qr.standard_normal((nctx, NQ, D)) + MEAN) * SCALE
        p1 = softmax(np.einsum("cqd,ctd->cqt", Q, K) / np.sqrt(D)).max(-1).mean()
        betas = {"β=1": 1.0, "peaky": calibrate_beta(K, Q, 0.5)}
        print(f"\n### Attention, {name}: {nctx} contexts × {T} keys × {NQ} queries;"
              f" β=1 gives mean max p = {p1:.3f}; 'peaky' β = {betas['peaky']:.3g}"
              f" gives mean max p = 0.5\n")
        print("| variant | norm_mode | KL β=1 | out-err β=1 | KL peaky | out-err peaky |")
        print("|---|---|---|---|---|---|")
        per = {}
        for v in VARS:
            for m in modes:
                Kh = recon[kn, v, m][: nctx * T].astype(np.float64).reshape(nctx, T, D)
                Vh = recon[vn, v, m][: nctx * T].astype(np.float64).reshape(nctx, T, D)
                cells = []
                for bn, b in betas.items():
                    per[v, m, bn] = attn(K, V, Kh, Vh, Q, b)
                    cells += [f"{per[v, m, bn][0].mean():.3g}", f"{per[v, m, bn][1].mean():.3f}"]
                print(f"| {v} | {m} | " + " | ".join(cells) + " |")
        print(f"\nPaired relative change (mean ± 2 s.e. over the {nctx * NQ} queries;"
              " + = worse than the reference):\n")
        print("| compared | reference | KL β=1 | out-err β=1 | KL peaky | out-err peaky |")
        print("|---|---|---|---|---|---|")
        rows = [(("v3", m), ("v3", "preserve")) for m in modes if m != "preserve"]
        rows += [(("v3-noS", "preserve"), ("v3", "preserve")),
                 (("v1", "preserve"), ("v3", "preserve"))]
        for a, b in rows:
            print(f"| {'/'.join(a)} | {'/'.join(b)} | " + " | ".join(paired(per, a, b, betas)) + " |")
    print(f"(took {time.time() - t0:.1f}s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
