"""K-cache calibration: per-channel K centring and Q/K rebalancing statistics, stored in the GGUF.

Post-RoPE keys of many models carry a large per-channel constant (Qwen2's k_proj bias, Gemma3's
outlier channels). A 3- or 4-bit K cache spends its levels on that constant. The patched llama.cpp
writes keys as (k - mu) / lam and multiplies queries by lam, which leaves softmax(q.k) unchanged:
q.mu is the same for every key of a query, and (q * lam).(k / lam) = q.k. This module measures mu
and lam on calibration text, through the patched library itself, and writes them as metadata arrays
(``rotaryquant.k_center.*``): stock llama.cpp ignores unknown keys, so the file stays loadable
everywhere; new tensors would make stock loaders fail ("wrong number of tensors").

    mu  = mean of post-RoPE K, per (layer, KV head, channel)
    lam = sqrt(max|K - mu| / max|Q|), Q over the query heads of that KV head (SmoothQuant, alpha 0.5)

The GGUF is rewritten by copying its header, tensor infos and data verbatim around the new keys, so
calibrating a 1 GB file takes seconds and never dequantises a tensor.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from rotaryquant import gguf_io
from rotaryquant.bindings import context, ggml
from rotaryquant.bindings.capture import EvalCallback, Node
from rotaryquant.converter import gguf_keys, kvalloc
from rotaryquant.converter.errors import ConvertError
from rotaryquant.converter.gguf_source import architecture, open_gguf
from rotaryquant.data import calibration_text

PREFIX = "rotaryquant.k_center."
FORMAT_VERSION = 1          # rotaryquant.k_center.version; the C++ loader checks it
MIN_TOKENS = 256            # fewer tokens give means dominated by the first positions
DEFAULT_TOKENS = 4096
HOOK_BATCH = 512            # tokens per llama_decode when a hook needs every token as an output
LAM_MIN, LAM_MAX = 2.0**-8, 2.0**8  # keeps K/lam and Q*lam well inside fp16 for any cache type

# attention that is not shift-invariant in its logits: centring would change the model there
# (logit soft-capping, tanh-scaled logits). The runtime decides the same from the loaded model, in
# ggml-patches/src/llama/llama-rq.cpp (K centring's set-up: hparams.attn_soft_cap || arch == grok);
# these are checked here from the GGUF, before a pass is run.
_SOFTCAP_KEYS = ("attn_logit_softcapping",)
_REFUSED_ARCHS = {"grok": "tanh-scaled attention logits", "gemma2": "attention logit soft-capping"}
# MLA (K used as V: deepseek2, kimi-linear, bailingmoe3, ...): the runtime refuses by hparams.is_mla();
# from the GGUF, these keys. The architectures that write K outside build_attn come from the library.
_MLA_KEYS = ("attention.kv_lora_rank", "attention.key_length_mla")


@functools.cache
def _unhooked_archs() -> frozenset[str]:
    """llama_rq_unhooked_archs(): the list the runtime refuses K centring and deferred prefill by."""
    ggml.load_llama_cpp()  # MissingBuildError, not an ImportError, without the build
    return frozenset(context.unhooked_archs())


def k_cache_unhooked(arch: str, get: Callable[[str], Any]) -> bool:
    """True when K centring cannot reach this model's K cache: MLA (``get(key)``: the GGUF value of
    ``{arch}.key``, None when absent) or an architecture the C library lists as unhooked."""
    return any(get(k) is not None for k in _MLA_KEYS) or arch in _unhooked_archs()


@dataclass
class LayerStats:
    """Running statistics of one attention layer: K per (KV head, channel), |Q| per its KV head."""

    n_head_kv: int
    head_dim: int
    count: int = 0
    k_sum: np.ndarray = field(init=False)
    k_min: np.ndarray = field(init=False)
    k_max: np.ndarray = field(init=False)
    q_absmax: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        shape = (self.n_head_kv, self.head_dim)
        self.k_sum = np.zeros(shape, np.float64)
        self.k_min = np.full(shape, np.inf)
        self.k_max = np.full(shape, -np.inf)
        self.q_absmax = np.zeros(shape, np.float64)

    def add_k(self, k: np.ndarray) -> None:
        """k: [tokens, n_head_kv, head_dim]."""
        self.count += k.shape[0]
        self.k_sum += k.sum(0, dtype=np.float64)
        np.minimum(self.k_min, k.min(0), out=self.k_min)
        np.maximum(self.k_max, k.max(0), out=self.k_max)

    def add_q(self, q: np.ndarray) -> None:
        """q: [tokens, n_head, head_dim]; query head h belongs to KV head h // (n_head / n_head_kv)."""
        g = q.shape[1] // self.n_head_kv
        a = np.abs(q).reshape(q.shape[0], self.n_head_kv, g, self.head_dim).max(axis=(0, 2))
        np.maximum(self.q_absmax, a, out=self.q_absmax)

    def derive(self) -> tuple[np.ndarray, np.ndarray]:
        """(mu, lam), each [n_head_kv, head_dim] float32."""
        mu = self.k_sum / max(self.count, 1)
        kdev = np.maximum(self.k_max - mu, mu - self.k_min)
        lam = np.sqrt(np.maximum(kdev, 1e-6) / np.maximum(self.q_absmax, 1e-6))
        return mu.astype(np.float32), np.clip(lam, LAM_MIN, LAM_MAX).astype(np.float32)


@dataclass
class Calibration:
    layers: list[int]
    mu: list[np.ndarray]       # per layer [n_head_kv, head_dim]
    lam: list[np.ndarray]
    tokens: int
    text_name: str
    text_sha256: str

    def metadata(self) -> dict[str, Any]:
        try:
            tool = f"rq-calibrate {version('rotaryquant')} (format {FORMAT_VERSION})"
        except Exception:  # noqa: BLE001
            tool = f"rq-calibrate (format {FORMAT_VERSION})"
        return {
            PREFIX + "version": FORMAT_VERSION,
            PREFIX + "layers": np.array(self.layers, np.int32),
            PREFIX + "mean": np.concatenate([m.ravel() for m in self.mu]).astype(np.float32),
            PREFIX + "scale": np.concatenate([lam.ravel() for lam in self.lam]).astype(np.float32),
            PREFIX + "tokens": self.tokens,
            PREFIX + "text": self.text_name,
            PREFIX + "text_sha256": self.text_sha256,
            PREFIX + "rule": "mu = mean(K); lam = sqrt(max|K - mu| / max|Q|) per channel, post-RoPE",
            PREFIX + "tool": tool,
        }


# --- checks ----------------------------------------------------------------------------------------

def check_model(path: Path, reader: Any = None) -> str:
    """The architecture, or ConvertError when the rewrite would not be exact for this model
    (``reader``: the GGUFReader of path, when the caller has one: parsing a big vocabulary takes seconds)."""
    r = reader if reader is not None else open_gguf(path)
    arch = architecture(r)
    if arch in _REFUSED_ARCHS:
        raise ConvertError(f"{path.name}: {arch} uses {_REFUSED_ARCHS[arch]}, so K centring would change "
                           "its attention", fix="keep this model's K cache at f16 or q8_0 without calibration")
    for k in _SOFTCAP_KEYS:
        f = r.fields.get(f"{arch}.{k}")
        if f is not None and float(f.contents()) > 0:
            raise ConvertError(f"{path.name}: attention logit soft-capping ({arch}.{k} = {f.contents()}) is "
                               "not shift-invariant, so K centring would change the model",
                               fix="keep this model's K cache at f16 or q8_0 without calibration")
    if k_cache_unhooked(arch, lambda k: r.fields.get(f"{arch}.{k}")):
        raise ConvertError(f"{path.name}: {arch} writes or reuses its K cache in ways K centring does not "
                           "cover (MLA / custom attention)", fix="use this model without calibration")
    if r.fields.get(f"{arch}.attention.head_count") is None:
        raise ConvertError(f"{path.name}: {arch} has no attention layers ({arch}.attention.head_count missing)",
                           fix="K calibration is for transformer models with a KV cache")
    return arch


def text_tokens(text: bytes, tokenize: Callable[[bytes], list[int]], n_tokens: int, name: str) -> list[int]:
    ids = tokenize(text)
    if len(ids) < MIN_TOKENS:
        raise ConvertError(f"calibration text {name} is too short: {len(ids)} tokens, at least {MIN_TOKENS} "
                           "are needed", fix="pass a longer text (rq-calibrate -f FILE, rq-convert --calibrate FILE)")
    return ids[:n_tokens]


# --- capture -------------------------------------------------------------------------------------------

class Hook(Protocol):
    """A second statistic gathered in the same pass (see :class:`calibration.GramCollector`)."""

    def ask(self, n: Node) -> bool: ...
    def take(self, n: Node) -> bool: ...
    def new_batch(self) -> None: ...


def collect(model: Path, text: bytes, *, text_name: str, n_tokens: int = DEFAULT_TOKENS, n_ctx: int = 2048,
            threads: int | None = None, progress: bool = True, verbose: bool = False) -> Calibration:
    """Run the model over the text (F16 cache, so nothing is rewritten) and gather the statistics."""
    cal, _ = run_pass(model, text, text_name=text_name, n_tokens=n_tokens, n_ctx=n_ctx, threads=threads,
                      progress=progress, verbose=verbose)
    assert cal is not None
    return cal


def run_pass(model: Path, text: bytes, *, text_name: str, n_tokens: int = DEFAULT_TOKENS, n_ctx: int = 2048,
             threads: int | None = None, progress: bool = True, verbose: bool = False, hook: Hook | None = None,
             k_stats: bool = True) -> tuple[Calibration | None, int]:
    """One pass over the text: K statistics when ``k_stats``, and whatever ``hook`` gathers from the
    nodes it asks for. Returns (K calibration or None, tokens evaluated)."""
    stats: dict[int, LayerStats] = {}
    pending_q: dict[int, np.ndarray] = {}
    k_names = ("attn_q_in-", "attn_k_in-") if k_stats else ()  # attn_v_in-: not needed here

    def want(n: Node) -> bool:
        return n.name.startswith(k_names) or (hook is not None and hook.ask(n))  # startswith(()) is False

    def take(n: Node) -> None:
        if hook is not None and hook.take(n):
            return
        name = n.name
        if not name.startswith(k_names):
            return
        a = n.f32()
        if a is None:
            return
        il = int(name.rsplit("-", 1)[1])
        x = a[0].reshape(a.shape[1], a.shape[2], a.shape[3])  # [tokens, heads, head_dim]
        if name.startswith("attn_k_in"):
            st = stats.setdefault(il, LayerStats(x.shape[1], x.shape[2]))
            st.add_k(x)
            if il in pending_q:
                st.add_q(pending_q.pop(il))
        elif il in stats:
            stats[il].add_q(x)
        else:
            pending_q[il] = x.copy()

    cb = EvalCallback(want, take)  # first: without the build this is a MissingBuildError, not an ImportError
    import llama_cpp as L  # lazy: loads the patched libllama: needs the build
    import llama_cpp._logger as llog  # lazy: loads the patched libllama: needs the build

    level = llog.logger.level
    if not verbose:
        llog.set_verbose(False)  # llama.cpp's errors still print
    try:
        return _collect(L, cb, stats, model, text, text_name=text_name, n_tokens=n_tokens, n_ctx=n_ctx,
                        threads=threads, progress=progress, hook=hook, k_stats=k_stats)
    finally:
        llog.logger.setLevel(level)


def _collect(L: Any, cb: EvalCallback, stats: dict[int, LayerStats], model: Path, text: bytes, *, text_name: str,
             n_tokens: int, n_ctx: int, threads: int | None, progress: bool, hook: Hook | None,
             k_stats: bool) -> tuple[Calibration | None, int]:
    mp = L.llama_model_load_from_file(str(model).encode(), L.llama_model_default_params())
    if not mp:
        raise ConvertError(f"llama.cpp could not load {model}", fix="see the log above")
    try:
        vocab = L.llama_model_get_vocab(mp)
        n_ctx = max(64, min(n_ctx, L.llama_model_n_ctx_train(mp) or n_ctx))
        bos = L.llama_vocab_bos(vocab) if L.llama_vocab_get_add_bos(vocab) else None

        def tokenize(data: bytes) -> list[int]:
            buf = (L.llama_token * (len(data) + 16))()
            n = L.llama_tokenize(vocab, data, len(data), buf, len(buf), False, False)
            return list(buf[:max(n, 0)])

        ids = text_tokens(text, tokenize, n_tokens, text_name)
        step = n_ctx - (1 if bos is not None else 0)
        chunks = [ids[i:i + step] for i in range(0, len(ids), step)]
        chunks = [c for c in chunks if len(c) >= 16]
        cp = L.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx
        if hook is not None:
            # every token is an output, so the last layer's FFN sees all of them (llama.cpp drops the
            # non-output rows before it); sub-batches bound the logits buffer (n_batch x n_vocab floats)
            cp.n_batch = cp.n_ubatch = min(n_ctx, HOOK_BATCH)
        cp.n_threads = cp.n_threads_batch = threads or os.cpu_count() or 2
        cp.type_k = cp.type_v = L.GGML_TYPE_F16
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cb.install(cp)
        ctx = L.llama_init_from_model(mp, cp)
        if not ctx:
            raise ConvertError(f"could not create a llama.cpp context for {model}", fix="see the log above")
        batch = None
        try:
            bar = gguf_keys.bar(sum(len(c) for c in chunks), progress, desc="calibrating" if hook else "calibrating K")
            batch = L.llama_batch_init(cp.n_batch, 0, 1) if hook is not None else None
            for c in chunks:
                toks = ([bos] if bos is not None else []) + c
                L.llama_memory_clear(L.llama_get_memory(ctx), True)
                for i in range(0, len(toks), cp.n_batch) if batch is not None else (0,):
                    if batch is not None:
                        part = toks[i:i + cp.n_batch]
                        batch.n_tokens = len(part)
                        for j, tok in enumerate(part):
                            batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = tok, i + j, 1, 1
                            batch.seq_id[j][0] = 0
                        hook.new_batch()
                        rc = L.llama_decode(ctx, batch)
                    else:
                        arr = (L.llama_token * len(toks))(*toks)
                        rc = L.llama_decode(ctx, L.llama_batch_get_one(arr, len(toks)))
                    cb.raise_pending()  # the callback's exception, when it stopped the graph
                    if rc != 0:
                        raise ConvertError("llama_decode failed during calibration", fix="see the log above")
                bar.update(len(c))
            bar.close()
        finally:
            if batch is not None:
                L.llama_batch_free(batch)
            L.llama_free(ctx)
    finally:
        L.llama_model_free(mp)
    n = sum(len(c) for c in chunks)
    if not k_stats:
        return None, n
    if not stats:
        raise ConvertError(f"{model.name}: no attention layer wrote a K cache during calibration",
                           fix="K calibration is for transformer models with a KV cache")
    layers = sorted(stats)
    if any(stats[il].q_absmax.max() == 0 for il in layers):
        raise ConvertError("queries were not captured for every layer", fix="is this the patched llama.cpp?")
    derived = [stats[il].derive() for il in layers]
    return Calibration(layers, [d[0] for d in derived], [d[1] for d in derived], tokens=n, text_name=text_name,
                       text_sha256=hashlib.sha256(text).hexdigest()), n


# --- GGUF rewrite (metadata only, data copied verbatim: rotaryquant.gguf_io) ---------------------------

def rewrite_metadata(src: Path, dst: Path, set_kv: dict[str, Any], *, drop_prefix: str = PREFIX,
                     progress: bool = True) -> None:
    """Copy src to dst (atomically) with keys under drop_prefix removed and set_kv added."""
    try:
        r = gguf_io.open_reader(src, fix="check it was written by a llama.cpp of this tree")
    except gguf_io.GGUFError as e:
        raise ConvertError(e.message, fix=e.fix) from None
    bar = gguf_keys.bar(os.path.getsize(src) - r.data_offset, progress, unit="B", desc="writing")
    try:
        gguf_io.rewrite_metadata(src, dst, set_kv, drop=lambda k: k.startswith(drop_prefix), reader=r,
                                 progress=lambda done, _total: bar.update(done - bar.n))
    finally:
        bar.close()


def read_calibration(path: Path) -> dict[str, Any] | None:
    """The rotaryquant.k_center.* keys of a GGUF (None when it has none)."""
    return gguf_keys.read_keys(path, PREFIX)


def calibrate(model: str | Path, output: str | Path | None = None, *, text: str | Path | None = None,
              n_tokens: int = DEFAULT_TOKENS, n_ctx: int = 2048, threads: int | None = None,
              progress: bool = True, verbose: bool = False, kv_bits: float | None = None,
              kv_hi: str | None = None, kv_lo: str | None = None,
              kv_chunks: int | None = None) -> tuple[Path, Calibration, Any]:
    """Measure mu/lam for a GGUF model and write them into output (default: the model, in place). With
    ``kv_bits``, also choose per-layer K/V cache types for that budget (:mod:`kvalloc`) on the calibrated file and
    store them; the third item is that :class:`kvalloc.Allocation` (None without ``kv_bits``)."""
    model = Path(model).expanduser()
    if not model.is_file():
        raise ConvertError(f"model {model} does not exist", fix="give the path of a .gguf file")
    out = Path(output).expanduser() if output else model
    if out.is_dir() or not out.parent.is_dir():
        raise ConvertError(f"cannot write {out}", fix="give a file name in an existing folder")
    check_model(model)
    if text is None:
        text = calibration_text()
    text = Path(text).expanduser()
    if not text.is_file():
        raise ConvertError(f"calibration text {text} does not exist", fix="give a UTF-8 text file with -f")
    if n_tokens < MIN_TOKENS:
        raise ConvertError(f"--tokens {n_tokens} is below the minimum {MIN_TOKENS}", fix=f"use --tokens {MIN_TOKENS} or more")
    # 16 bytes of text per wanted token is ample (English BPE: ~4 bytes per token)
    data = text.read_bytes()[: max(n_tokens, MIN_TOKENS) * 16]
    cal = collect(model, data, text_name=text.name, n_tokens=n_tokens, n_ctx=n_ctx, threads=threads,
                  progress=progress, verbose=verbose)
    if kv_bits is None:
        rewrite_metadata(model, out, cal.metadata(), progress=progress)
        return out, cal, None

    if not kv_chunks or kv_chunks < 1:
        raise ConvertError(f"--kv-chunks {kv_chunks}: give at least 1", fix="e.g. --kv-chunks 2")
    # measured on the calibrated model (a temporary copy): its caches are centred as users will run them
    tmp = out.with_name(f".{out.name}.kv-alloc.tmp")
    try:
        rewrite_metadata(model, tmp, cal.metadata(), progress=progress)
        need = text.read_bytes()[: kv_chunks * kvalloc.N_CTX * 16]
        alloc = kvalloc.measure(tmp, need, text_name=text.name, target=kv_bits, hi=kv_hi or kvalloc.HI,
                                lo=kv_lo or kvalloc.LO, chunks=kv_chunks, threads=threads, progress=progress)
        rewrite_metadata(tmp, out, alloc.metadata(), drop_prefix=kvalloc.PREFIX, progress=progress)
    finally:
        tmp.unlink(missing_ok=True)
    return out, cal, alloc


def summary(cal: Calibration) -> Iterable[str]:
    """Lines for the user: how much of K each layer's constant part was."""
    for il, mu, lam in zip(cal.layers, cal.mu, cal.lam):
        yield (f"layer {il:3d}: |mu| {float(np.linalg.norm(mu, axis=1).mean()):8.3f}  "
               f"lam {float(lam.min()):.3g}..{float(lam.max()):.3g}")
