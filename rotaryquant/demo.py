"""`make demo`: the main job on the embedded default models, each result beside its baseline.

1. Weights: a Hugging Face folder rebuilt from the packaged SmolLM2-135M GGUF is converted with
   ``rq-convert`` to F16 (the baseline), ``--recipe rotaryquant`` and ``--recipe rotaryquant-itq3``
   (ITQ3_S where rows allow, calibrated by default, the paper's per-role types elsewhere), and that
   last plan once more with IQ3_S + imatrix on the same tensors instead of ITQ3_S, so a 3-bit row that
   drifts says whether 3 bits or the format is to blame; all generate greedily from the same prompt.
2. KV cache: Gemma3-270M (head size 256 = 2 x 128) with its K calibration (``rq-calibrate``, once)
   runs with an F16 cache and with the recommended compressed cache, ``-ctk isoquant3_0 -ctv isoquant3_0``
   with its defaults (K centring on, fused attention, the last 16 positions exact in F16), then the same
   without that window (``--kv-window 0``, 3.125 bits/value).

Each run prints its size (file or KV cache), decode speed and how many of its tokens match the
baseline's; the measured tables are in docs/results/REPORT.md. Generation runs in this process (the patched
llama.cpp through llama_cpp): the KV size is ``llama_rq_get_memory``'s, the speed ``llama_perf_context``'s.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rotaryquant import assets, bindings, paths
from rotaryquant.bindings import tools
from rotaryquant.bindings.accounting import captured_log, errors, memory
from rotaryquant.converter import kcenter
from rotaryquant.converter.convert import Options, convert
from rotaryquant.converter.hf_folders import smollm2_hf_folder
from rotaryquant.converter.imatrix import subset_imatrix
from rotaryquant.converter.qtypes import QT
from rotaryquant.data import calibration_text
from rotaryquant.errors import RQError, run_cli
from rotaryquant.eval.weights import make_imatrix

PROMPT = "The three most important inventions of the nineteenth century were"
REPORT = "docs/results/REPORT.md"
WIDTH = 96
N_CTX = 1024


@dataclass(frozen=True)
class Run:
    label: str
    text: str        # the continuation, with its own leading space
    size: str        # what the run keeps in memory, e.g. "KV 1.8 MiB"
    decode_tps: float


@dataclass(frozen=True)
class Completion:
    text: str        # the continuation, with its own leading space
    kv_bytes: int    # the KV caches and their own buffers as llama.cpp allocated them (llama_rq_get_memory: kv_k + kv_v + kv_other)
    decode_tps: float  # decode tokens per second (llama_perf_context: t_eval_ms over n_eval)


def complete(model: Path, prompt: str, n_predict: int, threads: int, ctk: str = "f16", ctv: str = "f16",
             window: int | None = None) -> Completion:
    """One greedy completion in this process, through llama_cpp and the patched llama.cpp: a 1024-token context
    with flash attention, ``-ctk ctk -ctv ctv``, the default K centring (on for a calibrated model with a
    quantised K cache) and recent window (``window``: None for the default). The KV size counts the cache's own
    buffers too (K centring, the window's F16 rows). llama.cpp's log is kept off the terminal; its error lines say
    why when something fails."""
    import llama_cpp as L  # lazy: loads the patched libllama: needs the build

    with captured_log() as log:
        model_p = L.llama_model_load_from_file(str(model).encode(), L.llama_model_default_params())
        if not model_p:
            raise RQError(f"llama.cpp cannot load {model}: {errors(log) or 'no reason given'}")
        try:
            cp = L.llama_context_default_params()
            cp.n_ctx, cp.n_threads, cp.n_threads_batch = N_CTX, threads, threads
            cp.type_k, cp.type_v = bindings.type_from_name(ctk), bindings.type_from_name(ctv)
            cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
            cp.no_perf = False
            bindings.apply(cp, window=window)
            ctx = L.llama_init_from_model(model_p, cp)
            if not ctx:
                raise RQError(f"llama.cpp cannot make a {ctk}/{ctv} context for {model.name}: "
                              f"{errors(log) or 'no reason given'}")
            try:
                text = _greedy(L, ctx, L.llama_model_get_vocab(model_p), prompt, n_predict, log)
                mem = memory(ctx)
                perf = L.llama_perf_context(ctx)
            finally:
                L.llama_free(ctx)
        finally:
            L.llama_model_free(model_p)
    tps = 1e3 * perf.n_eval / perf.t_eval_ms if perf.n_eval and perf.t_eval_ms > 0 else float("nan")
    return Completion(text, mem["kv_k"] + mem["kv_v"] + mem["kv_other"], tps)


def _greedy(L: Any, ctx: Any, vocab: Any, prompt: str, n_predict: int, log: list[str]) -> str:
    """The prompt in one batch, then ``n_predict`` tokens one at a time, each the most likely (llama-completion
    --temp 0); stops early at an end-of-generation token. Returns the continuation's text."""
    data = prompt.encode()
    toks = (L.llama_token * (len(data) + 8))()
    n = L.llama_tokenize(vocab, data, len(data), toks, len(toks), True, True)
    if n <= 0:
        raise RQError(f"the prompt tokenises to nothing ({n})")
    smpl = L.llama_sampler_init_greedy()
    out = bytearray()
    buf = ctypes.create_string_buffer(256)
    try:
        batch = L.llama_batch_get_one(toks, n)
        for i in range(n_predict):
            if L.llama_decode(ctx, batch) != 0:
                raise RQError(f"llama_decode failed: {errors(log) or 'no reason given'}")
            tok = L.llama_sampler_sample(smpl, ctx, -1)
            if L.llama_vocab_is_eog(vocab, tok):
                break
            k = L.llama_token_to_piece(vocab, tok, buf, len(buf), 0, False)
            if k < 0:  # the piece needs -k bytes
                buf = ctypes.create_string_buffer(-k)
                k = L.llama_token_to_piece(vocab, tok, buf, len(buf), 0, False)
            out += buf.raw[:max(k, 0)]
            if i + 1 < n_predict:
                one = (L.llama_token * 1)(tok)
                batch = L.llama_batch_get_one(one, 1)
    finally:
        L.llama_sampler_free(smpl)
    return out.decode("utf-8", errors="replace").rstrip()


def same_words(a: str, b: str) -> tuple[int, int]:
    """(leading words of b equal to a's, words in b): how long a run follows its baseline."""
    wa, wb = a.split(), b.split()
    n = 0
    while n < min(len(wa), len(wb)) and wa[n] == wb[n]:
        n += 1
    return n, len(wb)


def show(prompt: str, runs: list[Run]) -> None:
    base = runs[0]
    for r in runs:
        if r is base:
            follows = "baseline"
        else:
            n, total = same_words(base.text, r.text)
            follows = "same text as the baseline" if n == total == len(base.text.split()) else \
                f"its first {n} of {total} words match the baseline"
        print(f"\n  {r.label}\n    {r.size}, decode {r.decode_tps:.1f} t/s, {follows}")
        for line in wrap(prompt + r.text):
            print(f"    | {line}")


def wrap(text: str) -> list[str]:
    out: list[str] = []
    for para in text.splitlines() or [""]:
        out.extend(textwrap.wrap(para, WIDTH - 6) or [""])
    while out and not out[-1]:
        out.pop()
    return out


def weights_demo(prompt: str, threads: int, n_predict: int) -> None:
    print("\n[1/2] Weights: SmolLM2-135M-Instruct, F16 vs rq-convert recipes vs IQ3_S + imatrix on the same tensors")
    work = paths.cache_dir() / "demo"
    hf = work / "SmolLM2-135M-Instruct-hf"
    work.mkdir(parents=True, exist_ok=True)
    if not (hf / "config.json").exists():
        print(f"  rebuilding a Hugging Face folder from the packaged GGUF -> {hf}")
        smollm2_hf_folder(assets.model_path("smollm2-135m"), hf)
    recipes = (("f16", "F16 weights (baseline)"),
               ("rotaryquant", "--recipe rotaryquant: the paper's per-role mix, 4-bit attention and FFN"),
               ("rotaryquant-itq3", "--recipe rotaryquant-itq3: ITQ3_S (3-bit) where rows allow, calibrated (the "
                                    "default)"))
    runs: list[Run] = []
    itq3: list[str] = []
    for recipe, label in recipes:
        out = work / f"SmolLM2-135M-{recipe}.gguf"
        t0 = time.time()
        res = convert(hf, out, Options(recipe=recipe, progress=False))
        print(f"  rq-convert {hf.name} {out.name} --recipe {recipe}: {time.time() - t0:.1f} s"
              + (" (including the calibration pass)" if res.calibration_default else ""))
        if recipe == "rotaryquant-itq3":
            itq3 = [d.name for d in res.planner.decisions if d.qtype == QT.ITQ3_S]
        runs.append(_weights_run(out, label, res.n_weights, prompt, n_predict, threads))
    if itq3:
        runs.append(_iq3s_run(hf, work, itq3, prompt, n_predict, threads))
    show(prompt, runs)
    if len(runs) == 4:
        print("\n  " + "\n  ".join(wrap(_verdict(runs, len(itq3)))))


def _weights_run(out: Path, label: str, n_weights: int, prompt: str, n_predict: int, threads: int) -> Run:
    c = complete(out, prompt, n_predict, threads)
    size = out.stat().st_size
    return Run(label, c.text, f"{size / 2**20:.1f} MiB file, {size * 8 / (n_weights or 1):.2f} bits/weight",
               c.decode_tps)


def _iq3s_run(hf: Path, work: Path, itq3: list[str], prompt: str, n_predict: int, threads: int) -> Run:
    """The ITQ3_S file's plan with its ITQ3_S tensors in IQ3_S, quantised with llama-imatrix's importance
    matrix (the same packaged text, 8 x 512 tokens) restricted to those tensors: only the type differs."""
    f16 = work / "SmolLM2-135M-f16.gguf"
    full = work / "SmolLM2-135M-f16.imatrix.gguf"
    if not full.exists():
        print(f"  llama-imatrix -m {f16.name} -f {calibration_text().name} --chunks 8 -c 512 (once)")
        tools.binary("llama-imatrix")   # a clear error when the build lacks it
        make_imatrix(f16, calibration_text(), full, chunks=8, ctx=512, threads=threads)
    sub = subset_imatrix(full, work / "SmolLM2-135M-itq3-tensors.imatrix.gguf", itq3)
    out = work / "SmolLM2-135M-iq3_s-imat.gguf"
    t0 = time.time()
    res = convert(hf, out, Options(recipe="rotaryquant-itq3", progress=False, imatrix=sub, auto_calibrate=False,
                                   tensor_types=[f"^{_literal(n)}$=iq3_s" for n in itq3]))
    print(f"  rq-convert ... --recipe rotaryquant-itq3 --tensor-type <its {len(itq3)} ITQ3_S tensors>=iq3_s "
          f"--imatrix <those tensors' entries>: {time.time() - t0:.1f} s")
    return _weights_run(out, f"the same file with IQ3_S + imatrix instead of ITQ3_S ({len(itq3)} tensors: "
                        f"{_roles(itq3)})", res.n_weights, prompt, n_predict, threads)


def _literal(name: str) -> str:
    """A tensor name as a --tensor-type regex matching only itself (names are [a-z0-9_.])."""
    return name.replace(".", "\\.")


def _roles(names: list[str]) -> str:
    return ", ".join(sorted({n.split(".")[-2] for n in names}))


def _verdict(runs: list[Run], n_tensors: int) -> str:
    """What the IQ3_S row says about the ITQ3_S row, from the words each keeps of the baseline's greedy text."""
    base, rq, itq, iq3 = runs
    n_rq, _ = same_words(base.text, rq.text)
    n_itq, tot = same_words(base.text, itq.text)
    n_iq3, _ = same_words(base.text, iq3.text)
    behind = "behind" if n_itq < n_iq3 else "not behind"
    if n_iq3 * 4 <= tot:
        return (f"IQ3_S + imatrix on the same {n_tensors} tensors leaves the baseline's greedy text early too "
                f"(after {n_iq3} word{'' if n_iq3 == 1 else 's'}; ITQ3_S {n_itq}, the 4-bit recipe {n_rq}): at 135M parameters greedy text "
                f"is fragile under any low-bit weights, so these rows show that ITQ3_S is {behind} IQ3_S + imatrix "
                f"on the same tensors, not how good either is. Whole-model numbers (Qwen2.5-Coder-1.5B): the README "
                f"table and {REPORT}.")
    return (f"On the same {n_tensors} tensors ITQ3_S keeps {n_itq} word{'' if n_itq == 1 else 's'} of the baseline, IQ3_S + imatrix {n_iq3}: "
            f"ITQ3_S is {behind} it here. Whole-model numbers (Qwen2.5-Coder-1.5B): {REPORT}.")


def kv_demo(model: Path | None, prompt: str, threads: int, n_predict: int) -> None:
    name = model.name if model else "Gemma3-270M"
    print(f"\n[2/2] KV cache: {name}, F16 vs compressed (1024-token context)")
    if model is None:
        src = assets.model_path(assets.ISO_MODEL)
        model = paths.cache_dir() / "demo" / (src.stem + ".kc.gguf")
        if not model.exists():
            print(f"  rq-calibrate {src.name} -o {model.name}  (K centring statistics, once; about a minute)")
            model.parent.mkdir(parents=True, exist_ok=True)

            with captured_log() as log:   # llama.cpp's load chatter off the terminal; its errors said if it fails
                try:
                    kcenter.calibrate(src, model, progress=True)
                except RQError as e:
                    raise RQError(f"{e.message} (llama.cpp: {errors(log) or 'no reason given'})", e.fix) from None
    configs = (("f16", None, "F16 KV (baseline)"),
               ("isoquant3_0", None, "isoquant3_0 K and V, K calibrated, last 16 positions exact (the defaults; recommended)"),
               ("isoquant3_0", 0, "isoquant3_0 K and V, K calibrated, --kv-window 0 (3.125 bits/value)"))
    runs = []
    for ct, window, label in configs:
        c = complete(model, prompt, n_predict, threads, ct, ct, window)
        runs.append(Run(label, c.text, f"KV {c.kv_bytes / 2**20:.2f} MiB", c.decode_tps))
    show(prompt, runs)


def _main(argv: list[str] | None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rotaryquant.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None,
                    help="GGUF for the KV-cache part, calibrated with rq-calibrate (default: the embedded "
                         "Gemma3-270M, calibrated on first use)")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("-n", "--n-predict", type=int, default=48)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--skip-convert", action="store_true", help="only the KV-cache part")
    ns = ap.parse_args(argv)
    print(f"RotaryQuant demo: greedy, {ns.n_predict} tokens, {ns.threads} threads; each result beside its baseline")
    if not ns.skip_convert:
        weights_demo(ns.prompt, ns.threads, ns.n_predict)
    kv_demo(ns.model, ns.prompt, ns.threads, ns.n_predict)
    print(f"\nMeasured quality and speed per type (perplexity, KLD, needle-in-a-haystack, decode t/s by depth): "
          f"{REPORT}\nPick types for your model and memory: .venv/bin/rq-plan MODEL --budget 8G --ctx 32768")


def main(argv: list[str] | None = None) -> int:
    return run_cli("rq-demo", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
