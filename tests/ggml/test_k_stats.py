"""K statistics of a model without a calibration (llama-rq-kstats.cpp): measured once, kept in a stats file named by
the model's content, loaded at later starts; a file that is not this model's current statistics is refused with the
reason and measured again, never used."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

PROMPT = "The three most important inventions of the nineteenth century were"
STATS = re.compile(r"k-stats-([0-9a-f]{16})\.gguf")


def _run(bin_dir: Path, model: Path, *extra: str, cache: Path | None = None, verbose: bool = True,
         k: str = "isoquant3_0") -> subprocess.CompletedProcess:
    cmd = [str(bin_dir / "llama-completion"), "-m", str(model), "-p", PROMPT, "-n", "6", "--temp", "0", "-no-cnv",
           "-t", "2", "-c", "256", "--no-warmup", "--no-display-prompt", "-fa", "on", "-ctk", k, "-ctv", k, *extra]
    if verbose:
        cmd += ["-lv", "4"]
    env = {n: v for n, v in os.environ.items() if n not in ("LLAMA_K_CENTER", "LLAMA_ARG_NO_K_CENTER", "LLAMA_ARG_K_STATS")}
    if cache is not None:
        env["LLAMA_CACHE"] = str(cache)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _fields(path: Path) -> dict:
    from gguf import GGUFReader

    r = GGUFReader(path)
    out = {}
    for name, f in r.fields.items():
        if name.startswith("rotaryquant."):
            v = f.contents()
            out[name] = np.asarray(v) if isinstance(v, list) else v
    return out


def _write(path: Path, fields: dict) -> None:
    """A stats file with these fields (what _fields read, edited), written as the runtime writes one."""
    from gguf import GGUFValueType, GGUFWriter

    w = GGUFWriter(path, arch="none")
    for name, v in fields.items():
        if isinstance(v, str):
            w.add_string(name, v)
        elif isinstance(v, np.ndarray):
            sub = GGUFValueType.INT32 if v.dtype.kind in "iu" else GGUFValueType.FLOAT32
            w.add_key_value(name, v.tolist(), GGUFValueType.ARRAY, sub_type=sub)
        elif isinstance(v, float):
            w.add_float32(name, v)
        else:
            w.add_uint32(name, int(v))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


def _same_stats(a: Path, b: Path) -> bool:
    """The same statistics of the same model by the same recipe (what the measurement took may differ)."""
    fa, fb = _fields(a), _fields(b)
    fa.pop("rotaryquant.k_stats.seconds"), fb.pop("rotaryquant.k_stats.seconds")
    return fa.keys() == fb.keys() and all(np.array_equal(fa[k], fb[k]) for k in fa)


@pytest.fixture(scope="module")
def measured(bin_dir, smollm2, tmp_path_factory):
    """One first start with an empty stats directory: (directory, the file it stored, the first start's run)."""
    d = tmp_path_factory.mktemp("kstats")
    proc = _run(bin_dir, smollm2, "--k-stats", str(d / "dir"), verbose=False)
    files = list((d / "dir").glob("k-stats-*.gguf"))
    assert len(files) == 1, proc.stderr[-3000:]
    return d / "dir", files[0], proc


def test_the_first_start_measures_and_stores_and_says_so(measured):
    d, f, proc = measured
    warn = [ln for ln in proc.stderr.splitlines() if "K statistics measured on" in ln]
    assert warn and f"stored in {f}" in warn[0], proc.stderr[-3000:]  # a WARN line: shown without -v
    assert not [p for p in d.iterdir() if ".tmp" in p.name]  # written beside it, then renamed
    fields = _fields(f)
    assert fields["rotaryquant.k_stats.model_id"] == STATS.search(f.name).group(1)
    assert fields["rotaryquant.k_stats.version"] == 1 and fields["rotaryquant.k_stats.n_tokens"] > 0
    # SmolLM2: 30 layers, 3 KV heads of 64
    assert fields["rotaryquant.k_center.layers"].tolist() == list(range(30))
    assert fields["rotaryquant.k_center.mean"].shape == (30 * 3 * 64,)
    assert np.all(fields["rotaryquant.k_center.scale"] > 0)
    # and the copy task's ranking: one loss per layer (llama-rq-retrieval.cpp; test_k_retrieval checks the values)
    assert fields["rotaryquant.k_stats.retrieval"].shape == (30,) and np.all(fields["rotaryquant.k_stats.retrieval"] >= 0)


def test_the_second_start_loads_them_and_answers_the_same(bin_dir, smollm2, measured):
    d, f, first = measured
    before = f.read_bytes()
    second = _run(bin_dir, smollm2, "--k-stats", str(d))
    line = [ln for ln in second.stderr.splitlines() if "K centring = on, self-calibrated" in ln]
    assert line and f"loaded from {f}" in line[0], second.stderr[-3000:]
    assert "K statistics measured" not in second.stderr
    assert f.read_bytes() == before
    assert second.stdout == first.stdout and second.stdout.strip()  # the same statistics: the same greedy text


def test_a_copy_of_the_model_finds_its_file_and_other_weights_do_not(bin_dir, smollm2, measured, tmp_path):
    d, f, _ = measured
    copy = tmp_path / "renamed-copy.gguf"
    shutil.copyfile(smollm2, copy)
    proc = _run(bin_dir, copy, "--k-stats", str(d))
    assert f"loaded from {f}" in proc.stderr, proc.stderr[-3000:]  # content, not path or date

    from gguf import GGUFReader

    t = GGUFReader(smollm2).tensors[-1]  # same metadata and names, one tensor's first bytes changed
    other = tmp_path / "other-weights.gguf"
    shutil.copyfile(smollm2, other)
    with open(other, "r+b") as fh:
        fh.seek(int(t.data_offset))
        b = fh.read(2)
        fh.seek(int(t.data_offset))
        fh.write(bytes(x ^ 0x01 for x in b))
    proc = _run(bin_dir, other, "--k-stats", str(d / "other"), verbose=False)
    new = list((d / "other").glob("k-stats-*.gguf"))
    assert len(new) == 1 and new[0].name != f.name, proc.stderr[-3000:]


@pytest.mark.parametrize("how", ["corrupt", "another-model", "stale", "format", "shape", "no-ranking", "bad-ranking"])
def test_a_file_that_is_not_this_models_is_refused_and_measured_again(bin_dir, smollm2, measured, tmp_path, how):
    _, good, _ = measured
    f = tmp_path / good.name
    fields = _fields(good)
    if how == "corrupt":
        f.write_bytes(good.read_bytes()[:200])
    elif how == "no-ranking":
        del fields["rotaryquant.k_stats.retrieval"]
        _write(f, fields)
    else:
        edit = {"another-model": ("rotaryquant.k_stats.model_id", "0123456789abcdef"),
                "stale": ("rotaryquant.k_stats.method", int(fields["rotaryquant.k_stats.method"]) + 1),
                "format": ("rotaryquant.k_stats.version", 2),
                "shape": ("rotaryquant.k_center.layers", np.arange(31, dtype=np.int32)),
                "bad-ranking": ("rotaryquant.k_stats.retrieval", np.full(30, np.nan, np.float32))}[how]
        fields[edit[0]] = edit[1]
        _write(f, fields)
    why = {"corrupt": "not a readable GGUF", "another-model": "measured on another model", "stale": "stale",
           "format": "another format", "shape": "belongs to another model",
           "no-ranking": "retrieval is missing", "bad-ranking": "neither a loss"}[how]
    proc = _run(bin_dir, smollm2, "--k-stats", str(tmp_path), verbose=False)
    refused = [ln for ln in proc.stderr.splitlines() if "refused" in ln]
    assert refused and why in refused[0] and "measuring them again" in refused[0], proc.stderr[-3000:]
    assert "K statistics measured on" in proc.stderr
    assert _same_stats(f, good)  # replaced by what was measured


def test_a_place_it_cannot_write_measures_and_warns(bin_dir, smollm2, tmp_path):
    (tmp_path / "a-file").write_text("x")
    proc = _run(bin_dir, smollm2, "--k-stats", str(tmp_path / "a-file" / "sub"), verbose=False)
    warn = [ln for ln in proc.stderr.splitlines() if "K statistics measured on" in ln]
    assert warn and "not stored (cannot create" in warn[0] and "--k-stats" in warn[0], proc.stderr[-3000:]
    assert proc.stdout.strip()


def test_default_place_none_and_a_named_file(bin_dir, smollm2, measured, tmp_path):
    _, good, _ = measured
    _run(bin_dir, smollm2, cache=tmp_path / "cache", verbose=False)  # the default: LLAMA_CACHE/rq-k-stats
    assert [p.name for p in (tmp_path / "cache" / "rq-k-stats").iterdir()] == [good.name]
    proc = _run(bin_dir, smollm2, "--k-stats", "none", cache=tmp_path / "none", verbose=False)
    assert "not stored (no k_stats_path" in proc.stderr and not (tmp_path / "none").exists()
    named = tmp_path / "mine.gguf"
    _run(bin_dir, smollm2, "--k-stats", str(named), verbose=False)
    assert _same_stats(named, good)


def test_nothing_is_measured_or_stored_where_nothing_needs_it(bin_dir, smollm2, tmp_path):
    for extra in (["--no-k-center"], []):
        proc = _run(bin_dir, smollm2, "--k-stats", str(tmp_path), *extra, k="q8_0" if not extra else "isoquant3_0")
        assert "K statistics" not in proc.stderr
    assert not list(tmp_path.iterdir())


def test_python_llama_keeps_them_in_the_cache_directory(smollm2, measured, tmp_path, monkeypatch):
    import llama_cpp

    _, good, _ = measured
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path / "cache"))
    iso = llama_cpp.GGML_TYPE_ISOQUANT3_0
    llm = llama_cpp.Llama(model_path=str(smollm2), n_ctx=256, n_threads=2, flash_attn=True, type_k=iso, type_v=iso,
                          verbose=False)
    del llm
    assert [p.name for p in (tmp_path / "cache" / "rq-k-stats").iterdir()] == [good.name]
    llm = llama_cpp.Llama(model_path=str(smollm2), n_ctx=256, n_threads=2, flash_attn=True, type_k=iso, type_v=iso,
                          verbose=False, k_stats=str(tmp_path / "py.gguf"))
    del llm
    assert _same_stats(tmp_path / "py.gguf", good)


def test_the_c_api_measures_once_per_model(smollm2, measured, tmp_path):
    import llama_cpp as L

    _, good, _ = measured
    m = L.llama_model_load_from_file(str(smollm2).encode(), L.llama_model_default_params())
    try:
        assert L.llama_rq_measure_k_stats(m, str(tmp_path).encode(), 2)
        assert _same_stats(tmp_path / good.name, good)
        (tmp_path / good.name).unlink()
        assert L.llama_rq_measure_k_stats(m, str(tmp_path).encode(), 2)  # once per model: not again
        assert not (tmp_path / good.name).exists()
    finally:
        L.llama_model_free(m)
