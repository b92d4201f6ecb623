"""The ways to hold a model's weights: the file as it is, or each rq-convert recipe, with the types
rq-convert would give each tensor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rotaryquant.bindings import type_from_name, type_name
from rotaryquant.converter import roles as R
from rotaryquant.converter.errors import ConvertError
from rotaryquant.converter.recipes import Planner, get_recipe
from rotaryquant.errors import PlanError
from rotaryquant.plan.errors import mib
from rotaryquant.plan.facts import FLOAT_TYPES, INT_TYPES, Header, tensor_bytes
from rotaryquant.plan.models import KnownModel
from rotaryquant.plan.results import Measurement, Quality, elsewhere


@dataclass
class Weights:
    """One way to hold the weights: the file as it is ("keep") or an rq-convert recipe."""

    name: str
    types: dict[str, int]            # tensor -> ggml type
    bytes_by_role: dict[str, int]
    total: int                       # tensor data bytes
    bpw: float                       # over the 2-D+ layer weights
    quality: Quality
    skeleton: Path | None = None     # the GGUF llama.cpp accounts for (the file itself for keep)
    fallbacks: int = 0


def role_bytes(h: Header, types: dict[str, int]) -> tuple[dict[str, int], int, float]:
    out: dict[str, int] = {}
    wbits = wn = 0
    for t in h.tensors:
        role = R.classify(t.name, len(t.ne))
        nb = tensor_bytes(types.get(t.name, t.type), t.ne)
        out[role] = out.get(role, 0) + nb
        if role in (R.ATTENTION, R.FFN_DENSE, R.FFN_ROUTED, R.FFN_SHARED, R.OTHER):
            wbits += nb * 8
            wn += t.n
    return out, sum(out.values()), (wbits / wn if wn else 0.0)


def recipe_types(h: Header, recipe: str) -> tuple[dict[str, int], int]:
    """The type rq-convert gives each tensor of ``h`` under ``recipe`` (kurtosis promotions aside)."""
    try:
        names = [t.name for t in h.tensors]
        pl = Planner(get_recipe(recipe), promote=False, measure=False, tied="output.weight" not in names,
                     n_layers=R.n_layers(names))
    except ConvertError as e:
        raise PlanError(str(e)) from None
    zero = np.zeros(1, np.float32)
    types: dict[str, int] = {}
    fallbacks = 0
    for t in h.tensors:
        if t.type in INT_TYPES:
            continue
        role = R.classify(t.name, len(t.ne))
        if h.keep_float is not None:  # HF input: what rq-convert's sink is told by upstream
            keep = h.keep_float.get(t.name)
            if keep is None:
                continue
        else:                         # GGUF input: as rq-convert's GGUF path decides
            keep = role in R.KEPT_F32 or (t.type == 0 and role == R.OTHER)
        shape = tuple(reversed(t.ne))
        fake = np.lib.stride_tricks.as_strided(zero, shape=shape, strides=(0,) * len(shape))
        d = pl.decide(t.name, fake, keep_float=keep)
        types[t.name] = int(d.qtype)
        fallbacks += d.fallback
    return types, fallbacks


def weights_options(h: Header, recipes: Sequence[str], *, source_kind: str, meas: list[Measurement],
                    model: KnownModel | None) -> tuple[list[Weights], list[str]]:
    """The file as it is (GGUF input) and each recipe; recipes that only grow a quantised file are dropped."""
    notes: list[str] = []
    out: list[Weights] = []
    src_float = all(t.type in FLOAT_TYPES or t.type in INT_TYPES for t in h.tensors)
    src_types = h.source_types if h.source_types is not None else \
        {t.type for t in h.tensors if t.type not in INT_TYPES and len(t.ne) >= 2}
    if source_kind == "gguf":
        roles, total, bpw = role_bytes(h, {})
        out.append(Weights("keep", {}, roles, total, bpw, Quality(0.0, True, "the file's own weights"),
                           skeleton=h.path))
    for r in recipes:
        types, fb = recipe_types(h, r)
        roles, total, bpw = role_bytes(h, types)
        if source_kind == "gguf" and not src_float and total >= out[0].total:
            notes.append(f"recipe {r}: {mib(total):.0f} MiB, not smaller than the file's "
                         f"{mib(out[0].total):.0f} MiB and its weights are already quantised: left out")
            continue
        q = Quality()
        lossless = r == "f32" or (src_float and r in ("bf16", "f16") and src_types <= {_type_id(r)})
        if lossless:
            q = Quality(0.0, True, f"{r} holds the source's {'/'.join(sorted(_tname(t) for t in src_types))} "
                                   "weights exactly")
        else:
            rows = [m for m in meas if m.what == "weights" and m.spec == r]
            mine = [m for m in rows if model is not None and m.model == model.id and src_float]
            if mine:
                m = mine[0]
                q.kld, q.where = m.kld, f"{m.label} ({m.source})"
            q.elsewhere = elsewhere([m for m in rows if m not in mine])
            if not src_float:
                q.where = "requantises already-quantised weights: not measured"
        same = next((o for o in out if o.name != "keep" and o.types == types), None)
        if same is not None:
            notes.append(f"recipe {r} gives this model the same types as {same.name}: shown once, as {same.name}")
            continue
        out.append(Weights(r, types, roles, total, bpw, q, fallbacks=fb))
    return out, notes


def _type_id(name: str) -> int:
    return type_from_name(name)


def _tname(t: int) -> str:
    return type_name(t)
