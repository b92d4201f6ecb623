#!/usr/bin/env python3
"""Lane-level model of the RotaryQuant CUDA kernels, checked on the CPU against the references.

    python3 scripts/cuda/lane-model.py        (from the repo root; numpy only, ~10 s)

Nothing here runs CUDA. It is a line-by-line numpy transcription of what each warp of
ggml-patches/src/cuda/*.cu does -- the lane layouts, the shuffle patterns (lane ^ m), the float
operation order, the bit unpacking from staged words, the online softmax over 128-row tiles with KV
splits and the combine step; for the 64-wide types (16-lane groups, two blocks per warp) too -- run for all
32 lanes at once and compared with the bit-exact numpy
references (rotaryquant.quants.isoquant, rotaryquant.quants.itq3) or with a float64 attention. It catches
index-algebra and ordering mistakes without a GPU; it cannot catch CUDA-specific ones (races,
launch bounds, flags), which only scripts/cuda/gpu-check.sh on a GPU can.
"""

from __future__ import annotations

import os
import sys

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)

from rotaryquant.quants import isoquant as iq  # noqa: E402
from rotaryquant.quants import itq3  # noqa: E402

F32, F64 = np.float32, np.float64
LANES = np.arange(32)
FAILS: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}{(': ' + detail) if detail else ''}")
    if not ok:
        FAILS.append(name)


def shfl_xor(v: np.ndarray, m: int) -> np.ndarray:
    """__shfl_xor_sync over the lane axis (axis 1)."""
    return v[:, LANES ^ m]


def shfl_down(v: np.ndarray, d: int) -> np.ndarray:
    src = np.where(LANES + d < 32, LANES + d, LANES)
    return v[:, src]


# ------------------------------------------------------------------------------------------------
# ISOQUANT3_0/4_0 (qk = 128: a warp per block) and ISOQUANT3_64/4_64 (qk = 64: a group of nl = 16 lanes per
# block, two blocks side by side in a warp): rq-device.cuh / rq-iso.cu. Lane l of a group = lane % nl.

SIGNS = iq.SIGNS.astype(F32).reshape(32, 4)
SO4 = iq.SO4.astype(F32)              # (32, 4, 4) [group][row][col]
WS = F32(iq.WHT_SCALE)


def _nl(qk: int) -> int:
    return qk // 4


def to_warps(x: np.ndarray, qk: int) -> tuple[np.ndarray, int]:
    """(n, qk) blocks -> (nw, 32, 4) warps, block i in lanes (i % g)*nl.. of warp i // g (g = 32/nl blocks per
    warp); a warp's missing groups repeat the last block, as rq_group_block does (they store nothing)."""
    n, g = x.shape[0], 32 // _nl(qk)
    pad = (-n) % g
    if pad:
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
    return x.reshape(-1, 32, 4), n


def from_warps(v: np.ndarray, qk: int, n: int) -> np.ndarray:
    return v.reshape(-1, qk)[:n]


def iso_wht_warp(v: np.ndarray, nl: int = 32) -> np.ndarray:
    """rq_iso_wht_warp / rq_wht_warp<4, nl>; v (n, 32, 4) float32, lane l holds values 4l..4l+3 of its group."""
    a0 = v[..., 0] + v[..., 1]
    a1 = v[..., 0] - v[..., 1]
    a2 = v[..., 2] + v[..., 3]
    a3 = v[..., 2] - v[..., 3]
    v = np.stack([a0 + a2, a1 + a3, a0 - a2, a1 - a3], axis=-1)
    m = 1
    while m < nl:
        p = shfl_xor(v, m)
        upper = ((LANES & m) != 0)[None, :, None]
        v = np.where(upper, p - v, v + p)
        m <<= 1
    return v * (WS if nl == 32 else F32(iq.WHT_SCALE_64))


def iso_block4(v: np.ndarray, transpose: bool, nl: int = 32) -> np.ndarray:
    M = SO4.transpose(0, 2, 1) if transpose else SO4   # M[g][r][c] as the kernel reads it
    M = M[LANES % nl]                                  # group lane % nl: the first 16 matrices for qk = 64
    y = np.empty_like(v)
    for r in range(4):
        m = M[:, r, :]                                 # (32, 4)
        y[..., r] = ((m[:, 0] * v[..., 0] + m[:, 1] * v[..., 1]) + m[:, 2] * v[..., 2]) + m[:, 3] * v[..., 3]
    return y


def iso_rotate_warp(v: np.ndarray, nl: int = 32) -> np.ndarray:
    return iso_block4(iso_wht_warp(v * SIGNS[LANES % nl], nl), transpose=False, nl=nl)


def iso_rotate_inv_warp(v: np.ndarray, nl: int = 32) -> np.ndarray:
    return iso_wht_warp(iso_block4(v, transpose=True, nl=nl), nl) * SIGNS[LANES % nl]


def tree_sum_warp(a: np.ndarray, nl: int = 32) -> np.ndarray:
    """rq_iso_tree_sum_warp<nl>; a (n, 32, 4) float64 -> (n, 32): every lane gets its group's sum (the group's
    lane 0, __shfl_sync(..., 0, nl))"""
    m = nl // 2
    while m >= 1:
        a = a + shfl_xor(a, m)
        m >>= 1
    s = (a[:, :, 0] + a[:, :, 2]) + (a[:, :, 1] + a[:, :, 3])
    return s[:, (LANES // nl) * nl]


def iso_quantize_warp(x: np.ndarray, nbits: int = 3, qk: int = 128) -> np.ndarray:
    """rq_iso_quantize_warp<nbits, qk> for n blocks; returns (n, 2 + qk*nbits/8) bytes."""
    nl = _nl(qk)
    xl, n = to_warps(x.astype(F32), qk)
    nw = xl.shape[0]
    xd = xl.astype(F64)
    sd = np.sqrt(tree_sum_warp(xd * xd, nl))[:, :, None]
    with np.errstate(all="ignore"):
        v = np.where(sd > 0.0, (xd / sd).astype(F32), F32(0))
    v = iso_rotate_warp(v.astype(F32), nl)
    idx = np.zeros(v.shape, np.uint32)
    for b in iq.bounds(nbits, qk).astype(F32):
        idx += (v > b)
    c = iq.codebook(nbits, qk).astype(F32)[idx].astype(F64)
    with np.errstate(all="ignore"):
        dd = sd[:, :, 0] / np.sqrt(tree_sum_warp(c * c, nl))
    d = np.where(dd < 65504.0, dd, 65504.0).astype(F32).astype(np.float16)
    bits = np.zeros((nw, 32), np.uint32)
    for e in range(4):
        bits |= idx[..., e] << np.uint32(nbits * e)
    hi = shfl_down(bits, 1)
    g = 32 // nl
    out = np.zeros((nw, g, iq.block_bytes(nbits, qk)), np.uint8)
    for lane in range(32):
        blk, sl = divmod(lane, nl)
        if sl == 0:                                     # the group's lane 0 writes d
            out[:, blk, :2] = np.ascontiguousarray(d[:, lane].astype("<f2")).view(np.uint8).reshape(nw, 2)
        if sl % 2 == 0:                                 # even lanes write their group's BITS bytes
            w = (bits[:, lane] | (hi[:, lane] << np.uint32(4 * nbits))).astype(np.uint64)
            for b in range(nbits):
                out[:, blk, 2 + nbits * (sl >> 1) + b] = (w >> np.uint64(8 * b)) & np.uint64(0xFF)
    return out.reshape(nw * g, -1)[:n]


def iso_lane_bits(qs: np.ndarray, nbits: int = 3, nl: int = 32) -> np.ndarray:
    """rq_iso_lane_bits<nbits> for every lane (lane % nl in its group); qs (n, 32, nl/2*nbits): the qs bytes
    of each lane's block -> (n, 32) 4*nbits-bit groups"""
    q = qs.astype(np.uint64)
    out = np.empty((qs.shape[0], 32), np.uint32)
    for lane in range(32):
        sl = lane % nl
        p = nbits * (sl >> 1)
        w = np.zeros(qs.shape[0], np.uint64)
        for b in range(nbits):
            w |= q[:, lane, p + b] << np.uint64(8 * b)
        out[:, lane] = (w >> np.uint64(4 * nbits * (sl & 1))) & np.uint64((1 << (4 * nbits)) - 1)
    return out


def iso_dequant_warp(blocks: np.ndarray, nbits: int = 3, qk: int = 128) -> np.ndarray:
    """rq_iso_dequant_warp<nbits, qk> for n blocks (n, 2 + qk*nbits/8) bytes -> (n, qk) float32"""
    nl, g = _nl(qk), 32 // _nl(qk)
    n = blocks.shape[0]
    pad = (-n) % g
    b = np.concatenate([blocks, np.repeat(blocks[-1:], pad, axis=0)]) if pad else blocks
    nw = b.shape[0] // g
    lane_blk = b.reshape(nw, g, -1)[:, LANES // nl]                 # (nw, 32, bytes): each lane's block
    d = np.ascontiguousarray(lane_blk[:, :, :2]).view("<f2").reshape(nw, 32).astype(F32)
    bits = iso_lane_bits(lane_blk[:, :, 2:], nbits, nl)
    cb = iq.codebook(nbits, qk).astype(F32)
    v = np.stack([d * cb[(bits >> (nbits * e)) & ((1 << nbits) - 1)] for e in range(4)], axis=-1)
    return from_warps(iso_rotate_inv_warp(v, nl), qk, n)


def test_iso_codec(rng: np.random.Generator) -> None:
    x = [rng.standard_normal((512, 128)),
         rng.standard_t(3, (256, 128)) * 1e3,
         rng.standard_normal((256, 128)) + 1.0,
         np.exp(rng.uniform(np.log(1e-40), np.log(1e38), (256, 128))) * rng.choice([-1, 1], (256, 128)),
         np.zeros((4, 128)), np.full((4, 128), 1e30), np.full((4, 128), 1e-42)]
    spec = rng.standard_normal((6, 128))
    spec[0, 3] = np.nan
    spec[1, 7] = np.inf
    spec[2, :] = -np.inf
    x.append(spec)
    x = np.concatenate(x).astype(F32)
    # qk = 64: the same values as 64-wide blocks (2 per row), plus one: an odd count leaves the last warp's
    # upper group past the end (it repeats the last block and stores nothing)
    x64 = np.concatenate([x.reshape(-1, 64), rng.standard_normal((1, 64)).astype(F32)])
    for qk, xs in ((128, x), (64, x64)):
        for nbits in iq.BITS:
            name = f"iso{nbits}" + ("" if qk == 128 else "_64 (16-lane groups)")
            with np.errstate(all="ignore"):
                ref = iq.quantize_blocks(xs, bits=nbits, qk=qk)
                got = iso_quantize_warp(xs, nbits, qk)
            bad = np.nonzero((ref != got).any(axis=1))[0]
            check(f"{name} quantiser (tree norm, WHT lanes, SO(4), packing) == numpy/C reference, bytes",
                  bad.size == 0, f"{xs.shape[0]} blocks" + (f", first differing block {bad[0]}" if bad.size else ""))
            with np.errstate(all="ignore"):
                dref = iq.dequantize_blocks(ref, bits=nbits, qk=qk)
                dgot = iso_dequant_warp(ref, nbits, qk)
            same = np.array_equal(dref.view(np.uint32), dgot.view(np.uint32))
            check(f"{name} dequantiser (lane bits, SO(4)^T, WHT, signs) == reference, float bits", same)
    v = rng.standard_normal((64, 32, 4)).astype(F32)
    a = np.exp(rng.uniform(-30, 30, (512, 128)))     # wide range: the summation order shows in the bits
    check("iso float64 tree norm across lanes == reference tree, bits",
          np.array_equal(tree_sum_warp(a.reshape(512, 32, 4))[:, 0].view(np.uint64), iq._tree_sum_f64(a).view(np.uint64)))
    check("iso_64 float64 tree norm across 16-lane groups == reference tree, bits",
          np.array_equal(tree_sum_warp(a.reshape(512, 32, 4), 16)[:, ::16].reshape(-1).view(np.uint64),
                         iq._tree_sum_f64(a.reshape(1024, 64)).view(np.uint64)))
    check("iso R then R^T in the lane layout ~ identity",
          np.abs(iso_rotate_inv_warp(iso_rotate_warp(v)) - v).max() < 1e-5)
    check("iso warp rotation == reference rotate()",
          np.array_equal(iso_rotate_warp(v).reshape(64, 128), iq.rotate(v.reshape(64, 128))))
    check("iso_64 rotation in 16-lane groups == reference rotate(qk=64), inverse too",
          np.array_equal(iso_rotate_warp(v, 16).reshape(128, 64), iq.rotate(v.reshape(128, 64), qk=64))
          and np.array_equal(iso_rotate_inv_warp(v, 16).reshape(128, 64), iq.rotate_inverse(v.reshape(128, 64), qk=64)))


# ------------------------------------------------------------------------------------------------
# fattn-iso.cu: staging, index extraction, online softmax, KV splits, combine

TILE = 128


def stage_rows(rows: np.ndarray, nb: int, nbits: int = 3, sw: int | None = None, qk: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """rq_fa_stage<nb, sw, nbits, qk>: rows (n, nb*(2+qk*nbits/8)) bytes -> staged words (n, sw) uint32, scales (n, nb)."""
    n = rows.shape[0]
    hpb = 1 + qk * nbits // 16
    src = rows.view("<u2").reshape(n, nb * hpb)
    sw = sw or (qk // 32) * nbits * nb + 1
    dst16 = np.zeros((n, 2 * sw), np.uint16)
    dsh = np.zeros((n, nb), F32)
    for u in range(nb * hpb):
        b, k = divmod(u, hpb)
        if k == 0:
            dsh[:, b] = src[:, u].view(np.float16).astype(F32)
        else:
            dst16[:, (hpb - 1) * b + k - 1] = src[:, u]
    return dst16.view("<u4").reshape(n, sw).astype(np.uint64), dsh


def idx_bits(w: np.ndarray, k: int, nbits: int = 3) -> np.ndarray:
    """rq_idx<nbits> on (n, nbits) words (uint64 holding uint32)"""
    bit = nbits * k
    wi, sh = bit >> 5, bit & 31
    v = w[:, wi] >> np.uint64(sh)
    if sh > 32 - nbits:
        v |= (w[:, wi + 1] << np.uint64(32 - sh)) & np.uint64(0xFFFFFFFF)
    return (v & np.uint64((1 << nbits) - 1)).astype(np.int64)


def staged_k_indices(words: np.ndarray, nb: int, nbits: int = 3, qk: int = 128) -> np.ndarray:
    """the score loop's view: (n, nb*qk) indices (NCH = qk/32 chunks of 32 per block)"""
    n = words.shape[0]
    nch = qk // 32
    kw = nch * nbits
    out = np.empty((n, nb * qk), np.int64)
    for b in range(nb):
        for ch in range(nch):
            w = words[:, kw * b + nbits * ch: kw * b + nbits * ch + nbits]
            for k in range(32):
                out[:, b * qk + 32 * ch + k] = idx_bits(w, k, nbits)
    return out


def staged_v_indices(words: np.ndarray, nb: int, nbits: int = 3, qk: int = 128) -> np.ndarray:
    """the accumulate loop's view (rq_fa_lane_bits): lane l (of the block's qk/4) takes bits 4*nbits*l.. of each block"""
    n = words.shape[0]
    vw = (qk // 32) * nbits
    out = np.empty((n, nb * qk), np.int64)
    for b in range(nb):
        for lane in range(qk // 4):
            bit = 4 * nbits * lane
            wi, sh = bit >> 5, bit & 31
            bits = words[:, vw * b + wi] >> np.uint64(sh)
            if sh > 32 - 4 * nbits:
                bits |= (words[:, vw * b + wi + 1] << np.uint64(32 - sh)) & np.uint64(0xFFFFFFFF)
            for e in range(4):
                out[:, b * qk + 4 * lane + e] = ((bits >> np.uint64(nbits * e)) & np.uint64((1 << nbits) - 1)).astype(np.int64)
    return out


def rotate_blocks(x: np.ndarray, qk: int, inverse: bool = False) -> np.ndarray:
    """rq_iso_rotate(_inv)_warp<qk> on each qk-block of the rows of x (n, D): blocks in lane groups"""
    n, D = x.shape
    w, nblk = to_warps(x.reshape(-1, qk).astype(F32), qk)
    r = iso_rotate_inv_warp(w, _nl(qk)) if inverse else iso_rotate_warp(w, _nl(qk))
    return from_warps(r, qk, nblk).reshape(n, D)


def fattn_model(q, kb, vb, mask, sinks, scale, max_bias, softcap, nc, nsplit_target):
    """k_rq_fattn + k_rq_fattn_combine for 3-bit ISO K and V (qk = 64 at D = 64, else 128). q (N, H, D) f32;
    kb/vb (n_kv, Hkv, nb*block bytes); mask (N, n_kv) f32 or None; returns (N, H, D) in the layout dst[i1][h].
    Which warp or half-warp accumulates which row is not modelled (a sum)."""
    N, H, D = q.shape
    n_kv, Hkv, _ = kb.shape
    qk = 64 if D == 64 else 128
    nb, g = D // qk, H // Hkv
    cb = iq.codebook(3, qk).astype(F32)
    scale_eff = F32(scale / softcap if softcap != 0 else scale)
    n_head_log2 = 1 << int(np.floor(np.log2(H)))
    m0 = F32(2.0 ** (-max_bias / n_head_log2))
    m1 = F32(2.0 ** (-(max_bias / 2.0) / n_head_log2))

    ncols = N * g
    ntile = -(-ncols // nc)
    nkvt = max(1, -(-n_kv // TILE))
    nsplit = min(nkvt, max(1, nsplit_target))
    tps = -(-nkvt // nsplit)
    nsplit = -(-nkvt // tps)
    chunk = tps * TILE

    part_vkq = np.zeros((nsplit, N * H, D), F32)
    part_ms = np.zeros((nsplit, N * H, 2), F32)
    for ik2 in range(Hkv):
        kw, kd = stage_rows(kb[:, ik2], nb, qk=qk)
        vw, vd = stage_rows(vb[:, ik2], nb, qk=qk)
        kidx = staged_k_indices(kw, nb, qk=qk)              # (n_kv, D)
        vidx = staged_v_indices(vw, nb, qk=qk)
        kval = cb[kidx] * np.repeat(kd, qk, axis=1)         # d * c[idx], rotated domain
        vval = np.repeat(vd, qk, axis=1) * cb[vidx]
        for tile in range(ntile):
            cols = [tile * nc + c for c in range(nc) if tile * nc + c < ncols]
            iq1 = [f // g for f in cols]
            hs = [ik2 * g + f % g for f in cols]
            Qs = np.stack([q[i, h] * scale_eff for i, h in zip(iq1, hs)]).astype(F32)     # (C, D)
            Qs = rotate_blocks(Qs, qk)                      # per qk-block
            slope = np.array([1.0 if max_bias <= 0 else (m0 ** (h + 1) if h < n_head_log2 else m1 ** (2 * (h - n_head_log2) + 1))
                              for h in hs], F32)
            for z in range(nsplit):
                M = np.full(len(cols), -np.inf, F32)
                S = np.zeros(len(cols), F32)
                acc = np.zeros((len(cols), D), F32)
                for kv0 in range(z * chunk, min(n_kv, (z + 1) * chunk), TILE):
                    rows = np.arange(kv0, min(kv0 + TILE, n_kv, (z + 1) * chunk))
                    mv = np.zeros((len(rows), len(cols)), F32) if mask is None else \
                        (slope[None, :] * mask[np.array(iq1)][:, rows].T).astype(F32)
                    if (mv == -np.inf).all():
                        continue                            # whole tile masked (__syncthreads_or)
                    x = (kval[rows] @ Qs.T).astype(F32)     # (rows, C)
                    if softcap != 0:
                        x = (F32(softcap) * np.tanh(x)).astype(F32)
                    s = np.where(mv == -np.inf, -np.inf, x + mv).astype(F32)
                    mx = s.max(axis=0)
                    Mnew = np.maximum(M, mx)
                    with np.errstate(invalid="ignore"):
                        ms = np.where(Mnew == -np.inf, 1.0, np.where(M == -np.inf, 0.0, np.exp(M - Mnew))).astype(F32)
                        p = np.where((s == -np.inf) | (Mnew == -np.inf)[None, :], 0.0, np.exp(s - Mnew[None, :])).astype(F32)
                    S = S * ms + p.sum(axis=0)
                    M = Mnew
                    acc = acc * ms[:, None] + (p.T @ vval[rows]).astype(F32)
                for c, (i, h) in enumerate(zip(iq1, hs)):
                    row = i * H + h
                    part_vkq[z, row] = acc[c]
                    part_ms[z, row] = (M[c], S[c])
    # combine
    out = np.zeros((N, H, D), F32)
    for row in range(N * H):
        h, i = row % H, row // H
        Mz, Sz = part_ms[:, row, 0], part_ms[:, row, 1]
        sink = sinks[h] if sinks is not None else -np.inf
        Mf = max(Mz.max(), sink)
        o = np.zeros(D, F32)
        S = F32(0)
        if Mf != -np.inf:
            for z in range(nsplit):
                if Mz[z] == -np.inf:
                    continue
                w = np.exp(Mz[z] - Mf)
                S += w * Sz[z]
                o += w * part_vkq[z, row]
            if sinks is not None:
                S += np.exp(sink - Mf)
        o = o * (0 if S == 0 else 1 / S)
        out[i, h] = rotate_blocks(o.reshape(1, D), qk, inverse=True).reshape(D)
    return out


def fattn_reference(q, K, V, mask, sinks, scale, max_bias, softcap):
    N, H, D = q.shape
    Hkv = K.shape[1]
    g = H // Hkv
    n_head_log2 = 1 << int(np.floor(np.log2(H)))
    m0 = 2.0 ** (-max_bias / n_head_log2)
    m1 = 2.0 ** (-(max_bias / 2.0) / n_head_log2)
    out = np.zeros((N, H, D))
    for h in range(H):
        slope = 1.0 if max_bias <= 0 else (m0 ** (h + 1) if h < n_head_log2 else m1 ** (2 * (h - n_head_log2) + 1))
        k = K[:, h // g].astype(F64)
        v = V[:, h // g].astype(F64)
        s = q[:, h].astype(F64) @ k.T * scale
        if softcap != 0:
            s = softcap * np.tanh(s / softcap)
        if mask is not None:
            s = s + slope * mask.astype(F64)
        mx = s.max(axis=1, keepdims=True)
        if sinks is not None:
            mx = np.maximum(mx, sinks[h])
        mx = np.where(np.isfinite(mx), mx, 0.0)
        p = np.exp(s - mx)
        den = p.sum(axis=1, keepdims=True) + (np.exp(sinks[h] - mx) if sinks is not None else 0.0)
        out[:, h] = np.where(den > 0, (p @ v) / np.where(den > 0, den, 1.0), 0.0)
    return out


def test_fattn(rng: np.random.Generator) -> None:
    for b, nbits in ((0, 3), (1, 3), (2, 4)):
        bb = iq.block_bytes(nbits)
        rows = iq.quantize_blocks(rng.standard_normal((300, 128)).astype(F32), bits=nbits).reshape(150, 2 * bb)
        # the buffer is shared by K and V: the row stride is that of the wider type (mixed 3/4-bit)
        w, _ = stage_rows(rows, 2, nbits, sw=4 * 4 * 2 + 1)
        ref = iq.unpack_indices(rows.reshape(300, bb)[:, 2:], nbits).reshape(150, 256)
        check(f"fattn staging {nbits}-bit: score-loop indices (rq_idx) == unpack [{b}]",
              np.array_equal(staged_k_indices(w, 2, nbits), ref))
        check(f"fattn staging {nbits}-bit: accumulate-loop lane bits == unpack [{b}]",
              np.array_equal(staged_v_indices(w, 2, nbits), ref))
    for nbits in iq.BITS:                            # 64-value blocks, D = 64: one block per row
        bb = iq.block_bytes(nbits, 64)
        rows = iq.quantize_blocks(rng.standard_normal((150, 64)).astype(F32), bits=nbits, qk=64)
        w, _ = stage_rows(rows, 1, nbits, sw=2 * 4 + 1, qk=64)
        ref = iq.unpack_indices(rows[:, 2:], nbits).reshape(150, 64)
        check(f"fattn staging {nbits}-bit, 64-value blocks: score-loop indices (rq_idx) == unpack",
              np.array_equal(staged_k_indices(w, 1, nbits, 64), ref))
        check(f"fattn staging {nbits}-bit, 64-value blocks: accumulate-loop lane bits (16 lanes) == unpack",
              np.array_equal(staged_v_indices(w, 1, nbits, 64), ref))

    cases = [  # D, N, H, Hkv, n_kv, mask kind, sinks, softcap, max_bias, nc, nsplit
        (128, 1, 8, 2, 700, "none", False, 0.0, 0.0, 4, 3),
        (128, 3, 4, 1, 113, "causal", False, 0.0, 0.0, 8, 1),
        (256, 2, 4, 4, 300, "random", True, 0.0, 0.0, 1, 2),
        (128, 5, 8, 2, 520, "causal", True, 10.0, 0.0, 8, 4),
        (256, 1, 2, 1, 129, "rowdead", True, 0.0, 8.0, 4, 2),
        (128, 4, 4, 2, 400, "rowdead", False, 0.0, 0.0, 8, 3),
        (64, 1, 9, 3, 700, "none", False, 0.0, 0.0, 4, 3),      # SmolLM2's shape: 9/3 heads of 64
        (64, 5, 8, 2, 520, "causal", True, 10.0, 0.0, 8, 4),
        (64, 2, 4, 4, 300, "random", True, 0.0, 8.0, 1, 2),
    ]
    for D, N, H, Hkv, n_kv, mk, use_sinks, softcap, max_bias, nc, ns in cases:
        q = rng.standard_normal((N, H, D)).astype(F32)
        kf = (rng.standard_normal((n_kv, Hkv, D)) + 0.3).astype(F32)
        vf = rng.standard_t(4, (n_kv, Hkv, D)).astype(F32)
        qk = 64 if D == 64 else 128
        kb = iq.quantize_blocks(kf.reshape(-1, qk), qk=qk).reshape(n_kv, Hkv, -1)
        vb = iq.quantize_blocks(vf.reshape(-1, qk), qk=qk).reshape(n_kv, Hkv, -1)
        K = iq.dequantize_blocks(kb.reshape(-1, iq.block_bytes(3, qk)), qk=qk).reshape(n_kv, Hkv, D)
        V = iq.dequantize_blocks(vb.reshape(-1, iq.block_bytes(3, qk)), qk=qk).reshape(n_kv, Hkv, D)
        mask = None
        if mk == "causal":
            mask = np.where(np.arange(n_kv)[None, :] <= (n_kv - N + np.arange(N))[:, None], 0.0, -np.inf).astype(F32)
        elif mk == "random":
            mask = np.where(rng.random((N, n_kv)) < 0.3, -np.inf, rng.standard_normal((N, n_kv))).astype(F32)
        elif mk == "rowdead":
            mask = np.zeros((N, n_kv), F32)
            mask[0, :] = -np.inf                      # a query that sees nothing
            mask[:, : min(n_kv, 260)] = -np.inf if N > 1 else 0.0
        mask16 = None if mask is None else mask.astype(np.float16).astype(F32)
        sinks = rng.standard_normal(H).astype(F32) if use_sinks else None
        scale = 1.0 / np.sqrt(D)
        got = fattn_model(q, kb, vb, mask16, sinks, scale, max_bias, softcap, nc, ns)
        ref = fattn_reference(q, K, V, mask16, sinks, scale, max_bias, softcap)
        err = np.abs(got - ref).max() / max(1e-30, np.abs(ref).max())
        check(f"fattn model D={D} N={N} H={H}/{Hkv} n_kv={n_kv} mask={mk} sinks={use_sinks} softcap={softcap} "
              f"alibi={max_bias} nc={nc} splits={ns}", bool(err < 2e-5) and np.isfinite(got).all(), f"max rel err {err:.1e}")


# ------------------------------------------------------------------------------------------------
# ITQ3_S: rq-device.cuh / rq-itq3.cu

GRID = np.asarray(itq3.GRID, np.int64)
ISIGNS = np.asarray(itq3.SIGNS, F32).reshape(32, 8)


def itq_lane_codes(blocks: np.ndarray) -> np.ndarray:
    """rq_itq_lane_codes for every lane: (n, 32, 2) uint32 words of 4 code bytes"""
    n = blocks.shape[0]
    qs = blocks[:, 4:68].view("<u4").reshape(n, 16).astype(np.uint32)
    qh = blocks[:, 68:100].view("<u4").reshape(n, 8).astype(np.uint32)
    out = np.empty((n, 32, 2), np.uint32)
    for lane in range(32):
        sl, sh = 2 * (lane >> 3), lane >> 2
        for k in range(2):
            lo = (qs[:, 2 * (lane & 7) + k] >> np.uint32(sl)) & np.uint32(0x03030303)
            hi = ((qh[:, 2 * (lane & 3) + k] >> np.uint32(sh)) & np.uint32(0x01010101)) << np.uint32(2)
            out[:, lane, k] = lo | hi
    return out


def byte_perm(x: np.ndarray, y: np.ndarray, s: np.ndarray) -> np.ndarray:
    src = (y.astype(np.uint64) << np.uint64(32)) | x.astype(np.uint64)
    out = np.zeros(np.broadcast(x, s).shape, np.uint64)
    for i in range(4):
        sel = (s.astype(np.uint64) >> np.uint64(4 * i)) & np.uint64(7)
        out |= ((src >> (sel * np.uint64(8))) & np.uint64(0xFF)) << np.uint64(8 * i)
    return out.astype(np.uint32)


def grid4(c: np.ndarray) -> np.ndarray:
    """rq_itq_grid4 -> the 4 int8 grid values"""
    glo = np.uint32(sum((int(GRID[k]) & 0xFF) << (8 * k) for k in range(4)))
    ghi = np.uint32(sum((int(GRID[k + 4]) & 0xFF) << (8 * k) for k in range(4)))
    sel = (c & 0x7) | ((c >> 4) & 0x70) | ((c >> 8) & 0x700) | ((c >> 12) & 0x7000)
    r = byte_perm(np.full_like(c, glo), np.full_like(c, ghi), sel)
    return np.ascontiguousarray(r).view(np.int8).reshape(*c.shape, 4)


def fwht256_warp(v: np.ndarray) -> np.ndarray:
    """rq_fwht256_warp; v (n, 32, 8) float32"""
    v = v.copy()
    for h in (1, 2, 4):
        for e in range(8):
            if e & h == 0:
                a, b = v[..., e].copy(), v[..., e + h].copy()
                v[..., e], v[..., e + h] = a + b, a - b
    for m in (1, 2, 4, 8, 16):
        p = shfl_xor(v, m)
        upper = ((LANES & m) != 0)[None, :, None]
        v = np.where(upper, p - v, v + p)
    return v * F32(0.0625)


def test_itq(rng: np.random.Generator) -> None:
    w = np.concatenate([rng.standard_normal((200, 256)), rng.standard_t(3, (50, 256)) * 0.05, np.zeros((2, 256))]).astype(F32)
    blocks = itq3.quantize_blocks(w)
    q, d16, m16 = itq3.unpack_blocks(blocks)
    codes = itq_lane_codes(blocks)
    cb = np.ascontiguousarray(codes).view(np.uint8).reshape(-1, 256)   # byte e of word k = code 8l + 4k + e
    check("itq lane codes (qs/qh bit planes) == unpack", np.array_equal(cb, q))
    g = grid4(codes).reshape(-1, 256)
    check("itq __byte_perm grid lookup == grid[code]", np.array_equal(g.astype(np.int64), GRID[q]))
    v = (d16.astype(F32)[:, None, None] * GRID[q].astype(F32).reshape(-1, 32, 8) + m16.astype(F32)[:, None, None]).astype(F32)
    got = (fwht256_warp(v) * ISIGNS).reshape(-1, 256)
    with np.errstate(all="ignore"):
        ref = itq3.dequantize_blocks(blocks)
    check("itq dequantiser (lane FWHT, signs) == numpy reference, float bits",
          np.array_equal(got.view(np.uint32), ref.view(np.uint32)))

    # matrix-vector: rotate + int8 activations, integer dot, offset term
    nrow, nblk = 16, 4
    W = rng.standard_normal((nrow, nblk * 256)).astype(F32)
    Wb = itq3.quantize_blocks(W.reshape(-1, 256)).reshape(nrow, nblk, 100)
    Wd = itq3.dequantize_blocks(Wb.reshape(-1, 100)).reshape(nrow, -1).astype(F64)
    x = rng.standard_normal(nblk * 256).astype(F32)
    xv = (x.reshape(nblk, 32, 8) * ISIGNS).astype(F32)
    y = fwht256_warp(xv).reshape(nblk, 256)
    amax = np.abs(y).max(axis=1)
    dy = (amax / 127).astype(F32)
    iy = np.where(amax > 0, 127 / amax, 0).astype(F32)
    qy = np.rint(y * iy[:, None]).astype(np.int64)
    ds = dy * qy.sum(axis=1)
    out = np.zeros(nrow)
    for r in range(nrow):
        qq, dw, mw = itq3.unpack_blocks(Wb[r])
        for b in range(nblk):
            isum = int((GRID[qq[b]] * qy[b]).sum())
            out[r] += float(dw[b]) * float(dy[b]) * isum + float(mw[b]) * float(ds[b])
    ref = Wd @ x.astype(F64)
    err = np.abs(out - ref).max() / np.abs(ref).max()
    check("itq mmvq formula (rotated int8 activations) ~ dequantised weights . x", err < 2e-2, f"max rel err {err:.1e}")


def main() -> int:
    rng = np.random.default_rng(20261129)
    test_iso_codec(rng)
    test_fattn(rng)
    test_itq(rng)
    print(f"lane-model: {'all ok' if not FAILS else str(len(FAILS)) + ' FAILED'}")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
