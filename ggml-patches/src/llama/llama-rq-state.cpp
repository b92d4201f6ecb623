// RotaryQuant in state files (llama-rq.h): the recent window's section after upstream's K/V data, and the checksum
// that seals a sequence state file.

#include "llama-rq.h"

#include "llama-impl.h"
#include "llama-io.h"

#include "ggml-rq.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <vector>

//
// the window section
//

static constexpr uint32_t RQ_STATE_WIN_MAGIC = 0x31575152u; // "RQW1"

bool llama_kv_rq::win_section() const {
    return std::any_of(kv.layers.begin(), kv.layers.end(), [](const auto & l) { return l.v && ggml_rq_type_is_iso(l.v->type); });
}

std::pair<uint32_t, uint64_t> llama_kv_rq::win_layout() const {
    uint32_t n_layer = 0;
    uint64_t row_bytes = 0;
    for (size_t i = 0; i < k_win.size(); ++i) {
        if (k_win[i]) {
            n_layer++;
            row_bytes += k_win[i]->nb[1] + v_win[i]->nb[1];
        }
    }
    return { n_layer, row_bytes };
}

void llama_kv_rq::state_write(llama_io_write_i & io, const llama_kv_cache::cell_ranges_t & cr, llama_seq_id seq_id) const {
    if (!win_section()) {
        return;
    }
    std::vector<uint32_t> ords; // the rows' cells, as their index among the saved cells
    std::vector<int32_t>  rows;
    uint32_t ord = 0;
    for (const auto & [i0, i1] : cr.data) {
        for (uint32_t i = i0; i < i1; ++i, ++ord) {
            const int64_t c = (int64_t) cr.strm*kv.get_size() + i;
            const int32_t r = win > 0 ? win_row_of_cell[c] : -1;
            if (r >= 0 && win_row_used(r, nullptr, seq_id)) {
                ords.push_back(ord);
                rows.push_back(r);
            }
        }
    }
    const auto [n_layer, row_bytes] = win_layout();
    const uint32_t n_rows = rows.size();
    io.write(&RQ_STATE_WIN_MAGIC, sizeof(RQ_STATE_WIN_MAGIC));
    io.write(&n_layer,   sizeof(n_layer));
    io.write(&row_bytes, sizeof(row_bytes));
    io.write(&n_rows,    sizeof(n_rows));
    if (n_rows > 0) {
        io.write(ords.data(), ords.size()*sizeof(uint32_t));
    }
    for (size_t i = 0; i < k_win.size(); ++i) {
        for (ggml_tensor * t : { k_win[i], v_win[i] }) {
            for (int32_t r = 0; t && r < (int32_t) n_rows; ++r) {
                io.write_tensor(t, rows[r]*t->nb[1], t->nb[1]);
            }
        }
    }
}

bool llama_kv_rq::state_read(llama_io_read_i & io, uint32_t strm, const llama_kv_cache::slot_info & sinfo) {
    if (!win_section()) {
        return true;
    }
    uint32_t magic = 0, n_layer = 0, n_rows = 0;
    uint64_t row_bytes = 0;
    io.read(&magic, sizeof(magic));
    if (magic != RQ_STATE_WIN_MAGIC) {
        LLAMA_LOG_ERROR("%s: the state has no RotaryQuant window section after its IsoQuant K/V data (saved by an older "
                "build or with other cache types): save it again with this build and the same -ctk/-ctv\n", __func__);
        return false;
    }
    io.read(&n_layer,   sizeof(n_layer));
    io.read(&row_bytes, sizeof(row_bytes));
    io.read(&n_rows,    sizeof(n_rows));
    std::vector<uint32_t> ords(n_rows);
    if (n_rows > 0) {
        io.read(ords.data(), ords.size()*sizeof(uint32_t));
    }
    const auto & idxs = sinfo.idxs[0];
    if (std::any_of(ords.begin(), ords.end(), [&](uint32_t o) { return o >= idxs.size(); })) {
        LLAMA_LOG_ERROR("%s: the state's window section names a cell it does not hold\n", __func__);
        return false;
    }
    if (n_rows > 0 && (win == 0 || win_layout() != std::make_pair(n_layer, row_bytes) || win_free.size() < n_rows)) {
        // another window layout, or none here: those keys are read packed, as without a window
        if (win > 0) {
            LLAMA_LOG_WARN("%s: %u window rows of the state do not fit this context's window: their keys are read packed\n",
                    __func__, n_rows);
        }
        std::vector<uint8_t> skip(row_bytes);
        for (uint32_t r = 0; r < n_rows; ++r) {
            io.read(skip.data(), skip.size());
        }
        return true;
    }
    std::vector<int32_t> rows(n_rows);
    for (uint32_t k = 0; k < n_rows; ++k) {
        const int64_t c = (int64_t) strm*kv.get_size() + idxs[ords[k]];
        if (win_row_of_cell[c] >= 0) {
            win_release(win_row_of_cell[c]);
        }
        rows[k] = win_free.back();
        win_free.pop_back();
        win_row_of_cell[c]       = rows[k];
        win_cell_of_row[rows[k]] = c;
        win_pos_of_row[rows[k]]  = kv.v_cells[strm].pos_get(idxs[ords[k]]);
    }
    for (size_t i = 0; i < k_win.size(); ++i) {
        for (ggml_tensor * t : { k_win[i], v_win[i] }) {
            for (uint32_t k = 0; t && k < n_rows; ++k) {
                io.read_tensor(t, rows[k]*t->nb[1], t->nb[1]);
            }
        }
    }
    return true;
}

// trailer: u64 FNV-1a of every byte before it, then this magic ("rqsm")
static constexpr uint32_t LLAMA_RQ_SUM_MAGIC = 0x6d737172u;

static bool rq_file_sum(FILE * f, long n, uint64_t & h) {
    uint8_t buf[1 << 16];
    h = 0xcbf29ce484222325ull;
    for (long done = 0; done < n; ) {
        const size_t k = fread(buf, 1, (size_t) std::min<long>(n - done, sizeof(buf)), f);
        if (k == 0) {
            return false;
        }
        for (size_t i = 0; i < k; ++i) {
            h = (h ^ buf[i]) * 0x100000001b3ull;
        }
        done += (long) k;
    }
    return true;
}

void llama_rq_state_file_seal(const char * path) {
    FILE * f = ggml_fopen(path, "r+b");
    uint64_t h;
    if (f == nullptr || fseek(f, 0, SEEK_END) != 0) {
        LLAMA_LOG_WARN("%s: %s: cannot reopen to add its checksum\n", __func__, path);
    } else {
        const long n = ftell(f);
        rewind(f);
        if (!rq_file_sum(f, n, h) || fseek(f, 0, SEEK_END) != 0 || fwrite(&h, sizeof(h), 1, f) != 1 ||
            fwrite(&LLAMA_RQ_SUM_MAGIC, sizeof(uint32_t), 1, f) != 1) {
            LLAMA_LOG_WARN("%s: %s: checksum not written\n", __func__, path);
        }
    }
    if (f) {
        fclose(f);
    }
}

bool llama_rq_state_file_check(const char * path) {
    FILE * f = ggml_fopen(path, "rb");
    if (f == nullptr) {
        return true; // the loader reports a missing file
    }
    bool ok = true;
    uint64_t stored = 0, h = 0;
    uint32_t magic = 0;
    const long tail = (long) (sizeof(stored) + sizeof(magic));
    if (fseek(f, 0, SEEK_END) == 0 && ftell(f) >= tail) {
        const long n = ftell(f) - tail;
        if (fseek(f, n, SEEK_SET) == 0 && fread(&stored, sizeof(stored), 1, f) == 1 &&
            fread(&magic, sizeof(magic), 1, f) == 1 && magic == LLAMA_RQ_SUM_MAGIC) {
            rewind(f);
            ok = rq_file_sum(f, n, h) && h == stored;
            if (!ok) {
                LLAMA_LOG_ERROR("%s: %s is corrupted: its checksum is %016" PRIx64 ", its bytes sum to %016" PRIx64
                                "; nothing was loaded\n", __func__, path, stored, h);
            }
        }
    }
    fclose(f);
    return ok;
}
