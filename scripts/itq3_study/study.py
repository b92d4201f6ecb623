"""The study itself: runs every measurement and prints the markdown tables (`main`)."""
import time

import numpy as np

from .core import F32, QK, T_START, Grid, cand_factors, fwht_cols, gauss_mse, log, make_grids, roundtrip, \
    roundtrip_norot
from .data import blocks, load_real, rel_rmse, synth_data, train_grid
from .imatrix import imat_quant
from .rec import ITQ3_C, Itq3Rec, itq3_pack, itq3_quantize_block_scalar, itq3_unpack, lcg_signs, ref_affine32_3bit, \
    ref_q4_0, ref_sym32_3bit, rotated_int8_dot


# ----------------------------------------------------------------------------
# Main study
# ----------------------------------------------------------------------------

def md_table(header, rows):
    s = "| " + " | ".join(header) + " |\n|" + "|".join("---" for _ in header) + "|\n"
    for r in rows:
        s += "| " + " | ".join(str(x) for x in r) + " |\n"
    return s


def fmt(x):
    return "%.4f" % x


def timed(fn, *a, **kw):
    """Returns (result, CPU seconds of this process) - robust to other load."""
    t = time.process_time()
    r = fn(*a, **kw)
    return r, time.process_time() - t


def main():
    rng = np.random.default_rng(12345)
    grids, lm_float = make_grids()
    print("# ITQ3_S design study\n")
    print("numpy %s, single thread. Metric: relative RMSE ||W-Ŵ||/||W|| over all weights (lower is better). "
          "Times are CPU time of this process.\n" % np.__version__)

    print("## Grids\n")
    rows = []
    for g in grids.values():
        lv = g.levels - (g.centre if g.affine else 0)
        rows.append([g.name, " ".join("%g" % v for v in g.levels), "%.6g" % float(g.c_rms),
                     "%.5f" % gauss_mse(lv, float(g.c_rms))])
    rows.append(["(Lloyd-Max float)", " ".join("%.4f" % v for v in lm_float), "1",
                 "%.5f" % gauss_mse(lm_float, 1.0)])
    print(md_table(["grid", "levels", "c = d/σ (Gauss-opt)", "N(0,1) MSE at c"], rows))

    data = synth_data(rng)
    real, norms = load_real()
    if real:
        keys = sorted(real, key=lambda k: (int(k.split(".")[0][1:]), k))
        train = [k for k in keys if k.startswith(("L7.", "L23."))]
        test = [k for k in keys if k not in train]
        Wtr = np.concatenate([blocks(real[k]) for k in train])
        sel = rng.choice(len(Wtr), size=min(len(Wtr), 6000), replace=False)
        emp = train_grid(Wtr[np.sort(sel)], lm_float)
        grids["emp"] = Grid("empirical int8 (trained on L7,L23)", emp)
        print("Empirical grid (scale-invariant Lloyd on rotated real blocks of layers 7/23): %s\n"
              % " ".join("%g" % v for v in emp))
        Rtest = np.concatenate([blocks(real[k]) for k in test])
        Rtest = Rtest[np.sort(rng.choice(len(Rtest), size=min(len(Rtest), 6144), replace=False))]
        data["real(test)"] = Rtest
        print("Real data: SmolLM2-135M-Instruct (Q4_1-dequantised), layers 0/7/15/23/29, "
              "q/k/v/o/gate/up/down; "
              "576-wide rows cropped to 512 columns. `real(test)` = 6144 random blocks of layers 0/15/29.\n")
    else:
        print("**Real weights not available (see script header); real-data sections skipped.**\n")
    datasets = {k: (v if v.shape[1] == QK else blocks(v)) for k, v in data.items()}
    dnames = list(datasets)

    # ---------------- Q1/Q2: grid x scale selection ----------------
    configs = [
        ("max", dict(init="max", K=0, refit=False)),
        ("max+LS", dict(init="max", K=0, refit=True)),
        ("rms", dict(init="rms", K=0, refit=False)),
        ("rms+LS", dict(init="rms", K=0, refit=True)),
        ("rms+LS+1 Lloyd", dict(init="rms", K=0, refit=True, lloyd=1)),
        ("rms+LS+3 Lloyd", dict(init="rms", K=0, refit=True, lloyd=3)),
        ("search4+LS+3 Lloyd", dict(init="rms", K=4, refit=True, lloyd=3)),
        ("search8+LS", dict(init="rms", K=8, refit=True)),
        ("search8+LS+1 Lloyd", dict(init="rms", K=8, refit=True, lloyd=1)),
        ("search16+LS", dict(init="rms", K=16, refit=True)),
        ("search32+LS", dict(init="rms", K=32, refit=True)),
        ("search32+LS+8 Lloyd", dict(init="rms", K=32, refit=True, lloyd=8)),
    ]
    gorder = [g for g in ("affine", "odd", "lm", "lm+m", "emp", "tern") if g in grids or g == "lm+m"]
    print("## Q1/Q2: grid × scale selection (rotated 256-blocks, 3.125 bpw)\n")
    print("Generic (study) code path. `LS` = least-squares refit of d (and m where the grid has m) "
          "for the chosen "
          "codes; `Lloyd` = extra (re-assign codes, LS refit) rounds; `searchK` = K scale candidates "
          "c·σ·f_k, f_k geometric in [0.80, 1.25], best LS score. "
          "The `+m` grid is the Lloyd-Max grid with the "
          "offset m as a free parameter inside the loop (the affine grid always has it). Last column: "
          "quantise+dequantise CPU ns/weight on the gauss set (generic path, indicative only).\n")
    for gk in gorder:
        grid = grids["lm"] if gk == "lm+m" else grids[gk]
        use_m = True if gk == "lm+m" else None
        rows = []
        for cname, kw in configs:
            row = [cname]
            tt = 0.0
            for dk, Wb in datasets.items():
                Wh, dt = timed(roundtrip, Wb, grid, use_m=use_m, **kw)
                row.append(fmt(rel_rmse(Wb, Wh)))
                if dk == "gauss":
                    tt = dt / Wb.size * 1e9
            rows.append(row + ["%.0f" % tt])
        print("### %s\n" % (grid.name + (" +m (free offset)" if gk == "lm+m" else "")))
        print(md_table(["scale selection"] + dnames + ["ns/w"], rows))
        log("grid %s done %.1fs" % (gk, time.perf_counter() - T_START))

    # ---------------- Q4/Q5: references ----------------
    print("## Q4/Q5: recommended quantiser vs references\n")
    rec = Itq3Rec(K=4, L=3)
    sg = lcg_signs()
    recs = Itq3Rec(K=4, L=3, signs=sg)
    refs = [
        ("**ITQ3_S recommended** (LM int8 grid, m free, search4 + 3 Lloyd)", 3.125, rec.roundtrip),
        ("ITQ3_S recommended + fixed sign flip before FWHT (format amendment)", 3.125, recs.roundtrip),
        ("ITQ3_S, odd grid ±1..±7 + m, search4 + 3 Lloyd (generic)", 3.125,
         lambda Wb: roundtrip(Wb, grids["odd"], init="rms", K=4, refit=True, lloyd=3, use_m=True)),
        ("same quantiser (LM+m), NO rotation, 256-blocks", 3.125,
         lambda Wb: roundtrip_norot(Wb, grids["lm"], init="rms", K=4, refit=True, lloyd=3, use_m=True)),
        ("paper-literal ternary (rotated, d = 0.798σ, round+clamp)", 3.125,
         lambda Wb: roundtrip(Wb, Grid("t", [-1, 0, 1], c_rms=0.798), init="rms", K=0, refit=False,
                              use_m=False)),
        ("3-bit sym odd per-32, no rotation (search8+LS), 1 fp16 scale", 3.5,
         lambda Wb: ref_sym32_3bit(Wb, grids["odd"])),
        ("3-bit affine per-32, no rotation (min/max), fp16 d + min", 4.0, ref_affine32_3bit),
        ("Q4_0 (llama.cpp reference quantiser)", 4.5, ref_q4_0),
    ]
    rows = []
    for name, bpw, fn in refs:
        rows.append([name, "%.3f" % bpw] + [fmt(rel_rmse(Wb, fn(Wb))) for Wb in datasets.values()])
    print(md_table(["method", "bpw"] + dnames, rows))
    print("IQ3_S (3.4375 bpw) / Q3_K (3.4375 bpw) need the C library; to be measured there.\n")
    if real:
        print("### Per tensor (real weights)\n")
        rows = []
        agg = np.zeros(7)
        tot = 0.0
        for k in keys:
            Wb = blocks(real[k])
            vals = [rel_rmse(Wb, rec.roundtrip(Wb)), rel_rmse(Wb, recs.roundtrip(Wb)),
                    rel_rmse(Wb, roundtrip_norot(Wb, grids["lm"], init="rms", K=4, refit=True, lloyd=3,
                                                 use_m=True)),
                    rel_rmse(Wb, ref_sym32_3bit(Wb, grids["odd"])), rel_rmse(Wb, ref_affine32_3bit(Wb)),
                    rel_rmse(Wb, ref_q4_0(Wb))]
            e2 = float((Wb.astype(np.float64) ** 2).sum())
            agg[:6] += np.array(vals) ** 2 * e2
            tot += e2
            rows.append([k, "%dx%d" % real[k].shape] + [fmt(v) for v in vals])
        rows.append(["**all 35 tensors**", ""] + ["**%s**" % fmt(np.sqrt(v / tot)) for v in agg[:6]])
        print(md_table(["tensor", "rows×cols used", "ITQ3 rec 3.125", "ITQ3 rec+signs 3.125",
                        "no-rot 3.125", "sym32 3.5", "aff32 4.0", "Q4_0 4.5"], rows))
    log("refs done %.1fs" % (time.perf_counter() - T_START))

    # ---------------- Q3: imatrix ----------------
    print("## Q3: imatrix handling\n")
    print("Cells: weighted relative RMSE sqrt(Σ_j w_j e_ij² / Σ_j w_j W_ij²) in the ORIGINAL domain "
          "(the llama.cpp imatrix objective), and below it the plain relative RMSE. "
          "All methods start from the recommended unweighted quantiser (search4 + 3 Lloyd). "
          "Time = CPU ns/weight for the whole quantisation (numpy).\n")
    imats = []
    g_ln = lambda C, s: np.exp(s * rng.standard_normal(C)).astype(F32)  # noqa: E731
    imats.append(("gauss 512×1024", data["gauss"][:512], g_ln(1024, 1.0), "lognormal σ=1"))
    imats.append(("gauss 512×1024", data["gauss"][:512], g_ln(1024, 2.0), "lognormal σ=2"))
    Tw = g_ln(1024, 1.5)
    Tw[[7, 300, 301, 777]] *= 10
    imats.append(("t3+outl 512×1024", data["t3+outl"][:512], Tw, "lognormal σ=1.5, outlier cols ×10"))
    if real:
        for k in ("L15.attn_q", "L15.ffn_up", "L15.ffn_down", "L29.attn_output"):
            W = real[k]
            if k.endswith(("attn_q", "ffn_up")):
                nk = k.split(".")[0] + (".attn_norm" if "attn" in k else ".ffn_norm")
                gam = norms[nk][: W.shape[1]]
                imats.append((k, W, (gam * gam).astype(F32), "γ² (%s)" % nk))
            imats.append((k, W, g_ln(W.shape[1], 1.5), "lognormal σ=1.5"))
    methods = [("none", dict(method="none")), ("refit", dict(method="refit")),
               ("wsearch8", dict(method="wsearch")), ("jacobi", dict(method="jacobi")),
               ("ldlq λ=.01", dict(method="ldlq", damp=0.01)), ("ldlq λ=.1", dict(method="ldlq", damp=0.1)),
               ("ldlq λ=.1 ×3 scales", dict(method="ldlq", damp=0.1, scales=(0.9, 1.0, 1.1)))]
    rows = []
    rec8 = Itq3Rec(K=8, L=3)
    for dname, W, imp, iname in imats:
        row = [dname, iname]
        for mname, kw in methods:
            Wh, dt = timed(imat_quant, W, imp, rec=rec8 if mname == "wsearch8" else rec, **kw)
            row.append("%s<br>%s (%.0f)" % (fmt(rel_rmse(W, Wh, imp)), fmt(rel_rmse(W, Wh)),
                                             dt / W.size * 1e9))
        row.append(fmt(rel_rmse(W, ref_q4_0(W), imp)))
        rows.append(row)
        log("imatrix %s/%s done %.1fs" % (dname, iname, time.perf_counter() - T_START))
    print(md_table(["data", "imatrix"] + [m for m, _ in methods] + ["Q4_0 (4.5 bpw)"], rows))

    # ---------------- Q6: speed + bit-exactness ----------------
    print("## Q6: speed of the recommended quantiser (single core, float32 numpy, CPU time, best of 3)\n")
    Wbig = rng.standard_normal((16384, QK)).astype(F32)
    rows = []
    for K, L in ((4, 3), (0, 4), (4, 2), (8, 2), (8, 3), (16, 4)):
        r = Itq3Rec(K=K, L=L) if K else Itq3Rec(K=1, L=L)
        r.quantize(Wbig[:1024])
        best = 1e9
        for _ in range(3):
            _, dt = timed(r.quantize, Wbig)
            best = min(best, dt)
        qdm = r.quantize(Wbig)
        bd = 1e9
        for _ in range(3):
            _, dtd = timed(r.dequantize, *qdm)
            bd = min(bd, dtd)
        rows.append(["K=%d, L=%d%s" % (K, L, "  (**recommended**)" if (K, L) == (4, 3) else ""),
                     "%.1f" % (Wbig.size / best / 1e6), "%.1f" % (Wbig.size / bd / 1e6),
                     fmt(rel_rmse(Wbig, r.dequantize(*qdm)))])
    print(md_table(["variant (K=0: no search, d0 = c·σ)", "quantise Mw/s", "dequantise Mw/s",
                    "rel RMSE (gauss)"], rows))
    bf = 1e9
    for _ in range(3):
        _, dt = timed(fwht_cols, Wbig.T)
        bf = min(bf, dt)
    print("FWHT alone (incl. transpose copy): %.1f Mw/s\n" % (Wbig.size / bf / 1e6))

    # bit-exactness: vectorised recommended path == scalar loop reference
    nchk = 48
    tb = np.concatenate([Wbig[:nchk // 2], data["t3+outl"].reshape(-1, QK)[:nchk // 4],
                         (datasets["real(test)"][:nchk // 4] if real else Wbig[-nchk // 4:])])
    tb[0, :] = 0.0
    tb[1, :] = 0.0
    tb[1, 0] = 0.37                  # single spike at element 0 -> flat rotated block
    tb[2, :] = F32(1e-3)             # constant block
    ok = True
    for sgn in (None, sg):
        r = Itq3Rec(K=4, L=3, signs=sgn)
        qv, dv, mv = r.quantize(tb)
        for i in range(len(tb)):
            qs, ds, ms = itq3_quantize_block_scalar(tb[i], K=4, L=3, signs=sgn)
            ok &= bool(np.array_equal(qs, qv[i])) and ds.tobytes() == dv[i].tobytes() and \
                ms.tobytes() == mv[i].tobytes()
    print("Bit-exactness check: vectorised numpy == scalar loop reference on %d blocks (incl. zero, "
          "spike and constant blocks), with and without signs: **%s**\n"
          % (len(tb), "PASS" if ok else "FAIL"))
    # packing round trip + rotated-domain int8 dot product check
    qv, dv, mv = rec.quantize(Wbig[:64])
    blk = itq3_pack(qv, dv, mv)
    q2, d2, m2 = itq3_unpack(blk)
    okp = np.array_equal(q2, qv) and np.array_equal(d2, dv) and np.array_equal(m2, mv)
    xa = rng.standard_normal(64 * QK).astype(F32)
    lines = []
    for lab, rr, sgn in (("no signs", rec, None), ("with signs", recs, sg)):
        qq, dd_, mm_ = rr.quantize(Wbig[:64])
        bb = itq3_pack(qq, dd_, mm_)
        wh = rr.dequantize(qq, dd_, mm_).reshape(-1).astype(np.float64)
        ref = float(wh @ xa.astype(np.float64))
        scale = float(np.linalg.norm(wh) * np.linalg.norm(xa))
        dfl = rotated_int8_dot(bb, xa, signs=sgn, int8=False)
        di8 = rotated_int8_dot(bb, xa, signs=sgn)
        lines.append("%s: |float-rotated - ref|/(|w||x|) = %.1e, |int8-rotated - ref|/(|w||x|) = %.1e"
                     % (lab, abs(dfl - ref) / scale, abs(di8 - ref) / scale))
    print("Packing (100-byte blocks) round trip: **%s**. Rotated-domain dot product "
          "d·Σgrid[q]x~ + m·Σx~ vs float dot of the dequantised row (64 blocks): %s.\n"
          % ("PASS" if okp else "FAIL", "; ".join(lines)))
    fs = cand_factors(4)
    print("Constants: c = %r (float32 bits 0x%08x); f_k = %s (float32 bits %s)\n" % (
        float(ITQ3_C), ITQ3_C.view(np.uint32),
        ", ".join(repr(float(v)) for v in fs), ", ".join("0x%08x" % v for v in fs.view(np.uint32))))
    print("Sign vector (LCG seed 0x12345678), bit j of the 256-bit mask = 1 -> s_j = -1, "
          "bytes little-endian: %s\n"
          % np.packbits((sg < 0).astype(np.uint8), bitorder="little").tobytes().hex())
    print("total runtime %.1f s (wall)" % (time.perf_counter() - T_START))
