"""Which rounding of the AVX-512 attention kernels (rq-cpu.c) moves the attention most?

The kernels score packed ISOQUANT keys with an int8 query (per 128-value block, max-scaled) against an int8 codebook,
and accumulate V from bf16 codebook values times bf16 weights. This replays each rounding alone, in float64 and in the
rotated domain (R is orthogonal, so scores and outputs are those of the model's domain), over n keys of random data
with a few heavy channels, at several attention sharpnesses (std of the scores), and prints the KL divergence of the
attention weights and the relative output error against the same attention without the rounding.

    .venv/bin/python scripts/avx512_rounding_study.py [--keys 32768] [--bits 3]
"""

from __future__ import annotations

import argparse

import numpy as np

from rotaryquant.quants import isoquant as iq


def bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 (nearest even), back as float64."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def int8_levels(cb: np.ndarray, top: int) -> np.ndarray:
    cmax = np.abs(cb).max()
    return np.round(cb * top / cmax) * cmax / top


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=32768)
    ap.add_argument("--bits", type=int, default=3, choices=(3, 4))
    ap.add_argument("--trials", type=int, default=4)
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    hs = 128
    cb = iq.codebook(args.bits).astype(np.float64)
    variants = {"q8": "int8 query", "cb8@127": "int8 codebook, L=127", "cb8@best": "int8 codebook, L=113/112",
                "bf16V": "bf16 V levels and weights"}
    best = 113 if args.bits == 3 else 112
    k = rng.standard_normal((args.keys, hs)).astype(np.float32)
    k[:, :4] *= 4
    v = rng.standard_normal((args.keys, hs)).astype(np.float32)
    dk, ik = iq.quantize_indices(k, bits=args.bits)
    dv, iv = iq.quantize_indices(v, bits=args.bits)
    kr = dk.astype(np.float64)[:, None] * cb[ik]
    print(f"{args.keys} keys, {args.bits}-bit; KL(attention) and relative output error vs no rounding, "
          f"mean of {args.trials} queries")
    print("| score std | " + " | ".join(variants.values()) + " |")
    print("| ---: |" + " ---: |" * len(variants))
    for s in (1, 2, 4, 8, 16):
        acc = {name: np.zeros(2) for name in variants}
        for _ in range(args.trials):
            q = iq.rotate(rng.standard_normal(hs).astype(np.float32)[None])[0].astype(np.float64)
            scale = s / (kr @ q).std()
            m = np.abs(q).max()
            q8 = np.round(q * 127 / m) * m / 127

            def attend(qv: np.ndarray, cbk: np.ndarray, cbv: np.ndarray, wround: bool,
                       scale: float = scale) -> tuple[np.ndarray, np.ndarray]:
                sc = (dk.astype(np.float64)[:, None] * cbk[ik]) @ qv * scale
                p = np.exp(sc - sc.max())
                p /= p.sum()
                w = p * dv.astype(np.float64)
                if wround:
                    w = bf16(w)
                return p, (w[:, None] * cbv[iv]).sum(0)

            p0, o0 = attend(q, cb, cb, False)
            runs = {"q8": (q8, cb, cb, False), "cb8@127": (q, int8_levels(cb, 127), cb, False),
                    "cb8@best": (q, int8_levels(cb, best), cb, False), "bf16V": (q, cb, bf16(cb), True)}
            for name, a in runs.items():
                p, o = attend(*a)
                kl = float(np.sum(p0 * (np.log(p0 + 1e-300) - np.log(p + 1e-300))))
                acc[name] += (kl, np.linalg.norm(o - o0) / np.linalg.norm(o0))
        cells = [f"{a[0] / args.trials:.1e} / {a[1] / args.trials:.1e}" for a in acc.values()]
        print(f"| {s} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
