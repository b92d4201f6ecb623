"""The models our quality tables were measured on, and how a file is recognised as one of them."""

from __future__ import annotations

from dataclasses import dataclass

from rotaryquant.plan.facts import Header


@dataclass(frozen=True)
class KnownModel:
    """A model our quality tables were measured on, recognised by its shape (not its file name)."""

    id: str
    label: str
    arch: str
    n_layer: int
    n_embd: int
    n_params: int
    file_type: int           # general.file_type of the file measured
    files: tuple[str, ...]   # file names the results JSON use for it (".kc": the same file after rq-calibrate)


KNOWN_MODELS = (
    KnownModel("smollm2-135m", "SmolLM2-135M-Instruct Q4_1", "llama", 30, 576, 134_515_008, 3,
               ("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2.kc.gguf")),
    KnownModel("gemma3-270m", "Gemma3-270M Q4_K_M", "gemma3", 18, 640, 268_098_176, 15,
               ("gemma-3-270m-q4_k_m.gguf", "gemma3.kc.gguf", "g3.kc.gguf")),
    KnownModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M", "qwen2", 28, 1536, 1_777_088_000, 15,
               ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen.kc.gguf")),
)


def identify(h: Header) -> tuple[KnownModel | None, bool]:
    """(the known model this file is, whether its weights are the measured file's)."""
    for km in KNOWN_MODELS:
        if (h.arch, h.get("block_count"), h.get("embedding_length"), h.n_params) == \
                (km.arch, km.n_layer, km.n_embd, km.n_params):
            return km, int(h.fields.get("general.file_type", -1)) == km.file_type
    return None, False


def known_by_file(name: str) -> KnownModel | None:
    return next((km for km in KNOWN_MODELS if name in km.files), None)
