"""rotaryquant.eval.frontier: points gathered from result files by spec; rows without bits are left out."""

from __future__ import annotations

import json

from rotaryquant.eval import frontier


def _write(path, obj):
    path.write_text(json.dumps(obj))


def test_points_join_kld_and_needles_by_spec(tmp_path):
    m = "gemma.gguf"
    _write(tmp_path / "kv-quality-a.json", {"model": m, "rows": [
        {"label": "f16", "ctx": 2048, "kld_mean": None, "bits_per_value": 16.0},
        {"label": "isoquant3_0+self", "ctx": 512, "kld_mean": 0.2, "bits_per_value": 3.125},
        {"label": "isoquant3_0+self", "ctx": 2048, "kld_mean": 0.09, "bits_per_value": 3.125},
        {"label": "q4_0+self", "ctx": 2048, "kld_mean": 0.02, "bits_per_value": 4.5, "deferred": True},
        {"label": "q8_0", "ctx": 2048, "kld_mean": 0.003},  # an old row: no bits recorded
    ]})
    _write(tmp_path / "kv-quality-other.json", {"model": "qwen.gguf", "rows": [
        {"label": "isoquant3_0+self", "ctx": 2048, "kld_mean": 0.07, "bits_per_value": 3.125}]})
    _write(tmp_path / "niah-x.json", {"model": m, "rows": [
        {"cache": "isoquant3_0+self", "ctx": 8192, "found": 5, "asked": 8, "bits_per_value": 3.125},
        {"cache": "isoquant3_0+self", "ctx": 8192, "found": 7, "asked": 8, "bits_per_value": 3.125},
        {"cache": "isoquant3_0+self", "ctx": 4096, "found": 8, "asked": 8, "bits_per_value": 3.125},
        {"cache": "f16", "ctx": 8192, "found": 8, "asked": 8, "bits_per_value": 16.0},
    ]})
    pts = {p.spec: p for p in frontier.collect(tmp_path, m)}
    assert set(pts) == {"f16", "isoquant3_0+self"}
    iso = pts["isoquant3_0+self"]
    assert (iso.bits, iso.kld, iso.kld_ctx, iso.found, iso.asked) == (3.125, 0.09, 2048, 12, 16)
    assert pts["f16"].kld is None and (pts["f16"].found, pts["f16"].asked) == (8, 8)
    md = frontier.to_markdown(list(pts.values()), m)
    assert "| isoquant3_0+self | 3.125 | 0.0900 (2048) | 12/16 (8192) |" in md
