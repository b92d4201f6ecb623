"""Bad input: one clear message (naming the input and the fix), exit 1, and no output or temp file left."""

from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rotaryquant.converter.cli import main as cli_main
from rotaryquant.converter.convert import Options, convert
from rotaryquant.converter.errors import ConvertError
from rotaryquant.converter.hf_folders import write_safetensors


def _fails(capsys, args, *needles, out: Path | None = None):
    rc = cli_main([*map(str, args), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1, err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("rq-convert: error:")]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]
    if out is not None:
        assert not out.exists()
        assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []
    return lines[0]


@pytest.fixture()
def folder(smol2_hf, tmp_path, h):
    return h.copy_folder(smol2_hf, tmp_path / "m")


@pytest.fixture()
def outdir(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    return d


def test_missing_config(folder, outdir, capsys):
    (folder / "config.json").unlink()
    _fails(capsys, [folder, outdir / "o.gguf"], "has no config.json", str(folder), out=outdir / "o.gguf")


def test_invalid_config_json(folder, outdir, capsys):
    (folder / "config.json").write_text("{ not json")
    _fails(capsys, [folder, outdir / "o.gguf"], "config.json is not valid JSON", out=outdir / "o.gguf")


def test_config_without_architecture(folder, outdir, capsys):
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["architectures"]
    (folder / "config.json").write_text(json.dumps(cfg))
    _fails(capsys, [folder, outdir / "o.gguf"], "names no architecture", out=outdir / "o.gguf")


def test_unknown_architecture(folder, outdir, capsys):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["FrobnicatorForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    _fails(capsys, [folder, outdir / "o.gguf"], "'FrobnicatorForCausalLM'", "not supported", out=outdir / "o.gguf")


def test_prequantised_checkpoint(folder, outdir, capsys):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    _fails(capsys, [folder, outdir / "o.gguf"], "pre-quantised", "gptq", out=outdir / "o.gguf")


def _shard(folder: Path) -> Path:
    return sorted(folder.glob("model-*.safetensors"))[-1]


def test_truncated_safetensors(folder, outdir, capsys):
    p = _shard(folder)
    os.truncate(p, p.stat().st_size - 1000)
    _fails(capsys, [folder, outdir / "o.gguf"], "is truncated", p.name, "re-download", out=outdir / "o.gguf")


def test_corrupt_safetensors_header(folder, outdir, capsys):
    p = _shard(folder)
    data = bytearray(p.read_bytes())
    data[8:20] = b"\x00garbage!!\xff\xfe"
    p.write_bytes(bytes(data))
    _fails(capsys, [folder, outdir / "o.gguf"], "not a valid safetensors file", p.name, out=outdir / "o.gguf")


def test_safetensors_header_larger_than_file(folder, outdir, capsys):
    p = _shard(folder)
    p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    _fails(capsys, [folder, outdir / "o.gguf"], "not a valid safetensors file", out=outdir / "o.gguf")


def test_missing_shard(folder, outdir, capsys):
    p = _shard(folder)
    p.unlink()
    _fails(capsys, [folder, outdir / "o.gguf"], "lacks 1 weight file", p.name, out=outdir / "o.gguf")


def test_integer_weights_are_a_dtype_surprise(folder, outdir, capsys):
    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    extra = folder / "model-extra.safetensors"
    write_safetensors(extra, {"model.layers.0.mlp.up_proj.weight_scale": np.ones((4, 4), np.int32)})
    idx["weight_map"]["model.layers.0.mlp.up_proj.weight_scale"] = extra.name
    (folder / "model.safetensors.index.json").write_text(json.dumps(idx))
    _fails(capsys, [folder, outdir / "o.gguf"], "is I32, expected floating-point", out=outdir / "o.gguf")


def test_unreadable_dtype(folder, outdir, capsys):
    p = folder / "model-zz.safetensors"
    hdr = json.dumps({"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    p.write_bytes(struct.pack("<Q", len(hdr)) + hdr + bytes(8))
    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    idx["weight_map"]["x"] = p.name
    (folder / "model.safetensors.index.json").write_text(json.dumps(idx))
    _fails(capsys, [folder, outdir / "o.gguf"], "dtype C64", out=outdir / "o.gguf")


def test_nan_weights(folder, outdir, capsys):
    """A tensor with NaN fails mid-conversion: the partial output and spill file are removed."""

    p = _shard(folder)
    raw = bytearray(p.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    meta = json.loads(raw[8:8 + n])
    b, e = meta["model.layers.1.mlp.down_proj.weight"]["data_offsets"]
    raw[8 + n + b: 8 + n + b + 4] = np.array([0x7FC0, 0x7FC0], np.uint16).tobytes()  # two bf16 NaNs
    p.write_bytes(bytes(raw))
    _fails(capsys, [folder, outdir / "o.gguf"], "blk.1.ffn_down.weight has 2 NaN/Inf", out=outdir / "o.gguf")


def test_missing_tokenizer(folder, outdir, capsys):
    (folder / "tokenizer.json").unlink()
    _fails(capsys, [folder, outdir / "o.gguf"], "cannot read the tokenizer", "tokenizer.json",
           out=outdir / "o.gguf")


def test_no_weights(folder, outdir, capsys):
    for p in folder.glob("model*.safetensors*"):
        p.unlink()
    _fails(capsys, [folder, outdir / "o.gguf"], "no model*.safetensors", out=outdir / "o.gguf")


def test_input_does_not_exist(tmp_path, capsys):
    _fails(capsys, [tmp_path / "nope", tmp_path / "o.gguf"], "does not exist")


def test_input_is_neither(tmp_path, capsys):
    f = tmp_path / "x.bin"
    f.write_bytes(b"hello world")
    _fails(capsys, [f, tmp_path / "o.gguf"], "neither a GGUF file nor")


def test_output_folder_missing(smol2_hf, tmp_path, capsys):
    _fails(capsys, [smol2_hf, tmp_path / "no" / "such" / "o.gguf"], "output folder", "does not exist")


def test_output_is_a_folder(smol2_hf, tmp_path, capsys):
    _fails(capsys, [smol2_hf, tmp_path], "is a folder")


def test_output_folder_not_writable(smol2_hf, capsys):
    # /sys refuses new files even to root (chmod cannot make a folder read-only for root)
    _fails(capsys, [smol2_hf, "/sys/rq-out.gguf"], "cannot write to the output folder /sys")


def test_output_not_writable_simulated(smol2_hf, outdir, capsys, monkeypatch):
    import tempfile

    def deny(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", deny)
    _fails(capsys, [smol2_hf, outdir / "o.gguf"], "cannot write to the output folder", out=outdir / "o.gguf")


def test_disk_full_while_writing(smol2_hf, outdir, capsys, monkeypatch):
    """ENOSPC from the spill file (simulated): clear message, nothing left behind, no partial file."""
    from rotaryquant.converter.writer import StreamingWriter

    calls = {"n": 0}
    orig = StreamingWriter.add_tensor

    def full(self, name, tensor, *a, **k):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return orig(self, name, tensor, *a, **k)

    monkeypatch.setattr(StreamingWriter, "add_tensor", full)
    _fails(capsys, [smol2_hf, outdir / "o.gguf"], "no space left", "free some space", out=outdir / "o.gguf")


def test_disk_full_at_the_final_copy(smol2_hf, outdir, capsys, monkeypatch):
    from rotaryquant.converter.writer import StreamingWriter

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(StreamingWriter, "write_tensors_to_file", full)
    _fails(capsys, [smol2_hf, outdir / "o.gguf"], "no space left", out=outdir / "o.gguf")


def test_existing_output_survives_a_failed_run(smol2_hf, outdir, capsys, monkeypatch):
    from rotaryquant.converter.writer import StreamingWriter

    out = outdir / "o.gguf"
    out.write_bytes(b"previous result")

    def boom(self, *a, **k):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(StreamingWriter, "write_tensors_to_file", boom)
    _fails(capsys, [smol2_hf, out], "I/O error")
    assert out.read_bytes() == b"previous result"


def test_output_is_the_input(converted, smol2_hf, capsys):
    f16, _ = converted.get(smol2_hf, "f16")
    _fails(capsys, [f16, f16], "is the input file")


def test_bad_recipe_type_override_and_imatrix(smol2_hf, outdir, capsys):
    with pytest.raises(SystemExit):                       # argparse rejects unknown recipes itself
        cli_main([str(smol2_hf), str(outdir / "o.gguf"), "--recipe", "q4_k_m"])
    capsys.readouterr()
    _fails(capsys, [smol2_hf, outdir / "o.gguf", "--tensor-type", "attn_v=q9_0"], "unknown type", "q9_0")
    _fails(capsys, [smol2_hf, outdir / "o.gguf", "--tensor-type", "attn_v"], "REGEX=TYPE")
    _fails(capsys, [smol2_hf, outdir / "o.gguf", "--imatrix", outdir / "none.gguf"], "imatrix", "does not exist")
    bad = outdir / "im.gguf"
    bad.write_bytes(b"GGUF" + bytes(20))
    _fails(capsys, [smol2_hf, outdir / "o.gguf", "--imatrix", bad], "not a readable GGUF")


def test_imatrix_for_another_model(smol2_hf, outdir):
    import gguf

    p = outdir / "im.gguf"
    w = gguf.GGUFWriter(p, "imatrix")
    w.add_tensor("blk.0.ffn_down.weight.in_sum2", np.ones((1, 999), np.float32))
    w.add_tensor("blk.0.ffn_down.weight.counts", np.ones((1, 1), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConvertError, match="imatrix entry for blk.0.ffn_down.weight"):
        convert(smol2_hf, outdir / "o.gguf", Options(imatrix=p, progress=False))
    assert list(outdir.iterdir()) == [p]


def test_corrupt_gguf_input(converted, smol2_hf, tmp_path, capsys):
    f16, _ = converted.get(smol2_hf, "f16")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(f16.read_bytes()[: 100_000])
    _fails(capsys, [bad, tmp_path / "o.gguf"], "not a readable GGUF", out=tmp_path / "o.gguf")


def test_interrupted_conversion_leaves_nothing(smol2_hf, outdir, monkeypatch):
    from rotaryquant.converter.writer import StreamingWriter

    def stop(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(StreamingWriter, "write_tensors_to_file", stop)
    with pytest.raises(KeyboardInterrupt):
        convert(smol2_hf, outdir / "o.gguf", Options(progress=False))
    assert list(outdir.iterdir()) == []


def test_cli_exit_code_in_a_real_process(tmp_path):
    p = subprocess.run([sys.executable, "-m", "rotaryquant.converter.cli", str(tmp_path / "missing"),
                        str(tmp_path / "o.gguf")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert p.stderr.strip().startswith("rq-convert: error:") and p.stderr.strip().count("\n") == 0
