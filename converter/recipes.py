"""Recipes (role -> type), the kurtosis promotion rule, ``--tensor-type`` overrides and llama.cpp's
block-size fallback: everything that decides one tensor's type, with the reasons kept for the table.

Order of decisions for a tensor: recipe type for its role -> the recipe's first matching rule (a
mixture's per-tensor refinement, as llama-quantize's _M types spend bits) -> kurtosis promotion (one
step up the ladder) -> first matching ``--tensor-type`` override (wins over all) -> fallback when the
row length does not fit the type's block (llama.cpp's table). Norms, 1-D tensors and routers stay F32 (as
convert_hf_to_gguf and llama-quantize keep them).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES

from rotaryquant.converter import roles as R
from rotaryquant.converter.errors import ConvertError
from rotaryquant.converter.qtypes import NEEDS_IMATRIX, QT, fit_type, parse_type, type_name
from rotaryquant.converter.stats import activation_kurtosis, excess_kurtosis

# Default thresholds; how they were chosen (measured values) is in docs/converter.md.
KURTOSIS_THRESHOLD = 5.0
ACT_KURTOSIS_THRESHOLD = 1000.0

LLAMA_DEFAULT = "llama.cpp default"


@dataclass(frozen=True)
class Rule:
    """Within ``roles``, tensors whose name matches ``pattern`` (searched) take ``qtype``; with
    ``outer_layers``, only outside the middle quarter of the layers (those sit nearest the average
    input, as llama-quantize's use_more_bits spares the middle too)."""
    pattern: str
    roles: tuple[str, ...]
    qtype: QT
    outer_layers: bool = False

    def applies(self, name: str, role: str, n_layers: int | None) -> bool:
        if role not in self.roles or not re.search(self.pattern, name):
            return False
        if not self.outer_layers:
            return True
        i = R.layer(name)
        if i is None or not n_layers:
            return True
        lo = 3 * n_layers // 8
        return not lo <= i < lo + (n_layers + 3) // 4

    @property
    def text(self) -> str:
        return f"{self.pattern}={type_name(self.qtype)}" + (" (outer layers)" if self.outer_layers else "")


@dataclass(frozen=True)
class Recipe:
    name: str
    summary: str
    types: dict[str, QT]          # role -> type for the roles a recipe sets
    token_embd: QT                # untied token embeddings (llama.cpp: the file's base type)
    output: QT | None             # None: llama.cpp's rule (Q6_K; Q8_0 when rows do not fit 256)
    promote: bool = True          # whether the kurtosis rule applies
    rules: tuple[Rule, ...] = ()  # per-tensor refinements of the role types, first match wins

    def table(self) -> dict[str, str]:
        """role -> type text, for --help, docs and metadata."""
        out = {role: type_name(t) for role, t in self.types.items()}
        out[R.TOKEN_EMBD] = f"{type_name(self.token_embd)} (tied: as output)"
        out[R.OUTPUT] = type_name(self.output) if self.output is not None else "q6_K (q8_0 if rows % 256)"
        for role in R.KEPT_F32:
            out[role] = "f32"
        out.update(self.rule_table())
        return out

    def rule_table(self) -> dict[str, str]:
        """"roles: pattern" -> type text, one per rule, in order."""
        return {f"{'/'.join(r.roles)}: {r.pattern}": type_name(r.qtype) + (" in the outer layers" if r.outer_layers
                                                                          else "") for r in self.rules}


def _mixed(name: str, summary: str, attn: QT, dense: QT, routed: QT, shared: QT) -> Recipe:
    return Recipe(name, summary, {R.ATTENTION: attn, R.FFN_DENSE: dense, R.FFN_ROUTED: routed,
                                  R.FFN_SHARED: shared, R.OTHER: QT.Q8_0}, token_embd=QT.Q4_K, output=None)


def _flat(name: str, t: QT) -> Recipe:
    return Recipe(name, f"every 2-D weight {type_name(t)} (convert_hf_to_gguf --outtype {name})",
                  {role: t for role in (R.ATTENTION, R.FFN_DENSE, R.FFN_ROUTED, R.FFN_SHARED, R.OTHER)},
                  token_embd=t, output=t, promote=False)


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    _mixed("rotaryquant", "the paper's per-role mix: attention and dense FFN 4-bit, routed experts 2-bit, "
           "shared experts 8-bit", QT.Q4_K, QT.Q4_K, QT.Q2_K, QT.Q8_0),
    _mixed("itq3", "every linear weight ITQ3_S (3.125 bpw)", QT.ITQ3_S, QT.ITQ3_S, QT.ITQ3_S, QT.ITQ3_S),
    # IQ3_S's size, spent as llama-quantize's _M mixtures spend bits (docs/results/weights-ftype-qwen.md: the
    # whole-file KLD 0.71x IQ3_S + imatrix's on Qwen2.5-1.5B); no kurtosis promotion: the rules set the budget
    Recipe("itq3-m", "ITQ3_S mixture at IQ3_S's size: untied token embeddings ITQ3_S (a lookup), attn_k/attn_v "
           "Q6_K, dense ffn_down Q4_K outside the middle quarter of the layers, the rest ITQ3_S",
           {R.ATTENTION: QT.ITQ3_S, R.FFN_DENSE: QT.ITQ3_S, R.FFN_ROUTED: QT.ITQ3_S, R.FFN_SHARED: QT.ITQ3_S,
            R.OTHER: QT.Q8_0}, token_embd=QT.ITQ3_S, output=None, promote=False,
           rules=(Rule(r"attn_[kv]\.", (R.ATTENTION,), QT.Q6_K),
                  Rule(r"ffn_down\.", (R.FFN_DENSE,), QT.Q4_K, outer_layers=True))),
    # IQ3_KT's size (ik_llama.cpp's trellis type, 3.54 bpw on Qwen2.5-1.5B with its own Q5_K head): the lookup and
    # the head are where a 3-bit file's size goes, so the head takes Q5_K and the saving keeps attn_k/attn_v at Q6_K
    Recipe("itq3-s", "ITQ3_S mixture at IQ3_KT's size: untied token embeddings ITQ3_S (a lookup), output Q5_K, "
           "attn_k/attn_v Q6_K, the rest ITQ3_S",
           {R.ATTENTION: QT.ITQ3_S, R.FFN_DENSE: QT.ITQ3_S, R.FFN_ROUTED: QT.ITQ3_S, R.FFN_SHARED: QT.ITQ3_S,
            R.OTHER: QT.Q8_0}, token_embd=QT.ITQ3_S, output=QT.Q5_K, promote=False,
           rules=(Rule(r"attn_[kv]\.", (R.ATTENTION,), QT.Q6_K),)),
    _mixed("rotaryquant-itq3", "the paper's roles with ITQ3_S where 4-bit was; routed experts stay Q2_K, "
           "shared experts Q8_0", QT.ITQ3_S, QT.ITQ3_S, QT.Q2_K, QT.Q8_0),
    _flat("f16", QT.F16), _flat("bf16", QT.BF16), _flat("q8_0", QT.Q8_0), _flat("f32", QT.F32),
)}

# one step up for a tensor the kurtosis rule promotes
PROMOTE: dict[QT, QT] = {
    QT.Q2_K: QT.Q4_K, QT.Q3_K: QT.Q4_K, QT.ITQ3_S: QT.Q4_K, QT.IQ3_S: QT.Q4_K, QT.IQ3_XXS: QT.Q4_K,
    QT.IQ2_XXS: QT.Q4_K, QT.IQ2_XS: QT.Q4_K, QT.IQ2_S: QT.Q4_K, QT.IQ1_S: QT.Q4_K, QT.IQ1_M: QT.Q4_K,
    QT.TQ1_0: QT.Q4_K, QT.TQ2_0: QT.Q4_K,
    QT.Q4_0: QT.Q6_K, QT.Q4_1: QT.Q6_K, QT.Q4_K: QT.Q6_K, QT.IQ4_NL: QT.Q6_K, QT.IQ4_XS: QT.Q6_K,
    QT.Q5_0: QT.Q6_K, QT.Q5_1: QT.Q6_K, QT.Q5_K: QT.Q6_K,
    QT.Q6_K: QT.Q8_0,
}


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise ConvertError(f"unknown recipe {name!r}", fix=f"use one of: {', '.join(RECIPES)}") from None


@dataclass(frozen=True)
class Override:
    pattern: str
    regex: re.Pattern
    qtype: QT

    @property
    def text(self) -> str:
        return f"{self.pattern}={type_name(self.qtype)}"


def parse_override(spec: str) -> Override:
    """``REGEX=TYPE`` as llama-quantize takes it: regex lower-cased, searched in the tensor name."""
    if "=" not in spec:
        raise ConvertError(f"--tensor-type {spec!r} is not REGEX=TYPE", fix="e.g. --tensor-type attn_v=q8_0")
    pat, _, tname = spec.rpartition("=")
    if not pat:
        raise ConvertError(f"--tensor-type {spec!r} has an empty pattern", fix="e.g. --tensor-type attn_v=q8_0")
    pat = pat.lower()
    try:
        rx = re.compile(pat)
    except re.error as e:
        raise ConvertError(f"--tensor-type {spec!r}: bad regular expression ({e})") from None
    return Override(pat, rx, parse_type(tname, what=f"type in --tensor-type {spec!r}"))


@dataclass
class Decision:
    name: str
    role: str
    shape: tuple[int, ...]                 # numpy order (..., rows, cols)
    qtype: QT
    base: QT | None = None
    kurtosis: float | None = None          # of the weights
    act_kurtosis: float | None = None      # from the imatrix, when it has this tensor
    promoted: bool = False
    overridden: bool = False
    fallback: bool = False
    reasons: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    @property
    def why(self) -> str:
        return "; ".join(self.reasons)


def _fmt(k: float | None) -> str:
    return "-" if k is None or (isinstance(k, float) and math.isnan(k)) else f"{k:.2f}"


class Planner:
    """Decides the type of each tensor as it streams past (one call per tensor)."""

    def __init__(self, recipe: Recipe, *, overrides: list[Override] = (), threshold: float = KURTOSIS_THRESHOLD,
                 act_threshold: float = ACT_KURTOSIS_THRESHOLD, promote: bool = True, tied: bool = False,
                 imatrix: dict[str, np.ndarray] | None = None, measure: bool | None = None,
                 n_layers: int | None = None) -> None:
        self.recipe = recipe
        self.n_layers = n_layers   # for the recipe's layer rules; set by the converter once the model is known
        self.overrides = list(overrides)
        self.threshold = threshold
        self.act_threshold = act_threshold
        self.promote = promote and recipe.promote
        self.tied = tied
        self.imatrix = imatrix or {}
        # measure kurtosis whenever it can matter or the user asked for the table
        self.measure = self.promote if measure is None else measure
        self.decisions: list[Decision] = []

    def _role_type(self, role: str, cols: int) -> tuple[QT, str]:
        rc = self.recipe
        if role == R.OUTPUT or (role == R.TOKEN_EMBD and self.tied):
            what = "output" if role == R.OUTPUT else "token_embd (tied: used as output)"
            if rc.output is not None:
                return rc.output, f"{what} -> {type_name(rc.output)} ({rc.name})"
            t = QT.Q8_0 if cols % 256 else QT.Q6_K
            return t, f"{what} -> {type_name(t)} ({LLAMA_DEFAULT}{': rows % 256' if cols % 256 else ''})"
        if role == R.TOKEN_EMBD:
            src = f"{LLAMA_DEFAULT} for a {type_name(rc.token_embd)} file" if rc.output is None else rc.name
            return rc.token_embd, f"token_embd -> {type_name(rc.token_embd)} ({src})"
        t = rc.types[role]
        return t, f"{role} -> {type_name(t)} ({rc.name})"

    def decide(self, name: str, data: np.ndarray, *, keep_float: bool = False) -> Decision:
        shape = tuple(int(s) for s in data.shape)
        role = R.classify(name, len(shape))
        if keep_float or role in R.KEPT_F32:
            d = Decision(name, role, shape, QT.F32, reasons=["kept f32 (as llama.cpp keeps norms, 1-D and "
                                                             "router tensors)"])
            self.decisions.append(d)
            return d
        cols = shape[-1]
        t, why = self._role_type(role, cols)
        for rule in self.recipe.rules:
            if rule.applies(name, role, self.n_layers):
                t, why = rule.qtype, f"{why}; {self.recipe.name} rule {rule.text} -> {type_name(rule.qtype)}"
                break
        d = Decision(name, role, shape, t, base=t, reasons=[why])
        if self.measure and role in R.PROMOTABLE:
            d.kurtosis = excess_kurtosis(data)
            im = self.imatrix.get(name)
            if im is not None:
                d.act_kurtosis = activation_kurtosis(im)
            if self.promote:
                stat, thr, what = ((d.act_kurtosis, self.act_threshold, "activation kurtosis")
                                   if d.act_kurtosis is not None and not math.isnan(d.act_kurtosis)
                                   else (d.kurtosis, self.threshold, "kurtosis"))
                if stat is not None and stat > thr and t in PROMOTE:
                    d.qtype = PROMOTE[t]
                    d.promoted = True
                    d.reasons.append(f"{what} {stat:.2f} > {thr:g}: promoted {type_name(t)} -> "
                                     f"{type_name(d.qtype)}")
        for ov in self.overrides:
            if ov.regex.search(name):
                d.reasons.append(f"--tensor-type {ov.text}")
                d.qtype, d.overridden = ov.qtype, True
                break
        t2, fb = fit_type(d.qtype, cols)
        if fb:
            d.qtype, d.fallback = t2, True
            d.reasons.append(fb)
        if d.qtype in NEEDS_IMATRIX and name not in self.imatrix:
            raise ConvertError(f"{name}: {type_name(d.qtype)} needs an importance matrix",
                               fix="pass --imatrix FILE (from llama-imatrix) or choose another type")
        self.decisions.append(d)
        return d

    # --- reporting
    def weights_per_type(self) -> dict[QT, int]:
        """Weights per type over the layers' matrices (what llama.cpp's file type names: a Q4_K_M or
        ITQ3_S file has q4_K/q6_K embeddings); all 2-D+ tensors when there are no layer matrices."""
        out: dict[QT, int] = {}
        layer_roles = (R.ATTENTION, R.FFN_DENSE, R.FFN_ROUTED, R.FFN_SHARED, R.OTHER)
        pool = [d for d in self.decisions if d.role in layer_roles] or \
            [d for d in self.decisions if len(d.shape) >= 2]
        for d in pool:
            out[d.qtype] = out.get(d.qtype, 0) + d.n
        return out

    def role_types(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for d in self.decisions:
            names = out.setdefault(d.role, [])
            if type_name(d.qtype) not in names:
                names.append(type_name(d.qtype))
        return out

    def table(self, *, full: bool = True) -> str:
        rows = [d for d in self.decisions if full or d.promoted or d.overridden or d.fallback]
        w = max([len(d.name) for d in rows] + [6])
        lines = [f"{'tensor':<{w}}  {'role':<10}  {'shape':<18}  {'kurt':>7}  {'act.k':>7}  {'type':<7}  why"]
        for d in rows:
            shp = "x".join(str(s) for s in reversed(d.shape))
            lines.append(f"{d.name:<{w}}  {d.role:<10}  {shp:<18}  {_fmt(d.kurtosis):>7}  {_fmt(d.act_kurtosis):>7}"
                         f"  {type_name(d.qtype):<7}  {d.why}")
        return "\n".join(lines)

    def summary(self) -> str:
        by_role: dict[str, dict[str, int]] = {}
        for d in self.decisions:
            by_role.setdefault(d.role, {})
            by_role[d.role][type_name(d.qtype)] = by_role[d.role].get(type_name(d.qtype), 0) + 1
        total = sum(d.n for d in self.decisions)
        bits = 0.0
        for d in self.decisions:
            blk, size = GGML_QUANT_SIZES[d.qtype]
            bits += d.n * size * 8 / blk
        promoted = [d for d in self.decisions if d.promoted]
        fb = [d for d in self.decisions if d.fallback]
        ov = [d for d in self.decisions if d.overridden]
        parts = [f"recipe {self.recipe.name}: {len(self.decisions)} tensors, {total / 1e6:.1f}M weights, "
                 f"{bits / max(total, 1):.3f} bits/weight"]
        for role in R.ROLES:
            if role in by_role:
                parts.append(f"  {role:<10} " + ", ".join(f"{k} x{v}" for k, v in by_role[role].items()))
        parts.append(f"  promoted by kurtosis: {len(promoted)}, overridden: {len(ov)}, block-size fallbacks: {len(fb)}")
        return "\n".join(parts)

