"""rq-eval: measure KV-cache and weight types against the model's own F16.

  rq-eval ppl       perplexity/KLD of KV-cache types (fused and unfused) vs an F16 KV baseline
  rq-eval decode    KLD of KV-cache types while decoding (prefill N, then M single-token steps), deferred off/on
  rq-eval ablation  the paper's rotation variants (Table 8) and "no inverse rotation"
  rq-eval niah      multi-key needle in a haystack per KV type and context
  rq-eval gate      the 12-prompt quality gate per KV type
  rq-eval weights   size, PPL/KLD and speed of weight types vs the F16 requantisation
  rq-eval memory    deferred prefill: the F16 transient's resident memory against the paper's eq. 12
  rq-eval serve     llama-server under concurrent load: failures, empty bodies, identical to alone, t/s
  rq-eval soak      llama-server for N minutes: RSS stays flat, every response well-formed
  rq-eval report    docs/results/*.json -> docs/results/REPORT.md with plots and the claims ledger

Results go to docs/results/NAME.json and .md (-o to change). Speed: rq-bench.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from rotaryquant import assets, paths
from rotaryquant.bindings import RQTypeError
from rotaryquant.eval import (ablation, data, decode, gate, kvmemory, kvquality, kvtypes, niah, perplexity, report, serve,
                              weights)

RESULTS = paths.REPO / "docs" / "results"


def _write(stem: Path, res: dict | list, md: str) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
    stem.with_suffix(".md").write_text(md)
    print(md)


def cmd_ppl(ns: argparse.Namespace) -> None:
    model = _model(ns, assets.ISO_MODEL)
    types = _types(ns.kv)
    ctxs = [int(c) for c in ns.ctx.split(",")]
    res = kvquality.run(model, data.evaluation_text(), kv_types=types, ctxs=ctxs, chunks=ns.chunks,
                        unfused=ns.unfused, deferred=ns.deferred, threads=ns.threads)
    _write(ns.out or RESULTS / "kv-quality", res, kvquality.to_markdown(res))


def cmd_decode(ns: argparse.Namespace) -> None:
    model = _model(ns, assets.ISO_MODEL)
    text = ns.text or data.evaluation_text()
    if not Path(text).exists():
        raise ValueError(f"text {text} does not exist")
    prefill = _ints(ns.prefill, "--prefill")
    modes = {"off": False, "on": True}
    deferred = []
    for d in (x.strip() for x in ns.deferred.split(",") if x.strip()):
        if d not in modes:
            raise ValueError(f"--deferred takes off, on or off,on; got {d!r}")
        deferred.append(modes[d])
    res = decode.run(model, Path(text), cache_types=_types(ns.kv), prefill=prefill, tokens=ns.tokens,
                     deferred=list(dict.fromkeys(deferred)), threads=ns.threads)
    _write(ns.out or RESULTS / "decode", res, decode.to_markdown(res))


def cmd_memory(ns: argparse.Namespace) -> None:
    model = _model(ns, assets.ISO_MODEL)
    prompts = _ints(ns.prompt, "--prompt")
    if not prompts or min(prompts) < 2:
        raise ValueError("--prompt takes prompt lengths of at least 2 tokens")
    res = kvmemory.run(model, caches=_types(ns.kv), prompts=prompts, threads=ns.threads)
    _write(ns.out or RESULTS / "kv-memory", res, kvmemory.to_markdown(res))


def _ints(spec: str, what: str) -> list[int]:
    try:
        return [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} takes comma-separated integers, got {spec!r}") from None


def cmd_weights(ns: argparse.Namespace) -> None:
    model = _model(ns, assets.DEFAULT_MODEL)
    variants = weights.DEFAULT_VARIANTS if ns.mode == "ftype" else weights.tensor_variants(ns.tensor)
    with tempfile.TemporaryDirectory(prefix="rq-weights-") as tmp:
        res = weights.bench(model, Path(ns.workdir or tmp), data.evaluation_text(), data.calibration_text(),
                            variants=variants, chunks=ns.chunks, threads=ns.threads, reps=ns.reps)
    title = "llama-quantize types" if ns.mode == "ftype" else f"one tensor role ({ns.tensor}) per type, Q8_0 elsewhere"
    _write(ns.out or RESULTS / f"weights-{ns.mode}", res, weights.to_markdown(res, title))


def _model(ns: argparse.Namespace, default: str) -> Path:
    model = ns.model or assets.model_path(default)
    if not Path(model).exists():
        raise ValueError(f"model {model} does not exist")
    return Path(model)


def _types(spec: str) -> list[str]:
    """Comma-separated cache types; each is a type or K/V pair (q8_0/isoquant3_0)."""
    return [kvtypes.validate(t.strip()) for t in spec.split(",") if t.strip()]


def cmd_ablation(ns: argparse.Namespace) -> None:
    res = ablation.run(_model(ns, assets.ISO_MODEL), data.evaluation_text(), ctx=ns.ctx, chunks=ns.chunks,
                       threads=ns.threads)
    _write(ns.out or RESULTS / "ablation", res, ablation.to_markdown(res))


def cmd_niah(ns: argparse.Namespace) -> None:
    res = niah.run(_model(ns, assets.ISO_MODEL), data.evaluation_text(), cache_types=_types(ns.kv),
                   ctxs=[int(c) for c in ns.ctx.split(",")], depths=[float(d) for d in ns.depths.split(",")],
                   threads=ns.threads)
    _write(ns.out or RESULTS / "niah", res, niah.to_markdown(res))


def cmd_gate(ns: argparse.Namespace) -> None:
    model = _model(ns, assets.CHAT_ISO_MODEL)
    runs = [(t, False) for t in _types(ns.kv)]
    if ns.unfused:
        runs.append(("isoquant3_0", True))
    res = [gate.run(model, cache_type=t, unfused=u, max_tokens=ns.max_tokens, threads=ns.threads) for t, u in runs]
    _write(ns.out or RESULTS / "gate", res, gate.to_markdown(res))


def cmd_serve(ns: argparse.Namespace) -> None:
    model = _model(ns, assets.ISO_MODEL)
    modes = {"default": [False], "deterministic": [True], "both": [False, True]}[ns.mode]
    res = [serve.as_dict(serve.load_test(model, cache=c, clients=ns.clients, per_client=ns.requests,
                                         n_predict=ns.n_predict, threads=ns.threads, server_args=ns.server_arg,
                                         deterministic=d))
           for d in modes for c in _types(ns.kv)]
    _write(ns.out or RESULTS / "serve", res, serve.to_markdown(res))


def cmd_soak(ns: argparse.Namespace) -> None:
    res = serve.soak(_model(ns, assets.ISO_MODEL), cache=kvtypes.validate(ns.kv), minutes=ns.minutes,
                     clients=ns.clients, threads=ns.threads)
    stem = ns.out or RESULTS / "soak"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
    stalled = " (the server stalled)" if res["stalled"] else ""
    print(f"{res['requests']} requests, {res['malformed']} malformed{stalled}, RSS growth {res['rss_growth_pct']}% "
          f"(second half vs first half)")
    if res["malformed"] or res["rss_growth_pct"] > 5:
        raise ValueError("soak failed: malformed responses or RSS growth above 5%")


def cmd_report(ns: argparse.Namespace) -> None:
    out = report.build(ns.results)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rq-eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("ppl", help="KV-cache types: perplexity and KLD against F16 KV")
    p.add_argument("--model", type=Path, help="GGUF (default: the embedded Gemma3-270M)")
    p.add_argument("--kv", default="q8_0,q4_0,isoquant3_0,q8_0/isoquant3_0",
                   help="cache types, each a type or a K/V pair (default: %(default)s); f16 is the baseline")
    p.add_argument("--ctx", default="512,2048", help="context sizes, comma-separated (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=8, help="chunks per context (default: %(default)s)")
    p.add_argument("--unfused", action="store_true", help="also run isoquant3_0 unfused")
    p.add_argument("--deferred", action="store_true",
                   help="also run each non-f16 type with deferred prefill (LLAMA_KV_DEFERRED=1), labelled "
                        "'TYPE deferred': llama-perplexity is all prefill, so these rows show it no longer "
                        "reads the quantised cache (KLD ~0); decode-time quality: rq-eval decode")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-o", "--out", type=Path, help="output stem (default: docs/results/kv-quality)")
    p.set_defaults(fn=cmd_ppl)

    d = sub.add_parser("decode", help="KV-cache types while decoding: KLD per step vs F16 KV, deferred off/on")
    d.add_argument("--model", type=Path, help="GGUF (default: the embedded Gemma3-270M)")
    d.add_argument("--kv", default="q8_0,q4_0,isoquant3_0,q8_0/isoquant3_0",
                   help="cache types, each a type or a K/V pair, +calib to use the model's K calibration "
                        "(default: %(default)s); f16 is the baseline")
    d.add_argument("--prefill", default="512,2048,8192", help="prompt lengths N, comma-separated (default: %(default)s)")
    d.add_argument("--tokens", type=int, default=64,
                   help="tokens M teacher-forced after the prompt, one llama_decode each (default: %(default)s)")
    d.add_argument("--deferred", default="off,on",
                   help="deferred prefill: off, on or off,on (default: %(default)s)")
    d.add_argument("--text", type=Path, help="text file (default: the evaluation slice of the default text)")
    d.add_argument("-t", "--threads", type=int, default=2)
    d.add_argument("-o", "--out", type=Path, help="output stem (default: docs/results/decode)")
    d.set_defaults(fn=cmd_decode)

    w = sub.add_parser("weights", help="weight types: size, PPL/KLD vs F16, speed")
    w.add_argument("--model", type=Path, help="GGUF to requantise (default: the embedded SmolLM2-135M)")
    w.add_argument("--mode", choices=("ftype", "tensor"), default="ftype",
                   help="ftype: llama-quantize positional types; tensor: one role per type, Q8_0 elsewhere")
    w.add_argument("--tensor", default="ffn_down", help="the role for --mode tensor (default: %(default)s)")
    w.add_argument("--chunks", type=int, default=20, help="perplexity chunks of 512 tokens (default: %(default)s)")
    w.add_argument("-r", "--reps", type=int, default=2, help="llama-bench repetitions (default: %(default)s)")
    w.add_argument("-t", "--threads", type=int, default=2)
    w.add_argument("--workdir", type=Path, help="keep intermediate files here (default: a temporary folder)")
    w.add_argument("-o", "--out", type=Path, help="output stem (default: docs/results/weights-MODE)")
    w.set_defaults(fn=cmd_weights)

    a = sub.add_parser("ablation", help="rotation variants and no-inverse-rotation, PPL/KLD vs f16 KV")
    a.add_argument("--model", type=Path, help="GGUF (default: the embedded Gemma3-270M)")
    a.add_argument("--ctx", type=int, default=512)
    a.add_argument("--chunks", type=int, default=8)
    a.add_argument("-t", "--threads", type=int, default=2)
    a.add_argument("-o", "--out", type=Path)
    a.set_defaults(fn=cmd_ablation)

    n = sub.add_parser("niah", help="multi-key needle in a haystack")
    n.add_argument("--model", type=Path, help="GGUF (default: the embedded Gemma3-270M, 32K context)")
    n.add_argument("--kv", default="f16,q8_0,q4_0,isoquant3_0,q8_0/isoquant3_0", help="cache types or K/V pairs (default: %(default)s)")
    n.add_argument("--ctx", default="4096,8192", help="contexts (default: %(default)s)")
    n.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths (default: %(default)s)")
    n.add_argument("-t", "--threads", type=int, default=2)
    n.add_argument("-o", "--out", type=Path)
    n.set_defaults(fn=cmd_niah)

    g = sub.add_parser("gate", help="the 12-prompt quality gate")
    g.add_argument("--model", type=Path, help="GGUF of an instruction model (default: Qwen2.5-Coder-1.5B-Instruct, "
                   "the optional asset; the embedded Gemma3-270M is a base model)")
    g.add_argument("--kv", default="f16,q8_0,q4_0,isoquant3_0,q8_0/isoquant3_0", help="cache types or K/V pairs (default: %(default)s)")
    g.add_argument("--unfused", action="store_true", help="also isoquant3_0 unfused")
    g.add_argument("--max-tokens", type=int, help="answer length cap (default: the data file's, 200)")
    g.add_argument("-t", "--threads", type=int, default=2)
    g.add_argument("-o", "--out", type=Path)
    g.set_defaults(fn=cmd_gate)

    sv = sub.add_parser("serve", help="llama-server under concurrent load (loopback)")
    sv.add_argument("--model", type=Path, help="GGUF (default: the embedded Gemma3-270M)")
    sv.add_argument("--kv", default="isoquant3_0,f16", help="cache types or K/V pairs (default: %(default)s)")
    sv.add_argument("--clients", type=int, default=8, help="concurrent clients and server slots (default: %(default)s)")
    sv.add_argument("--requests", type=int, default=8, help="requests per client (default: %(default)s)")
    sv.add_argument("-n", "--n-predict", type=int, default=48)
    sv.add_argument("-t", "--threads", type=int, default=2)
    sv.add_argument("--mode", choices=("default", "deterministic", "both"), default="both",
                    help="server as configured by default, batch-invariant (--no-repack and GGML_CPU_TILED_MM=0: "
                         "responses under load identical to alone), or both in one run (default: %(default)s)")
    sv.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="extra llama-server argument, repeatable (e.g. --server-arg=--no-repack)")
    sv.add_argument("-o", "--out", type=Path)
    sv.set_defaults(fn=cmd_serve)

    so = sub.add_parser("soak", help="llama-server for N minutes, RSS and response checks")
    so.add_argument("--model", type=Path, help="GGUF (default: the embedded Gemma3-270M)")
    so.add_argument("--kv", default="isoquant3_0")
    so.add_argument("--minutes", type=float, default=30.0, help="duration (default: %(default)s)")
    so.add_argument("--clients", type=int, default=4)
    so.add_argument("-t", "--threads", type=int, default=2)
    so.add_argument("-o", "--out", type=Path)
    so.set_defaults(fn=cmd_soak)

    mm = sub.add_parser("memory", help="deferred prefill: the F16 transient's resident memory vs eq. 12")
    mm.add_argument("--model", type=Path, help="GGUF (default: the embedded Gemma3-270M)")
    mm.add_argument("--kv", default="isoquant3_0", help="cache types (default: %(default)s)")
    mm.add_argument("--prompt", default="512,2048,8192", help="prompt lengths, comma-separated (default: %(default)s)")
    mm.add_argument("-t", "--threads", type=int, default=2)
    mm.add_argument("-o", "--out", type=Path, help="output stem (default: docs/results/kv-memory)")
    mm.set_defaults(fn=cmd_memory)

    r = sub.add_parser("report", help="collect results into REPORT.md with plots")
    r.add_argument("--results", type=Path, default=RESULTS, help="results folder (default: docs/results)")
    r.set_defaults(fn=cmd_report)

    ns = ap.parse_args(argv)
    try:
        ns.fn(ns)
    except (assets.AssetError, perplexity.PerplexityError, weights.WeightsBenchError, niah.NiahError, serve.ServeError,
            RQTypeError, decode.DecodeError, ValueError) as e:
        print(f"rq-eval: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
