"""Fixtures for the rq-convert tests: small HF folders made from the packaged SmolLM2 GGUF, a tiny
random Qwen2-MoE, cached conversions (session-wide, so each is made once) and llama.cpp helpers."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rotaryquant import assets, paths

PY = sys.executable


def have_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


needs_torch = pytest.mark.skipif(not have_torch(), reason="upstream convert_hf_to_gguf needs torch (test extra)")


@pytest.fixture(scope="session")
def smol_gguf() -> Path:
    return assets.model_path("smollm2-135m")


@pytest.fixture(scope="session")
def smol2_hf(smol_gguf, tmp_path_factory) -> Path:
    """SmolLM2 with its first 2 layers (real weights, full tokenizer, BF16, 2 shards + index)."""
    from rotaryquant.converter.hf_folders import smollm2_hf_folder

    return smollm2_hf_folder(smol_gguf, tmp_path_factory.mktemp("hf") / "smollm2-2L", n_layers=2)


@pytest.fixture(scope="session")
def smol_full_hf(smol_gguf, tmp_path_factory) -> Path:
    from rotaryquant.converter.hf_folders import smollm2_hf_folder

    return smollm2_hf_folder(smol_gguf, tmp_path_factory.mktemp("hf") / "smollm2-full")


@pytest.fixture(scope="session")
def moe_hf(smol2_hf, tmp_path_factory) -> Path:
    from rotaryquant.converter.hf_folders import qwen2moe_toy_folder

    return qwen2moe_toy_folder(tmp_path_factory.mktemp("hf") / "qwen2moe-toy", smol2_hf)


class Converted:
    """Session cache of conversions: ``get(folder, recipe, **opts)`` -> (path, Result)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cache: dict[tuple, tuple[Path, object]] = {}

    def get(self, src: Path, recipe: str, **opts):
        from rotaryquant.converter.convert import Options, convert

        key = (str(src), recipe, tuple(sorted((k, str(v)) for k, v in opts.items())))
        if key not in self.cache:
            out = self.root / f"{Path(src).name}-{recipe}-{len(self.cache)}.gguf"
            opts.setdefault("auto_calibrate", False)   # the plain conversions; test_calibration tests the default
            res = convert(src, out, Options(recipe=recipe, progress=False, **opts))
            self.cache[key] = (out, res)
        return self.cache[key]


@pytest.fixture(scope="session")
def converted(tmp_path_factory) -> Converted:
    return Converted(tmp_path_factory.mktemp("converted"))


_upstream: dict[str, Path] = {}


@pytest.fixture(scope="session")
def upstream_f16(tmp_path_factory):
    """Run the vendored convert_hf_to_gguf.py (torch) on a folder, once per folder."""
    root = tmp_path_factory.mktemp("upstream")

    def run(folder: Path) -> Path:
        if not have_torch():
            pytest.skip("upstream convert_hf_to_gguf needs torch")
        if str(folder) not in _upstream:
            out = root / f"{folder.name}-f16.gguf"
            script = paths.llama_root() / "convert_hf_to_gguf.py"
            p = subprocess.run([PY, str(script), str(folder), "--outtype", "f16", "--outfile", str(out)],
                               capture_output=True, text=True, timeout=600)
            assert p.returncode == 0, p.stderr[-3000:]
            _upstream[str(folder)] = out
        return _upstream[str(folder)]

    return run


def tensors(path: Path) -> dict:
    from gguf import GGUFReader

    return {t.name: t for t in GGUFReader(path).tensors}


def fields(path: Path) -> dict:
    from gguf import GGUFReader

    out = {}
    for k, f in GGUFReader(path).fields.items():
        try:
            out[k] = f.contents()
        except Exception:  # noqa: BLE001
            out[k] = None
    return out


def raw_bytes(t) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(t.data)).view(np.uint8).reshape(-1)


def greedy_tokens(model: Path, prompt: str = "The capital of France is", n: int = 12) -> list[int]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model), n_ctx=256, n_threads=2, seed=0, verbose=False)
    try:
        out = []
        for tok in llm.generate(llm.tokenize(prompt.encode()), temp=0.0, top_k=1):
            out.append(int(tok))
            if len(out) == n:
                break
        return out
    finally:
        llm.close()


def forward_logits(model: Path, prompt: str = "Hello world, this is a test") -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model), n_ctx=128, n_threads=2, seed=0, verbose=False, logits_all=True)
    try:
        toks = llm.tokenize(prompt.encode())
        llm.eval(toks)
        return np.array(llm.scores[: len(toks)], dtype=np.float32)
    finally:
        llm.close()


def copy_folder(src: Path, dst: Path) -> Path:
    """A private copy of an HF folder (weights hard-linked or copied) that a test may damage."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copy2(f, dst / f.name)
    return dst


def leftovers(folder: Path) -> list[str]:
    """Files rq-convert would leave behind on failure (its hidden temp and spill files)."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") and p.suffix in (".tmp", ".data"))


def write_imatrix(path: Path, entries: dict, chunk_count: int = 4) -> None:
    """An imatrix GGUF as llama-imatrix writes it: {name: (sums (n_mat, cols), counts (n_mat,))}."""
    import gguf

    w = gguf.GGUFWriter(path, "imatrix")
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", ["synthetic"])
    w.add_uint32("imatrix.chunk_count", chunk_count)
    w.add_uint32("imatrix.chunk_size", 512)
    for name, (sums, counts) in entries.items():
        w.add_tensor(f"{name}.in_sum2", sums.astype(np.float32))
        w.add_tensor(f"{name}.counts", counts.astype(np.float32).reshape(-1, 1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class Helpers:
    """The helpers above, as a fixture (test modules cannot import conftest under --import-mode=importlib)."""

    tensors = staticmethod(tensors)
    fields = staticmethod(fields)
    raw_bytes = staticmethod(raw_bytes)
    greedy_tokens = staticmethod(greedy_tokens)
    forward_logits = staticmethod(forward_logits)
    copy_folder = staticmethod(copy_folder)
    leftovers = staticmethod(leftovers)
    have_torch = staticmethod(have_torch)
    write_imatrix = staticmethod(write_imatrix)


@pytest.fixture(scope="session")
def h() -> type[Helpers]:
    return Helpers
