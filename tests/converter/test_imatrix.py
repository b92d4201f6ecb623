"""converter/imatrix.py: loading llama-imatrix's GGUF and keeping a subset of it."""

from __future__ import annotations

import numpy as np
import pytest

from rotaryquant.converter.errors import ConvertError
from rotaryquant.converter.imatrix import load_imatrix, subset_imatrix


def test_subset_keeps_exactly_the_named_entries(tmp_path, h):
    import gguf

    rng = np.random.default_rng(1)
    entries = {f"blk.{i}.{r}.weight": (rng.random((n, 512)) * 100, np.full(n, 40.0 + i))
               for i in range(2) for r, n in (("ffn_down", 1), ("attn_q", 1), ("ffn_up_exps", 4))}
    h.write_imatrix(tmp_path / "full.gguf", entries, chunk_count=8)
    keep = ["blk.0.ffn_down.weight", "blk.1.ffn_up_exps.weight"]
    out = subset_imatrix(tmp_path / "full.gguf", tmp_path / "sub.gguf", keep)
    full, sub = load_imatrix(tmp_path / "full.gguf"), load_imatrix(out)
    assert sorted(sub) == sorted(keep)
    for n in keep:
        np.testing.assert_array_equal(sub[n], full[n])
    r = gguf.GGUFReader(out)
    assert r.get_field("imatrix.chunk_count").parts[-1][0] == 8
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_subset_refuses_a_name_the_imatrix_lacks(tmp_path, h):
    h.write_imatrix(tmp_path / "full.gguf", {"blk.0.ffn_down.weight": (np.ones((1, 256)), np.array([4.0]))})
    with pytest.raises(ConvertError, match="no entry for blk.1.ffn_down.weight") as e:
        subset_imatrix(tmp_path / "full.gguf", tmp_path / "sub.gguf", ["blk.1.ffn_down.weight"])
    assert "llama-imatrix" in e.value.fix
    assert not (tmp_path / "sub.gguf").exists()
