"""The decode roofline's inputs (eval/roofline.py): bytes per step and the triad bandwidth."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rotaryquant.eval import roofline


def _gguf(path, names):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for name, shape in names.items():
        w.add_tensor(name, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_weight_bytes_read_one_embedding_row_unless_the_output_is_tied(tmp_path):
    emb, blk = (100, 8), (8, 8)  # numpy shape: 100 rows of 8
    sep = _gguf(tmp_path / "sep.gguf", {"token_embd.weight": emb, "output.weight": emb, "blk.0.w": blk})
    tied = _gguf(tmp_path / "tied.gguf", {"token_embd.weight": emb, "blk.0.w": blk})
    assert roofline.weight_bytes(sep) == (8 + 800 + 64) * 4
    assert roofline.weight_bytes(tied) == (800 + 64) * 4


@pytest.mark.parametrize("depth", [0, 2048, 8192])
def test_kv_bytes_are_the_cells_a_decode_step_attends(gemma3, depth):
    # Gemma3-270M: 18 layers of 1 KV head x 256; layers 5, 11, 17 attend everything (cells: the context, padded
    # to 256), the 15 sliding-window layers a cache of window 512 + ubatch 512 cells
    # "@none": every layer the named type (by default a full layer's K may take 4 bits where the budget allows)
    kv = roofline.kv_bytes(gemma3, ["f16", "isoquant3_0@none"], [depth], n_gen=32)
    full = math.ceil(max(depth + 32, 256) / 256) * 256
    swa = min(full, 1024)
    cells = 3 * full + 15 * swa
    assert kv[("f16", depth)] == cells * 2 * 256 * 2          # K and V, 2 bytes per value
    assert kv[("isoquant3_0@none", depth)] == cells * 2 * 2 * 50   # 2 blocks of 50 bytes per 256-wide row


def test_triad_bandwidth_is_measured_on_a_graph_that_ran():
    bw = roofline.triad_bandwidth(2, mib=16, reps=2)  # raises when the sum is wrong
    assert 1e8 < bw < 1e13


def test_f32_rate_is_measured_on_a_product_that_ran():
    rate = roofline.f32_rate(1, n=64, reps=2)  # raises when the product is wrong
    assert 1e7 < rate < 1e13


def test_attention_flops_count_every_query_head(gemma3):
    # Gemma3-270M: 4 query heads share 1 KV head, so each attended K or V value takes 4 x 2 FLOPs
    kv16 = roofline.kv_bytes(gemma3, ["f16"], [2048])[("f16", 2048)]
    assert roofline.attention_flops(gemma3, kv16) == 2 * (kv16 / 2) * 4


def test_roofline_takes_the_slower_of_read_and_arithmetic():
    # 100 ms step at depth 0; 1 GB at 10 GB/s is 100 ms, 1 TFLOP at 1e13 FLOP/s 100 ms: either way 5 t/s
    assert roofline.roofline_tps(10.0, 10**9, 1e10, 1e12, 1e13) == pytest.approx(5.0)
    # arithmetic 4x slower than the read: 100 + 400 ms
    assert roofline.roofline_tps(10.0, 10**9, 1e10, 4e12, 1e13) == pytest.approx(2.0)
    assert roofline.roofline_tps(10.0, 10**9, 1e10, 0.0, 1e13) == pytest.approx(roofline.cache_limit_tps(10.0, 10**9, 1e10))


def test_prediction_is_bandwidth_over_step_bytes(gemma3):
    b = roofline.bounds(gemma3, ["f16"], [0], bandwidth=1e10)[0]
    assert b.predicted_tps == pytest.approx(1e10 / (roofline.weight_bytes(gemma3) + b.kv_bytes))


def test_cache_limit_adds_the_cache_read_to_the_measured_weights_step():
    # 10 t/s at depth 0 (100 ms a step) plus 1 GB at 10 GB/s (100 ms): 5 t/s
    assert roofline.cache_limit_tps(10.0, 10**9, 1e10) == pytest.approx(5.0)
    assert roofline.cache_limit_tps(10.0, 0, 1e10) == pytest.approx(10.0)


def test_report_and_plot(tmp_path):
    row = dict(label="f16", cache="f16", unfused=False, depth=0, weight_bytes=2 << 20, kv_bytes=1 << 20,
               bandwidth=3e9, predicted_tps=1000.0, step_bytes=3 << 20, tg_tps=800.0, tg_std=1.0,
               measured_over_predicted=0.8, tg_vs_f16=1.0, predicted_vs_f16=1.0, cache_limit_tps=900.0,
               measured_over_cache_limit=800 / 900, attn_flops=3e9, roofline_tps=850.0,
               measured_over_roofline=800 / 850)
    res = {"model": "m.gguf", "machine": "test", "bandwidth": {"before": 3e9, "after": 3e9, "used": 3e9,
           "triad_mib": 128, "threads": 2}, "f32_rate": {"before": 5e10, "after": 5e10, "used": 5e10, "n": 512,
           "threads": 2}, "settings": {"n_gen": 32, "reps": 2}, "rows": [row]}
    md = roofline.to_markdown(res)
    assert "| 0 | f16 | 2 | 1.0 | 3.00 | 1000.0 | 900.0 | 850.0 | 800.0 | 0.80 | 0.89 | 0.94 | 1.00 | 1.00 |" in md
    assert "F32 rate: a 512 x 512 x 512 ggml_mul_mat with 2 threads" in md
    assert roofline.plot(res, tmp_path / "r.png").stat().st_size > 1000
