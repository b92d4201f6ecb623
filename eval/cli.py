"""rq-eval: every measurement of the project, one subcommand each (rq-bench is `rq-eval bench`).

Each writes its results to docs/results/STEM.json and .md (-o STEM to change) and prints the markdown;
`rq-eval report` collects them into docs/results/REPORT.md. KV-cache and weight types are measured
against the model's own F16.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path

from rotaryquant import assets, bindings, data
from rotaryquant.errors import RQError, run_cli
from rotaryquant.eval import (ablation, cli_versus, convertspeed, decode, gate, isovariants, kvbench, kvmemory,
                              kvquality, niah, report, roofline, serve, servertests, weights, weightspeed)
from rotaryquant.eval.cli_common import RESULTS, floats, ints, model_path, names, result_file, write

KV_TYPES = "q8_0,q4_0,isoquant3_0,q8_0/isoquant3_0"
GEMMA = "GGUF (default: the embedded Gemma3-270M)"


def _types(spec: str) -> list[str]:
    """Comma-separated cache types; each is a type or K/V pair (q8_0/isoquant3_0)."""
    return [bindings.validate_kv_spec(t) for t in names(spec)]


def cmd_bench(ns: argparse.Namespace) -> None:
    configs = [kvbench.config(t) for t in names(ns.types)]
    depths = ints(ns.depths, "--depths")
    res = kvbench.bench(model_path(ns, assets.ISO_MODEL), configs=configs, depths=depths, n_prompt=ns.n_prompt,
                        n_gen=ns.n_gen, reps=ns.reps, threads=ns.threads)
    write(ns.out, res, kvbench.to_markdown(res))


def cmd_ppl(ns: argparse.Namespace) -> None:
    model = model_path(ns, assets.ISO_MODEL)
    res = kvquality.run(model, data.evaluation_text(), kv_types=_types(ns.kv), ctxs=ints(ns.ctx, "--ctx"),
                        chunks=ns.chunks, unfused=ns.unfused, deferred=ns.deferred, threads=ns.threads)
    write(ns.out, res, kvquality.to_markdown(res))


def cmd_decode(ns: argparse.Namespace) -> None:
    model = model_path(ns, assets.ISO_MODEL)
    text = ns.text or data.evaluation_text()
    if not Path(text).exists():
        raise RQError(f"text {text} does not exist")
    modes = {"off": False, "on": True}
    deferred = []
    for d in names(ns.deferred):
        if d not in modes:
            raise RQError(f"--deferred takes off, on or off,on; got {d!r}")
        deferred.append(modes[d])
    res = decode.run(model, Path(text), cache_types=_types(ns.kv), prefill=ints(ns.prefill, "--prefill"),
                     tokens=ns.tokens, deferred=list(dict.fromkeys(deferred)), threads=ns.threads,
                     roofline=ns.roofline, rounds=ns.rounds)
    if ns.note:
        res["note"] = ns.note
    write(ns.out, res, decode.to_markdown(res))


def cmd_memory(ns: argparse.Namespace) -> None:
    model = model_path(ns, assets.ISO_MODEL)
    prompts = ints(ns.prompt, "--prompt")
    if not prompts or min(prompts) < 2:
        raise RQError("--prompt takes prompt lengths of at least 2 tokens")
    res = kvmemory.run(model, caches=_types(ns.kv), prompts=prompts, threads=ns.threads)
    write(ns.out, res, kvmemory.to_markdown(res))


def cmd_weights(ns: argparse.Namespace) -> None:
    model = model_path(ns, assets.DEFAULT_MODEL)
    variants = weights.DEFAULT_VARIANTS if ns.mode == "ftype" else weights.tensor_variants(ns.tensor)
    if ns.only:
        known = {v.label: v for v in variants}
        unknown = [x for x in ns.only.split(",") if x not in known]
        if unknown:
            raise RQError(f"--only: unknown variant(s) {', '.join(unknown)}; known: {', '.join(known)}")
        variants = tuple(known[x] for x in ns.only.split(","))
    out = ns.out or RESULTS / f"weights-{ns.mode}"
    merge = None
    if ns.merge:
        prev = result_file(out, ".json")
        if not prev.is_file():
            raise RQError(f"--merge: {prev} does not exist (run without --merge first)")
        try:
            merge = json.loads(prev.read_text())
        except ValueError as e:
            raise RQError(f"--merge: {prev} is not a results file ({e})", "run without --merge") from None
    title = ("llama-quantize types" if ns.mode == "ftype"
             else f"one tensor role ({ns.tensor}) per type, Q8_0 elsewhere")

    def save(res: dict) -> None:  # after every row: an interrupted run keeps its rows (--merge continues it)
        write(out, res, weights.to_markdown(res, title), echo=False)

    with tempfile.TemporaryDirectory(prefix="rq-weights-") as tmp:
        res = weights.bench(model, Path(ns.workdir or tmp), data.evaluation_text(), data.calibration_text(),
                            variants=variants, chunks=ns.chunks, threads=ns.threads, reps=ns.reps, merge=merge,
                            on_row=save)
    write(out, res, weights.to_markdown(res, title))


def cmd_ablation(ns: argparse.Namespace) -> None:
    res = ablation.run(model_path(ns, assets.ISO_MODEL), data.evaluation_text(), ctx=ns.ctx, chunks=ns.chunks,
                       threads=ns.threads)
    write(ns.out, res, ablation.to_markdown(res))


def cmd_roofline(ns: argparse.Namespace) -> None:
    configs = [kvbench.config(t) for t in names(ns.types)]
    res = roofline.run(model_path(ns, assets.ISO_MODEL), configs=configs, depths=ints(ns.depths, "--depths"),
                       n_gen=ns.n_gen, reps=ns.reps, threads=ns.threads)
    write(ns.out, res, roofline.to_markdown(res))
    roofline.plot(res, result_file(ns.out, ".png"))


def cmd_niah(ns: argparse.Namespace) -> None:
    res = niah.run(model_path(ns, assets.ISO_MODEL), data.evaluation_text(), cache_types=_types(ns.kv),
                   ctxs=ints(ns.ctx, "--ctx"), depths=floats(ns.depths, "--depths"),
                   seeds=tuple(ints(ns.seeds, "--seeds")), n_needles=ns.needles, deferred=ns.deferred,
                   threads=ns.threads)
    write(ns.out, res, niah.to_markdown(res))


def cmd_gate(ns: argparse.Namespace) -> None:
    model = model_path(ns, assets.CHAT_ISO_MODEL)
    runs = [(t, False) for t in _types(ns.kv)]
    if ns.unfused:
        runs.append(("isoquant3_0", True))
    res = [gate.run(model, cache_type=t, unfused=u, max_tokens=ns.max_tokens, threads=ns.threads)
           for t, u in runs]
    write(ns.out, res, gate.to_markdown(res))


def cmd_serve(ns: argparse.Namespace) -> None:
    model = model_path(ns, assets.ISO_MODEL)
    modes = {"default": [False], "deterministic": [True], "both": [False, True]}[ns.mode]
    res = [serve.as_dict(serve.load_test(model, cache=c, clients=ns.clients, per_client=ns.requests,
                                         n_predict=ns.n_predict, threads=ns.threads,
                                         server_args=ns.server_arg, deterministic=d))
           for d in modes for c in _types(ns.kv)]
    write(ns.out, res, serve.to_markdown(res))


def cmd_soak(ns: argparse.Namespace) -> None:
    res = serve.soak(model_path(ns, assets.ISO_MODEL), cache=bindings.validate_kv_spec(ns.kv), minutes=ns.minutes,
                     clients=ns.clients, threads=ns.threads, mixed=ns.mixed, disconnect_every=ns.disconnect_every,
                     extra=ns.server_arg)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    result_file(ns.out, ".json").write_text(json.dumps(res, indent=1))
    result_file(ns.out, ".md").write_text(serve.soak_markdown(res))
    stalled = " (the server stalled)" if res["stalled"] else ""
    print(f"{res['requests']} requests, {res['dropped']} dropped by their clients, {res['malformed']} malformed"
          f"{stalled}, RSS growth {res['rss_growth_pct']}% (second half vs first half); afterwards "
          f"{res['after']['slots_processing']} slots processing, {res['after']['kv_deferred_bytes']:.0f} deferred bytes")
    if res["malformed"] or res["rss_growth_pct"] > 5 or any(res["after"].values()):
        raise RQError("soak failed: malformed responses, RSS growth above 5%, or a slot or deferred rows left behind")


def cmd_server_tests(ns: argparse.Namespace) -> None:
    if ns.render:
        res = json.loads(result_file(ns.out, ".json").read_text())
    else:
        res = servertests.run(names(ns.configs), select=names(ns.files), slow=ns.slow, threads=ns.threads,
                              nice=ns.nice, keyword=ns.keyword, jobs=ns.jobs)
        res["command"] = " ".join([ns.prog, *ns.argv])
    servertests.annotate(res)
    write(ns.out, res, servertests.to_markdown(res))


def cmd_convert_speed(ns: argparse.Namespace) -> None:
    plan = convertspeed.Plan(names(ns.models), names(ns.recipes), names(ns.inputs), ns.layers)
    if ns.tiny:
        plan = plan.tiny()
    meta = convertspeed.meta(" ".join([ns.prog, *ns.argv]))
    with tempfile.TemporaryDirectory(prefix="rq-convert-bench-", dir=ns.work_dir) as td:
        rows = convertspeed.run(plan, Path(td), nice=ns.nice)
    write(ns.out, convertspeed.as_dict(rows, meta), convertspeed.to_markdown(rows, meta))


def cmd_weight_speed(ns: argparse.Namespace) -> None:
    res = weightspeed.measure(ns.files, rounds=ns.rounds, n_prompt=ns.n_prompt, n_gen=ns.n_gen, threads=ns.threads)
    res["command"] = " ".join([ns.prog, *ns.argv])
    write(ns.out, res, weightspeed.to_markdown(res))


def cmd_isoquant_variants(ns: argparse.Namespace) -> None:
    if ns.vectors < isovariants.T:
        raise RQError(f"--vectors: at least {isovariants.T} vectors (one attention context), got {ns.vectors}")
    modes = isovariants.iq.NORM_MODES if ns.all_modes else isovariants.DEFAULT_MODES
    res = isovariants.run(modes=tuple(modes), n=ns.vectors)
    write(ns.out, res, isovariants.to_markdown(res))


def cmd_report(ns: argparse.Namespace) -> None:
    print(f"wrote {report.build(ns.results)}")


class _Help(argparse.RawDescriptionHelpFormatter):
    """At least 128 columns (one line per subcommand on most terminals), file names never split at a
    hyphen, and every option with a real default says it."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=26, width=max(128, shutil.get_terminal_size().columns - 2))

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text, default = action.help or "", action.default
        if "%(default)" in text or isinstance(default, Path) or any(default is x for x in (None, False)) \
                or default == [] or default == argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


def build_parser(prog: str = "rq-eval") -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The rq-eval parser and its subcommands' parsers by name."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=_Help)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    subs: dict[str, argparse.ArgumentParser] = {}

    def add(name: str, what: str, fn: Callable[[argparse.Namespace], None], *, out: str | None,
            model: str | None = GEMMA, threads: bool = True,
            where: str | None = None) -> argparse.ArgumentParser:
        """A subcommand with the shared options: --model, -t, -o STEM (default docs/results/OUT)."""
        where = where or f"docs/results/{out}.json, .md"
        p = sub.add_parser(name, help=f"{what} -> {where.replace('.json, .md', '.*')}",
                           description=f"{what}; writes {where}.", formatter_class=_Help)
        if model:
            p.add_argument("--model", type=Path, help=model)
        if threads:
            p.add_argument("-t", "--threads", type=int, default=2, help="threads")
        if out is not None:
            p.add_argument("-o", "--out", type=Path, default=RESULTS / out,
                           help=f"output stem: writes STEM.json and STEM.md (default: docs/results/{out})")
        p.set_defaults(fn=fn)
        subs[name] = p
        return p

    b = add("bench", "KV-cache speed: prompt/decode t/s, KV bytes/token per type and depth", cmd_bench,
            out="kv-bench", model="GGUF (default: the embedded Gemma3-270M, head size 256)")
    b.add_argument("--depths", default="0,2048,8192", help="prefilled KV depths, comma-separated")
    b.add_argument("--types", default=",".join(c[0] for c in kvbench.DEFAULT_CONFIGS),
                   help="configurations, each a cache spec (q8_0, q8_0/isoquant3_0, isoquant3_0+calib: "
                        "with the model's K calibration) with optional -unfused and -deferred (deferred "
                        "prefill) suffixes")
    b.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens timed")
    b.add_argument("-n", "--n-gen", type=int, default=32, help="generated tokens timed")
    b.add_argument("-r", "--reps", type=int, default=2, help="repetitions")

    p = add("ppl", "KV-cache quality: PPL and KLD vs F16 KV per type and context", cmd_ppl, out="kv-quality")
    p.add_argument("--kv", default=KV_TYPES,
                   help="cache types, each a type or a K/V pair; f16 is the baseline")
    p.add_argument("--ctx", default="512,2048", help="context sizes, comma-separated")
    p.add_argument("--chunks", type=int, default=8, help="chunks per context")
    p.add_argument("--unfused", action="store_true", help="also run isoquant3_0 unfused")
    p.add_argument("--deferred", action="store_true",
                   help="also run each non-f16 type with deferred prefill (LLAMA_KV_DEFERRED=1), labelled "
                        "'TYPE deferred': llama-perplexity is all prefill, so these rows show it no longer "
                        "reads the quantised cache (KLD ~0); decode-time quality: rq-eval decode")

    d = add("decode", "KV-cache quality while decoding: KLD per step vs F16 KV, deferred prefill off/on",
            cmd_decode, out="decode")
    d.add_argument("--kv", default=KV_TYPES,
                   help="cache types, each a type or a K/V pair, +calib to use the model's K calibration; "
                        "f16 is the baseline")
    d.add_argument("--prefill", default="512,2048,8192", help="prompt lengths N, comma-separated")
    d.add_argument("--tokens", type=int, default=64,
                   help="tokens M teacher-forced after the prompt, one llama_decode each")
    d.add_argument("--deferred", default="off,on", help="deferred prefill: off, on or off,on")
    d.add_argument("--text", type=Path, help="text file (default: the evaluation slice of the default text)")
    d.add_argument("-r", "--rounds", type=int, default=1,
                   help="interleaved rounds per prefill, every other one in reverse order (ABBA); speeds are "
                        "medians, each round's prefill ratio to f16 is kept")
    d.add_argument("--roofline", action="store_true",
                   help="also measure bandwidth and F32 rate (before and after) and give each row rq-eval "
                        "roofline's limit, f16's decode after a short prefill as the depth-0 step (a "
                        f"{decode.ROOFLINE_STEP0}-token prefill is added when none is that short)")
    d.add_argument("--note", help="a sentence kept in the result and printed above its table: what else the "
                                  "machine ran, why a column is not a measurement")

    mm = add("memory", "deferred prefill: resident memory of the F16 transient vs eq. 12", cmd_memory,
             out="kv-memory")
    mm.add_argument("--kv", default="isoquant3_0", help="cache types")
    mm.add_argument("--prompt", default="512,2048,8192", help="prompt lengths, comma-separated")

    a = add("ablation", "rotation variants (paper Table 8) and no inverse rotation: PPL/KLD vs F16 KV",
            cmd_ablation, out="ablation")
    a.add_argument("--ctx", type=int, default=512, help="context size")
    a.add_argument("--chunks", type=int, default=8, help="chunks")

    rl = add("roofline", "decode t/s vs the memory-bandwidth limit (triad bandwidth, bytes per step) per depth",
             cmd_roofline, out="roofline")
    rl.add_argument("--types", default="f16,q8_0,q4_0,isoquant3_0,isoquant3_0-unfused",
                    help="cache configurations as rq-eval bench takes them (TYPE, K/V, TYPE-unfused, +calib)")
    rl.add_argument("--depths", default="0,2048,8192", help="depths, comma-separated")
    rl.add_argument("--n-gen", type=int, default=32, help="decode tokens per measurement")
    rl.add_argument("-r", "--reps", type=int, default=2, help="interleaved rounds")

    n = add("niah", "multi-key needle in a haystack per KV type, context and depth", cmd_niah, out="niah",
            model="GGUF (default: the embedded Gemma3-270M, 32K context)")
    n.add_argument("--kv", default="f16," + KV_TYPES, help="cache types or K/V pairs")
    n.add_argument("--ctx", default="4096,8192", help="contexts")
    n.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths")
    n.add_argument("--seeds", default="42", help="seeds: each sets the numbers and where the haystack starts")
    n.add_argument("--needles", type=int, default=niah.N_NEEDLES, help=f"needles per haystack (1-{len(niah.KEYS)})")
    n.add_argument("--deferred", choices=("off", "also", "only"), default="off",
                   help="run each non-f16 type (also / only) with deferred prefill (label 'TYPE deferred')")

    cli_versus.add_parsers(add)

    g = add("gate", "12-prompt quality gate (instruction model): pass/fail per KV type", cmd_gate, out="gate",
            model="GGUF of an instruction model (default: Qwen2.5-Coder-1.5B-Instruct, the optional asset; "
                  "the embedded Gemma3-270M is a base model)")
    g.add_argument("--kv", default="f16," + KV_TYPES, help="cache types or K/V pairs")
    g.add_argument("--unfused", action="store_true", help="also isoquant3_0 unfused")
    g.add_argument("--max-tokens", type=int, help="answer length cap (default: the data file's, 200)")

    w = add("weights", "weight types: size, PPL/KLD vs the F16 requantisation, t/s", cmd_weights, out=None,
            model="GGUF to requantise (default: the embedded SmolLM2-135M)",
            where="docs/results/weights-MODE.json, .md")
    w.add_argument("--mode", choices=("ftype", "tensor"), default="ftype",
                   help="ftype: llama-quantize positional types; tensor: one role per type, Q8_0 elsewhere")
    w.add_argument("--tensor", default="ffn_down", help="the role for --mode tensor")
    w.add_argument("--chunks", type=int, default=20, help="perplexity chunks of 512 tokens")
    w.add_argument("-r", "--reps", type=int, default=0,
                   help="llama-bench repetitions per file (default 0: no speed columns; rq-eval weight-speed "
                        "measures speed in interleaved rounds)")
    w.add_argument("--only", metavar="LABELS", help="comma-separated variant labels to run (default: all)")
    w.add_argument("--merge", action="store_true", help="keep the rows of the existing output file that this run "
                                                        "does not redo (same model, ctx, chunks)")
    w.add_argument("--workdir", type=Path, help="keep and reuse the F16 file, importance matrix and baseline logits "
                                                "here (default: a temporary folder)")
    w.add_argument("-o", "--out", type=Path, help="output stem (default: docs/results/weights-MODE)")

    sv = add("serve", "llama-server under concurrent load: failures, identical to alone, t/s", cmd_serve,
             out="serve")
    sv.add_argument("--kv", default="isoquant3_0,f16", help="cache types or K/V pairs")
    sv.add_argument("--clients", type=int, default=8, help="concurrent clients and server slots")
    sv.add_argument("--requests", type=int, default=8, help="requests per client")
    sv.add_argument("-n", "--n-predict", type=int, default=48, help="tokens per answer")
    sv.add_argument("--mode", choices=("default", "deterministic", "both"), default="both",
                    help="server as configured by default, batch-invariant (--no-repack and "
                         "GGML_CPU_TILED_MM=0: responses under load identical to alone), or both in one run")
    sv.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="extra llama-server argument, repeatable (e.g. --server-arg=--no-repack)")

    so = add("soak", "llama-server for N minutes: RSS growth, malformed responses", cmd_soak, out="soak",
             where="docs/results/soak.json")
    so.add_argument("--kv", default="isoquant3_0", help="cache type")
    so.add_argument("--minutes", type=float, default=30.0, help="duration")
    so.add_argument("--clients", type=int, default=4, help="concurrent clients")
    so.add_argument("--mixed", action="store_true", help="prompts of 1-8 sentences and 16-96 new tokens")
    so.add_argument("--disconnect-every", type=int, default=0, metavar="N",
                    help="every Nth request of each client is a stream it leaves after a few tokens")
    so.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="extra llama-server argument, repeatable (e.g. --server-arg=--cache-ram --server-arg=0)")

    st = add("server-tests", "upstream llama.cpp's tools/server/tests/unit on local models, per cache setting: "
             "pass/fail/skip per file, every failure explained", cmd_server_tests, out="server-upstream-tests",
             model=None)
    st.add_argument("--configs", default=",".join(servertests.CONFIGS),
                    help=f"configurations, comma-separated, of {', '.join(servertests.CONFIGS)}")
    st.add_argument("--files", default="", help="test files or ids under unit/, comma-separated (default: all)")
    st.add_argument("-k", "--keyword", help="pytest -k expression")
    st.add_argument("--slow", action="store_true", help="also upstream's slow tests (SLOW_TESTS=1)")
    st.add_argument("--nice", type=int, default=10, help="niceness of the servers")
    st.add_argument("-j", "--jobs", type=int, default=1, help="configurations run at once (each its own port)")
    st.add_argument("--render", action="store_true", help="no run: rewrite STEM.md from STEM.json")

    c = add("convert-speed", "rq-convert vs convert_hf_to_gguf + llama-quantize: M weights/s, peak RSS",
            cmd_convert_speed, out="convert-bench", model=None, threads=False)
    c.add_argument("--models", default="smollm2,gemma3",
                   help="smollm2 (HF and GGUF input), gemma3 (GGUF input), comma-separated")
    c.add_argument("--recipes", default="rotaryquant,itq3,rotaryquant-itq3",
                   help=f"recipes, comma-separated, of {', '.join(convertspeed.UPSTREAM_FTYPE)}")
    c.add_argument("--inputs", default="hf,gguf", help="which input paths to measure for SmolLM2")
    c.add_argument("--layers", type=int, help="keep the first N layers of SmolLM2 (quick; HF input only)")
    c.add_argument("--tiny", action="store_true", help="smoke run (seconds): SmolLM2, 2 layers, 1 recipe, HF")
    c.add_argument("--work-dir", type=Path, help="scratch folder (default: a temporary folder)")
    c.add_argument("--nice", type=int, default=0, help="run the measured processes at this niceness")

    ws = add("weight-speed", "weight types' speed: llama-bench pp/tg per GGUF in interleaved rounds, medians, "
             "per-round ratios to the first file", cmd_weight_speed, out="weight-speed", model=None)
    ws.add_argument("files", nargs="+", type=Path, metavar="FILE", help="GGUF files; the first is the baseline")
    ws.add_argument("-r", "--rounds", type=int, default=5, help="rounds, each running every file once")
    ws.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens timed")
    ws.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens timed")

    iv = add("isoquant-variants",
             "IsoQuant numpy reference per rotation variant x norm mode: MSE, attention error",
             cmd_isoquant_variants, out="isoquant-variants", model=None, threads=False)
    iv.add_argument("--all-modes", action="store_true", help="also the lsq / unbiased research norm modes")
    iv.add_argument("--vectors", type=int, default=isovariants.N,
                    help="vectors per data set; attention uses VECTORS/256 contexts")

    r = add("report", "no measurement: docs/results/*.json into one report, plots, claims ledger", cmd_report,
            out=None, model=None, threads=False, where="docs/results/REPORT.md")
    r.add_argument("--results", type=Path, default=RESULTS, help="results folder (default: docs/results)")
    return ap, subs


def _eval(argv: list[str] | None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ns = build_parser()[0].parse_args(argv)
    ns.prog, ns.argv = "rq-eval", argv
    ns.fn(ns)


def _bench(argv: list[str] | None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = build_parser()[1]["bench"]
    p.prog = "rq-bench"
    ns = p.parse_args(argv)
    ns.prog, ns.argv = "rq-bench", ["bench", *argv]
    ns.fn(ns)


def main(argv: list[str] | None = None) -> int:
    return run_cli("rq-eval", _eval, argv)


def bench_main(argv: list[str] | None = None) -> int:
    """rq-bench: `rq-eval bench` under its own name."""
    return run_cli("rq-bench", _bench, argv)


if __name__ == "__main__":
    sys.exit(main())
