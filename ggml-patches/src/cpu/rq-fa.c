// RotaryQuant fused flash attention on the CPU, the driver: tiles of query rows, chunks and blocks of each row's
// visible keys, the online softmax's state, exact rows, the split decode. No ISA here: the kernels it calls are one
// struct rq_fa_kernels, chosen once (rq-cpu.c, arch/).

#include "rq-cpu-impl.h"

// what the whole op shares
struct fa_ctx {
    const struct ggml_tensor * q, * k, * v, * mask;
    // exact rows standing in for some cells' packed K and V (ggml_rq_flash_attn_ext_set_exact), in the cache's domain
    const struct ggml_tensor * k_x, * v_x;
    const int32_t            * xrows, * xuntil, * qpos;
    struct rq_fa_op              op;
    const struct rq_fa_kernels * kern;
    int64_t           rk2, rk3, rv2, rv3;
    float             scale, max_bias, softcap, m0, m1;
    uint32_t          n_head_log2;
    ggml_from_float_t q_to_vec_dot;
    ggml_vec_dot_t    kq_vec_dot;
    int64_t           rec;   // a row's record in the split path's part: m, s, V, exact V
};

// what each query row of a tile owns: the current chunk's state (M, S, VKQ, VKX) and the chunks folded so far (*t)
struct fa_tile {
    int                 T;
    int64_t             ik2, ik3, iv2, iv3;
    int32_t             qp;   // the tile's query position (one token)
    const ggml_fp16_t * mp;   // its mask row
    int64_t             row[RQ_FA_TILE][3];
    float               slope[RQ_FA_TILE];
    const float       * QR[RQ_FA_TILE];   // the raw query rows (exact keys)
    float               Q32[RQ_FA_TILE][RQ_FA_DMAX + 1];
    float               M[RQ_FA_TILE], S[RQ_FA_TILE], VKQ[RQ_FA_TILE][RQ_FA_DMAX], VKX[RQ_FA_TILE][RQ_FA_DMAX];
    float               Mt[RQ_FA_TILE], St[RQ_FA_TILE], VKQt[RQ_FA_TILE][RQ_FA_DMAX], VKXt[RQ_FA_TILE][RQ_FA_DMAX];
    struct rq_fa_qtile  qt;
};

// one block of up to RQ_FA_KB visible keys
struct fa_block {
    int             nu, nc, nx, nk;   // keys: all, packed V, exact, packed K (scored by the kernel)
    float           raw[RQ_FA_KB][RQ_FA_TILE], mkv[RQ_FA_KB];  // scores, then weights; mask values
    const uint8_t * kp[RQ_FA_KB];
    int             ku[RQ_FA_KB];
    const uint8_t * vp[RQ_FA_KB];
    bool            is_x[RQ_FA_KB];
    float           kx[RQ_FA_DMAX], vx[RQ_FA_KB][RQ_FA_DMAX];
};

bool ggml_rq_fa_iso_takes(const struct ggml_tensor * dst) {
    return ggml_rq_type_is_iso(dst->src[2]->type) && dst->src[1]->ne[0] <= RQ_FA_DMAX && dst->src[2]->ne[0] <= RQ_FA_DMAX;
}

static void fa_ctx_init(struct fa_ctx * c, const struct ggml_tensor * dst) {
    c->q    = dst->src[0];
    c->k    = dst->src[1];
    c->v    = dst->src[2];
    c->mask = dst->src[3];
    c->k_x  = dst->src[5];
    c->v_x  = dst->src[6];
    c->xrows  = dst->src[7] ? (const int32_t *) dst->src[7]->data : NULL;
    c->xuntil = dst->src[8] ? (const int32_t *) dst->src[8]->data : NULL;
    c->qpos   = dst->src[9] ? (const int32_t *) dst->src[9]->data : NULL;
    GGML_ASSERT(!c->xrows || c->q->type == GGML_TYPE_F32);
    GGML_ASSERT(ggml_rq_fa_iso_takes(dst));

    struct rq_fa_op * op = &c->op;
    op->v_bits = ggml_rq_iso_bits(c->v->type);
    op->k_bits = ggml_rq_iso_bits(c->k->type); // 0: K is another type, scored with its own vec_dot
    op->v_qk   = ggml_rq_iso_qk(c->v->type);   // block (rotation) width: 128 or 64
    op->k_qk   = op->k_bits ? ggml_rq_iso_qk(c->k->type) : 1;
    op->dk     = c->k->ne[0];
    op->dv     = c->v->ne[0];
    GGML_ASSERT(op->v_bits != 0);
    c->kern = ggml_rq_fa_kernels();

    const int64_t neq2 = c->q->ne[2], neq3 = c->q->ne[3];
    c->rk2 = neq2/c->k->ne[2]; c->rk3 = neq3/c->k->ne[3];
    c->rv2 = neq2/c->v->ne[2]; c->rv3 = neq3/c->v->ne[3];

    memcpy(&c->scale,    (const float *) dst->op_params + 0, sizeof(float));
    memcpy(&c->max_bias, (const float *) dst->op_params + 1, sizeof(float));
    memcpy(&c->softcap,  (const float *) dst->op_params + 2, sizeof(float));
    if (c->softcap != 0) {
        c->scale /= c->softcap;
    }
    c->n_head_log2 = 1u << (uint32_t) floor(log2((uint32_t) neq2));
    c->m0 = powf(2.0f, -(c->max_bias       ) / c->n_head_log2);
    c->m1 = powf(2.0f, -(c->max_bias / 2.0f) / c->n_head_log2);

    const enum ggml_type k_vec_dot_type = ggml_get_type_traits_cpu(c->k->type)->vec_dot_type;
    c->q_to_vec_dot = ggml_get_type_traits_cpu(k_vec_dot_type)->from_float;
    c->kq_vec_dot   = ggml_get_type_traits_cpu(c->k->type)->vec_dot;
    GGML_ASSERT(c->q_to_vec_dot && "fattn: unsupported K-type");
    GGML_ASSERT(ggml_row_size(k_vec_dot_type, op->dk) <= sizeof(((struct fa_tile *) NULL)->Q32[0]));
    c->rec = 2 + op->dv + (c->xrows ? op->dv : 0);
}

// Rows are taken heads-fastest (r = (iq3*neq1 + iq1)*neq2 + iq2), and a tile is the query heads of one token
// that share a K/V head and a mask row. Each row then sees its own visible keys, in cell order, in blocks of
// RQ_FA_KB: which cells a sequence holds, or who shares the ubatch or the tile, changes neither its blocks nor
// its float order, so a sequence decodes the same alone or in a unified cache with others.
static void fa_tile_init(const struct fa_ctx * c, struct fa_tile * tl, int64_t ir, int64_t ir1) {
    const struct ggml_tensor * q = c->q, * mask = c->mask;
    const int64_t neq1 = q->ne[1], neq2 = q->ne[2];
    tl->T = 0;
    for (int t = 0; t < RQ_FA_TILE; ++t) {
        tl->slope[t] = 0.0f; // the lanes of absent rows (SIMD kernels read all of them)
        tl->M[t]     = 0.0f;
    }
    for (; tl->T < RQ_FA_TILE && ir + tl->T < ir1; ++tl->T) {
        const int     T   = tl->T;
        const int64_t r   = ir + T;
        const int64_t iq3 = r/(neq1*neq2);
        const int64_t iq1 = (r - iq3*neq1*neq2)/neq2;
        const int64_t iq2 = r - iq3*neq1*neq2 - iq1*neq2;
        const ggml_fp16_t * mpt = mask ? (const ggml_fp16_t *)((const char *) mask->data + iq1*mask->nb[1] + (iq2%mask->ne[2])*mask->nb[2] + (iq3%mask->ne[3])*mask->nb[3]) : NULL;
        if (T == 0) {
            tl->ik2 = iq2/c->rk2; tl->ik3 = iq3/c->rk3; tl->iv2 = iq2/c->rv2; tl->iv3 = iq3/c->rv3;
            tl->mp = mpt;
            tl->qp = c->qpos ? c->qpos[iq3*neq1 + iq1] : 0;
        } else if (iq2/c->rk2 != tl->ik2 || iq3/c->rk3 != tl->ik3 || iq2/c->rv2 != tl->iv2 || iq3/c->rv3 != tl->iv3 ||
                   mpt != tl->mp || (c->qpos && (iq1 != tl->row[0][0] || iq3 != tl->row[0][2]))) {
            break;
        }
        tl->row[T][0] = iq1; tl->row[T][1] = iq2; tl->row[T][2] = iq3;
        const uint32_t h = iq2;
        tl->slope[T] = (c->max_bias > 0.0f) ? h < c->n_head_log2 ? powf(c->m0, h + 1) : powf(c->m1, 2*(h - c->n_head_log2) + 1) : 1.0f;
        tl->Mt[T] = -INFINITY;
        tl->St[T] = 0.0f;
        memset(tl->VKQt[T], 0, c->op.dv*sizeof(float));
        const float * qrow = (const float *) ((const char *) q->data + (iq1*q->nb[1] + iq2*q->nb[2] + iq3*q->nb[3]));
        if (c->xrows) {
            memset(tl->VKXt[T], 0, c->op.dv*sizeof(float));
            tl->QR[T] = qrow;
        }
        c->q_to_vec_dot(qrow, tl->Q32[T], c->op.dk);
    }
    if (c->op.k_bits) {
        c->kern->q_tile(&c->op, tl->T, tl->Q32[0], tl->Q32[1] - tl->Q32[0], &tl->qt);
    }
}

// the next visible keys from cell *ic, up to RQ_FA_KB: exact and non-IsoQuant keys scored here, packed IsoQuant keys
// listed for the score kernel; false when no key is left. The loop runs once per key: what it reads of the op and the
// tile is in locals first (read through the structs, it cost the whole op ~10%).
static bool fa_block_gather(const struct fa_ctx * c, const struct fa_tile * tl, int64_t * ic, struct fa_block * b) {
    const struct ggml_tensor * k = c->k, * v = c->v;
    const int64_t   nek1   = k->ne[1], DK = c->op.dk, DV = c->op.dv;
    const size_t    k_nb1  = k->nb[1], v_nb1 = v->nb[1];
    const char    * k_base = (const char *) k->data + tl->ik2*k->nb[2] + tl->ik3*k->nb[3];
    const char    * v_base = (const char *) v->data + tl->iv2*v->nb[2] + tl->iv3*v->nb[3];
    const ggml_fp16_t * mp = tl->mp;
    const int32_t * xrows  = c->xrows  ? c->xrows  + tl->ik3*nek1 : NULL;
    const int32_t * xuntil = c->xuntil ? c->xuntil + tl->ik3*nek1 : NULL;
    const bool      k_iso  = c->op.k_bits != 0;
    const int       T      = tl->T;
    int64_t i = *ic;
    int nu = 0, nc = 0, nx = 0, nk = 0;
    for (; i < nek1 && nu < RQ_FA_KB; ++i) {
        const float mk = mp ? GGML_CPU_FP16_TO_FP32(mp[i]) : 0.0f;
        if (mk == -INFINITY) {
            continue;
        }
        const char  * k_data = k_base + i*k_nb1;
        const int32_t xr     = xrows && (!xuntil || tl->qp <= xuntil[i]) ? xrows[i] : -1;
        float * s = b->raw[nu]; // rows t < T; packed keys' scores are written by the kernel, all lanes
        b->is_x[nu] = xr >= 0;
        if (xr >= 0) {
            memset(s, 0, sizeof(b->raw[0])); // the lanes of absent rows stay finite
            ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) ((const char *) c->k_x->data + xr*c->k_x->nb[1]) + tl->ik2*DK, b->kx, DK);
            for (int t = 0; t < T; ++t) {
                ggml_vec_dot_f32(DK, &s[t], 0, b->kx, 0, tl->QR[t], 0, 1);
            }
            ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) ((const char *) c->v_x->data + xr*c->v_x->nb[1]) + tl->iv2*DV, b->vx[nx++], DV);
        } else {
            if (k_iso) {
                b->kp[nk]   = (const uint8_t *) k_data;
                b->ku[nk++] = nu;
            } else {
                memset(s, 0, sizeof(b->raw[0]));
                for (int t = 0; t < T; ++t) {
                    c->kq_vec_dot(DK, &s[t], 0, k_data, 0, tl->Q32[t], 0, 1);
                }
            }
            b->vp[nc++] = (const uint8_t *) (v_base + i*v_nb1);
        }
        b->mkv[nu++] = mk;
    }
    *ic = i;
    b->nu = nu; b->nc = nc; b->nx = nx; b->nk = nk;
    return nu > 0;
}

// the block's online-softmax update: scores to weights in place, at most one rescale of each row's V (a scale by
// exactly 1 would change no bit, so ms = 1 stands for "no rescale")
static void fa_block_softmax(const struct fa_ctx * c, struct fa_tile * tl, struct fa_block * b) {
    float ms[RQ_FA_TILE];
    c->kern->softmax(tl->T, b->nu, b->raw, b->mkv, tl->slope, c->scale, c->softcap, tl->M, tl->S, ms);
    for (int t = 0; t < tl->T; ++t) {
        if (ms[t] != 1.0f) {
            ggml_vec_scale_f32(c->op.dv, tl->VKQ[t], ms[t]);
            if (c->xrows) {
                ggml_vec_scale_f32(c->op.dv, tl->VKX[t], ms[t]);
            }
        }
    }
}

// V of the block: packed values by the kernel (rotated domain), exact ones in floats (unrotated)
static void fa_block_values(const struct fa_ctx * c, struct fa_tile * tl, struct fa_block * b) {
    const int64_t stride = tl->VKQ[1] - tl->VKQ[0];
    if (b->nx == 0) {
        c->kern->mad(&c->op, tl->T, b->nu, tl->VKQ[0], stride, b->vp, (const float (*)[RQ_FA_TILE]) b->raw);
        return;
    }
    float wc[RQ_FA_KB][RQ_FA_TILE];
    for (int u = 0, jc = 0, jx = 0; u < b->nu; ++u) {
        if (b->is_x[u]) {
            for (int t = 0; t < tl->T; ++t) {
                ggml_vec_mad_f32(c->op.dv, tl->VKX[t], b->vx[jx], b->raw[u][t]);
            }
            jx++;
        } else {
            memcpy(wc[jc++], b->raw[u], sizeof(wc[0]));
        }
    }
    if (b->nc > 0) {
        c->kern->mad(&c->op, tl->T, b->nc, tl->VKQ[0], stride, b->vp, (const float (*)[RQ_FA_TILE]) wc);
    }
}

// a row's online-softmax state: max, sum, V accumulated (rotated domain), exact rows' V (unrotated)
static void iso_fa_fold(int64_t n, bool x, float * m, float * s, float * vkq, float * vkx,
                        float mc, float sc, const float * vkqc, const float * vkxc) {
    if (mc == -INFINITY) {
        return; // no visible key in the chunk
    }
    const float mx = MAX(*m, mc);
    const float a  = iso_expf_ftz(*m - mx); // 0 for the first chunk: the total becomes the chunk's, exactly
    const float b  = iso_expf_ftz(mc - mx);
    ggml_vec_scale_f32(n, vkq, a);
    ggml_vec_mad_f32(n, vkq, vkqc, b);
    if (x) {
        ggml_vec_scale_f32(n, vkx, a);
        ggml_vec_mad_f32(n, vkx, vkxc, b);
    }
    *s = *s*a + sc*b;
    *m = mx;
}

// one chunk of the tile's visible keys from cell *ic: its state written to part (the split path) or folded
static void fa_tile_chunk(const struct fa_ctx * c, struct fa_tile * tl, struct fa_block * b, int64_t * ic, float * part) {
    const int64_t DV = c->op.dv;
    for (int t = 0; t < tl->T; ++t) {
        tl->M[t] = -INFINITY;
        tl->S[t] = 0.0f;
        memset(tl->VKQ[t], 0, DV*sizeof(float));
        if (c->xrows) {
            memset(tl->VKX[t], 0, DV*sizeof(float));
        }
    }
    // per block: scores of every row first, then one online-softmax update per row, then V
    for (int64_t nv = 0; nv < RQ_FA_CHUNK && fa_block_gather(c, tl, ic, b); nv += b->nu) {
        if (b->nk > 0) {
            c->kern->score(&c->op, &tl->qt, tl->T, b->nk, b->kp, b->ku, b->raw);
        }
        fa_block_softmax(c, tl, b);
        fa_block_values(c, tl, b);
    }
    for (int t = 0; t < tl->T; ++t) {
        if (part) {
            float * r = part + t*c->rec;
            r[0] = tl->M[t];
            r[1] = tl->S[t];
            memcpy(r + 2, tl->VKQ[t], DV*sizeof(float));
            if (c->xrows) {
                memcpy(r + 2 + DV, tl->VKX[t], DV*sizeof(float));
            }
        } else {
            iso_fa_fold(DV, c->xrows, &tl->Mt[t], &tl->St[t], tl->VKQt[t], tl->VKXt[t], tl->M[t], tl->S[t], tl->VKQ[t], tl->VKX[t]);
        }
    }
}

// a row's output from its folded state: inverse rotation, exact rows' V, sinks, 1/sum, permuted into dst
static void iso_fa_finish(struct ggml_tensor * dst, const int64_t row[3], int64_t n, int qk, float m, float s,
                          float * vkq, const float * vkx) {
    const struct ggml_tensor * sinks = dst->src[4];
    ggml_rq_iso_unrotate_qk(n, vkq, qk);
    if (vkx) {
        ggml_vec_acc_f32(n, vkq, vkx);
    }
    if (sinks) {
        const float sk = ((const float *) sinks->data)[row[1]];
        float ms = 1.0f;
        float vs = 1.0f;
        if (sk > m) {
            ms = expf(m - sk);
            ggml_vec_scale_f32(n, vkq, ms);
        } else {
            vs = expf(sk - m);
        }
        s = s*ms + vs;
    }
    const float s_inv = s == 0.0f ? 0.0f : 1.0f/s;
    ggml_vec_scale_f32(n, vkq, s_inv);
    // permute(0, 2, 1, 3)
    memcpy((char *) dst->data + (row[2]*dst->ne[2]*dst->ne[1] + row[1] + row[0]*dst->ne[1])*dst->nb[1], vkq, dst->nb[1]);
}

// Rows [ir0, ir1), chunks [c0, c1) of each row's visible keys starting at cell ic0 (0, INT64_MAX, 0: all of them).
// part: one tile's chunk states, [chunk][row][m, s, V, exact V], written instead of the output (the split path).
static void iso_fa_rows(struct ggml_tensor * dst, int64_t ir0, int64_t ir1, int64_t c0, int64_t c1, int64_t ic0, float * part) {
    struct fa_ctx   c;
    struct fa_tile  tl;
    struct fa_block b;
    fa_ctx_init(&c, dst);
    if (c.kern->counter >= 0 && ir1 > ir0) {
        ggml_rq_counter_add((enum ggml_rq_counter) c.kern->counter, 1);
    }
    for (int64_t ir = ir0; ir < ir1; ir += tl.T) {
        fa_tile_init(&c, &tl, ir, ir1);
        GGML_ASSERT(!part || tl.T == ir1 - ir0); // the split path hands over one tile at a time
        int64_t ic = ic0;
        for (int64_t ch = c0; ch < c1 && ic < c.k->ne[1]; ++ch) {
            fa_tile_chunk(&c, &tl, &b, &ic, part ? part + ch*tl.T*c.rec : NULL);
        }
        for (int t = 0; t < tl.T && !part; ++t) {
            iso_fa_finish(dst, tl.row[t], c.op.dv, c.op.v_qk, tl.Mt[t], tl.St[t], tl.VKQt[t], c.xrows ? tl.VKXt[t] : NULL);
        }
    }
}

void ggml_rq_fa_iso_rows(const struct ggml_compute_params * params, struct ggml_tensor * dst, int64_t ir0, int64_t ir1) {
    GGML_UNUSED(params);
    iso_fa_rows(dst, ir0, ir1, 0, INT64_MAX, 0, NULL);
}

// the tiles iso_fa_rows makes of one token's heads (a K/V head's query heads, at most RQ_FA_TILE): their first rows
// in tile[0..nt), tile[nt] = the head count; 0 when there are enough tiles for every thread (or too many)
static int fa_split_tiles(const struct ggml_tensor * q, const struct ggml_tensor * k, const struct ggml_tensor * v,
                          int nth, int64_t tile[RQ_FA_TILE + 1]) {
    const int64_t nh = q->ne[2], rk2 = nh/k->ne[2], rv2 = nh/v->ne[2];
    int nt = 0;
    for (int64_t r = 0; r < nh; ++r) {
        if (nt == 0 || r - tile[nt - 1] == RQ_FA_TILE || r/rk2 != tile[nt - 1]/rk2 || r/rv2 != tile[nt - 1]/rv2) {
            if (nt == RQ_FA_TILE || nt + 1 >= nth) {
                return 0;
            }
            tile[nt++] = r;
        }
    }
    tile[nt] = nh;
    return nt;
}

// each tile's chunks folded in order, as iso_fa_rows folds them: the same bits as without the split
static void fa_split_fold(struct ggml_tensor * dst, const float * pt, int64_t nch, int64_t rec, int64_t r0, int T) {
    const int64_t DV = dst->src[2]->ne[0];
    float vkq[RQ_FA_DMAX], vkx[RQ_FA_DMAX];
    for (int t = 0; t < T; ++t) {
        float m = -INFINITY, s = 0.0f;
        memset(vkq, 0, sizeof(vkq));
        memset(vkx, 0, sizeof(vkx));
        for (int64_t ch = 0; ch < nch; ++ch) {
            const float * r = pt + (ch*T + t)*rec;
            iso_fa_fold(DV, rec > 2 + DV, &m, &s, vkq, vkx, r[0], r[1], r + 2, r + 2 + DV);
        }
        const int64_t row[3] = { 0, r0 + t, 0 };
        iso_fa_finish(dst, row, DV, ggml_rq_iso_qk(dst->src[2]->type), m, s, vkq, rec > 2 + DV ? vkx : NULL);
    }
}

bool ggml_rq_fa_iso_split(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * q    = dst->src[0];
    const struct ggml_tensor * k    = dst->src[1];
    const struct ggml_tensor * v    = dst->src[2];
    const struct ggml_tensor * mask = dst->src[3];
    const int ith = params->ith;
    const int nth = params->nth;
    if (nth < 2 || q->ne[1] != 1 || q->ne[3] != 1 || (mask && mask->ne[2] != 1) || !ggml_rq_cpu_get_split()) {
        return false; // one token of one sequence, one mask row for all heads
    }
    int64_t tile[RQ_FA_TILE + 1];
    const int nt = fa_split_tiles(q, k, v, nth, tile);
    if (nt == 0) {
        return false; // enough tiles for every thread: iso_fa_rows over the rows
    }
    // the row's visible keys, and the threads per tile: each takes a run of its chunks
    const int64_t nek1 = k->ne[1];
    const ggml_fp16_t * mp = mask ? (const ggml_fp16_t *) mask->data : NULL;
    int64_t nvis = nek1;
    if (mp) {
        nvis = 0;
        for (int64_t ic = 0; ic < nek1; ++ic) {
            nvis += GGML_CPU_FP16_TO_FP32(mp[ic]) != -INFINITY;
        }
    }
    const int64_t nch = (nvis + RQ_FA_CHUNK - 1)/RQ_FA_CHUNK;
    const int64_t DV  = v->ne[0];
    const int64_t rec = 2 + DV + (dst->src[7] ? DV : 0);
    const int64_t np  = MIN(nth/nt, nch);
    if (np < 2 || (size_t) (nt*nch*RQ_FA_TILE*rec)*sizeof(float) > params->wsize) {
        return false;
    }
    if (ith == 0) {
        ggml_rq_counter_add(GGML_RQ_ISO_SPLIT_CALLS, 1);
    }
    float * part = (float *) params->wdata;
    const int j = ith/np, p = ith % np;
    if (j < nt) {
        const int64_t c0 = p*nch/np, c1 = (p + 1)*nch/np;
        int64_t ic0 = 0;
        for (int64_t nv = 0; mp && nv < c0*RQ_FA_CHUNK; ++ic0) {
            nv += GGML_CPU_FP16_TO_FP32(mp[ic0]) != -INFINITY;
        }
        if (!mp) {
            ic0 = c0*RQ_FA_CHUNK;
        }
        iso_fa_rows(dst, tile[j], tile[j + 1], c0, c1, ic0, part + j*nch*RQ_FA_TILE*rec);
    }
    ggml_barrier(params->threadpool);
    if (ith < nt) {
        fa_split_fold(dst, part + ith*nch*RQ_FA_TILE*rec, nch, rec, tile[ith], (int) (tile[ith + 1] - tile[ith]));
    }
    return true;
}
