// The recent window (llama-rq.h): with an IsoQuant V cache, F16 copies of each sequence's last kv_window positions, and
// of the ubatch's own tokens, stand in for their packed K/V for the queries within kv_window of them.

#include "llama-rq.h"
#include "llama-rq-impl.h"

#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-model.h"

#include "ggml-backend.h"
#include "ggml-rq.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <tuple>

//
// the recent window
//

void llama_kv_rq::init_window(ggml_type type_v) {
    const llama_hparams & hparams = kv.hparams;
    const bool dflt = params.kv_window < 0; // not asked for: on where it can be, quietly off elsewhere
    if (params.kv_window == 0) {
        return;
    }
    const char * why = nullptr;
    if (!ggml_rq_type_is_iso(type_v)) {
        why = "the V cache is not IsoQuant: only the fused IsoQuant attention reads the window";
    } else if (params.iso_unfused) {
        why = "the unfused path attends to dequantised K/V";
    } else if (hparams.is_mla() || llama_rq_arch_unhooked(kv.model.arch)) {
        why = "this architecture's attention is not hooked";
    } else if (std::any_of(kv.layers.begin(), kv.layers.end(), [](const auto & l) {
                   return l.k->buffer && !ggml_backend_buffer_is_host(l.k->buffer); })) {
        why = "the KV cache is on a GPU device, whose kernels do not read the window yet";
    }
    if (why) {
        if (dflt && !ggml_rq_type_is_iso(type_v)) {
            return; // nothing to say about a cache the window is not for
        }
        if (dflt) {
            LLAMA_LOG_INFO("%s: recent window = off (%s)\n", __func__, why);
        } else {
            LLAMA_LOG_WARN("%s: recent window = off (%s)\n", __func__, why);
        }
        return;
    }

    const uint32_t w = dflt ? LLAMA_RQ_KV_WINDOW_DEFAULT : (uint32_t) params.kv_window;
    // a ubatch reads its own tokens' rows from the graph and the pool from a copy the graph takes before writing it
    // (build_window), so the pool keeps only rows a later query can use: at most w - 1 positions per sequence
    const uint32_t budget = w*kv.n_seq_max;

    rq_buft_ctxs ctxs;
    size_t row_bytes = 0;
    for (size_t i = 0; i < kv.layers.size(); ++i) {
        const auto & layer = kv.layers[i];
        if (!layer.v || !ggml_rq_type_is_iso(layer.v->type)) {
            continue; // --kv-layer-types: this layer's V is not IsoQuant
        }
        ggml_context * ctx = llama_rq_buft_ctx(ctxs, ggml_backend_buffer_get_type(layer.k->buffer), 2*kv.layers.size(), "the recent window");
        k_win[i] = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, layer.k->ne[0], budget + 1);
        v_win[i] = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, layer.v->ne[0], budget + 1);
        ggml_format_name(k_win[i], "cache_win_k_l%d", layer.il);
        ggml_format_name(v_win[i], "cache_win_v_l%d", layer.il);
        row_bytes += ggml_row_size(GGML_TYPE_F16, layer.k->ne[0]) + ggml_row_size(GGML_TYPE_F16, layer.v->ne[0]);
    }
    for (auto & [buft, ctx] : ctxs) {
        // no_alloc (memory planning): the tensors are counted, nothing is allocated and the window stays off
        ggml_backend_buffer_ptr buf { hparams.no_alloc ? ggml_backend_buft_alloc_buffer(buft, 0)
                                                          : ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft) };
        if (!buf) {
            throw std::runtime_error("failed to allocate the recent window");
        }
        for (ggml_tensor * t = ggml_get_first_tensor(ctx.get()); hparams.no_alloc && t; t = ggml_get_next_tensor(ctx.get(), t)) {
            t->buffer = buf.get();
        }
        if (!hparams.no_alloc) {
            ggml_backend_buffer_clear(buf.get(), 0);
        }
        win_ctxs_bufs.emplace_back(std::move(ctx), std::move(buf));
    }
    if (hparams.no_alloc) {
        std::fill(k_win.begin(), k_win.end(), nullptr);
        std::fill(v_win.begin(), v_win.end(), nullptr);
        return;
    }
    win        = w;
    win_budget = budget;

    win_row_of_cell.assign((size_t) kv.get_size()*kv.n_stream, -1);
    win_cell_of_row.assign(win_budget, -1);
    win_pos_of_row.assign(win_budget, -1);
    win_free.resize(win_budget);
    for (uint32_t r = 0; r < win_budget; ++r) {
        win_free[r] = win_budget - 1 - r;
    }
    LLAMA_LOG_INFO("%s: recent window = %u positions%s (K and V in F16 for the last %u positions of each of %u sequences: "
            "%u rows, %.2f MiB)\n", __func__, win, dflt ? ", the default (--kv-window 0: none)" : "",
            win, kv.n_seq_max, win_budget, (win_budget + 1)*row_bytes/1024.0/1024.0);
}

void llama_kv_rq::win_release(uint32_t row) {
    const int64_t c = win_cell_of_row[row];
    GGML_ASSERT(c >= 0);
    win_row_of_cell[c]   = -1;
    win_cell_of_row[row] = -1;
    win_free.push_back(row);
}

bool llama_kv_rq::win_row_used(uint32_t r, const std::vector<llama_pos> * next, llama_seq_id only) const {
    // a query of one of its cell's sequences can still use it: its position is within win - 1 of that sequence's next
    // query position (next[s]; none given, or INT_MAX there: the position after the sequence's last cell)
    const int64_t c = win_cell_of_row[r];
    if (c < 0 || !cell_holds(c, win_pos_of_row[r])) {
        return false;
    }
    const auto & cells = kv.v_cells[c/kv.get_size()];
    const uint32_t idx = c % kv.get_size();
    for (llama_seq_id s = 0; s < (llama_seq_id) kv.n_seq_max; ++s) {
        if ((only == -1 || s == only) && cells.seq_has(idx, s)) {
            const llama_pos n = next && (*next)[s] != std::numeric_limits<llama_pos>::max() ? (*next)[s] : cells.seq_pos_max(s) + 1;
            if (win_pos_of_row[r] + (llama_pos) win > n) {
                return true;
            }
        }
    }
    return false;
}

void llama_kv_rq::win_release_unused(const std::vector<llama_pos> & next) {
    for (uint32_t r = 0; r < win_budget; ++r) {
        if (win_cell_of_row[r] >= 0 && !win_row_used(r, &next)) {
            win_release(r);
        }
    }
}

void llama_kv_rq::win_ubatch(const llama_kv_cache::slot_info & sinfo, const llama_ubatch & ub) {
    win_w.clear();
    win_rows.clear();
    win_until.clear();
    win_qpos.clear();
    if (win == 0) {
        return;
    }
    const uint32_t kv_size = kv.get_size();
    const uint32_t n_seq   = kv.n_seq_max;
    const llama_pos none   = std::numeric_limits<llama_pos>::max();

    // the first position each sequence of the ubatch queries at, and the one after its last
    std::vector<llama_pos> first(n_seq, none), after(n_seq, none);
    for (uint32_t i = 0; i < ub.n_tokens; ++i) {
        for (int32_t j = 0; j < ub.n_seq_id[i]; ++j) {
            const llama_seq_id s = ub.seq_id[i][j];
            first[s] = std::min(first[s], ub.pos[i]);
            after[s] = after[s] == none ? ub.pos[i] + 1 : std::max(after[s], ub.pos[i] + 1);
        }
    }
    // rows of the cells this ubatch overwrites, of cells emptied or moved, and rows this ubatch's queries cannot use
    for (uint32_t s = 0; s < sinfo.n_stream(); ++s) {
        for (uint32_t ii = 0; ii < sinfo.size(); ++ii) {
            const int64_t c = (int64_t) sinfo.strm[s]*kv_size + sinfo.idxs[s][ii];
            if (win_row_of_cell[c] >= 0) {
                win_release(win_row_of_cell[c]);
            }
        }
    }
    win_release_unused(first);

    // the attended view: cells [0, n_kv) of streams s0..s1, read from the graph's copy of the pool as it is now
    const uint32_t n_kv = kv.get_n_kv(sinfo);
    win_ns = sinfo.s1 - sinfo.s0 + 1;
    GGML_ASSERT(ub.n_tokens % win_ns == 0);
    win_rows.assign((size_t) n_kv*win_ns, -1);
    win_until.assign((size_t) n_kv*win_ns, std::numeric_limits<int32_t>::min());
    rq_rows_in_view(win_cell_of_row, kv_size, sinfo, n_kv, [&](uint32_t r, int64_t j) {
        win_rows[j]  = (int32_t) r;
        win_until[j] = win_pos_of_row[r] + (int32_t) win - 1;
    });
    // the ubatch's cells: their rows in the graph, after the pool's win_budget + 1 (build_window)
    for (uint32_t s = 0; s < sinfo.n_stream(); ++s) {
        for (uint32_t ii = 0; ii < sinfo.size(); ++ii) {
            const uint32_t i = s*sinfo.size() + ii, idx = sinfo.idxs[s][ii];
            if (idx < n_kv) {
                const int64_t j = (int64_t) (sinfo.strm[s] - sinfo.s0)*n_kv + idx;
                win_rows[j]  = (int32_t) (win_budget + 1 + i);
                win_until[j] = ub.pos[i] + (int32_t) win - 1;
            }
        }
    }
    win_qpos.assign(ub.pos, ub.pos + ub.n_tokens);

    // rows no query after this ubatch can use are free for its tokens now: the graph copies the pool before it writes
    win_release_unused(after);
    // a pool row for each of the ubatch's tokens that a later query of one of its sequences can still use
    win_w.assign(ub.n_tokens, win_budget); // the spare row
    for (uint32_t s = 0; s < sinfo.n_stream(); ++s) {
        for (uint32_t ii = 0; ii < sinfo.size(); ++ii) {
            const uint32_t i = s*sinfo.size() + ii;
            const int64_t  c = (int64_t) sinfo.strm[s]*kv_size + sinfo.idxs[s][ii];
            bool later = false;
            for (int32_t j = 0; j < ub.n_seq_id[i] && !later; ++j) {
                later = ub.pos[i] + (llama_pos) win > after[ub.seq_id[i][j]];
            }
            if (!later) {
                continue;
            }
            if (win_free.empty()) {
                if (!win_full_logged) {
                    LLAMA_LOG_WARN("%s: recent window: no free row (%u rows); some keys are read packed\n", __func__, win_budget);
                    win_full_logged = true;
                }
                continue;
            }
            const int32_t r = win_free.back();
            win_free.pop_back();
            win_row_of_cell[c] = r;
            win_cell_of_row[r] = c;
            win_pos_of_row[r]  = ub.pos[i];
            win_w[i] = r;
        }
    }
}

namespace {
class llama_rq_win_shift : public llm_graph_input_i {
public:
    explicit llama_rq_win_shift(llama_kv_rq * rq) : rq(rq) {}
    void set_input(const llama_ubatch * ubatch) override {
        GGML_UNUSED(ubatch);
        rq->set_window_shift(shift);
    }
    ggml_tensor * shift = nullptr; // I32 [win_budget + 1]: each pool row's cell shift, 0 for free rows
    llama_kv_rq * rq;
};
} // namespace

ggml_tensor * llama_kv_rq::window_shift_input(llm_graph_result * res, ggml_context * ctx) {
    if (win == 0 || std::none_of(k_win.begin(), k_win.end(), [](const ggml_tensor * t) { return t != nullptr; })) {
        return nullptr;
    }
    auto inp = std::make_unique<llama_rq_win_shift>(this);
    inp->shift = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, win_budget + 1);
    ggml_set_input(inp->shift);
    ggml_set_name(inp->shift, "rq_win_shift");
    ggml_tensor * t = inp->shift;
    res->add_input(std::move(inp));
    return t;
}

void llama_kv_rq::window_shift(ggml_context * ctx, ggml_cgraph * gf, const llama_cparams & cparams, int32_t il,
        ggml_tensor * shift, ggml_tensor * rot, ggml_tensor * factors, float freq_base, float freq_scale) const {
    const int32_t ikv = kv.map_layer_ids.at(il);
    ggml_tensor * kw = shift ? k_win[ikv] : nullptr;
    if (!kw || kv.hparams.n_lora_kv > 0) {
        return; // MLA caches keep their rows unshifted: they are dropped as before
    }
    const int64_t n_embd_head_k = kv.hparams.n_embd_head_k(il);
    ggml_tensor * k = ggml_view_3d(ctx, kw, k_center(il).k_scale ? n_embd_head_k : kv.hparams.n_rot(il),
            kv.hparams.n_head_kv(il), kw->ne[1], ggml_row_size(kw->type, n_embd_head_k), kw->nb[1], 0);
    ggml_build_forward_expand(gf, kv.build_rope_shift(cparams, ctx, k, shift, rot, factors, freq_base, freq_scale, il));
}

void llama_kv_rq::set_window_shift(ggml_tensor * shift) {
    GGML_ASSERT(shift->buffer && ggml_backend_buffer_is_host(shift->buffer));
    int32_t * d = (int32_t *) shift->data;
    std::fill(d, d + win_budget + 1, 0);
    for (uint32_t r = 0; r < win_budget; ++r) {
        // the row was written at win_pos_of_row; its cell moved from pos - shift to pos since
        const int64_t c = win_cell_of_row[r];
        if (c >= 0 && cell_moved_from(c, win_pos_of_row[r])) {
            const auto & cells = kv.v_cells[c/kv.get_size()];
            d[r] = cells.get_shift(c % kv.get_size());
            win_pos_of_row[r] = cells.pos_get(c % kv.get_size());
        }
    }
}

bool llama_kv_rq::window_fits(const llama_rq_dfr_inputs & inp) const {
    if (win_w.empty()) {
        return inp.win_w == nullptr;
    }
    return inp.win_w && ggml_nelements(inp.win_w) == (int64_t) win_w.size() && inp.win_rows->ne[1] == (int64_t) win_ns &&
           ggml_nelements(inp.win_rows) == (int64_t) win_rows.size() && ggml_nelements(inp.win_qpos) == (int64_t) win_qpos.size();
}

std::pair<ggml_tensor *, ggml_tensor *> llama_kv_rq::build_window(ggml_context * ctx, ggml_cgraph * gf,
        const llama_rq_dfr_inputs & inp, ggml_tensor * k_cur, ggml_tensor * v_cur, int32_t il, bool attend) const {
    const int32_t ikv = kv.map_layer_ids.at(il);
    if (!inp.win_w || !k_win[ikv] || !k_cur || !v_cur) {
        return { nullptr, nullptr };
    }
    // a copy of the pool as the ubatch found it, then the ubatch's tokens' rows as F16 (the same rounding as the
    // pool's): the kernel's source of exact rows, the ubatch's own at win_budget + 1 + i. The rows that stay go into the
    // pool after the copy (nodes run in graph order): they may take rows of keys only this ubatch still reads
    const auto write = [&](ggml_tensor * rows, ggml_tensor * cur) {
        cur = ggml_is_contiguous(cur) ? cur : ggml_cont(ctx, cur);
        cur = ggml_reshape_2d(ctx, cur, rows->ne[0], ggml_nelements(cur)/rows->ne[0]);
        ggml_tensor * x = nullptr;
        if (attend) {
            // in the graph now: attached to the attention after it joined the graph, it would not be computed
            x = ggml_concat(ctx, rows, ggml_cast(ctx, cur, GGML_TYPE_F16), 1);
            ggml_build_forward_expand(gf, x);
        }
        ggml_build_forward_expand(gf, ggml_set_rows(ctx, rows, cur, inp.win_w));
        return x;
    };
    // the attention's inputs join the graph here too: it may already hold the attention when they are attached.
    // Only then: as leaves no node reads, ggml-alloc would not check their sizes when it reuses the last graph's
    // layout, and a larger n_kv would overlap them with the inputs after them
    if (attend) {
        for (ggml_tensor * t : { inp.win_rows, inp.win_until, inp.win_qpos }) {
            ggml_build_forward_expand(gf, t);
        }
    }
    return { write(k_win[ikv], k_cur), write(v_win[ikv], v_cur) };
}


void llama_rq_attn::window(ggml_tensor * k_cur, ggml_tensor * v_cur) {
    if (inp.win_w && !g.cparams.training) {
        // a ubatch that attends through the deferred transient reads F16 K/V: it only writes the rows
        std::tie(k_win, v_win) = mctx->get_rq()->build_window(g.ctx0, g.gf, inp, k_cur, v_cur, il, !dfr);
    }
}

void llama_rq_attn::window_attend() const {
    if (!k_win) {
        return;
    }
    // the layer's flash attention, as build_attn_mha recorded it; a prompt that attends through the deferred
    // transient (F16 V) or the unfused path only wrote its rows
    const auto & fused = g.res->get_fused_nodes();
    ggml_tensor * fa = !fused.empty() && fused.back().op == LLM_FUSED_OP_FLASH_ATTN && fused.back().il == il ? fused.back().tensor : nullptr;
    if (fa && ggml_rq_type_is_iso(fa->src[2]->type)) {
        ggml_rq_flash_attn_ext_set_exact(fa, k_win, v_win, inp.win_rows, inp.win_until, inp.win_qpos);
    }
}
