"""rq-eval versus and versus-weights: other llama.cpp builds (stock, forks) beside ours, each through its own
binaries (rotaryquant.eval.versus, rotaryquant.eval.versus_weights)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from rotaryquant import assets, data, paths
from rotaryquant.errors import RQError
from rotaryquant.eval import builds as builds_mod  # "builds" is the common word for the dicts here
from rotaryquant.eval import niah, versus, versus_md, weights
from rotaryquant.eval import versus_weights as vw
from rotaryquant.eval.cli_common import floats, ints, model_path, names, result_file, write


def _builds(ns: argparse.Namespace) -> dict[str, builds_mod.Build]:
    """--build NAME=BIN_DIR, ours (build/cpu/bin) first unless given."""
    blds = {b.name: b for b in (builds_mod.parse(x) for x in ns.build)}
    return blds if "ours" in blds else {"ours": builds_mod.ours(), **blds}


def cmd_versus(ns: argparse.Namespace) -> None:
    if ns.resume and not ns.merge:
        raise RQError("--resume continues the needles of the output file: it needs --merge", fix="add --merge")
    if "niah" in names(ns.measure) and not 1 <= ns.needles <= len(niah.KEYS):
        raise RQError(f"--needles {ns.needles}: a haystack holds 1 to {len(niah.KEYS)}",
                      fix="ask for more needles with more --depths (one haystack each)")
    model = model_path(ns, assets.ISO_MODEL).resolve()  # the programs run in a scratch folder
    blds = _builds(ns)
    configs = [versus.parse_config(c, list(blds)) for c in ns.config]
    if not configs:
        raise RQError("no --config given", fix="add e.g. --config ours:isoquant3_0 --config 'ik:q4_0 -khad -vhad'")
    measures = names(ns.measure)
    unknown = [m for m in measures if m not in versus.MEASURES]
    if unknown:
        raise RQError(f"--measure: unknown {', '.join(unknown)}; known: {', '.join(versus.MEASURES)}")
    used = {c.build for c in configs}
    versus.TIMEOUT = ns.timeout
    res: dict = {"model": model.name, "text": data.evaluation_text().name, "threads": ns.threads,
                 "runs": [["rq-eval", *ns.argv]], "builds": {n: b.describe() for n, b in blds.items() if n in used},
                 "cpu": builds_mod.cpu()}
    text = data.evaluation_text()

    prev = result_file(ns.out, ".json")
    old = json.loads(prev.read_text()) if ns.merge and prev.exists() else {}
    if old and old.get("model") != model.name:
        raise RQError(f"--merge: {ns.out}.json is for {old.get('model')}, not {model.name}")

    def save() -> None:  # after every measurement: a long unattended run keeps what it finished
        merged = versus.merge(old, res)
        write(ns.out, merged, versus_md.to_markdown(merged), echo=False)

    for m in measures:
        if m == "kld":
            res["kld"] = versus.kld(blds, configs, model, text, ctx=ns.ctx, chunks=ns.chunks, threads=ns.threads)
        elif m == "decode":
            res["decode"] = versus.decode(blds, configs, model, text, prefill=ns.prefill, steps=ns.tokens,
                                          rounds=ns.rounds, repeats=ns.repeat, threads=ns.threads,
                                          fills=names(ns.fill))
        elif m == "ttft":
            res["ttft"] = versus.ttft(blds, configs, model, text, rounds=max(ns.rounds, 3), threads=ns.threads)
        else:
            held = {(r["config"], r["ctx"], r.get("seed"), r.get("depth")) for r in old.get("niah") or []
                    if "error" not in r} if ns.resume else set()
            res["niah"] = []  # filled haystack by haystack, each saved as it finishes
            versus.niah(blds, configs, model, text, ctxs=ints(ns.niah_ctx, "--niah-ctx"),
                        depths=floats(ns.depths, "--depths"), seeds=ints(ns.seeds, "--seeds"), n_needles=ns.needles,
                        threads=ns.threads, rows=res["niah"], saved=save, skip=held)
        save()
    print(versus_md.to_markdown(versus.merge(old, res)))


def cmd_versus_weights(ns: argparse.Namespace) -> None:
    model = model_path(ns, assets.CHAT_ISO_MODEL).resolve()
    blds = _builds(ns)
    variants = [vw.parse_variant(v, list(blds)) for v in ns.variant]
    if not variants:
        raise RQError("no --variant given", fix="add e.g. --variant 'ik:IQ3_KT+imat'")
    out = result_file(ns.out, ".json")
    res = json.loads(out.read_text()) if ns.merge and out.exists() else {}
    if res and res.get("model") != model.name:
        raise RQError(f"--merge: {out} is for {res.get('model')}, not {model.name}")
    used = {v.build for v in variants}
    res.update({"model": model.name, "ctx": ns.ctx, "chunks": ns.chunks, "calib_tokens": ns.imatrix_chunks * ns.ctx,
                "builds": {**res.get("builds", {}), **{n: b.describe() for n, b in blds.items() if n in used}},
                "runs": [*res.get("runs", []), ["rq-eval", *ns.argv]]})
    work = ns.workdir or paths.build_dir() / "versus-weights" / model.stem
    labels = {v.label for v in variants}
    measures = names(ns.measure)
    if "quality" in measures:
        rows = vw.quality(blds, variants, model, work, data.evaluation_text(), data.calibration_text(), ctx=ns.ctx,
                          chunks=ns.chunks, imatrix_chunks=ns.imatrix_chunks, threads=ns.threads,
                          reuse=ns.reuse_quantized)
        res["quality"] = [r for r in res.get("quality", []) if r["label"] not in labels] + rows
        write(ns.out, res, vw.to_markdown(res), echo=False)
    if "speed" in measures:
        rows = vw.speed(blds, variants, model, work, threads=ints(ns.speed_threads, "--speed-threads"),
                        rounds=ns.rounds)
        res["speed"] = vw.merge_speed(res.get("speed", []), rows, len(res["runs"]) - 1, res["runs"])
    write(ns.out, res, vw.to_markdown(res))


def add_parsers(add: Callable[..., argparse.ArgumentParser]) -> None:
    """The two subcommands, through rq-eval's ``add`` (its shared --model, -t, -o)."""
    vs = add("versus", "other llama.cpp builds (stock, forks) beside ours: KLD, decode KLD and speed, start-up, "
             "needles, each build through its own binaries against its own F16", cmd_versus, out="versus")
    vs.add_argument("--build", action="append", default=[], metavar="NAME=BIN_DIR",
                    help="a build's bin folder (CMake, shared libraries), repeatable; 'ours' is build/cpu/bin "
                         "unless given")
    vs.add_argument("--config", action="append", default=[], metavar="'BUILD:K[/V] [FLAGS]'",
                    help="a cache configuration as that build's tools take it, repeatable, e.g. "
                         "'ours:isoquant3_0', 'turbo:q8_0/turbo3', 'ik:q4_0 -khad -vhad'; each build's f16 is added "
                         "as its baseline (not for niah)")
    vs.add_argument("--measure", default="kld,decode,ttft",
                    help=f"comma-separated, of {', '.join(versus.MEASURES)}")
    vs.add_argument("--ctx", type=int, default=2048, help="kld: llama-perplexity's context")
    vs.add_argument("--chunks", type=int, default=2, help="kld: chunks")
    vs.add_argument("--prefill", type=int, default=8192, help="decode: prompt tokens before the decode steps")
    vs.add_argument("--tokens", type=int, default=64, help="decode: teacher-forced steps after the prompt")
    vs.add_argument("-r", "--rounds", type=int, default=1,
                    help="decode and ttft (at least 3): interleaved rounds, every other one reversed; medians")
    vs.add_argument("--repeat", type=int, default=1,
                    help="decode: time the steps this many times after each prefill, from a saved copy of the state "
                         "(median): more samples at a depth whose prefill takes minutes")
    vs.add_argument("--fill", default="prompt",
                    help="decode: how the cache is filled before the steps, comma-separated, each configuration once "
                         "per fill: prompt (evaluate it); independent (each 512-token call attends only to itself: "
                         "the same cells and positions in minutes where a CPU path takes hours over a 32K prompt; "
                         "speeds only, no KLD)")
    vs.add_argument("--niah-ctx", default="8192,16384", help="niah: contexts")
    vs.add_argument("--depths", default="0.1,0.5,0.9", help="niah: needle depths")
    vs.add_argument("--seeds", default="42", help="niah: seeds")
    vs.add_argument("--needles", type=int, default=niah.N_NEEDLES,
                    help=f"niah: needles per haystack (1-{len(niah.KEYS)}), all at the haystack's depth")
    vs.add_argument("--merge", action="store_true",
                    help="keep the existing output's rows of the configurations this run does not measure (same model)")
    vs.add_argument("--resume", action="store_true",
                    help="niah, with --merge: skip the haystacks the output file already holds for a configuration "
                         "(every finished haystack is saved at once: a run of hours can be continued later)")
    vs.add_argument("--timeout", type=float, default=versus.TIMEOUT,
                    help="seconds one program may run; past it the row records the timeout and the run goes on")

    vw = add("versus-weights", "weight types of other llama.cpp builds beside ours: each build quantises the same F16 "
             "with its own tools and importance matrix; KLD vs its own F16, t/s vs its own Q4_K_M", cmd_versus_weights,
             out="versus-weights-qwen", model="GGUF to requantise (default: Qwen2.5-Coder-1.5B, the optional asset)")
    vw.add_argument("--build", action="append", default=[], metavar="NAME=BIN_DIR", help="a build's bin folder")
    vw.add_argument("--variant", action="append", default=[], metavar="'BUILD:FTYPE[+imat] [ARGS]'",
                    help="llama-quantize type of that build, +imat: with its importance matrix; ARGS go to its "
                         "llama-quantize (e.g. --custom-q for a mixture)")
    vw.add_argument("--measure", default="quality,speed", help="quality, speed or both")
    vw.add_argument("--ctx", type=int, default=512, help="perplexity and importance-matrix context")
    vw.add_argument("--chunks", type=int, default=10, help="perplexity chunks")
    vw.add_argument("--imatrix-chunks", type=int, default=weights.CALIB_TOKENS // 512, help="importance-matrix chunks")
    vw.add_argument("--speed-threads", default="1,2", help="llama-bench thread counts")
    vw.add_argument("-r", "--rounds", type=int, default=3, help="llama-bench interleaved rounds")
    vw.add_argument("--workdir", type=Path, help="F16 file, logits, importance matrices and quantised files "
                                                 "(default: build/versus-weights/MODEL)")
    vw.add_argument("--merge", action="store_true", help="keep the existing output's other rows")
    vw.add_argument("--reuse-quantized", action="store_true",
                    help="score a variant's quantised file already in the workdir instead of quantising it again "
                         "(the row then has no quantize time); for types that take an hour to quantise")
