"""rq-bench: decode/prompt speed and KV bytes per token for each KV-cache type, fused vs unfused."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rotaryquant import assets, paths
from rotaryquant.bindings import RQTypeError
from rotaryquant.eval import kvbench


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rq-bench", description=__doc__)
    ap.add_argument("--model", type=Path, help="GGUF model (default: the embedded Gemma3-270M, head size 256)")
    ap.add_argument("--depths", default="0,2048,8192", help="prefilled KV depths, comma-separated (default: %(default)s)")
    ap.add_argument("--types", default=",".join(c[0] for c in kvbench.DEFAULT_CONFIGS),
                    help="configurations, each a cache spec (q8_0, q8_0/isoquant3_0, isoquant3_0+calib: with the "
                         "model's K calibration) with optional -unfused and -deferred (deferred prefill) suffixes "
                         "(default: %(default)s)")
    ap.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens timed (default: %(default)s)")
    ap.add_argument("-n", "--n-gen", type=int, default=32, help="generated tokens timed (default: %(default)s)")
    ap.add_argument("-r", "--reps", type=int, default=2, help="repetitions (default: %(default)s)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-o", "--out", type=Path, default=paths.REPO / "docs" / "results" / "kv-bench",
                    help="output stem: writes STEM.json and STEM.md (default: docs/results/kv-bench)")
    ns = ap.parse_args(argv)
    try:
        model = ns.model or assets.model_path(assets.ISO_MODEL)
        if not model.exists():
            raise kvbench.BenchError(f"model {model} does not exist")
        configs = [kvbench.config(t.strip()) for t in ns.types.split(",") if t.strip()]
        depths = [int(d) for d in ns.depths.split(",")]
        res = kvbench.bench(model, configs=configs, depths=depths, n_prompt=ns.n_prompt,
                            n_gen=ns.n_gen, reps=ns.reps, threads=ns.threads)
    except (assets.AssetError, kvbench.BenchError, ValueError, RQTypeError) as e:
        print(f"rq-bench: error: {e}", file=sys.stderr)
        return 1
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    md = kvbench.to_markdown(res)
    ns.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
