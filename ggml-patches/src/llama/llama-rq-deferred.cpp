// Deferred prefill (llama-rq.h): while a sequence processes its prompt, its K/V rows are also kept in an F16 transient
// that its prompt attends to; its first decode step gives them back (docs/deferred-prefill.md).

#include "llama-rq.h"
#include "llama-rq-impl.h"

#include "llama-batch.h"
#include "llama-impl.h"
#include "llama-model.h"

#include "ggml-backend.h"
#include "ggml-rq.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

//
// deferred prefill
//

void llama_kv_rq::add_bytes(int64_t n) {
    if (n == 0) {
        return;
    }
    stats.deferred_bytes = (uint64_t) ((int64_t) stats.deferred_bytes + n);
    stats.deferred_peak_bytes = std::max(stats.deferred_peak_bytes, stats.deferred_bytes);
}

void llama_kv_rq::init_deferred(ggml_type type_k, ggml_type type_v) {
    const llama_hparams & hparams = kv.hparams;
    const int64_t req = params.kv_deferred;
    if (req == 0 || hparams.no_alloc) {
        return;
    }
    bool any_kc = false;
    for (const auto & c : kc) {
        any_kc |= c.k_scale != nullptr;
    }
    const bool dk = ggml_is_quantized(type_k) || any_kc;
    const bool dv = ggml_is_quantized(type_v);
    const char * why = nullptr;
    if (!dk && !dv) {
        why = "the cache is not quantised: prompts already attend to exact K/V";
    } else if (hparams.is_mla()) {
        why = "K doubles as V (MLA)";
    } else if (llama_rq_arch_unhooked(kv.model.arch)) {
        why = "this architecture writes its K cache outside build_attn";
    } else if (dv && kv.v_trans) {
        why = "a quantised V cache needs flash attention";
    } else if (std::any_of(kv.layers.begin(), kv.layers.end(), [](const auto & l) {
                   return l.k->buffer && !ggml_backend_buffer_is_host(l.k->buffer); })) {
        // on purpose: its prompt graphs crash inside Mesa's lavapipe (q8_0 as isoquant3_0) and never ran on CUDA
        why = "the KV cache is on a GPU device, where deferred prefill is not supported yet (docs/deferred-prefill.md)";
    }
    if (why) {
        if (strstr(why, "GPU")) {
            LLAMA_LOG_WARN("%s: deferred prefill = off (%s)\n", __func__, why);
        } else {
            LLAMA_LOG_INFO("%s: deferred prefill = off (%s)\n", __func__, why);
        }
        return;
    }

    const uint32_t n_cells = kv.get_size()*kv.n_stream;
    dfr_budget = req < 0 ? n_cells : (uint32_t) std::min<int64_t>(req, n_cells);

    rq_buft_ctxs ctxs;
    for (size_t i = 0; i < kv.layers.size(); ++i) {
        const auto & layer = kv.layers[i];
        ggml_context * ctx = llama_rq_buft_ctx(ctxs, ggml_backend_buffer_get_type(layer.k->buffer), 2*kv.layers.size(), "deferred prefill");
        if (dk) {
            k_dfr[i] = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, layer.k->ne[0], dfr_budget + 1);
            ggml_format_name(k_dfr[i], "cache_dfr_k_l%d", layer.il);
            dfr_row_bytes += ggml_row_size(GGML_TYPE_F16, layer.k->ne[0]);
        }
        if (dv) {
            v_dfr[i] = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, layer.v->ne[0], dfr_budget + 1);
            ggml_format_name(v_dfr[i], "cache_dfr_v_l%d", layer.il);
            dfr_row_bytes += ggml_row_size(GGML_TYPE_F16, layer.v->ne[0]);
        }
    }
    for (auto & [buft, ctx] : ctxs) {
        dfr_ctxs_bufs.emplace_back(std::move(ctx), nullptr);
        dfr_bufts.push_back(buft);
    }

    dfr_row_of_cell.assign(n_cells, -1);
    dfr_cell_of_row.assign(dfr_budget, -1);
    dfr_pos_of_row.assign(dfr_budget, -1);
    dfr_free.resize(dfr_budget);
    for (uint32_t r = 0; r < dfr_budget; ++r) {
        dfr_free[r] = dfr_budget - 1 - r;
    }

    LLAMA_LOG_INFO("%s: deferred prefill = on (%s%s%s in F16 for up to %u prompt cells: %.2f MiB transient, "
            "taken while prompts are processed and given back when their sequences decode)\n", __func__,
            dk ? "K" : "", dk && dv ? " and " : "", dv ? "V" : "", dfr_budget, dfr_budget*dfr_row_bytes/1024.0/1024.0);
}

void llama_kv_rq::release(uint32_t row) {
    const int64_t c = dfr_cell_of_row[row];
    GGML_ASSERT(c >= 0);
    dfr_row_of_cell[c]   = -1;
    dfr_cell_of_row[row] = -1;
    dfr_free.push_back(row);
    dfr_used--;
    add_bytes(-(int64_t) dfr_row_bytes);
    if (dfr_used == 0) {
        // give the memory back: on CPU only the touched rows were ever resident
        for (auto & [ctx, buf] : dfr_ctxs_bufs) {
            buf.reset();
            for (ggml_tensor * t = ggml_get_first_tensor(ctx.get()); t; t = ggml_get_next_tensor(ctx.get(), t)) {
                t->data   = nullptr;
                t->buffer = nullptr;
            }
        }
        std::sort(dfr_free.begin(), dfr_free.end(), std::greater<int32_t>());
    }
}

void llama_kv_rq::release_seq(llama_seq_id seq_id) {
    if (dfr_used == 0 || seq_id < 0 || seq_id >= (llama_seq_id) kv.seq_to_stream.size()) {
        return;
    }
    const uint32_t kv_size = kv.get_size();
    const uint32_t strm    = kv.seq_to_stream[seq_id];
    uint64_t n_rel = 0;
    for (uint32_t r = 0; r < dfr_budget; ++r) {
        const int64_t c = dfr_cell_of_row[r];
        if (c >= 0 && c/kv_size == strm && kv.v_cells[strm].seq_has(c % kv_size, seq_id)) {
            release(r);
            n_rel++;
        }
    }
    if (n_rel > 0) {
        stats.deferred_cells += n_rel;
        stats.deferred_conversions += 1;
    }
}

void llama_kv_rq::batch(const llama_batch_allocr & balloc) {
    if (dfr_budget == 0) {
        return;
    }
    // a sequence with several tokens in the batch is processing a prompt (or a draft to verify); one token is a
    // decode step. Judged per batch: the ubatches of a prompt can hold a single token of it
    for (llama_seq_id s = 0; s < LLAMA_MAX_SEQ; ++s) {
        dfr_prompt[s] = balloc.seq_pos_max(s) > balloc.seq_pos_min(s);
    }
}

bool llama_kv_rq::ubatch(const llama_kv_cache::slot_info & sinfo, const llama_ubatch & ub) {
    win_ubatch(sinfo, ub);
    dfr_w.clear();
    dfr_rows.clear();
    dfr_cells.clear();
    dfr_in_place = false;
    if (dfr_budget == 0) {
        return false;
    }

    const uint32_t kv_size = kv.get_size();

    // a single token is a decode step: the sequence reads the quantised cache from now on
    if (dfr_used > 0) {
        for (uint32_t i = 0; i < ub.n_seqs_unq; ++i) {
            const llama_seq_id seq_id = ub.seq_id_unq[i];
            if (dfr_prompt[seq_id]) {
                continue;
            }
            release_seq(seq_id);
        }
        drop_stale();
    }

    dfr_w.assign(ub.n_tokens, dfr_budget); // the spare row
    uint32_t n_prompt = 0;
    for (uint32_t s = 0; s < sinfo.n_stream(); ++s) {
        for (uint32_t ii = 0; ii < sinfo.size(); ++ii) {
            const uint32_t i = s*sinfo.size() + ii;
            const int64_t  c = (int64_t) sinfo.strm[s]*kv_size + sinfo.idxs[s][ii];
            if (dfr_row_of_cell[c] >= 0) {
                release(dfr_row_of_cell[c]);
            }
            if (!dfr_prompt[ub.seq_id[i][0]]) {
                continue;
            }
            n_prompt++;
            if (dfr_free.empty()) {
                if (!dfr_full_logged) {
                    LLAMA_LOG_WARN("%s: deferred prefill: the transient (%u cells) is full; further prompt tokens "
                            "attend to the quantised cache (raise --kv-deferred-budget)\n", __func__, dfr_budget);
                    dfr_full_logged = true;
                }
                continue;
            }
            if (dfr_used == 0) {
                for (size_t j = 0; j < dfr_ctxs_bufs.size(); ++j) {
                    auto & [ctx, buf] = dfr_ctxs_bufs[j];
                    // not cleared: pages a row never touches are never made resident
                    buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), dfr_bufts[j]));
                    if (!buf) {
                        throw std::runtime_error("failed to allocate the deferred-prefill transient");
                    }
                }
            }
            const int32_t r = dfr_free.back();
            dfr_free.pop_back();
            dfr_used++;
            dfr_row_of_cell[c] = r;
            dfr_cell_of_row[r] = c;
            dfr_pos_of_row[r]  = ub.pos[i];
            dfr_w[i] = r;
            add_bytes((int64_t) dfr_row_bytes);
        }
    }

    if (n_prompt == 0 || dfr_used == 0) {
        dfr_w.clear();
        return false;
    }

    // One prompt in a fresh cache (the common case) takes rows in cell order, so each attended cell is its own row
    // or an empty cell over a free row. The ubatch then attends the transient in place (build_attn): no dequantised
    // copy of the cache, which on a small model cost ~10% of a long prefill. Free rows in view are zeroed: their
    // cells are masked, but old contents could hold a non-finite value, and 0 * inf is NaN in a kernel that
    // multiplies masked weights instead of skipping them.
    const uint32_t n_kv = kv.get_n_kv(sinfo);
    dfr_in_place = sinfo.s0 == sinfo.s1 && n_kv <= dfr_budget;
    const int64_t c0 = (int64_t) sinfo.s0*kv_size;
    for (uint32_t j = 0; j < n_kv && dfr_in_place; ++j) {
        const int32_t r = dfr_row_of_cell[c0 + j];
        dfr_in_place = r == (int32_t) j || (r < 0 && dfr_cell_of_row[j] < 0 && kv.v_cells[sinfo.s0].is_empty(j));
    }
    for (uint32_t j = 0; j < n_kv && dfr_in_place; ) {
        uint32_t e = j;
        while (e < n_kv && dfr_cell_of_row[e] < 0) {
            ++e;
        }
        for (const auto * side : { &k_dfr, &v_dfr }) {
            for (ggml_tensor * t : *side) {
                if (t && e > j) {
                    ggml_backend_tensor_memset(t, 0, j*t->nb[1], (e - j)*t->nb[1]);
                }
            }
        }
        j = e + 1;
    }
    if (!dfr_in_place) {
        rq_rows_in_view(dfr_cell_of_row, kv_size, sinfo, n_kv, [&](uint32_t r, int64_t j) {
            dfr_rows.push_back(r);
            dfr_cells.push_back(j);
        });
    }

    return true;
}

void llama_kv_rq::build_input(ggml_context * ctx, llama_rq_dfr_inputs & inp) const {
    if (!win_w.empty()) {
        const int64_t ns = win_ns, n_kv = (int64_t) win_rows.size()/ns;
        inp.win_w     = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, win_w.size());
        inp.win_rows  = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_kv, ns);
        inp.win_until = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_kv, ns);
        inp.win_qpos  = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, (int64_t) win_qpos.size()/ns, ns);
        const std::pair<ggml_tensor *, const char *> ins[] = { {inp.win_w, "attn_inp_win_w"}, {inp.win_rows, "attn_inp_win_rows"},
            {inp.win_until, "attn_inp_win_until"}, {inp.win_qpos, "attn_inp_win_qpos"} };
        for (const auto & [t, name] : ins) {
            ggml_set_input(t);
            ggml_set_name(t, name);
        }
    }
    if (dfr_w.empty()) {
        return;
    }
    inp.w_rows = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, dfr_w.size());
    ggml_set_input(inp.w_rows);
    ggml_set_name(inp.w_rows, "attn_inp_dfr_w");
    if (!dfr_rows.empty()) {
        inp.rows  = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, dfr_rows.size());
        inp.cells = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, dfr_cells.size());
        ggml_set_input(inp.rows);
        ggml_set_input(inp.cells);
        ggml_set_name(inp.rows,  "attn_inp_dfr_rows");
        ggml_set_name(inp.cells, "attn_inp_dfr_cells");
    }
}

void llama_kv_rq::set_input(const llama_rq_dfr_inputs & inp) const {
    const std::pair<ggml_tensor *, const void *> ins[] = {
        { inp.w_rows, dfr_w.data() }, { inp.rows, dfr_rows.data() }, { inp.cells, dfr_cells.data() },
        { inp.win_w, win_w.data() }, { inp.win_rows, win_rows.data() }, { inp.win_until, win_until.data() },
        { inp.win_qpos, win_qpos.data() } };
    for (const auto & [t, src] : ins) {
        if (t && t->buffer) {
            GGML_ASSERT(ggml_backend_buffer_is_host(t->buffer));
            memcpy(t->data, src, ggml_nbytes(t));
        }
    }
}

void llama_kv_rq::build_attn(ggml_context * ctx, ggml_cgraph * gf, const llama_rq_dfr_inputs & inp,
        ggml_tensor * k_raw, ggml_tensor * v_raw, ggml_tensor *& k, ggml_tensor *& v,
        ggml_tensor * k_rot, ggml_tensor * v_rot, int32_t il, uint32_t n_kv) const {
    const int32_t ikv = kv.map_layer_ids.at(il);

    // the cache in the model's basis, F16, with the transient's exact rows in place of their cells
    const auto attend = [&](ggml_tensor * view, ggml_tensor * dfr, ggml_tensor * raw, ggml_tensor * rot, bool is_k) {
        const int64_t n_embd_gqa = dfr->ne[0];
        ggml_tensor * src = dfr;
        if (raw) {
            raw = ggml_is_contiguous(raw) ? raw : ggml_cont(ctx, raw);
            src = ggml_set_rows(ctx, dfr, ggml_reshape_2d(ctx, raw, n_embd_gqa, ggml_nelements(raw)/n_embd_gqa), inp.w_rows);
            ggml_build_forward_expand(gf, src);
        }
        if (dfr_in_place) {
            GGML_ASSERT(view->ne[2] == (int64_t) n_kv && view->ne[3] == 1 && view->ne[0]*view->ne[1] == n_embd_gqa);
            return ggml_view_4d(ctx, src, view->ne[0], view->ne[1], n_kv, 1, ggml_row_size(src->type, view->ne[0]),
                                src->nb[1], src->nb[1]*n_kv, 0);
        }
        ggml_tensor * x = rot || (is_k && kc[ikv].k_scale) ? ggml_cast(ctx, to_model_basis(ctx, view, rot, il, is_k), GGML_TYPE_F16)
                                                           : ggml_cast(ctx, view, GGML_TYPE_F16);
        if (inp.rows) {
            ggml_tensor * x2 = ggml_reshape_2d(ctx, x, n_embd_gqa, ggml_nelements(x)/n_embd_gqa);
            x2 = ggml_set_rows(ctx, x2, ggml_get_rows(ctx, src, inp.rows), inp.cells);
            x  = ggml_reshape_4d(ctx, x2, view->ne[0], view->ne[1], view->ne[2], view->ne[3]);
        }
        GGML_ASSERT(x->ne[2] == (int64_t) n_kv);
        return x;
    };

    if (k_dfr[ikv]) {
        k = attend(k, k_dfr[ikv], k_raw, k_rot, true);
    }
    if (v_dfr[ikv]) {
        GGML_ASSERT(!kv.v_trans);
        v = attend(v, v_dfr[ikv], v_raw, v_rot, false);
    }
}
