"""rotaryquant.gguf_io: what it reads back is what gguf-py wrote and what gguf-py reads; skeletons and
metadata rewrites keep everything else byte for byte."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rotaryquant import gguf_io

META = {
    "general.name": "tiny",
    "llama.block_count": 2,
    "llama.rope.freq_base": 10000.0,
    "llama.use_parallel_residual": True,
    "tokenizer.ggml.tokens": [f"t{i}" for i in range(10)],          # a short string array: kept
    "tokenizer.ggml.merges": [f"m {i}" for i in range(100)],        # a long one: its length
    "llama.attention.head_count": [4, 4],
    "tokenizer.ggml.scores": [float(i) for i in range(5000)],       # a long numeric one: its length
}


def _write(path: Path) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", META["general.name"])
    w.add_uint32("llama.block_count", META["llama.block_count"])
    w.add_float32("llama.rope.freq_base", META["llama.rope.freq_base"])
    w.add_bool("llama.use_parallel_residual", META["llama.use_parallel_residual"])
    for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        w.add_array(k, META[k])
    w.add_key_value("llama.attention.head_count", META["llama.attention.head_count"], gguf.GGUFValueType.ARRAY,
                    gguf.GGUFValueType.INT32)
    w.add_key_value("tokenizer.ggml.scores", META["tokenizer.ggml.scores"], gguf.GGUFValueType.ARRAY,
                    gguf.GGUFValueType.FLOAT32)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((10, 64)).astype(np.float16))
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float32))
    q8 = gguf.quants.quantize(rng.standard_normal((3, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ids", np.arange(7, dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture()
def tiny(tmp_path) -> Path:
    return _write(tmp_path / "tiny.gguf")


def test_value_type_table_is_gguf_pys():
    import gguf

    VT = gguf.GGUFValueType
    sizes = {VT.UINT8: 1, VT.INT8: 1, VT.UINT16: 2, VT.INT16: 2, VT.UINT32: 4, VT.INT32: 4, VT.FLOAT32: 4,
             VT.BOOL: 1, VT.UINT64: 8, VT.INT64: 8, VT.FLOAT64: 8}
    import struct

    assert {int(k): v for k, v in sizes.items()} == {k: struct.calcsize(f) for k, f in gguf_io._SCALAR.items()}
    assert (gguf_io._STRING, gguf_io._ARRAY) == (VT.STRING, VT.ARRAY)
    assert (gguf_io.MAGIC, gguf_io.DEFAULT_ALIGNMENT) == (gguf.GGUF_MAGIC, gguf.GGUF_DEFAULT_ALIGNMENT)


def test_tensor_bytes_are_ggmls_row_sizes():
    """gguf_io sizes tensors by gguf-py's table (no library needed); it must be what the loaded ggml says, for every
    type a file can hold."""
    import gguf

    from rotaryquant import bindings

    for t in gguf.GGML_QUANT_SIZES:
        blck = gguf.GGML_QUANT_SIZES[t][0]
        assert gguf_io.tensor_bytes(int(t), (blck * 3, 2)) == bindings.row_size(int(t), blck * 3) * 2, t.name


def test_round_trip_metadata_and_tensor_infos(tiny):
    import gguf

    h = gguf_io.read_header(tiny)
    assert gguf_io.is_gguf(tiny) and h.arch == "llama" and h.version == 3
    f = h.fields
    for k in ("general.name", "llama.block_count", "llama.use_parallel_residual", "tokenizer.ggml.tokens",
              "llama.attention.head_count"):
        assert f[k] == META[k], k
    assert f["llama.rope.freq_base"] == pytest.approx(META["llama.rope.freq_base"])
    assert f["tokenizer.ggml.merges"] == 100 and f["tokenizer.ggml.scores"] == 5000   # long arrays: lengths
    assert h.n_vocab == 10 and h.get("block_count") == 2
    # the tensor infos and the layout are gguf-py's
    r = gguf.GGUFReader(tiny)
    assert h.n_kv == len([k for k in r.fields if not k.startswith("GGUF.")]) == len(f)
    assert h.data_offset == r.data_offset and h.alignment == r.alignment and h.file_size == tiny.stat().st_size
    assert [(t.name, t.ne, t.type, h.data_offset + t.offset, t.nbytes) for t in h.tensors] == \
        [(t.name, tuple(int(n) for n in t.shape), int(t.tensor_type), int(t.data_offset), int(t.n_bytes))
         for t in r.tensors]
    assert h.n_params == 10 * 64 + 64 + 3 * 64 + 7
    # the key/value section is kept verbatim
    raw = tiny.read_bytes()
    assert raw[24:24 + len(h.kv_raw)] == h.kv_raw


def test_skeleton_round_trip(tiny, tmp_path):
    h = gguf_io.read_header(tiny)
    f16 = 1
    types = {"blk.0.attn_q.weight": f16}
    out = tmp_path / "skel.gguf"
    size = gguf_io.write_skeleton(h, types, out)
    h2 = gguf_io.read_header(out)
    assert h2.fields == h.fields and h2.kv_raw == h.kv_raw
    assert [(t.name, t.ne, t.type) for t in h2.tensors] == [(t.name, t.ne, types.get(t.name, t.type)) for t in h.tensors]
    assert h2.file_size == h2.data_offset + size
    layout = gguf_io.skeleton_layout(h, types)
    assert layout == {t.name: (h2.data_offset + t.offset, t.nbytes) for t in h2.tensors}
    assert gguf_io.skeleton_layout(h, {}) == {t.name: (h.data_offset + t.offset, t.nbytes) for t in h.tensors}


def test_rewrite_metadata_packs_with_gguf_py(tiny, tmp_path):
    import gguf

    out = tmp_path / "re.gguf"
    new = {"x.s": "hello", "x.n": 7, "x.f": 0.5, "x.b": True, "x.a": np.arange(4, dtype=np.float32),
           "x.i": np.array([3, 1], np.int32)}
    gguf_io.rewrite_metadata(tiny, out, new, drop=lambda k: k == "general.name")
    r, r0 = gguf.GGUFReader(out), gguf.GGUFReader(tiny)
    assert "general.name" not in r.fields
    got = {k: r.fields[k].contents() for k in new}
    assert got == {"x.s": "hello", "x.n": 7, "x.f": 0.5, "x.b": True, "x.a": [0.0, 1.0, 2.0, 3.0], "x.i": [3, 1]}
    assert r.fields["x.n"].types == [gguf.GGUFValueType.UINT32]
    for a, b in zip(r0.tensors, r.tensors, strict=True):
        assert (a.name, a.tensor_type, a.data.tobytes()) == (b.name, b.tensor_type, b.data.tobytes())
    assert not list(tmp_path.glob(".*partial"))


def test_errors_name_the_file(tiny, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[:200])
    with pytest.raises(gguf_io.GGUFError, match="truncated header"):
        gguf_io.read_header(cut)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model" * 10)
    assert not gguf_io.is_gguf(junk)
    with pytest.raises(gguf_io.GGUFError, match="no GGUF magic"):
        gguf_io.read_header(junk)
    with pytest.raises(gguf_io.GGUFError, match="not a readable GGUF"):
        gguf_io.open_reader(junk)


def test_a_foreign_file_is_sized_by_its_offsets(tiny):
    """Another build's file: type ids are not trusted; each tensor spans to the next one's offset (or the file's
    end), which is its own bytes plus at most the alignment padding."""
    h, f = gguf_io.read_header(tiny), gguf_io.read_header(tiny, foreign=True)
    assert [t.type for t in f.tensors] == [t.type for t in h.tensors]
    for a, b in zip(h.tensors, f.tensors):
        assert a.nbytes <= b.nbytes < a.nbytes + h.alignment
    assert f.data_offset + f.data_bytes == tiny.stat().st_size
