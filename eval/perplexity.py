"""Perplexity and KL divergence through the patched llama-perplexity.

The KL divergence compares a run against a baseline's saved logits (``--kl-divergence-base``): the
baseline is the F16-weights / F16-KV run of the same model on the same text, so every number is a
loss relative to what the model itself does, not to published figures.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rotaryquant import kvtypes
from rotaryquant.bindings import tools
from rotaryquant.errors import RQError


class PerplexityError(RQError):
    """llama-perplexity failed or printed nothing we could read; the message has its last lines."""


@dataclass
class PplResult:
    label: str
    ppl: float
    ppl_err: float
    kld_mean: float | None = None
    kld_err: float | None = None
    kld_p99: float | None = None
    kld_max: float | None = None
    same_top_p: float | None = None  # percent
    ppl_ratio: float | None = None
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


_NUM = r"([-+0-9.eE]+|nan|inf)"


def _grab(pattern: str, text: str) -> float | None:
    m = re.search(pattern, text)
    return float(m.group(1)) if m else None


def parse_output(label: str, text: str) -> PplResult:
    """Read llama-perplexity's summary (plain run, or --kl-divergence run)."""
    final = r"Final estimate: PPL(?: over \d+ chunks for n_ctx=\d+)? = "  # the second form: ik_llama.cpp's
    ppl = _grab(final + _NUM, text)
    err = _grab(final + r"[-+0-9.eE]+ \+/- " + _NUM, text)
    if ppl is None:  # the KLD run prints the quantised PPL in its own summary
        ppl = _grab(r"Mean PPL\(Q\)\s*:\s*" + _NUM, text)
        err = _grab(r"Mean PPL\(Q\)\s*:\s*[-+0-9.eE]+ ± " + _NUM, text)
    if ppl is None:
        tail = "\n".join(text.strip().splitlines()[-8:])
        raise PerplexityError(f"no perplexity in llama-perplexity's output for {label}:\n{tail}")
    return PplResult(
        label=label, ppl=ppl, ppl_err=err or 0.0,
        kld_mean=_grab(r"Mean\s+KLD:\s*" + _NUM, text),
        kld_err=_grab(r"Mean\s+KLD:\s*[-+0-9.eE]+ ± " + _NUM, text),
        kld_p99=_grab(r"99\.0%\s+KLD:\s*" + _NUM, text),
        kld_max=_grab(r"Maximum KLD:\s*" + _NUM, text),
        same_top_p=_grab(r"Same top p:\s*" + _NUM, text),
        ppl_ratio=_grab(r"Mean PPL\(Q\)/PPL\(base\)\s*:\s*" + _NUM, text),
    )


DEFERRED_ENV = "LLAMA_KV_DEFERRED"  # deferred prefill: 1 = the prompt attends an F16 copy of its own K/V
# settings the parent environment must not leak into a run: each run sets its own
_CLEARED_ENV = ("LLAMA_ISOQUANT_", "GGML_ISOQUANT_", "LLAMA_K_CENTER", "LLAMA_KV_LAYER_TYPES", DEFERRED_ENV)


def command(model: Path, text_file: Path, *, ctx: int = 512, chunks: int = 20, cache_type: str = "f16",
            unfused: bool = False, deferred: bool = False, kld_base: Path | None = None, save_base: bool = False,
            threads: int = 2, batch: int | None = None, extra: list[str] | None = None,
            env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The llama-perplexity command line and its environment (see run)."""
    cmd = [str(tools.binary("llama-perplexity")), "-m", str(model), "-f", str(text_file), "-c", str(ctx),
           "--chunks", str(chunks), "-t", str(threads), "-fa", "on", "-ctk", kvtypes.split(cache_type)[0],
           "-ctv", kvtypes.split(cache_type)[1]]
    if not kvtypes.k_center(cache_type):
        cmd += ["--no-k-center"]
    if kvtypes.layer_types(cache_type):
        cmd += ["--kv-layer-types", kvtypes.layer_types(cache_type)]
    cmd += ["--kv-window", str(kvtypes.window(cache_type))]  # the spec's, 0 included: not the runtime's default
    if batch:
        cmd += ["-b", str(batch)]
    if kld_base is not None:
        cmd += ["--kl-divergence-base", str(kld_base)]
        if not save_base:
            cmd += ["--kl-divergence"]
    cmd += extra or []
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(_CLEARED_ENV)}
    if unfused:
        run_env["LLAMA_ISOQUANT_UNFUSED"] = "1"
    if deferred:
        run_env[DEFERRED_ENV] = "1"
    run_env.update(env or {})
    return cmd, run_env


def run(model: Path, text_file: Path, *, label: str, ctx: int = 512, chunks: int = 20, cache_type: str = "f16",
        unfused: bool = False, deferred: bool = False, kld_base: Path | None = None, save_base: bool = False,
        threads: int = 2, batch: int | None = None, extra: list[str] | None = None,
        env: dict[str, str] | None = None, timeout: float = 7200) -> PplResult:
    """One llama-perplexity run. save_base writes the logits to kld_base; otherwise a given kld_base
    makes this a --kl-divergence run against it. deferred: deferred prefill (LLAMA_KV_DEFERRED=1)."""
    cmd, run_env = command(model, text_file, ctx=ctx, chunks=chunks, cache_type=cache_type, unfused=unfused,
                           deferred=deferred, kld_base=kld_base, save_base=save_base, threads=threads, batch=batch,
                           extra=extra, env=env)
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=run_env, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        tail = "\n".join(out.strip().splitlines()[-8:])
        raise PerplexityError(f"llama-perplexity failed for {label} (exit {proc.returncode}):\n{tail}")
    res = parse_output(label, out)
    res.seconds = round(time.time() - t0, 1)
    return res
