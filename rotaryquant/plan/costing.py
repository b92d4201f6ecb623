"""What a candidate costs: llama.cpp's buffers (:mod:`rotaryquant.bindings.accounting`) laid over the file's
layout, the deferred-prefill transient, the server's own memory; the ranking of candidates, and the plan that
holds them."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from rotaryquant import bindings, gguf_io, kvtypes
from rotaryquant.bindings.accounting import ContextCost, DryRun
from rotaryquant.plan.errors import MiB, mib
from rotaryquant.plan.facts import Header, layer_dims
from rotaryquant.plan.results import Quality
from rotaryquant.plan.weights import Weights

# llama-server's own resident memory beyond the buffers llama.cpp reports: program and library code
# (~15 MiB of file pages), threads and heap, and the vocabulary (per token: text, score, attributes,
# lookup maps). Measured on this build as VmHWM minus every predicted buffer, at ctx 512: SmolLM2-135M
# (49152 tokens) 37.3 MiB, Gemma3-270M (262144 tokens) 69.5 MiB; the slope gives the per-token part
# (docs/results/plan-verify.md verifies at ctx 4096, and on models not used here).
BASE = 30 * MiB
BASE_PER_TOKEN = 157

# the routed-expert tensors of a layer (tensor names in the file, not llama.cpp log text)
EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps\.")
PAGE = 4096

# llama.cpp stores isoquant3_0/4_0 on heads that are all 64 wide as these siblings (more bits per value)
_ISO64 = {"isoquant3_0": "isoquant3_64", "isoquant4_0": "isoquant4_64"}


@dataclass
class Candidate:
    weights: str                     # "keep" or a recipe
    kv: str                          # KV spec, "K/V" with optional "+calib"
    ctx: int                         # per slot
    n_ctx: int                       # llama-server -c (ctx x slots)
    bytes: dict[str, int] = field(default_factory=dict)
    peak: int = 0                    # predicted peak RSS (CPU) or VRAM (CUDA)
    host: int = 0                    # CUDA: host RAM for what stays on the CPU
    fits: bool = False
    error: str = ""                  # llama.cpp refused this combination
    weights_quality: Quality = field(default_factory=Quality)
    kv_quality: Quality = field(default_factory=Quality)
    bpw: float = 0.0
    kv_bits: float = 0.0             # bits per cached value (K and V averaged)
    predicted: list[str] = field(default_factory=list)   # components that come from a formula
    experts_on_cpu: int = 0          # CUDA: layers whose routed experts stay in RAM (-ot)
    rank: int = 0

    @property
    def quality_key(self) -> float:
        return self.weights_quality.key + self.kv_quality.key

    @property
    def label(self) -> str:
        return f"{self.weights} + {self.kv}"


def kv_bits(spec: str, head: tuple[int, int] = (128, 128)) -> float:
    """Bits per cached value of a K/V spec, for heads of (K, V) width ``head``."""
    def bits(t: str, d: int) -> float:
        t = _ISO64.get(t, t) if d == 64 else t
        n = 64 if d == 64 else 128
        return bindings.row_size(bindings.type_from_name(t), n) * 8 / n

    k, v = kvtypes.split(spec)
    return (bits(k, head[0]) + bits(v, head[1])) / 2


def deferred_transient(h: Header, tokens: int) -> int:
    """Eq. 12 of the RotaryQuant paper: F16 K and V for ``tokens`` prompt tokens in every layer,
    2 x L x H_kv x d x T x 2 bytes (per layer: n_embd_k_gqa + n_embd_v_gqa)."""
    return sum((k + v) * tokens * 2 for k, v in layer_dims(h))


def transient_bytes(f16: ContextCost | None, spec: str) -> int:
    """The deferred-prefill transient for a prompt that fills the context: F16 K (if K is quantised) and F16 V
    (if V is) of every cache cell, i.e. eq. 12 with llama.cpp's own per-cache sizes (an SWA layer's cache
    holds its window, not the context). ``f16``: llama.cpp's accounting of an F16 cache of this context."""
    if f16 is None:
        return 0
    k, v = kvtypes.split(spec)
    return (f16.k if k not in ("f16", "f32", "bf16") else 0) + (f16.v if v not in ("f16", "f32", "bf16") else 0)


def base_bytes(h: Header) -> int:
    return BASE + BASE_PER_TOKEN * h.n_vocab


def pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


def cpu_costs(h: Header, w: Weights, dr: DryRun, cost: ContextCost, *, transient: int) -> \
        tuple[dict[str, int], int, list[str]]:
    layout = gguf_io.skeleton_layout(h, w.types)
    mapped = [n for b, names in dr.placement.items() if b == "CPU" for n in names]
    copies = [n for b, names in dr.placement.items() if b != "CPU" for n in names]
    if mapped:
        lo = min(layout[n][0] for n in mapped)
        hi = max(layout[n][0] + layout[n][1] for n in mapped)
        resident = pages(hi) - (lo // PAGE) * PAGE
    else:
        resident = 0
    repack = sum(layout[n][1] for n in copies)
    file_size = (max(o + b for o, b in layout.values()) if layout else 0)
    b = {"weights_mapped": resident, "weights_copied": repack, "kv": cost.kv, "kv_other": cost.kv_other,
         "compute": cost.compute, "output": cost.output, "transient": transient, "base": base_bytes(h)}
    serve = sum(b.values())
    load = pages(file_size) + repack + b["base"]
    b["load_peak"] = load
    predicted = ["base (constant measured on this build)"]
    if transient:
        predicted.append("deferred prefill: the F16 transient (eq. 12, llama.cpp's cache sizes) is counted, the "
                         "prompt graphs' extra working memory is not")
    return b, max(serve, load), predicted


def gpu_costs(h: Header, w: Weights, cost: ContextCost, *, budget: int, transient: int) -> \
        tuple[dict[str, int], int, int, int, list[str]]:
    """CUDA: everything on the GPU (-ngl 99) except routed experts of the first N layers (-ot ...=CPU)."""
    layout = gguf_io.skeleton_layout(h, w.types)
    experts: dict[int, int] = {}
    rest = 0
    for name, (_, nb) in layout.items():
        m = EXPERTS.match(name)
        if m:
            experts[int(m.group(1))] = experts.get(int(m.group(1)), 0) + nb
        else:
            rest += nb
    fixed = rest + cost.kv + cost.kv_other + cost.compute + transient
    on_cpu, moved = 0, 0
    vram = fixed + sum(experts.values())
    for il in sorted(experts):
        if vram <= budget:
            break
        vram -= experts[il]
        moved += experts[il]
        on_cpu += 1
    b = {"weights_gpu": rest + sum(experts.values()) - moved, "experts_cpu": moved, "kv": cost.kv,
         "kv_other": cost.kv_other, "compute": cost.compute, "transient": transient}
    host = moved + cost.output + base_bytes(h)
    predicted = ["compute buffer: the CPU backend's, measured; CUDA's is not measured (no GPU here)",
                 "VRAM placement: not verified on a GPU"]
    if transient:
        predicted.append("deferred prefill: the F16 transient (eq. 12) is counted, the prompt graphs' extra "
                         "working memory is not")
    return b, vram, host, on_cpu, predicted


def sort(cands: list[Candidate]) -> list[Candidate]:
    """Fitting candidates first, best expected quality first (this model's KLD where measured, else the
    worst measured on other models, else unknown), then more bits, then less memory."""
    def key(c: Candidate) -> tuple:
        return (bool(c.error), not c.fits, c.quality_key, -c.bpw, -c.kv_bits, c.peak)
    out = sorted(cands, key=key)
    for i, c in enumerate(out, 1):
        c.rank = i
    return out


@dataclass
class Plan:
    model: str
    source_kind: str                 # "gguf" | "hf"
    arch: str
    n_params: int
    known: str | None                # the measured model this file is, if any
    same_weights: bool
    budget: int
    ctx: int
    parallel: int
    device: str
    deferred: bool
    candidates: list[Candidate]
    commands: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def winner(self) -> Candidate | None:
        return next((c for c in self.candidates if c.fits and not c.error), None)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["winner"] = asdict(self.winner) if self.winner else None
        for c in d["candidates"] + ([d["winner"]] if d["winner"] else []):
            c["peak_mib"] = round(mib(c["peak"]), 1)
        return d
