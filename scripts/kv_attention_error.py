#!/usr/bin/env python3
"""Where a 3-bit K cache loses attention at long context: a numpy study on real Q/K/V.

Captures post-RoPE Q, K, V of chosen layers (an F16-cache pass over the evaluation text), then for the last
``--queries`` positions of each context computes one head's attention output exactly and with K (or V) through
ggml's isoquant3_0 quantiser, under K-centring variants:

- mu0-2k: the constant mean of K over positions 0..2047 of the calibration text (rq-calibrate's default),
- mu0-8k: the mean over positions 0..8191 (calibrating with --ctx 8192),
- none, and "own": the mean of the last 2048 keys before the query (what a position-matched mean would give),
- mu0-2k with the first 4 keys (sinks) or the last 128 keys kept exact.

lam (Q/K rebalancing) is rq-calibrate's rule on the 0..2047 calibration pass. Printed: the mean relative error
||o' - o||^2 / ||o||^2 over queries and heads, per layer and context. Also the residual energy of K after each
centring at positions 0..2047 and 6144..8191, relative to none. Not a perplexity: a mechanism check.

    .venv/bin/python scripts/kv_attention_error.py --layers 11,15 --contexts 512,2048,8192
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the embedded Gemma3-270M)")
    ap.add_argument("--layers", default="11,15", help="layers (default 11,15: Gemma3's full layer 11, window layer 15)")
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--queries", type=int, default=32, help="last positions of each context scored")
    ap.add_argument("--f16-windows", default="128", help="comma-separated sizes W of an F16 window of the last W "
                    "keys (and values, in the 'K+V' columns) kept exact, with mu0-2k centring")
    ap.add_argument("--variants", default=None, help="comma-separated subset of the centring columns to score "
                    "(default all); the window columns are always scored")
    ap.add_argument("--window", type=int, default=None, help="sliding window of the chosen layers, 0 for none "
                                                             "(default: Gemma3's, every layer but each 6th attends 512)")
    ap.add_argument("--rope-base", type=float, default=1e6, help="RoPE base of full-attention layers (Gemma3: 1e6)")
    ap.add_argument("--rope-base-window", type=float, default=1e4, help="RoPE base of window layers (Gemma3: 1e4)")
    ap.add_argument("--scale", type=float, default=1.0, help="attention scale the graph applies after Q "
                                                             "(Gemma3 scales Q itself: 1.0)")
    a = ap.parse_args()

    import llama_cpp

    from rotaryquant import assets, bindings
    from rotaryquant.bindings import ggml as G
    from rotaryquant.bindings.capture import capture
    from rotaryquant.data import calibration_text, evaluation_text

    model = a.model or assets.model_path("gemma3-270m")
    layers = [int(x) for x in a.layers.split(",")]
    ctxs = [int(x) for x in a.contexts.split(",")]
    n = max(max(ctxs), 8192)
    tok = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)
    f16 = bindings.type_from_name("f16")
    ev = tok.tokenize(evaluation_text().read_bytes()[: n * 24], add_bos=True)[:n]
    cal = tok.tokenize(calibration_text().read_bytes()[: n * 24], add_bos=True)[:n]
    names = ["attn_q_in", "attn_k_in", "attn_v_in"]
    E = capture(model, ev, names, type_k=f16, type_v=f16, n_ctx=n)
    C = capture(model, cal, names[:2], type_k=f16, type_v=f16, n_ctx=n)
    t3 = bindings.type_from_name("isoquant3_0")

    def qd(x: np.ndarray) -> np.ndarray:
        return G.dequantize(G.quantize(np.ascontiguousarray(x, np.float32), t3), t3, x.shape[1])

    def attend(q, K, V, lo, hi):
        s = q @ K[lo:hi].T * a.scale
        p = np.exp(s - s.max())
        p /= p.sum()
        return p @ V[lo:hi]

    wins = [int(w) for w in a.f16_windows.split(",") if w]
    variants = [v for v in VARIANTS if a.variants is None or v in a.variants.split(",")]
    variants += [f"mu0-2k, last {w} f16" for w in wins] + ["K+V iso3"] + [f"K+V iso3, last {w} f16" for w in wins]
    print("Relative attention-output error ||o' - o||^2 / ||o||^2, K through isoquant3_0 (V exact) per centring; "
          "'K+V' columns: both through isoquant3_0 (K with mu0-2k); last column: V through isoquant3_0, K exact.\n")
    print("| layer | ctx | " + " | ".join(variants) + " | V iso3 |")
    print("|---:|---:|" + "---:|" * (len(variants) + 1))
    for il in layers:
        dk = C[f"attn_k_in-{il}"].size // n
        nh = C[f"attn_q_in-{il}"].size // (n * dk)
        K0 = E[f"attn_k_in-{il}"].reshape(n, -1, dk)[:, 0]  # the first KV head
        nkv = E[f"attn_k_in-{il}"].size // (n * dk)
        Q0 = E[f"attn_q_in-{il}"].reshape(n, nh, dk)[:, : nh // nkv]  # the query heads that read KV head 0
        V = E[f"attn_v_in-{il}"].reshape(n, -1, dk)[:, 0]
        kc = C[f"attn_k_in-{il}"].reshape(n, -1, dk)[:, 0]
        qc = C[f"attn_q_in-{il}"].reshape(n, nh, dk)
        mu2 = kc[:2048].mean(0)
        lam = np.clip(np.sqrt(np.maximum(np.abs(kc[:2048] - mu2).max(0), 1e-6)
                              / np.maximum(np.abs(qc[:2048]).max((0, 1)), 1e-6)), 2.0**-8, 2.0**8)
        window = a.window if a.window is not None else (512 if (il + 1) % 6 else 0)
        rbase = a.rope_base_window if window else a.rope_base
        # RoPE-aware centring: the pre-RoPE mean m (calibration positions 0..2047 rotated back), rotated to each
        # key's own position; "top r" does so on the r pairs where m is largest and keeps mu0-2k on the others
        m = rope(kc[:2048], np.arange(2048), rbase, -1).mean(0)
        pair = m[: dk // 2] ** 2 + m[dk // 2:] ** 2
        mup = {"rope": rope(np.broadcast_to(m, (n, dk)), np.arange(n), rbase, 1)}
        for r in (4, 8, 16):
            top = np.argsort(pair)[::-1][:r]
            sel = np.zeros(dk, bool)
            sel[top] = sel[top + dk // 2] = True
            mup[f"rope top{r}"] = np.where(sel, mup["rope"], mu2)
        K, Q, mu2, mu8 = K0 / lam, Q0 * lam, mu2 / lam, kc[:8192].mean(0) / lam
        mup = {k: v / lam for k, v in mup.items()}
        for ctx in ctxs:
            own = K[max(0, ctx - 2048):ctx].mean(0)
            Kq = {"mu0-2k": qd(K[:ctx] - mu2) + mu2, "mu0-8k": qd(K[:ctx] - mu8) + mu8, "none": qd(K[:ctx]),
                  "own": qd(K[:ctx] - own) + own}
            Kq.update({k: qd(K[:ctx] - v[:ctx]) + v[:ctx] for k, v in mup.items()})
            Vq = qd(V[:ctx])
            err: dict[str, list[float]] = {}
            for t in range(ctx - a.queries, ctx):
                lo = max(0, t + 1 - window) if window else 0
                for h in range(Q.shape[1]):
                    q = Q[t, h]
                    o = attend(q, K, V, lo, t + 1)
                    nrm = float((o ** 2).sum())
                    for name in variants:
                        base = name.split(",")[0]
                        Kx, Vx = (Kq["mu0-2k"], Vq) if base == "K+V iso3" else (Kq[base], V)
                        if name.endswith("sinks f16"):
                            Kx = Kx.copy()
                            Kx[:4] = K[:4]
                        elif name.endswith(" f16"):
                            w0 = max(0, t + 1 - int(name.split()[-2]))
                            Kx, Vx = Kx.copy(), Vx.copy()
                            Kx[w0:t + 1], Vx[w0:t + 1] = K[w0:t + 1], V[w0:t + 1]
                        err.setdefault(name, []).append(float(((attend(q, Kx, Vx, lo, t + 1) - o) ** 2).sum()) / nrm)
                    err.setdefault("V", []).append(float(((attend(q, K, Vq, lo, t + 1) - o) ** 2).sum()) / nrm)
            print(f"| {il}{' (window)' if window else ''} | {ctx} | "
                  + " | ".join(f"{np.mean(err[v]):.4f}" for v in variants) + f" | {np.mean(err['V']):.4f} |", flush=True)
    print()
    print("| layer | positions | mu0-2k | mu0-8k | own (positions' own mean) |   (K residual energy / none)")
    print("|---:|---|---:|---:|---:|")
    for il in layers:
        dk = C[f"attn_k_in-{il}"].size // n
        kc = C[f"attn_k_in-{il}"].reshape(n, -1, dk)[:, 0]
        ke = E[f"attn_k_in-{il}"].reshape(n, -1, dk)[:, 0]
        for lo, hi in ((0, 2048), (6144, 8192)):
            w = ke[lo:hi]
            e = {k: float(((w - mu) ** 2).sum(1).mean()) for k, mu in
                 (("none", 0.0), ("mu0-2k", kc[:2048].mean(0)), ("mu0-8k", kc[:8192].mean(0)), ("own", w.mean(0)))}
            print(f"| {il} | {lo}..{hi - 1} | {e['mu0-2k'] / e['none']:.2f} | {e['mu0-8k'] / e['none']:.2f} "
                  f"| {e['own'] / e['none']:.2f} |")


def rope(x: np.ndarray, pos: np.ndarray, base: float, sign: int) -> np.ndarray:
    """NEOX-style RoPE (pairs i, i + d/2; Gemma3, Qwen2) of rows x at positions pos; sign -1 rotates back."""
    d = x.shape[1] // 2
    ang = sign * pos[:, None] * base ** (-np.arange(d) / d)
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[:, :d], x[:, d:]
    return np.concatenate([a * c - b * s, a * s + b * c], 1)


VARIANTS = ("mu0-2k", "mu0-8k", "none", "own", "rope", "rope top4", "rope top8", "rope top16",
            "mu0-2k, 4 sinks f16")

if __name__ == "__main__":
    main()
