// The copy task of the K statistics' pass (llama-rq-impl.h): which layers retrieve, and how much of that a 3-bit K
// cache costs each, so that the default per-layer types give 4-bit K to the layers that lose most (llama-rq-layers.cpp).

#include "llama-rq-impl.h"

#include "llama-hparams.h"

#include "ggml-rq.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>

llama_rq_copy_task::llama_rq_copy_task(const std::vector<llama_token> & ordinary, std::mt19937 & rng, llama_token bos,
                                       uint32_t n_layer) : q(n_layer), k(n_layer) {
    // distinct tokens, so that each has exactly one earlier occurrence to retrieve (ordinary holds distinct ids)
    std::vector<llama_token> body;
    while (body.size() < std::min<size_t>(L, ordinary.size())) {
        const llama_token t = ordinary[rng() % ordinary.size()];
        if (std::find(body.begin(), body.end(), t) == body.end()) {
            body.push_back(t);
        }
    }
    off = bos == LLAMA_TOKEN_NULL ? 0 : 1;
    if (off) {
        tokens.push_back(bos);
    }
    tokens.insert(tokens.end(), body.begin(), body.end());
    tokens.insert(tokens.end(), body.begin(), body.end());
}

bool llama_rq_copy_task::wants(const ggml_tensor * t) {
    return strncmp(t->name, "attn_q_sm-", 10) == 0 || strncmp(t->name, "attn_k_in-", 10) == 0;
}

void llama_rq_copy_task::take(const ggml_tensor * t, std::vector<uint8_t> & buf) {
    const int il = atoi(t->name + 10);
    if (t->type != GGML_TYPE_F32 || t->ne[3] != 1 || t->ne[2] != (int64_t) tokens.size() || il < 0 ||
        (size_t) il >= q.size()) {
        bad = true;
        return;
    }
    std::vector<float> & dst = strncmp(t->name, "attn_q_sm-", 10) == 0 ? q[il] : k[il];
    dst.resize(t->ne[0]*t->ne[1]*t->ne[2]);
    rq_read_f32(t, buf, [&](int64_t i, int64_t h, int64_t j, float x) {
        dst[(i*t->ne[1] + h)*t->ne[0] + j] = x;
    });
}

// layer il: mean over query heads and the second copy's queries of the softmax weight on the earlier occurrence's
// successor that K through the 3-bit quantiser gives up (clamped at 0: a head that gains elsewhere does not cancel one
// that loses), K centred with the layer's mu/lam as the cache stores it and q scaled by lam, the window's keys exact.
// -1 where the layer was not captured or its heads take no IsoQuant type.
static float rq_copy_loss(const llama_rq_copy_task & task, const llama_hparams & hp, uint32_t il,
                          const float * mu, const float * lam) {
    const std::vector<float> & Q = task.q[il];
    const std::vector<float> & K = task.k[il];
    const int64_t hd = hp.n_embd_head_k(il), nkv = hp.n_head_kv(il), n = (int64_t) task.tokens.size();
    if (Q.empty() || K.empty() || nkv == 0 || K.size() != (size_t) (n*nkv*hd) || Q.size() % (n*hd) != 0) {
        return -1.0f;
    }
    const int64_t nq = (int64_t) Q.size()/(n*hd), g = nq/nkv;
    const ggml_type type = hd % 128 == 0 ? GGML_TYPE_ISOQUANT3_0 : hd == 64 ? GGML_TYPE_ISOQUANT3_64 : GGML_TYPE_COUNT;
    if (type == GGML_TYPE_COUNT || g == 0 || nq % nkv != 0) {
        return -1.0f;
    }
    // keys as the cache stores them: centred, exact (kc) and through the quantiser (kx)
    std::vector<float> kc(K.size()), kx(K.size());
    for (int64_t i = 0; i < n; ++i) {
        for (int64_t h = 0; h < nkv; ++h) {
            const int64_t o = (i*nkv + h)*hd;
            for (int64_t j = 0; j < hd; ++j) {
                kc[o + j] = (K[o + j] - mu[h*hd + j])/lam[h*hd + j];
            }
            ggml_rq_iso_roundtrip(type, kc.data() + o, kx.data() + o, hd);
        }
    }
    const int64_t L = llama_rq_copy_task::L, W = LLAMA_RQ_KV_WINDOW_DEFAULT;
    std::vector<float> qs(hd);
    std::vector<double> s(n), sx(n);
    double lost = 0.0;
    for (int64_t h = 0; h < nq; ++h) {
        const int64_t hk = h/g;
        for (int64_t t = task.off + L; t < n; ++t) {
            const int64_t target = t - L + 1;
            for (int64_t j = 0; j < hd; ++j) {
                qs[j] = Q[(t*nq + h)*hd + j]*lam[hk*hd + j];
            }
            double m = -INFINITY, mx = -INFINITY;
            for (int64_t c = 0; c <= t; ++c) {
                const float * ke = kc.data() + (c*nkv + hk)*hd;
                const float * kq = t - c < W ? ke : kx.data() + (c*nkv + hk)*hd;
                double a = 0.0, b = 0.0;
                for (int64_t j = 0; j < hd; ++j) {
                    a += (double) qs[j]*ke[j];
                    b += (double) qs[j]*kq[j];
                }
                s[c] = a, sx[c] = b;
                m = std::max(m, a), mx = std::max(mx, b);
            }
            double z = 0.0, zx = 0.0;
            for (int64_t c = 0; c <= t; ++c) {
                z  += std::exp(s[c] - m);
                zx += std::exp(sx[c] - mx);
            }
            lost += std::max(std::exp(s[target] - m)/z - std::exp(sx[target] - mx)/zx, 0.0);
        }
    }
    return (float) (lost/(nq*(n - task.off - L)));
}

std::vector<float> llama_rq_copy_task::losses(const llama_hparams & hp, const llama_rq_k_center_data & d,
                                              int32_t n_threads) const {
    // layers are independent: each thread takes every n-th, so the values do not depend on the thread count
    std::vector<float> out(q.size(), -1.0f);
    const uint32_t n_layer = (uint32_t) std::min(q.size(), d.off.size());
    const uint32_t n = std::clamp<uint32_t>(n_threads > 0 ? (uint32_t) n_threads : 1, 1, std::max(n_layer, 1u));
    auto work = [&](uint32_t i0) {
        for (uint32_t il = i0; il < n_layer; il += n) {
            if (d.off[il] >= 0) {
                out[il] = rq_copy_loss(*this, hp, il, d.mu.data() + d.off[il], d.lam.data() + d.off[il]);
            }
        }
    };
    std::vector<std::thread> pool;
    for (uint32_t i = 1; i < n; ++i) {
        pool.emplace_back(work, i);
    }
    work(0);
    for (auto & t : pool) {
        t.join();
    }
    return out;
}
