"""Hugging Face input: locate the folder, validate it, and drive llama.cpp's own converter over it.

Architecture coverage comes from the vendored ``conversion/`` package (what convert_hf_to_gguf.py
runs): its per-architecture classes do tensor naming, Q/K permutes, expert stacking, metadata and the
tokenizer. We subclass the chosen class only to (a) learn which tensors upstream keeps in float (the
``tensor_force_quant`` hook) and (b) swap its GGUFWriter for our streaming one, whose ``add_tensor``
is where every tensor gets its type. Upstream is run with ftype ALL_F32, so each tensor reaches us in
float32 (lossless from BF16/F16/F32) and is quantised once, from the source precision.

Tensor backend: the conversion package imports torch. ``numpy`` (default) runs it over
:mod:`rotaryquant.converter.torchshim`, a numpy stand-in with torch semantics; ``torch`` uses the real
library (upstream's lazy tensors). See docs/converter.md for why and what is verified.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import logging
import math
import os
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import gguf  # before load_conversion puts llama.cpp's tree on sys.path: the patched gguf-py wins over its copy

from rotaryquant.converter import torchshim
from rotaryquant.converter.dtypes import SAFETENSORS_DTYPES
from rotaryquant.converter.errors import ConvertError
from rotaryquant.converter.torchshim import ShimMissingAttribute, ShimUnsupported
from rotaryquant.gguf_io import is_gguf

log = logging.getLogger("rq-convert")

# architectures whose numpy-backend output is byte-identical to upstream's torch run (tests/converter)
NUMPY_VERIFIED = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                            "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"})
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
# integer buffers some checkpoints carry next to the weights; upstream drops or ignores them
_INT_BUFFERS = (".position_ids", ".num_batches_tracked", "attention.bias", "attention.masked_bias")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


# --- input resolution -------------------------------------------------------------------------------

def resolve_repo_id(repo_id: str) -> Path:
    """A Hugging Face repo id -> a local snapshot folder: the cache first, then (if allowed) the hub."""
    # lazy: only a repo id needs it, and it is slow to import
    from huggingface_hub import constants, snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.tiktoken"]
    cache = Path(constants.HF_HUB_CACHE)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception:  # noqa: BLE001 (not cached, or partly: try the hub if that is allowed)
        pass
    offline = bool(constants.HF_HUB_OFFLINE)
    if offline:
        raise ConvertError(f"{repo_id!r} is not in the Hugging Face cache at {cache} and HF_HUB_OFFLINE is set",
                           fix="download it on a connected machine (huggingface-cli download "
                               f"{repo_id}) into that cache, set HF_HOME/HF_HUB_CACHE to where it is, "
                               "or pass a local folder")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # noqa: BLE001
        raise ConvertError(f"{repo_id!r} is not in the Hugging Face cache at {cache} and could not be "
                           f"downloaded ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
                           fix="check the repo id and the network, or download it elsewhere into that "
                               "cache and rerun with HF_HUB_OFFLINE=1, or pass a local folder") from None


def resolve_input(spec: str | Path) -> tuple[str, Path]:
    """('hf', folder) or ('gguf', file) for a folder, a .gguf file or a repo id."""
    p = Path(spec).expanduser()
    if p.is_dir():
        return "hf", p
    if p.is_file():
        if is_gguf(p):
            return "gguf", p
        if p.name == "config.json":
            return "hf", p.parent
        raise ConvertError(f"{p} is neither a GGUF file nor a Hugging Face model folder",
                           fix="pass the folder with config.json and *.safetensors, or a .gguf file")
    if isinstance(spec, str) and _REPO_ID.match(spec) and not spec.startswith((".", "/")) \
            and not spec.endswith(".gguf"):
        try:
            return "hf", resolve_repo_id(spec)
        except ConvertError as e:
            raise ConvertError(f"{e.message} (and there is no local folder {spec})", fix=e.fix) from None
    raise ConvertError(f"input {spec} does not exist",
                       fix="pass an HF model folder, a .gguf file or a Hugging Face repo id (org/name)")


# --- folder validation ------------------------------------------------------------------------------

@dataclass
class SafetensorsInfo:
    path: Path
    tensors: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # name -> (dtype, shape)


@dataclass
class HFFolder:
    path: Path
    config: dict
    arch: str
    module: str
    shards: list[SafetensorsInfo]
    n_weights: int

    @property
    def tensor_names(self) -> list[str]:
        return [n for s in self.shards for n in s.tensors]


def _text_model_map(llama_root: Path) -> dict[str, str]:
    src = (llama_root / "conversion" / "__init__.py").read_text()
    m = re.search(r"TEXT_MODEL_MAP\s*:\s*dict\[str,\s*str\]\s*=\s*(\{.*?\n\})", src, re.S)
    if not m:
        raise ConvertError(f"cannot read the architecture table in {llama_root}/conversion/__init__.py",
                           fix="run `make setup` to restore the patched llama.cpp tree")
    return ast.literal_eval(m.group(1))


def read_safetensors_header(path: Path) -> SafetensorsInfo:
    """Parse and check one .safetensors file without reading its data: header, dtypes, offsets, size."""
    size = path.stat().st_size
    bad = f"{path} is not a valid safetensors file"
    fix = "re-download or re-export it (the file is corrupt or truncated)"
    if size < 8:
        raise ConvertError(f"{bad} ({size} bytes)", fix=fix)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(size - 8, 100 << 20):
            raise ConvertError(f"{bad} (header of {n} bytes in a {size}-byte file)", fix=fix)
        raw = f.read(n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise ConvertError(f"{bad} (header: {e})", fix=fix) from None
    data_len = size - 8 - n
    info = SafetensorsInfo(path)
    end_max = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = meta["dtype"], tuple(int(s) for s in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ConvertError(f"{bad} (entry {name!r}: {meta!r})", fix=fix) from None
        if dtype not in SAFETENSORS_DTYPES and not dtype.startswith("F8"):
            raise ConvertError(f"{path}: tensor {name} has dtype {dtype}, which this converter cannot read",
                               fix="store weights as BF16, F16 or F32")
        itemsize = SAFETENSORS_DTYPES[dtype][1] if dtype in SAFETENSORS_DTYPES else 1
        if not (0 <= b <= e) or e - b != math.prod(shape) * itemsize:
            raise ConvertError(f"{bad} (tensor {name}: {e - b} bytes for shape {list(shape)} of {dtype})", fix=fix)
        end_max = max(end_max, e)
        info.tensors[name] = (dtype, shape)
    if end_max > data_len:
        raise ConvertError(f"{path} is truncated: its header describes {end_max + 8 + n} bytes, the file has {size}",
                           fix="re-download or re-copy it")
    return info


def inspect_folder(folder: Path, llama_root: Path) -> HFFolder:
    """Check an HF folder up front (so a bad input fails in a second, not after an hour)."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ConvertError(f"{folder} has no config.json",
                           fix="pass a Hugging Face model folder (config.json, *.safetensors, tokenizer files)")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise ConvertError(f"{cfg_path} is not valid JSON ({e})", fix="restore the model's config.json") from None
    arches = config.get("architectures") or (config.get("text_config") or {}).get("architectures")
    if not arches or not isinstance(arches, list) or not isinstance(arches[0], str):
        raise ConvertError(f"{cfg_path} names no architecture (\"architectures\": [...] is missing)",
                           fix="add the transformers class name, e.g. \"architectures\": [\"LlamaForCausalLM\"]")
    arch = arches[0]
    tcfg = config.get("text_config") or {}
    if isinstance(tcfg, dict) and tcfg.get("architectures"):
        arch = tcfg["architectures"][0]
    table = _text_model_map(llama_root)
    if arch not in table and arches[0] in table:
        arch = arches[0]
    if arch not in table:
        close = [a for a in table if a.lower()[:6] == arch.lower()[:6]][:5]
        raise ConvertError(f"architecture {arch!r} ({cfg_path}) is not supported by llama.cpp's converter",
                           fix=f"supported are the {len(table)} architectures of convert_hf_to_gguf"
                               + (f" (similar: {', '.join(close)})" if close else ""))
    if config.get("quantization_config"):
        qm = (config["quantization_config"] or {}).get("quant_method", "?")
        raise ConvertError(f"{folder} is a pre-quantised checkpoint (quant_method {qm!r})",
                           fix="convert the original BF16/F16 checkpoint instead")

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
            files = sorted(set(wm.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConvertError(f"{index} is not a valid weight index ({e})", fix="restore it or remove it") from None
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise ConvertError(f"{folder} lacks {len(missing)} weight file(s) listed in {index.name}: "
                               f"{', '.join(missing[:3])}", fix="download the missing shards")
        parts = [folder / f for f in files]
    else:
        parts = sorted(p for p in folder.glob("model*.safetensors"))
        wm = None
    if not parts:
        if list(folder.glob("pytorch_model*.bin")):
            raise ConvertError(f"{folder} has only pytorch_model*.bin weights",
                               fix="use --tensor-backend torch (needs torch) or save the model as safetensors")
        raise ConvertError(f"{folder} has no model*.safetensors weights", fix="download the weight files")
    shards = [read_safetensors_header(p) for p in parts]
    if wm is not None:
        have = {n for s in shards for n in s.tensors}
        absent = sorted(set(wm) - have)
        if absent:
            raise ConvertError(f"{index} lists {len(absent)} tensor(s) that no shard holds, e.g. {absent[0]}",
                               fix="re-download the checkpoint")
    n_weights = 0
    for s in shards:
        for name, (dtype, shape) in s.tensors.items():
            if dtype not in _FLOAT_DTYPES and not name.endswith(_INT_BUFFERS):
                what = "FP8" if dtype.startswith("F8") else dtype
                raise ConvertError(f"{s.path.name}: tensor {name} is {what}, expected floating-point weights "
                                   "(BF16/F16/F32)",
                                   fix="quantised or integer checkpoints are not supported; convert the "
                                       "original floating-point checkpoint")
            n_weights += math.prod(shape)
    return HFFolder(folder, config, arch, table[arch], shards, n_weights)


# --- loading the conversion package -----------------------------------------------------------------

_loaded_backend: str | None = None


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def choose_backend(requested: str, arch: str) -> str:
    if requested not in ("auto", "numpy", "torch"):
        raise ConvertError(f"unknown tensor backend {requested!r}", fix="use auto, numpy or torch")
    if requested == "torch" and not torch_available():
        raise ConvertError("--tensor-backend torch needs torch", fix="pip install torch (the CPU wheel is enough)")
    if requested == "auto":
        if _loaded_backend is not None:
            return _loaded_backend
        if arch not in NUMPY_VERIFIED and torch_available():
            return "torch"
        return "numpy"
    return requested


def load_conversion(backend: str, llama_root: Path) -> Any:
    """Import llama.cpp's ``conversion`` package bound to ``backend`` (once per process)."""
    global _loaded_backend
    if _loaded_backend is not None and _loaded_backend != backend:
        raise ConvertError(f"this process already loaded llama.cpp's converter with the {_loaded_backend} "
                           f"backend; {backend} needs a fresh process", fix="run rq-convert again")
    try:
        hide = backend == "numpy" and "transformers" not in sys.modules and "torch" not in sys.modules
        if hide:
            # transformers imports torch whenever it is installed (~250 MB, 2 s); on the numpy path
            # nothing needs it, so let transformers see (and cache) "torch absent" for this process
            sys.modules["torch"] = None  # type: ignore[assignment]
        try:
            import transformers  # lazy: heavy (seconds), only an HF folder needs it

            # lazy: as above; before any torch stand-in
            from transformers import AutoConfig, AutoTokenizer  # noqa: F401

            if hide:
                transformers.utils.import_utils.is_torch_available()
        finally:
            if hide:
                del sys.modules["torch"]
    except ImportError as e:
        raise ConvertError(f"converting a Hugging Face folder needs {e.name}",
                           fix="pip install transformers sentencepiece (see docs/converter.md)") from None
    root = str(llama_root)
    if root not in sys.path:
        sys.path.append(root)
    if backend == "numpy":
        with torchshim.installed():
            conv = importlib.import_module("conversion")
    else:
        conv = importlib.import_module("conversion")
    _loaded_backend = backend
    return conv


def model_class(conv: Any, arch: str, backend: str, llama_root: Path) -> type:
    if backend == "numpy":
        ctx: Any = torchshim.installed()
    else:
        ctx = contextlib.nullcontext()
    with ctx:
        try:
            return conv.get_model_class(arch)
        except NotImplementedError:
            raise ConvertError(f"architecture {arch!r} is not supported by llama.cpp's converter") from None


# --- the upstream model with our hooks --------------------------------------------------------------

_KEEP_F32_KEYS = (
    "FFN_GATE_INP", "FFN_GATE_INP_SHEXP", "POS_EMBD", "TOKEN_TYPES", "SSM_CONV1D", "SHORTCONV_CONV",
    "TIME_MIX_FIRST", "TIME_MIX_W1", "TIME_MIX_W2", "TIME_MIX_DECAY_W1", "TIME_MIX_DECAY_W2",
    "TIME_MIX_LERP_FUSED", "POSNET_NORM1", "POSNET_NORM2", "V_ENC_EMBD_POS", "A_ENC_EMBD_POS",
    "ALTUP_CORRECT_COEF", "ALTUP_PREDICT_COEF", "SSM_CONV1D_Q", "SSM_CONV1D_K", "SSM_CONV1D_V",
    "INDEXER_PROJ",
)


def _upstream_keeps_float(model: Any, new_name: str, bid: int | None, n_dims: int) -> bool:
    """The float-only rule of ModelBase.prepare_tensors (conversion/base.py), for one output tensor."""
    if n_dims <= 1 or new_name.endswith("_norm.weight"):
        return True
    keys = [getattr(gguf.MODEL_TENSOR, k) for k in _KEEP_F32_KEYS if hasattr(gguf.MODEL_TENSOR, k)]
    if any(model.match_model_tensor_name(new_name, k, bid) for k in keys):
        return True
    return new_name[-7:] not in (".weight", ".lora_a", ".lora_b")


def subclass(cls: type) -> type:
    """``cls`` plus our two hooks (TextModel insists that subclasses define ``model_arch``)."""

    def tensor_force_quant(self: Any, name: str, new_name: str, bid: int | None, n_dims: int) -> Any:
        upstream = cls.tensor_force_quant(self, name, new_name, bid, n_dims)
        self._rq_keep_float[new_name] = _upstream_keeps_float(self, new_name, bid, n_dims)
        return upstream

    def set_vocab(self: Any) -> None:
        cached = getattr(self, "_rq_vocab_kv", None)
        if cached is None:
            cls.set_vocab(self)
            return
        for k, v in cached.items():
            self.gguf_writer.kv_data[0][k] = v

    return type(f"RQ{cls.__name__}", (cls,), {"model_arch": cls.model_arch, "tensor_force_quant": tensor_force_quant,
                                             "set_vocab": set_vocab, "_rq_keep_float": None})


def shim_errors() -> tuple[type, ...]:
    return (ShimUnsupported, ShimMissingAttribute)


@contextlib.contextmanager
def quiet_upstream(verbose: bool) -> Iterator[None]:
    names = ("hf-to-gguf", "gguf.gguf_writer", "gguf.vocab", "gguf.gguf", "gguf.metadata", "transformers")
    saved = {n: logging.getLogger(n).level for n in names}
    try:
        if not verbose:
            for n in names:
                logging.getLogger(n).setLevel(logging.ERROR)
            os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        yield
    finally:
        for n, lvl in saved.items():
            logging.getLogger(n).setLevel(lvl)


def build_model(src: HFFolder, backend: str, llama_root: Path, out_tmp: Path,
                make_writer: Callable[[str, Any], Any]) -> Any:
    """Instantiate upstream's model class for ``src`` with our hooks and our writer."""
    conv = load_conversion(backend, llama_root)
    cls = subclass(model_class(conv, src.arch, backend, llama_root))
    try:
        model = cls(src.path, gguf.LlamaFileType.ALL_F32, out_tmp, eager=(backend == "numpy"))
    except ConvertError:
        raise
    except Exception as e:  # noqa: BLE001 (upstream raises anything; name the input)
        raise ConvertError(f"llama.cpp's converter rejected {src.path} ({type(e).__name__}: {e})",
                           fix="check config.json against the model's transformers class") from None
    model._rq_keep_float = {}
    old = model.gguf_writer
    writer = make_writer(gguf.MODEL_ARCH_NAMES[model.model_arch], old)
    writer.kv_data = old.kv_data
    writer.tensors = old.tensors
    model.gguf_writer = writer
    # the tokenizer, now: a broken one fails here and not after every tensor is quantised
    scratch = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[model.model_arch])
    model.gguf_writer = scratch
    try:
        cls.__mro__[1].set_vocab(model)
    except Exception as e:  # noqa: BLE001
        raise ConvertError(f"cannot read the tokenizer of {src.path} ({type(e).__name__}: {e})",
                           fix="the folder needs tokenizer.json (or tokenizer.model) and tokenizer_config.json "
                               "as the model was published") from None
    finally:
        model.gguf_writer = writer
    model._rq_vocab_kv = {k: v for k, v in scratch.kv_data[0].items() if k != "general.architecture"}
    return model


def output_is_tied(model: Any) -> bool:
    """llama.cpp's has_tied_embeddings: no source tensor becomes output.weight."""
    for name in model.model_tensors:
        mapped = model.tensor_map.get_type_and_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is not None and mapped[0] == gguf.MODEL_TENSOR.OUTPUT:
            return False
    return True
