"""Second-order input statistics for ITQ3_S: per 256-column block, the Gram matrix of a weight's inputs.

For a linear weight W (rows x n) fed activations x_t (n values per token), the quantiser of ITQ3_S can
minimise the output error sum_t |(W - Q) x_t|^2 instead of |W - Q|^2 when it knows
H = sum_t x_t x_t^T. ITQ3_S rotates and quantises each 256-column block on its own, so only the
block-diagonal of H is kept: n/256 matrices of 256 x 256, in the original (unrotated) domain, raw sums
(the quantiser damps and normalises them).

They are measured in the same llama.cpp pass as the K-cache centring (:mod:`kcenter`), with an eval
callback on every ``GGML_OP_MUL_MAT`` whose first source is a layer weight (``blk.N.*.weight``), the
way llama-imatrix finds its tensors. Weights that read the same activation tensor (q/k/v after the
attention norm, gate/up after the FFN norm) share one accumulator. MoE expert matmuls
(``GGML_OP_MUL_MAT_ID``) are not collected: their 3-D tensors are quantised without statistics.

Memory: n/256 * 256 * 256 * 8 bytes (float64) per distinct input during the pass, half that (float32)
afterwards; Qwen2.5-1.5B (28 layers, inputs 1536/1536/1536/8960 wide) needs 0.78 GB, then 0.39 GB.

Saved statistics (``--save-calibration FILE``) are an ``.npz``: the Gram blocks, the K-centring arrays,
and the identity of the model they were measured on (architecture, vocabulary size and hash, tensor
names and shapes), checked when the file is reused with ``--calibration-data``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rotaryquant.bindings import capture
from rotaryquant.bindings.capture import Node
from rotaryquant.converter import kcenter
from rotaryquant.converter.errors import ConvertError
from rotaryquant.converter.gguf_source import architecture, open_gguf
from rotaryquant.files import publish

BLOCK = 256
FORMAT = "rotaryquant.calibration"
FORMAT_VERSION = 1


def _weight_name(name: str) -> str:
    """llama-imatrix's filter_tensor_name: CUDA0#blk.0.attn_k.weight#0 -> blk.0.attn_k.weight."""
    if "#" in name:
        return name.split("#")[1]
    return name


class GramCollector:
    """The eval-callback half that accumulates block Gram matrices of matmul inputs.

    ``ask(node)`` / ``take(node)`` are called from :func:`kcenter.run_pass`'s callback
    (:class:`rotaryquant.bindings.capture.EvalCallback`) for every node; ``new_batch()`` before each
    ``llama_decode`` (inputs are identified per graph).
    """

    def __init__(self, want: Callable[[str], bool]) -> None:
        self.want = want
        self.mul_mat = capture.op_id("MUL_MAT")  # loads the library and checks struct ggml_tensor's layout
        self.mul_mat_id = capture.op_id("MUL_MAT_ID")
        self.group_of: dict[str, str] = {}        # weight -> group (its first weight's name)
        self.sums: dict[str, np.ndarray] = {}     # group -> (n/256, 256, 256) float64
        self.tokens: dict[str, int] = {}          # group -> tokens accumulated
        self.shapes: dict[str, tuple[int, int]] = {}  # weight -> (rows, cols), numpy order
        self.skipped: dict[str, str] = {}         # weight -> why it has no statistics
        self._seen: dict[tuple, str] = {}
        self.seconds = 0.0                        # spent accumulating (the rest of the pass is llama.cpp)

    def new_batch(self) -> None:
        self._seen.clear()

    def _weight(self, n: Node) -> tuple[Node, str] | None:
        op = n.op
        if op == self.mul_mat_id:
            src0 = n.src(0)
            name = _weight_name(src0.name) if src0 is not None else "?"
            if self.want(name):
                self.skipped.setdefault(name, "MoE expert matmul (MUL_MAT_ID): not collected")
            return None
        if op != self.mul_mat:
            return None
        src0 = n.src(0)
        assert src0 is not None
        name = _weight_name(src0.name)
        if not name.startswith("blk.") or not name.endswith(".weight") or not self.want(name):
            return None
        return src0, name

    def ask(self, n: Node) -> bool:
        w = self._weight(n)
        if w is None:
            return False
        src0, name = w
        cols = src0.ne[0]
        if cols % BLOCK:
            self.skipped[name] = f"rows of {cols} values are not a multiple of {BLOCK}"
            return False
        src1 = n.src(1)
        if src1 is None or src1.type != 0:  # GGML_TYPE_F32
            self.skipped[name] = "its input is not F32 in the graph"
            return False
        return True

    def take(self, n: Node) -> bool:
        """Accumulate the input of matmul node n; False when n is not one of ours."""
        w = self._weight(n)
        if w is None:
            return False
        src0, name = w
        src1 = n.src(1)
        assert src1 is not None
        ne = src1.ne
        self.shapes[name] = (int(src0.ne[1]), int(ne[0]))
        key = (src1.addr, src1.name, ne)
        g = self._seen.get(key)
        if g is not None:                          # same input as an earlier weight of this graph
            self.group_of.setdefault(name, g)
            return True
        g = self.group_of.setdefault(name, name)
        self._seen[key] = g
        x = src1.f32()
        if x is None:
            self.skipped[name] = "its input is not F32 in the graph"
            return True
        self.add(g, x.reshape(-1, ne[0]))
        return True

    def add(self, group: str, x: np.ndarray) -> None:
        """x: (tokens, n) float32, n a multiple of 256."""
        t0 = time.perf_counter()
        nb = x.shape[1] // BLOCK
        acc = self.sums.get(group)
        if acc is None:
            acc = self.sums[group] = np.zeros((nb, BLOCK, BLOCK), np.float64)
        xt = np.ascontiguousarray(x.T)            # (n, tokens): each block's rows are contiguous
        for j in range(nb):
            a = xt[j * BLOCK:(j + 1) * BLOCK]
            acc[j] += a @ a.T                     # float32 SYRK per batch, float64 running sum
        self.tokens[group] = self.tokens.get(group, 0) + x.shape[0]
        self.seconds += time.perf_counter() - t0


# --- identity of the model the statistics belong to ------------------------------------------------

@dataclass(frozen=True)
class Identity:
    arch: str
    n_vocab: int
    vocab_sha256: str

    @staticmethod
    def of_tokens(arch: str, tokens: list[str] | list[bytes]) -> Identity:
        h = hashlib.sha256()
        for tok in tokens:
            b = tok.encode() if isinstance(tok, str) else bytes(tok)
            h.update(len(b).to_bytes(4, "little"))
            h.update(b)
        return Identity(arch, len(tokens), h.hexdigest())

    @staticmethod
    def of_gguf(path: Path, reader: Any = None) -> Identity:
        r = reader if reader is not None else open_gguf(path)
        f = r.fields.get("tokenizer.ggml.tokens")
        if f is None:
            raise ConvertError(f"{path.name} has no vocabulary (tokenizer.ggml.tokens)",
                               fix="calibration needs a model with its tokenizer")
        return Identity.of_tokens(architecture(r), list(f.contents()))


def gguf_shapes(path: Path, reader: Any = None) -> dict[str, tuple[int, ...]]:
    """Tensor name -> numpy shape, for every tensor of a GGUF."""
    r = reader if reader is not None else open_gguf(path)
    return {t.name: tuple(int(n) for n in reversed(t.shape)) for t in r.tensors}


# --- the statistics ----------------------------------------------------------------------------------

@dataclass
class Stats:
    """What one calibration pass measured: Gram blocks per input group and the K-centring statistics."""

    identity: Identity
    xtx: dict[str, np.ndarray]                  # group -> (n/256, 256, 256) float32
    group_of: dict[str, str]                    # weight -> group
    shapes: dict[str, tuple[int, int]]          # weight -> (rows, cols)
    tokens: dict[str, int]                      # group -> tokens
    kcal: kcenter.Calibration | None
    n_tokens: int
    text_name: str
    text_sha256: str
    skipped: dict[str, str] = field(default_factory=dict)
    model_tensors: dict[str, tuple[int, ...]] = field(default_factory=dict)  # layer tensors of the model measured
    notes: list[str] = field(default_factory=list)

    def for_tensor(self, name: str) -> np.ndarray | None:
        g = self.group_of.get(name)
        return None if g is None else self.xtx.get(g)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.xtx.values())

    def summary(self) -> str:
        parts = [f"{len(self.group_of)} weights ({len(self.xtx)} distinct inputs, {self.nbytes / 1e6:.0f} MB)"]
        if self.kcal is not None:
            parts.append(f"K centring for {len(self.kcal.layers)} layers")
        return f"calibration: {', '.join(parts)} from {self.n_tokens} tokens of {self.text_name}"

    # --- file
    def save(self, path: str | Path) -> Path:
        """Write an .npz atomically (float32 blocks, K arrays, identity and provenance as JSON)."""
        path = Path(path).expanduser()
        if path.suffix != ".npz":
            raise ConvertError(f"calibration file {path} must end in .npz", fix="e.g. --save-calibration stats.npz")
        if not path.parent.is_dir():
            raise ConvertError(f"folder {path.parent} does not exist", fix="create it first")
        meta = {"format": FORMAT, "version": FORMAT_VERSION, "arch": self.identity.arch,
                "n_vocab": self.identity.n_vocab, "vocab_sha256": self.identity.vocab_sha256,
                "group_of": self.group_of, "shapes": {k: list(v) for k, v in self.shapes.items()},
                "tokens": self.tokens, "n_tokens": self.n_tokens, "text_name": self.text_name,
                "text_sha256": self.text_sha256, "skipped": self.skipped,
                "groups": list(self.xtx), "model_tensors": {k: list(v) for k, v in self.model_tensors.items()}}
        arrays: dict[str, np.ndarray] = {f"xtx_{i}": a for i, a in enumerate(self.xtx.values())}
        if self.kcal is not None:
            meta["k_tokens"] = self.kcal.tokens
            arrays["k_layers"] = np.asarray(self.kcal.layers, np.int32)
            arrays["k_mean"] = np.stack(self.kcal.mu)
            arrays["k_scale"] = np.stack(self.kcal.lam)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
            publish(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return path

    @staticmethod
    def load(path: str | Path) -> Stats:
        path = Path(path).expanduser()
        if not path.is_file():
            raise ConvertError(f"calibration file {path} does not exist",
                               fix="write one with rq-convert --calibrate TEXT --save-calibration FILE.npz")
        try:
            z = np.load(path, allow_pickle=False)
            meta = json.loads(bytes(z["meta"]).decode())
            if meta.get("format") != FORMAT:
                raise ValueError("not a rotaryquant calibration file")
            if meta.get("version") != FORMAT_VERSION:
                raise ValueError(f"format version {meta.get('version')}, this tool reads {FORMAT_VERSION}")
            xtx = {g: np.asarray(z[f"xtx_{i}"], np.float32) for i, g in enumerate(meta["groups"])}
            kcal = None
            if "k_layers" in z.files:
                kcal = kcenter.Calibration([int(i) for i in z["k_layers"]], list(z["k_mean"]),
                                           list(z["k_scale"]), tokens=int(meta["k_tokens"]),
                                           text_name=meta["text_name"], text_sha256=meta["text_sha256"])
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
            raise ConvertError(f"{path} is not a readable calibration file ({e})",
                               fix="write it again with rq-convert --calibrate TEXT --save-calibration FILE.npz") \
                from None
        return Stats(Identity(meta["arch"], int(meta["n_vocab"]), meta["vocab_sha256"]), xtx, meta["group_of"],
                     {k: (int(v[0]), int(v[1])) for k, v in meta["shapes"].items()}, meta["tokens"], kcal,
                     int(meta["n_tokens"]), meta["text_name"], meta["text_sha256"], meta.get("skipped", {}),
                     {k: tuple(int(n) for n in v) for k, v in meta["model_tensors"].items()})

    def check(self, identity: Identity, shapes: dict[str, tuple[int, ...]], *, what: str) -> None:
        """Refuse statistics measured on another model (vocabulary, architecture or tensors differ)."""
        fix = "measure statistics for this model with --calibrate TEXT"
        mine = self.identity
        if mine.arch != identity.arch:
            raise ConvertError(f"calibration statistics are for a {mine.arch} model, {what} is {identity.arch}",
                               fix=fix)
        if (mine.n_vocab, mine.vocab_sha256) != (identity.n_vocab, identity.vocab_sha256):
            raise ConvertError(f"calibration statistics were measured with another vocabulary ({mine.n_vocab} "
                               f"tokens, sha256 {mine.vocab_sha256[:12]}) than {what}'s ({identity.n_vocab} "
                               f"tokens, sha256 {identity.vocab_sha256[:12]})", fix=fix)
        theirs = layer_tensors(shapes)
        for name in sorted(set(self.model_tensors) | set(theirs)):
            a, b = self.model_tensors.get(name), theirs.get(name)
            if a is None or b is None:
                raise ConvertError(f"calibration statistics were measured on a model {'without' if a is None else 'with'}"
                                   f" tensor {name}, which {what} {'has' if a is None else 'does not have'}", fix=fix)
            if tuple(a) != tuple(b):
                raise ConvertError(f"calibration statistics were measured on a model whose {name} is {tuple(a)}, "
                                   f"{what}'s is {tuple(b)}", fix=fix)


def layer_tensors(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The identity part of a model's tensors: every 2-D+ blk.* tensor and its shape."""
    return {k: tuple(v) for k, v in shapes.items() if k.startswith("blk.") and len(v) >= 2}


# --- the pass ------------------------------------------------------------------------------------------

def collect(model: Path, text: bytes, *, text_name: str, want: Callable[[str], bool], k_stats: bool,
            n_tokens: int = kcenter.DEFAULT_TOKENS, n_ctx: int = 2048, threads: int | None = None,
            progress: bool = True, verbose: bool = False, reader: Any = None) -> Stats:
    """One llama.cpp pass over ``text``: Gram blocks for the weights ``want`` accepts, and K centring
    when ``k_stats``."""
    grams = GramCollector(want)
    t0 = time.perf_counter()
    kcal, n = kcenter.run_pass(model, text, text_name=text_name, n_tokens=n_tokens, n_ctx=n_ctx, threads=threads,
                               progress=progress, verbose=verbose, hook=grams, k_stats=k_stats)
    t1 = time.perf_counter()
    xtx: dict[str, np.ndarray] = {}
    for g in list(grams.sums):
        xtx[g] = grams.sums.pop(g).astype(np.float32)
    group_of = {w: g for w, g in grams.group_of.items() if g in xtx}
    skipped = {w: why for w, why in grams.skipped.items() if w not in group_of}
    if reader is None:
        reader = open_gguf(model)
    st = Stats(Identity.of_gguf(model, reader), xtx, group_of, {w: grams.shapes[w] for w in group_of}, grams.tokens,
               kcal, n, text_name, hashlib.sha256(text).hexdigest(), skipped, layer_tensors(gguf_shapes(model, reader)))
    st.notes.append(f"calibration pass {t1 - t0:.0f} s, of which {grams.seconds:.0f} s "
                    "accumulating Gram matrices")
    return st
