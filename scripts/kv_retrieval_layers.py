#!/usr/bin/env python3
"""Which full-attention layers retrieve, and how much 3-bit K costs them there: a numpy study on real Q/K.

A copy task: BOS, then L pseudo-random tokens, then the same L tokens again. In the second copy an induction head
(a retrieval head) attends from each token to the token after its earlier occurrence, L positions back; with L
beyond the sliding window only full-attention layers can. Post-RoPE Q and K of the chosen layers come from one
F16-cache pass (the attention inputs as the graph hands them over, Q already scaled); for sampled queries of the
second copy, per query head:

- copy mass: softmax weight on the earlier occurrence's successor, with exact K;
- lost: the copy mass given up when K goes through ggml's isoquant3_0 (or isoquant4_0) quantiser, centred on the
  mean of the first 1024 keys (what self-calibrated K centring measures, roughly; no Q/K rebalancing).

Printed per layer: the largest copy mass over heads, and the mean over heads of (copy mass x relative loss), i.e.
how much retrieval 3-bit K takes away in that layer. A mechanism check for ranking layers, not a needle test.

    .venv/bin/python scripts/kv_retrieval_layers.py --layers 5,11,17 --length 2048
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma3-270M)")
    ap.add_argument("--layers", default="5,11,17", help="layers (default: Gemma3's full-attention layers)")
    ap.add_argument("--length", type=int, default=2048, help="L: tokens per copy (beyond the sliding window)")
    ap.add_argument("--queries", type=int, default=64, help="queries sampled from the second copy")
    ap.add_argument("--scale", type=float, default=1.0, help="attention scale the graph applies after Q "
                                                             "(Gemma3 scales Q itself: 1.0; else 1/sqrt(head))")
    ap.add_argument("--seed", type=int, default=42)
    a = ap.parse_args()

    import llama_cpp

    from rotaryquant import assets, bindings
    from rotaryquant.bindings import ggml as G
    from rotaryquant.bindings.capture import capture

    model = a.model or assets.model_path("gemma3-270m")
    layers = [int(x) for x in a.layers.split(",")]
    voc = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)
    rng = np.random.default_rng(a.seed)
    n_vocab = voc.n_vocab()
    # ordinary tokens only: ids past the first few hundred, distinct within a copy so each has one earlier occurrence
    body = rng.choice(np.arange(1000, min(n_vocab, 200_000)), size=a.length, replace=False).tolist()
    toks = [voc.token_bos(), *body, *body]
    n = len(toks)
    f16 = bindings.type_from_name("f16")
    E = capture(model, toks, ["attn_q_in", "attn_k_in"], type_k=f16, type_v=f16, n_ctx=-(-n // 256) * 256)
    qs = np.sort(rng.choice(np.arange(a.length + 2, n), size=a.queries, replace=False))

    def through(x: np.ndarray, t: str) -> np.ndarray:
        tt = bindings.type_from_name(t)
        return G.dequantize(G.quantize(np.ascontiguousarray(x, np.float32), tt), tt, x.shape[1])

    print(f"Copy task, L = {a.length}, {a.queries} queries of the second copy, seed {a.seed}: per layer the largest "
          "copy mass over query heads, and mean over heads of copy mass x relative loss with K at 3 / 4 bits.\n")
    print("| layer | copy mass (max head) | retrieval lost, K iso3 | retrieval lost, K iso4 |")
    print("|---:|---:|---:|---:|")
    for il in layers:
        kin, qin = E[f"attn_k_in-{il}"], E[f"attn_q_in-{il}"]
        dk = 256 if kin.size % (n * 256) == 0 else 128
        nkv, nh = kin.size // (n * dk), qin.size // (n * dk)
        K, Q = kin.reshape(n, nkv, dk), qin.reshape(n, nh, dk)
        mass, lost = np.zeros(nh), {"isoquant3_0": np.zeros(nh), "isoquant4_0": np.zeros(nh)}
        for g in range(nkv):
            k = K[:, g]
            mu = k[:1024].mean(0)
            kq = {t: through(k - mu, t) + mu for t in lost}
            for h in range(g * nh // nkv, (g + 1) * nh // nkv):
                for t in qs:
                    target = t - a.length + 1  # the successor of this token's earlier occurrence
                    s = Q[t, h] @ k[:t + 1].T * a.scale
                    p = np.exp(s - s.max())
                    p /= p.sum()
                    mass[h] += p[target] / len(qs)
                    for name, kx in kq.items():
                        sx = Q[t, h] @ kx[:t + 1].T * a.scale
                        px = np.exp(sx - sx.max())
                        px /= px.sum()
                        lost[name][h] += max(p[target] - px[target], 0.0) / len(qs)
        print(f"| {il} | {mass.max():.3f} | {lost['isoquant3_0'].mean():.4f} | {lost['isoquant4_0'].mean():.4f} |",
              flush=True)


if __name__ == "__main__":
    main()
