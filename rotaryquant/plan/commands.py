"""The winner's command lines (rq-convert / rq-calibrate, llama-server) and the advice that goes with them."""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from pathlib import Path

from rotaryquant import kvtypes
from rotaryquant.bindings import tools
from rotaryquant.plan.costing import EXPERTS, Plan
from rotaryquant.plan.errors import mib
from rotaryquant.plan.facts import Header


def _bin(name: str) -> str:
    p = tools.bin_dir() / name
    try:
        return os.path.relpath(p) if len(os.path.relpath(p)) < len(str(p)) else str(p)
    except ValueError:
        return str(p)


def _q(p: str | Path) -> str:
    return shlex.quote(str(p))


def expert_rule(layers: Sequence[int]) -> str:
    """The -ot rule that keeps the routed experts of ``layers`` in host memory (as --n-cpu-moe does)."""
    ids = "|".join(str(i) for i in layers)
    return f"blk\\.({ids})\\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU"


def commands(plan: Plan, h: Header) -> None:
    """Fill ``plan.commands`` and ``plan.advice`` for its winner."""
    c = plan.winner
    assert c is not None
    src = Path(plan.model)
    stem = src.name[:-5] if src.name.endswith(".gguf") else src.name
    calib = kvtypes.suffix(c.kv) == kvtypes.CALIB  # "+self": the runtime measures its own, nothing to run first
    cmds: list[str] = []
    out = src
    if c.weights == "keep":
        if calib and not h.calibrated:
            out = src.with_name(f"{stem}.kc.gguf")
            cmds.append(f"rq-calibrate {_q(src)} -o {_q(out)}")
    else:
        out = src.parent / f"{stem}.{c.weights}.gguf"
        cmds.append(f"rq-convert {_q(src)} {_q(out)} --recipe {c.weights}" + (" --calibrate" if calib else ""))
    has_calib = calib or (h.calibrated and c.weights == "keep")
    k, v = kvtypes.split(c.kv)
    head = max(0, int(mib(plan.budget - c.peak)) - 1) if plan.device == "cpu" else 0
    srv = [_bin("llama-server"), "-m", _q(out), "-c", str(c.n_ctx), "--parallel", str(plan.parallel), "-fa", "on",
           "-ctk", k, "-ctv", v]
    if has_calib and not calib:
        srv.append("--no-k-center")
    if kvtypes.window(c.kv) or any(t.startswith("isoquant") for t in (k, v)):
        srv += ["--kv-window", str(kvtypes.window(c.kv))]  # the planned one: llama.cpp's default is 16 for IsoQuant V
    if plan.device == "cpu":
        srv += ["--cache-ram", str(head)]
    if plan.deferred and any(t != "f16" for t in (k, v)):
        srv.append("--kv-deferred")
    if plan.device == "cuda":
        srv += ["-ngl", "99", "--fit", "off"]
        if c.experts_on_cpu:
            layers = sorted({int(m.group(1)) for t in h.tensors if (m := EXPERTS.match(t.name))})
            srv += ["-ot", f'"{expert_rule(layers[:c.experts_on_cpu])}"']
    cmds.append(" ".join(srv))
    plan.commands = cmds
    adv = plan.advice
    b = c.bytes
    if plan.device == "cpu":
        adv.append(f"--cache-ram {head}: llama-server keeps finished prompts' KV in RAM (default up to 8192 MiB); "
                   "the headroom left by the budget is what it may use (0 turns the cache off)")
        mapped = b.get("weights_mapped", 0)
        adv.append(f"the weights are memory-mapped ({mib(mapped):.0f} MiB): under memory pressure the kernel drops "
                   "their pages and reads them back from disk on use, a large slow-down; to pin them add "
                   "-lm mmap+mlock (needs ulimit -l unlimited or CAP_IPC_LOCK)")
        if b.get("weights_copied"):
            adv.append(f"{mib(b['weights_copied']):.0f} MiB of weights are repacked for the CPU matmuls, and their "
                       "mapped file pages stay resident as well (both are in the peak): -lm none reads the weights "
                       "into memory once instead (less resident memory, slower start); --no-repack keeps only the "
                       "mapped copy (slower prompt processing)")
    else:
        adv.append(f"host RAM for what stays on the CPU: {mib(c.host):.0f} MiB"
                   + (f" ({c.experts_on_cpu} layers of routed experts, {mib(b.get('experts_cpu', 0)):.0f} MiB, "
                      "same as --n-cpu-moe " + str(c.experts_on_cpu) + ")" if c.experts_on_cpu else ""))
        adv.append("CUDA placement and compute buffers are predicted from the CPU build's accounting; no GPU here "
                   "has run it (--fit off keeps llama-server from moving layers on its own); add --cache-ram N "
                   "(MiB of host RAM for finished prompts, default 8192) to bound the prompt cache")
    if plan.deferred:
        import llama_cpp  # lazy: loads the patched libllama: needs the build

        has = any(f[0] == "kv_deferred" for f in llama_cpp.llama_context_params._fields_)
        adv.append(f"deferred prefill: the F16 transient ({mib(b.get('transient', 0)):.0f} MiB, eq. 12 with "
                   "llama.cpp's cache sizes) is in the peak; llama.cpp does not reserve the prompt graphs' extra "
                   "working memory for it, so that is not (measured: +0 to +36 MiB on the small models here, "
                   "docs/results/plan-verify.md); "
                   + ("this build has --kv-deferred" if has else "this build does not have --kv-deferred yet"))
    if c.weights != "keep":
        adv.append("rq-convert may promote high-kurtosis tensors one type up (see rq-convert --dry-run); the "
                   "prediction is for the recipe's types without promotions")
