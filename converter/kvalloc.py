"""Per-layer KV-cache bit allocation at a bits/value budget, chosen by measurement (``rq-calibrate --kv-bits``).

A 3-bit cache loses what its most sensitive layers need; 4 bits everywhere costs a bit per value that most
layers do not use. Here each layer's sensitivity is measured, not guessed: the model runs over calibration
text with every layer at the wider pair ``hi`` (default K isoquant4_0 / V isoquant3_0) except one at the
narrower ``lo`` (isoquant3_0 / isoquant3_0), and the KLD of its logits against an F16 cache is compared with
all-``hi``. Layers are then narrowed, least KLD per bit saved first, until the cache's bits/value (llama.cpp's
own accounting, every layer holding the whole context) meet the budget. The result is a ``kv_layer_types``
spec naming every layer, stored as metadata (``rotaryquant.kv_alloc.*``) and used by
``--kv-layer-types model`` / ``Llama(kv_layer_types="model")``.

One-layer-at-a-time sensitivities assume the layers' errors add up; the chosen allocation's own KLD is
measured at the end and stored beside them, so a file says how well that held.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rotaryquant import bindings, kvtypes
from rotaryquant.bindings import context as _ctx
from rotaryquant.bindings.accounting import kv_bits_per_value
from rotaryquant.converter import gguf_keys
from rotaryquant.converter.errors import ConvertError
from rotaryquant.errors import PlanError

PREFIX = "rotaryquant.kv_alloc."
FORMAT_VERSION = 1
HI, LO = "isoquant4_0/isoquant3_0", "isoquant3_0/isoquant3_0"
DEFAULT_CHUNKS = 2
N_CTX = 1024            # tokens per chunk; the second half of each chunk is scored, as llama-perplexity does


@dataclass
class Allocation:
    hi: str
    lo: str
    target: float               # the bits/value budget asked for
    bits: float                 # the chosen spec's bits/value
    kld_hi: float               # all layers at hi
    kld_lo: float               # all layers at lo
    kld: float                  # the chosen allocation, measured
    sensitivity: list[float]    # per layer: KLD with that layer alone at lo, minus kld_hi
    lowered: list[int]          # layers at lo
    spec: str                   # llama.cpp kv_layer_types, naming every layer
    tokens: int
    text_name: str

    def metadata(self) -> dict[str, Any]:
        return {
            PREFIX + "version": FORMAT_VERSION,
            PREFIX + "layer_types": self.spec,
            PREFIX + "bits": float(self.bits),
            PREFIX + "target": float(self.target),
            PREFIX + "hi": self.hi,
            PREFIX + "lo": self.lo,
            PREFIX + "sensitivity": np.array(self.sensitivity, np.float32),
            PREFIX + "kld": np.array([self.kld_hi, self.kld, self.kld_lo], np.float32),
            PREFIX + "tokens": self.tokens,
            PREFIX + "text": self.text_name,
            PREFIX + "rule": "per layer: KLD vs F16 with that layer alone at lo, others hi; lower the least KLD "
                             "per bit saved until the budget is met",
        }

    def summary(self) -> list[str]:
        order = sorted(range(len(self.sensitivity)), key=lambda i: self.sensitivity[i])
        return [f"KLD vs an F16 cache on {self.tokens} scored tokens: all {self.hi} {self.kld_hi:.4f}, "
                f"all {self.lo} {self.kld_lo:.4f}, chosen {self.kld:.4f} at {self.bits:.3f} bits/value",
                "layer sensitivity (KLD added at " + self.lo + "), least first: "
                + ", ".join(f"{i}:{self.sensitivity[i]:+.4f}" for i in order),
                f"layers at {self.lo}: {', '.join(map(str, sorted(self.lowered))) or 'none'}"]


def layer_spec(n_layer: int, hi: str, lo: str, lowered: Sequence[int]) -> str:
    """``*=hi`` then the lowered layers as ranges: every layer named, whatever -ctk/-ctv say."""
    items, low = [f"*={hi}"], sorted(set(lowered))
    i = 0
    while i < len(low):
        j = i
        while j + 1 < len(low) and low[j + 1] == low[j] + 1:
            j += 1
        items.append(f"{low[i]}={lo}" if i == j else f"{low[i]}-{low[j]}={lo}")
        i = j + 1
    if any(not 0 <= x < n_layer for x in low):
        raise ValueError(f"layers {low} outside 0-{n_layer - 1}")
    return ",".join(items)


def choose(sensitivity: Sequence[float], saved: Sequence[float], bits_hi: float, target: float) -> list[int]:
    """Layers to lower: least sensitivity per bit saved first (ties: the earlier layer), until
    bits_hi - sum(saved) <= target. ``saved[i]``: bits/value the whole cache saves when layer i is lowered."""
    if target >= bits_hi:
        return []
    if bits_hi - sum(saved) > target + 1e-9:
        raise ConvertError(f"a budget of {target:.3f} bits/value is below what the narrower type reaches "
                           f"({bits_hi - sum(saved):.3f})", fix="raise --kv-bits or choose a narrower --kv-lo")
    order = sorted(range(len(saved)), key=lambda i: (max(sensitivity[i], 0.0) / max(saved[i], 1e-12), i))
    out, bits = [], bits_hi
    for i in order:
        if bits <= target + 1e-9:
            break
        out.append(i)
        bits -= saved[i]
    return sorted(out)


class _Runner:
    """One loaded model; a context per cache spec; logits of the scored half of each chunk."""

    def __init__(self, L: Any, mp: Any, threads: int) -> None:
        self.L, self.mp, self.threads = L, mp, threads
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(mp))

    def logits(self, spec: str, toks: list[int], first: int, use: Callable[[np.ndarray], Any]) -> Any:
        """use([len(toks) - first, n_vocab] float32 logits of positions first.. under the cache spec): a view
        into the context's buffer, valid only during the call (a 262K vocabulary makes a copy 0.5 GB)."""
        L = self.L

        cp = L.llama_context_default_params()
        cp.n_ctx = cp.n_batch = len(toks)
        cp.n_ubatch = min(512, len(toks))
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.swa_full = False  # as the tools run (llama_context_default_params says True)
        cp.type_k, cp.type_v = (bindings.type_from_name(t) for t in kvtypes.split(spec))
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
        layers = kvtypes.layer_types(spec)
        keep = layers.encode() if layers else None  # the struct holds the pointer: keep the bytes alive
        cp.kv_layer_types = keep
        _ctx.apply(cp, k_center="auto")
        ctx = L.llama_init_from_model(self.mp, cp)
        if not ctx:
            raise ConvertError(f"could not create a llama.cpp context with cache {spec}", fix="see the log above")
        batch = L.llama_batch_init(len(toks), 0, 1)
        try:
            batch.n_tokens = len(toks)
            for j, tok in enumerate(toks):
                batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = tok, j, 1, int(j >= first)
                batch.seq_id[j][0] = 0
            if L.llama_decode(ctx, batch) != 0:
                raise ConvertError("llama_decode failed while measuring layer sensitivity", fix="see the log above")
            p = ctypes.cast(L.llama_get_logits(ctx), ctypes.POINTER(ctypes.c_float))
            return use(np.ctypeslib.as_array(p, shape=(len(toks) - first, self.n_vocab)))
        finally:
            L.llama_batch_free(batch)
            L.llama_free(ctx)
            del keep


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise, in the array's dtype (here, not rotaryquant.eval's: the converter does not import eval)."""
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _kld_sum(ref_lp: np.ndarray, logits: np.ndarray, rows: int = 64) -> float:
    """Sum over positions of KL(ref || run); ref_lp holds the reference's log-softmax (float32)."""
    tot = 0.0
    for a in range(0, len(ref_lp), rows):
        lp = ref_lp[a:a + rows].astype(np.float64)
        lq = log_softmax(logits[a:a + rows].astype(np.float64))
        tot += float((np.exp(lp) * (lp - lq)).sum())
    return tot


def measure(model: Path, text: bytes, *, text_name: str, target: float, hi: str = HI, lo: str = LO,
            chunks: int = DEFAULT_CHUNKS, n_ctx: int = N_CTX, threads: int | None = None, progress: bool = True,
            log: Callable[[str], None] = print) -> Allocation:
    """Measure each layer's sensitivity on ``chunks`` x ``n_ctx`` tokens of the text and choose the layers to
    lower so that the cache meets ``target`` bits/value."""
    for s in (hi, lo):
        try:
            bindings.validate_kv_spec(s)
        except Exception as e:  # noqa: BLE001 - the type name is the user's
            raise ConvertError(f"cache pair {s!r}: {e}", fix="give K/V type names, e.g. isoquant4_0/isoquant3_0") from None
    import llama_cpp as L  # lazy: loads the patched libllama: needs the build
    import llama_cpp._logger as llog  # lazy: loads the patched libllama: needs the build

    level = llog.logger.level
    llog.set_verbose(False)  # llama.cpp's errors still print
    mp = L.llama_model_load_from_file(str(model).encode(), L.llama_model_default_params())
    if not mp:
        llog.logger.setLevel(level)
        raise ConvertError(f"llama.cpp could not load {model}", fix="see the log above")
    try:
        n_layer = L.llama_model_n_layer(mp)
        specs = [hi, lo, *(f"{hi}@{i}={lo}" for i in range(n_layer))]
        try:
            bits = kv_bits_per_value(model, specs, n_ctx)
        except PlanError as e:
            raise ConvertError(str(e), fix="choose cache types this model's heads can take") from None
        saved = [bits[hi] - bits[f"{hi}@{i}={lo}"] for i in range(n_layer)]
        if target < bits[lo] - 1e-9:
            raise ConvertError(f"--kv-bits {target} is below {lo}'s {bits[lo]:.3f} bits/value",
                               fix=f"give a budget between {bits[lo]:.3f} and {bits[hi]:.3f}")
        vocab = L.llama_model_get_vocab(mp)
        buf = (L.llama_token * (len(text) + 16))()
        ids = list(buf[:max(L.llama_tokenize(vocab, text, len(text), buf, len(buf), False, False), 0)])
        bos = [L.llama_vocab_bos(vocab)] if L.llama_vocab_get_add_bos(vocab) else []
        step = n_ctx - len(bos)
        if len(ids) < step * chunks:
            raise ConvertError(f"calibration text {text_name} is too short for {chunks} chunks of {n_ctx} tokens "
                               f"({len(ids)} tokens)", fix="pass a longer text (-f) or fewer --kv-chunks")
        run = _Runner(L, mp, threads or os.cpu_count() or 2)
        first = n_ctx // 2
        sums = dict.fromkeys(specs + ["chosen"], 0.0)
        bar = gguf_keys.bar(chunks * (len(specs) + 2), progress, unit="run", desc="layer sensitivity")
        refs = []
        for c in range(chunks):
            toks = bos + ids[c * step:(c + 1) * step]
            ref = run.logits("f16", toks, first, lambda x: log_softmax(x.astype(np.float64)).astype(np.float32))
            bar.update(1)
            for s in specs:
                sums[s] += run.logits(s, toks, first, functools.partial(_kld_sum, ref))
                bar.update(1)
            refs.append((toks, ref))
        n_scored = chunks * (n_ctx - first)
        kld = {s: v / n_scored for s, v in sums.items()}
        sens = [kld[f"{hi}@{i}={lo}"] - kld[hi] for i in range(n_layer)]
        lowered = choose(sens, saved, bits[hi], target)
        spec = layer_spec(n_layer, hi, lo, lowered)
        chosen = f"{hi}@{spec.replace(',', ';')}"
        for toks, ref in refs:
            sums["chosen"] += run.logits(chosen, toks, first, functools.partial(_kld_sum, ref))
            bar.update(1)
        bar.close()
        b = kv_bits_per_value(model, [chosen], n_ctx)[chosen]
        return Allocation(hi, lo, target, b, kld[hi], kld[lo], sums["chosen"] / n_scored, sens, lowered, spec,
                          n_scored, text_name)
    finally:
        llog.logger.setLevel(level)
        L.llama_model_free(mp)


def read_allocation(path: Path) -> dict[str, Any] | None:
    """The rotaryquant.kv_alloc.* keys of a GGUF (None when it has none)."""
    return gguf_keys.read_keys(path, PREFIX)
