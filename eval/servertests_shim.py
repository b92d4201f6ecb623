"""A pytest plugin that runs upstream llama.cpp's server tests (tools/server/tests/unit) on local models.

Loaded by ``rq-eval server-tests`` as ``-p rotaryquant.eval.servertests_shim``, before upstream's conftest. It
edits no upstream file; it patches upstream's ``utils`` module in memory:

- ``ServerPreset``'s presets keep every setting except the model, which becomes a local file (RQ_ST_CHAT:
  a chat model for the tiny story models and, with mean pooling, for the embedding presets; RQ_ST_FIM: a
  fill-in-the-middle model for the infill preset); presets with no local stand-in (reranker, vision, router) skip;
- ``ServerPreset.load_all`` (the hub downloads before the session) does nothing;
- ``ServerProcess.start`` skips a test whose server would still load anything from a hub, with the name;
- ``download_file`` returns a local stand-in for the speculative-decoding draft model and skips otherwise.

The cache type and the other server settings of ours reach llama-server through LLAMA_ARG_* variables, which the
runner sets; a test that passes its own -ctk/-fa on the command line wins over them, as in any llama-server run.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

_DIR = os.environ.get("RQ_ST_DIR")
if not _DIR:
    raise RuntimeError("servertests_shim: RQ_ST_DIR (upstream's tools/server/tests) is not set; "
                       "run it through `rq-eval server-tests`")
sys.path.insert(0, _DIR)

import utils  # noqa: E402  (upstream's tools/server/tests/utils.py)

CHAT = os.environ["RQ_ST_CHAT"]
FIM = os.environ.get("RQ_ST_FIM") or None

# hub models with a local stand-in: (repo, file) -> env-named path
_HUB = {
    ("ggml-org/models", "tinyllamas/stories260K.gguf"): CHAT,  # ServerProcess's own default
    ("ggml-org/Qwen2.5-Coder-1.5B-IQ3_XXS-GGUF", "qwen2.5-coder-1.5b-iq3_xxs-imat.gguf"): FIM,
}
_DRAFT_URL_SUFFIX = "/stories15M-q4_0.gguf"  # test_speculative's draft: SmolLM2 drafts for itself

_ORIG = {name: getattr(utils.ServerPreset, name) for name, v in vars(utils.ServerPreset).items()
         if isinstance(v, staticmethod)}


def _local(server: utils.ServerProcess, path: str) -> utils.ServerProcess:
    server.model_hf_repo = None
    server.model_hf_file = None
    server.model_url = None
    server.model_file = path
    server.offline = True
    return server


def _skip_preset(why: str):
    def preset() -> utils.ServerProcess:
        pytest.skip(f"no local stand-in: {why}", allow_module_level=True)
    return staticmethod(preset)


def _chat_preset(name: str, embeddings: bool = False):
    def preset() -> utils.ServerProcess:
        s = _local(_ORIG[name](), CHAT)
        if embeddings:
            s.pooling = "mean"  # a causal LM as embedder; a test that sets its own pooling wins
        return s
    return staticmethod(preset)


def _fim_preset(name: str):
    def preset() -> utils.ServerProcess:
        if FIM is None:
            pytest.skip("no local fill-in-the-middle model (RQ_ST_FIM)", allow_module_level=True)
        return _local(_ORIG[name](), FIM)
    return staticmethod(preset)


PRESETS = {
    "tinyllama2": _chat_preset("tinyllama2"),
    "stories15m_moe": _chat_preset("stories15m_moe"),
    "bert_bge_small": _chat_preset("bert_bge_small", embeddings=True),
    "bert_bge_small_with_fa": _chat_preset("bert_bge_small_with_fa", embeddings=True),
    "tinyllama_infill": _fim_preset("tinyllama_infill"),
    "jina_reranker_tiny": _skip_preset("reranker (jina-reranker-v1-tiny: a classification head)"),
    "tinygemma3": _skip_preset("vision model with mmproj (tinygemma3)"),
    "router": _skip_preset("router mode: its child servers load hub models by name"),
}
for _name, _fn in PRESETS.items():
    setattr(utils.ServerPreset, _name, _fn)
utils.ServerPreset.load_all = staticmethod(lambda: None)

_start = utils.ServerProcess.start


def start(self: utils.ServerProcess, *args, **kwargs) -> None:
    if self.model_hf_repo:
        local = _HUB.get((self.model_hf_repo, self.model_hf_file))
        if local is None:
            pytest.skip(f"hub model {self.model_hf_repo} {self.model_hf_file or ''}".rstrip())
        _local(self, local)
    for what in ("model_url", "mmproj_url"):
        if getattr(self, what):
            pytest.skip(f"hub download {what}: {getattr(self, what).rsplit('/', 1)[-1]}")
    _start(self, *args, **kwargs)
    if self.log_path:
        _wait_for_log(self.log_path)


def _wait_for_log(path: str, line: str = ": model loaded\n", timeout: float = 30.0) -> None:
    # llama-server answers /health before its log thread has written what came before: upstream's log-reading
    # tests (test_kv_keep_only_active) then race it on a loaded 2-core machine. "model loaded" is logged right
    # after the server turns ready and the log keeps order, so once it is in the file everything before it is.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path, errors="replace") as f:
            if line in f.read():
                return
        time.sleep(0.02)


utils.ServerProcess.start = start


def download_file(url: str, output_file_path: str | None = None) -> str:
    if url.endswith(_DRAFT_URL_SUFFIX):
        return CHAT
    pytest.skip(f"download {url.rsplit('/', 1)[-1]}", allow_module_level=True)


utils.download_file = download_file
