"""Beside the alternatives: the same measurements through every build's own binaries, each against its own F16.

Builds (ours, stock llama.cpp, forks) are named NAME=BIN_DIR (rotaryquant.eval.builds). A configuration is
"BUILD:K[/V] [FLAGS...]", the cache types and flags as that build's own tools take them (``ik:q4_0 -khad -vhad``;
a NAME=VALUE word is that run's environment instead, e.g. ``ours:isoquant3_0 GGML_RQ_CPU_AVX512=0``, and model=PATH
that configuration's own file of the same model, e.g. one rq-calibrate wrote);
every build used also runs "BUILD:f16", the baseline its rows are scored against, because different builds give
slightly different F16 logits. Four measurements:

- ``kld``: llama-perplexity of each build, --kl-divergence against that build's F16 logits (mean, p99, same top-1);
- ``decode``: rq-probe prefills N tokens of text in 512-token calls, then teacher-forces M single-token steps; KLD of
  the steps against the build's F16 run, and prefill / decode t/s over the same build's F16 in the same round
  (rounds interleaved, every other one reversed, as ``rq-eval decode -r``);
- ``ttft``: rq-probe from process start to the first token's logits on a short prompt (model load, context creation
  and anything the build does at start-up, e.g. measuring K statistics): a first start with nothing kept from before,
  and, for a build that keeps what it measured (ours: K statistics, --k-stats), the start after it;
- ``niah``: rq-probe evaluates each haystack once, asks every needle from a saved copy of its state, greedy answers.

Bits per value are read from the KV cache size each build's log prints (never from the flag: a build may change
what a flag means), over the values the model's K/V heads hold; the build's own notes about its cache (a type
upgraded, heads padded) are kept beside each row.
"""

from __future__ import annotations

import json
import re
import shlex
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TypeVar
from pathlib import Path

import numpy as np

from rotaryquant import paths
from rotaryquant.errors import RQError
from rotaryquant.eval import builds as B
from rotaryquant.eval import decode as dec
from rotaryquant.eval import niah as nh
from rotaryquant.eval import perplexity
from rotaryquant.gguf_io import read_header

BASE = "f16"
MEASURES = ("kld", "decode", "ttft", "niah")
TIMEOUT = 4 * 3600  # seconds one program may run before its row records a timeout (rq-eval versus --timeout)
_T = TypeVar("_T")


class VersusError(RQError):
    """Bad configurations or arguments; a run that fails is recorded in its row, not raised."""


@dataclass(frozen=True)
class Config:
    build: str
    k: str
    v: str
    flags: tuple[str, ...] = ()

    @property
    def cache(self) -> str:
        return self.k if self.k == self.v else f"{self.k}/{self.v}"

    @property
    def label(self) -> str:
        words = (f"model={Path(f[6:]).name}" if f.startswith("model=") else f for f in self.flags)
        return f"{self.build}:{self.cache}" + "".join(" " + f for f in words)

    @property
    def model(self) -> Path | None:
        """model=PATH: this configuration's own file of the same model (e.g. with our stored calibration); the
        baseline and tokens stay the main model's, so the file must hold the same weights and vocabulary."""
        return next((Path(f[6:]).expanduser() for f in self.flags if f.startswith("model=")), None)

    @property
    def is_base(self) -> bool:
        return self.k == self.v == BASE and not self.flags

    def args(self) -> list[str]:
        return ["-ctk", self.k, "-ctv", self.v, *(f for f in self.flags if not _ENV.match(f) and
                                                  not f.startswith("model="))]

    def env(self) -> dict[str, str]:
        """NAME=VALUE words of the configuration: that run's environment (e.g. GGML_RQ_CPU_AVX512=0)."""
        return dict(f.split("=", 1) for f in self.flags if _ENV.match(f))


_ENV = re.compile(r"^[A-Z][A-Z0-9_]*=")


def split_spec(spec: str, names: Sequence[str], form: str) -> tuple[str, list[str]]:
    """'BUILD:WORD [WORDS...]' -> (BUILD, words); VersusError naming ``form`` for an empty one or an unknown build."""
    name, sep, rest = spec.partition(":")
    words = shlex.split(rest)
    if not sep or not words:
        raise VersusError(f"expected {form}, got {spec!r}")
    if name not in names:
        raise VersusError(f"{spec!r} names build {name!r}; builds given: {', '.join(names)}",
                          fix="add --build NAME=BIN_DIR for it")
    return name, words


def parse_config(spec: str, names: Sequence[str]) -> Config:
    """'BUILD:K[/V] [FLAGS...]' -> Config; VersusError for an unknown build or an empty cache."""
    name, words = split_spec(spec, names, "a configuration BUILD:K[/V] [FLAGS...]")
    k, _, v = words[0].partition("/")
    return Config(name, k, v or k, tuple(words[1:]))


def with_baselines(configs: Sequence[Config]) -> list[Config]:
    """Each build's F16 first, then its configurations, in the order the builds first appear."""
    out: list[Config] = []
    for name in dict.fromkeys(c.build for c in configs):
        out += [Config(name, BASE, BASE), *(c for c in configs if c.build == name and not c.is_base)]
    return out


# --- what a build's log says about its cache ----------------------------------------------------------------

@dataclass(frozen=True)
class KvShape:
    n_layer: int
    n_head_kv: int
    k_len: int
    v_len: int


def kv_shape(model: Path) -> KvShape:
    h = read_header(model)

    def one(key: str, default: int | None = None) -> int:
        val = h.get(key, default)
        if isinstance(val, (list, tuple)):  # per-layer head counts: the attention layers'
            val = max(val)
        if val is None:
            raise VersusError(f"{model.name} has no {h.arch}.{key}")
        return int(val)

    heads = one("attention.head_count")
    k_len = one("attention.key_length", one("embedding_length") // heads)
    return KvShape(one("block_count"), one("attention.head_count_kv", heads), k_len,
                   one("attention.value_length", k_len))


# cells are per stream (one per sequence unless the cache is unified): "N/S seqs" is n_seq_max/n_stream
_UPSTREAM = (r"size =\s*[\d.]+ MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*\d+/(\d+) seqs\), "
             r"K \(([^)]+)\):\s*([\d.]+) MiB, V \(([^)]+)\):\s*([\d.]+) MiB")
_IK = r"KV self size\s*=\s*[\d.]+ MiB, K \(([^)]+)\):\s*([\d.]+) MiB, V \(([^)]+)\):\s*([\d.]+) MiB"
_WINDOW = r"init_window: .*?([\d.]+) MiB\)"  # ours: the recent window's F16 rows, beside each cache
_NOTE = (r"auto-asymmetric|Boundary V|zero-padding|require flash_attn|_hadam|K centring|not a supported combination|"
         r"attn_rot_[kv] = [1-9]|per-layer K/V types \(default\)")


def kv_bits(log: str, shape: KvShape) -> dict:
    """Bits per value of the KV cache a run allocated, from the size lines its log printed (upstream's per-cache
    line, or ik_llama.cpp's "KV self size" with its n_ctx), and the build's notes about its cache."""
    mib, values, types = 0.0, 0, set()
    for cells, layers, streams, kt, km, vt, vm in re.findall(_UPSTREAM, log):
        mib += float(km) + float(vm)
        values += int(cells) * int(layers) * int(streams) * shape.n_head_kv * (shape.k_len + shape.v_len)
        types.add(f"{kt}/{vt}")
    mib += sum(float(x) for x in re.findall(_WINDOW, log)) if values else 0.0
    if not values:
        ctx = re.search(r"\bn_ctx\s*=\s*(\d+)", log)
        for kt, km, vt, vm in re.findall(_IK, log):
            if ctx:
                mib += float(km) + float(vm)
                values += int(ctx.group(1)) * shape.n_layer * shape.n_head_kv * (shape.k_len + shape.v_len)
                types.add(f"{kt}/{vt}")
    notes = list(dict.fromkeys(re.sub(r"\b\d+\.\d+ s\b", "N s", line.split(": ", 1)[-1].strip())
                               for line in log.splitlines() if re.search(_NOTE, line)))[:6]
    return {"bits_per_value": round(mib * 2**20 * 8 / values, 3) if values else None,
            "kv_mib": round(mib, 2) if values else None, "logged_types": sorted(types), "notes": notes}


# --- running one program --------------------------------------------------------------------------------------

def _run(cmd: list[str], timeout: float | None = None, env: dict[str, str] | None = None) -> tuple[int, str, str, float]:
    timeout = timeout or TIMEOUT
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env={**B.run_env(), **(env or {})}, timeout=timeout,
                           cwd=_scratch())
        return p.returncode, p.stdout, p.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return -9, out, err + f"\n(timed out after {timeout:.0f} s)", time.perf_counter() - t0


def _scratch() -> Path:
    """The programs' working folder: some builds' tools write files there (ik_llama.cpp's llama.log)."""
    d = paths.build_dir() / "versus-scratch"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _failure(rc: int, log: str) -> dict:
    """What happened, for a row that did not run (beside its command): the exit and the log's last lines."""
    what = f"killed by signal {-rc}" if rc < 0 else f"exit {rc}"
    lines = [x.strip(" =") for x in log.strip().splitlines() if x.strip(" =")]
    # an abort's last lines are a debugger's backtrace: the lines that say why come first
    why = [x for x in lines if _WHY.search(x)]
    return {"error": what, "log_tail": (why[-3:] + lines[-3:]) if why else lines[-8:]}


_WHY = re.compile(r"error|not a supported|not supported|GGML_ASSERT|GGML_ABORT|failed|exception|timed out", re.I)


def _cmdline(cfg: Config, cmd: list[str]) -> str:
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in cfg.env().items()), shlex.join(cmd)])


def _json_line(out: str) -> dict:
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line")


def _probe_cmd(build: B.Build, mode: str, model: Path, n_ctx: int, cfg: Config, threads: int,
               *extra: str) -> list[str]:
    return [str(B.probe(build)), mode, "-m", str(cfg.model or model), "-c", str(n_ctx), "-t", str(threads), "-fa", "on",
            *cfg.args(), *extra]


# --- measurements ---------------------------------------------------------------------------------------------

Progress = Callable[[str], None]


def kld(builds: dict[str, B.Build], configs: Sequence[Config], model: Path, text: Path, *, ctx: int = 2048,
        chunks: int = 2, threads: int = 2, progress: Progress = print) -> list[dict]:
    """llama-perplexity of each build: its F16 run saves logits, each configuration is scored against them."""
    shape = kv_shape(model)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rq-versus-") as tmp:
        for cfg in with_baselines(configs):
            b = builds[cfg.build]
            base = Path(tmp) / f"{cfg.build}.kld"
            cmd = [str(b.tool("llama-perplexity")), "-m", str(cfg.model or model), "-f", str(text), "-c", str(ctx), "--chunks",
                   str(chunks), "-t", str(threads), "-fa", "on", *cfg.args(), "--kl-divergence-base", str(base),
                   *b.log_flags("llama-perplexity")]
            if not cfg.is_base:
                if not base.exists():
                    rows.append({"config": cfg.label, "build": cfg.build, "error": "no F16 baseline (it failed)"})
                    continue
                cmd.append("--kl-divergence")
            progress(f"[rq-eval versus] kld ctx {ctx}: {cfg.label}")
            rc, out, err, secs = _run(cmd, env=cfg.env())
            row = {"config": cfg.label, "build": cfg.build, "cache": cfg.cache, "flags": list(cfg.flags), "ctx": ctx,
                   "chunks": chunks, "command": _cmdline(cfg, cmd), "seconds": round(secs, 1), **kv_bits(out + err, shape)}
            if rc != 0:
                row.update(_failure(rc, out + err))
            else:
                try:
                    r = perplexity.parse_output(cfg.label, out + err)
                    row.update({k: getattr(r, k) for k in ("ppl", "kld_mean", "kld_p99", "kld_max", "same_top_p")})
                except perplexity.PerplexityError as e:
                    row.update(_failure(rc, str(e)))
            rows.append(row)
            if "error" in row:
                progress(f"[rq-eval versus]   failed: {row['error']}: {(row.get('log_tail') or [''])[-1]}")
            elif not cfg.is_base:
                progress(f"[rq-eval versus]   {row['bits_per_value']} bits/value, KLD {row['kld_mean']:.5f}, "
                         f"p99 {row['kld_p99']:.4f}")
    return rows


def _rounds_order(configs: list[_T], rounds: int) -> list[tuple[int, _T]]:
    """ABBA: every configuration once per round, every other round in reverse order."""
    return [(r, c) for r in range(rounds) for c in (configs if r % 2 == 0 else configs[::-1])]


def _tokens_file(path: Path, toks: Sequence[int]) -> Path:
    path.write_text(" ".join(map(str, toks)) + "\n")
    return path


FILLS = ("prompt", "independent")


def decode(builds: dict[str, B.Build], configs: Sequence[Config], model: Path, text: Path, *, prefill: int,
           steps: int = 64, rounds: int = 1, repeats: int = 1, threads: int = 2, fills: Sequence[str] = ("prompt",),
           progress: Progress = print) -> list[dict]:
    """Prefill `prefill` tokens, teacher-force `steps`: per-step KLD against the build's F16, speeds in rounds; in
    each round the steps are timed `repeats` times from a saved copy of the state (a round's decode time is their
    median: samples at a depth whose prefill takes minutes, for seconds each).

    `fills`: how the cache is filled before the steps, each configuration once per fill. "prompt" evaluates the
    prompt; "independent" evaluates each 512-token call of it on its own (rq-probe --fill independent): the same
    cells at the same positions for the steps, without the prompt's quadratic attention (a CPU path that takes
    hours over a 32K prompt takes minutes). The values cached then differ from a prompt's, so those rows have
    speeds only, no KLD: set beside the same configuration's "prompt" row, they show what the fill changes."""
    if rounds < 1 or steps < 1 or prefill < 2 or repeats < 1:
        raise VersusError("decode needs a prefill of at least 2 tokens, at least 1 step, 1 round and 1 repeat")
    bad = [f for f in fills if f not in FILLS]
    if bad or not fills:
        raise VersusError(f"unknown fill {', '.join(bad) or '(none)'}; known: {', '.join(FILLS)}")
    lacking = sorted({c.build for c in configs if not {"RQ_PROBE_SEQ", "RQ_PROBE_SEQ_KV"} & builds[c.build].features})
    if "independent" in fills and lacking:
        raise VersusError(f"--fill independent needs llama_memory_seq_cp and kv_unified, or "
                          f"llama_kv_cache_seq_cp, in llama.h, which {', '.join(lacking)} lack")
    toks = dec.text_tokens(model, text, prefill + steps + 1)
    targets = np.asarray(toks[prefill:prefill + steps + 1])
    n_ctx = -(-(prefill + steps) // 256) * 256
    shape = kv_shape(model)
    order = [(c, f) for f in dict.fromkeys(fills) for c in with_baselines(configs)]
    secs: dict[tuple[Config, str], list[tuple[float, float]]] = {k: [] for k in order}
    reps: dict[tuple[Config, str], list[list[float]]] = {k: [] for k in order}
    first: dict[tuple[Config, str], dict] = {}
    with tempfile.TemporaryDirectory(prefix="rq-versus-") as tmp:
        tok_file = _tokens_file(Path(tmp) / "tokens.txt", toks)
        for rnd, (cfg, fill) in _rounds_order(order, rounds):
            if (cfg, fill) in first and "error" in first[cfg, fill]:
                continue
            progress(f"[rq-eval versus] decode {prefill}+{steps}: {cfg.label}"
                     + (f" ({fill} fill)" if fill != "prompt" else "")
                     + (f" (round {rnd + 1}/{rounds})" if rounds > 1 else ""))
            scored = rnd == 0 and fill == "prompt"
            logits = Path(tmp) / f"{len(first)}.f32"
            cmd = _probe_cmd(builds[cfg.build], "decode", model, n_ctx, cfg, threads, "--tokens", str(tok_file),
                             "--prefill", str(prefill), "--steps", str(steps),
                             *(["--fill", fill] if fill != "prompt" else []),
                             *(["--repeat", str(repeats)] if repeats > 1 else []),
                             *(["--logits", str(logits)] if scored else []))
            rc, out, err, _ = _run(cmd, env=cfg.env())
            if rnd == 0:
                first[cfg, fill] = {"command": _cmdline(cfg, cmd), **kv_bits(out + err, shape)}
            if rc != 0:
                first[cfg, fill].update(_failure(rc, out + err))
                progress(f"[rq-eval versus]   failed: {first[cfg, fill]['error']}: "
                         f"{first[cfg, fill]['log_tail'][-1:]}")
                continue
            t = _json_line(out)
            reps[cfg, fill].append(t.get("decode_s_repeats") or [t["decode_s"]])
            secs[cfg, fill].append((t["prefill_s"], statistics.median(reps[cfg, fill][-1])))
            if scored:
                first[cfg, fill]["logits"] = logits
                first[cfg, fill]["n_vocab"] = t["n_vocab"]
            progress(f"[rq-eval versus]   prefill {prefill / t['prefill_s']:.1f} t/s, decode "
                     + ", ".join(f"{steps / d:.2f}" for d in reps[cfg, fill][-1]) + " t/s")
        rows = []
        for cfg, fill in order:
            f = first[cfg, fill]
            row = {"config": cfg.label, "build": cfg.build, "cache": cfg.cache, "flags": list(cfg.flags),
                   "prefill": prefill, "steps": steps, **({"fill": fill} if fill != "prompt" else {}),
                   **{k: v for k, v in f.items() if k not in ("logits", "n_vocab")}}
            base = first[Config(cfg.build, BASE, BASE), fill]
            if "logits" in f and "logits" in base:
                shape2 = (steps + 1, f["n_vocab"])
                s = dec.score(np.fromfile(base["logits"], np.float32).reshape(shape2),
                              np.fromfile(f["logits"], np.float32).reshape(shape2), targets)
                row.update({k: s[k] for k in ("kld_mean", "kld_p99", "kld_max", "same_top1_pct", "kld_steps")})
            if secs[cfg, fill]:
                row["prefill_tps_rounds"] = [round(prefill / p, 2) for p, _ in secs[cfg, fill]]
                row["decode_tps_rounds"] = [round(steps / d, 3) for _, d in secs[cfg, fill]]
                row["prefill_tps"] = round(statistics.median(row["prefill_tps_rounds"]), 2)
                row["decode_tps"] = round(statistics.median(row["decode_tps_rounds"]), 3)
                if repeats > 1:
                    row["decode_tps_repeats"] = [[round(steps / d, 3) for d in r] for r in reps[cfg, fill]]
            rows.append(row)
    _ratios(rows, ("prefill_tps", "decode_tps"))
    return rows


def _ratios(rows: list[dict], keys: Sequence[str]) -> None:
    """Each row's speeds over its own build's F16 row: the medians' ratio, and each round's."""
    base = {(r["build"], r.get("fill")): r for r in rows if r["cache"] == BASE and not r["flags"]}
    for r in rows:
        b = base.get((r["build"], r.get("fill")))
        for k in keys:
            if b is None or not r.get(k) or not b.get(k):
                continue
            r[k + "_vs_f16"] = round(r[k] / b[k], 4)
            r[k + "_vs_f16_rounds"] = [round(x / y, 4) for x, y in zip(r[k + "_rounds"], b[k + "_rounds"])]


def ttft(builds: dict[str, B.Build], configs: Sequence[Config], model: Path, text: Path, *, prompt: int = 16,
         rounds: int = 3, threads: int = 2, progress: Progress = print) -> list[dict]:
    """Seconds from process start to the first token's logits for a `prompt`-token prompt, median of rounds: a first
    start (nothing kept), and where the build keeps K statistics the next start from what the first kept."""
    toks = dec.text_tokens(model, text, prompt)
    order = with_baselines(configs)
    times: dict[Config, list[dict]] = {c: [] for c in order}
    rows: dict[Config, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rq-versus-") as tmp:
        tok_file = _tokens_file(Path(tmp) / "tokens.txt", toks)
        for rnd, cfg in _rounds_order(order, rounds):
            if cfg in rows and "error" in rows[cfg]:
                continue
            progress(f"[rq-eval versus] ttft: {cfg.label} (round {rnd + 1}/{rounds})")
            keeps = "RQ_PROBE_KSTATS" in builds[cfg.build].features
            kept = Path(tempfile.mkdtemp(prefix="k-stats-", dir=tmp))  # empty: a first start
            cmd = _probe_cmd(builds[cfg.build], "decode", model, 4096, cfg, threads, "--tokens", str(tok_file),
                             "--prefill", str(prompt), "--steps", "0", *(["--k-stats", str(kept)] if keeps else []))
            rc, out, err, wall = _run(cmd, env=cfg.env())
            if cfg not in rows:
                rows[cfg] = {"config": cfg.label, "build": cfg.build, "cache": cfg.cache, "flags": list(cfg.flags),
                             "prompt": prompt, "command": _cmdline(cfg, cmd), **kv_bits(out + err, kv_shape(model))}
            if rc != 0:
                rows[cfg].update(_failure(rc, out + err))
                continue
            t = _json_line(out)
            times[cfg].append({"first_token_s": t["first_token_s"], "ctx_s": t["ctx_s"], "wall_s": wall})
            progress(f"[rq-eval versus]   first token after {t['first_token_s']:.2f} s (context {t['ctx_s']:.2f} s)")
            if keeps and any(kept.iterdir()):
                rc2, out2, err2, _ = _run(cmd, env=cfg.env())
                if rc2 != 0:
                    rows[cfg].update(_failure(rc2, out2 + err2))
                    continue
                t2 = _json_line(out2)
                times[cfg][-1].update(first_token_kept_s=t2["first_token_s"], ctx_kept_s=t2["ctx_s"])
                progress(f"[rq-eval versus]   the next start: first token after {t2['first_token_s']:.2f} s")
    out_rows = []
    for cfg in order:
        r = rows[cfg]
        for k in ("first_token_s", "ctx_s", "wall_s", "first_token_kept_s", "ctx_kept_s"):
            if times[cfg] and all(k in x for x in times[cfg]):
                r[k + "_rounds"] = [round(x[k], 3) for x in times[cfg]]
                r[k] = round(statistics.median(r[k + "_rounds"]), 3)
        out_rows.append(r)
    base = {r["build"]: r for r in out_rows if r["cache"] == BASE and not r["flags"]}
    for r in out_rows:
        b = base.get(r["build"])
        if b and r.get("first_token_s") is not None and b.get("first_token_s") is not None:
            r["added_s"] = round(r["first_token_s"] - b["first_token_s"], 3)
            if r.get("first_token_kept_s") is not None:
                r["added_kept_s"] = round(r["first_token_kept_s"] - b["first_token_s"], 3)
    return out_rows


def niah(builds: dict[str, B.Build], configs: Sequence[Config], model: Path, haystack: Path, *, ctxs: Sequence[int],
         depths: Sequence[float], seeds: Sequence[int] = (42,), n_needles: int = 8, threads: int = 2,
         answer: int = 12, progress: Progress = print, rows: list[dict] | None = None,
         saved: Callable[[], None] = lambda: None, skip: Collection[tuple] = ()) -> list[dict]:
    """Multi-key needles (rotaryquant.eval.niah's haystacks and questions) through each build's rq-probe. No F16
    baseline is added: give the configurations to compare, f16 among them if wanted. Rows are appended to ``rows``
    as each haystack finishes, then ``saved()`` runs (a run of hours keeps what it finished); a (configuration, ctx,
    seed, depth) in ``skip`` is not run (rq-eval versus --resume: the output file holds it)."""
    import llama_cpp  # lazy: loads the patched libllama: needs the build

    text = haystack.read_text(errors="replace")
    voc = llama_cpp.Llama(model_path=str(model), vocab_only=True, n_ctx=16, verbose=False)
    shape = kv_shape(model)
    rows = [] if rows is None else rows
    try:
        vocab = llama_cpp.llama_model_get_vocab(voc.model)
        with tempfile.TemporaryDirectory(prefix="rq-versus-") as tmp:
            for ctx in ctxs:
                for seed in seeds:
                    for depth in depths:
                        pairs = nh.needles(seed, n_needles)
                        prompt = nh.build_prompt(voc, text[nh.haystack_offset(seed, len(text), ctx):], ctx, depth,
                                                 pairs)
                        hay = _tokens_file(Path(tmp) / f"hay-{ctx}-{seed}-{depth}.txt", prompt)
                        qs = Path(tmp) / f"q-{ctx}-{seed}-{depth}.txt"
                        qs.write_text("".join(" ".join(map(str, voc.tokenize(
                            f"\n\nQuestion: What is the secret number of the {k}?\nAnswer: The secret number of the "
                            f"{k} is".encode(), add_bos=False))) + "\n" for k, _ in pairs))
                        for cfg in configs:
                            if (cfg.label, ctx, seed, depth) in skip:
                                progress(f"[rq-eval versus] niah ctx {ctx} seed {seed} depth {depth:.0%}: "
                                         f"{cfg.label}: kept from the output file (--resume)")
                                continue
                            progress(f"[rq-eval versus] niah ctx {ctx} seed {seed} depth {depth:.0%}: {cfg.label}")
                            cmd = _probe_cmd(builds[cfg.build], "niah", model, ctx, cfg, threads, "--tokens", str(hay),
                                             "--questions", str(qs), "--answer", str(answer))
                            rc, out, err, secs = _run(cmd, env=cfg.env())
                            row = {"config": cfg.label, "build": cfg.build, "cache": cfg.cache,
                                   "flags": list(cfg.flags), "ctx": ctx, "seed": seed, "depth": depth,
                                   "asked": len(pairs), "seconds": round(secs, 1), "command": _cmdline(cfg, cmd),
                                   **kv_bits(out + err, shape)}
                            if rc != 0:
                                row.update(_failure(rc, out + err))
                            else:
                                lines = [x for x in out.strip().splitlines() if not x.startswith("{")]
                                answers = []
                                for line in lines:
                                    ids = [int(x) for x in line.split()]
                                    cut = next((i for i, t in enumerate(ids) if llama_cpp.llama_vocab_is_eog(vocab, t)),
                                               len(ids))
                                    answers.append(voc.detokenize(ids[:cut]).decode(errors="replace").strip())
                                row["answers"] = answers
                                row["found"] = sum(v in a.replace(",", "").replace(" ", "")
                                                   for (_, v), a in zip(pairs, answers))
                                progress(f"[rq-eval versus]   {row['found']}/{row['asked']}")
                            rows.append(row)
                            saved()
    finally:
        voc.close()
    return rows


def merge(old: dict, new: dict) -> dict:
    """new, plus old's rows (per measurement) of the configurations new did not measure there, at a context (and for
    needles a seed and depth) it did not measure them at (needles at 8K keep the same configuration's 16K rows, a
    haystack at depth 90% the one at 10%): runs share one file, each row still scored against the F16 of its own run
    (its ratios are stored with it)."""
    if not old:
        return new

    def key(r: dict) -> tuple:
        return r["config"], r.get("ctx"), r.get("seed"), r.get("depth"), r.get("fill")

    out = {**new, "builds": {**old.get("builds", {}), **new.get("builds", {})}}
    for m in MEASURES:
        ran = {key(r) for r in new.get(m) or []}
        kept = [r for r in old.get(m) or [] if key(r) not in ran]
        if kept or new.get(m):
            out[m] = kept + list(new.get(m) or [])
    out["runs"] = [*old.get("runs", []), *new.get("runs", [])]
    if "threads" in old and "threads" in new:  # runs at other thread counts: each run's command says which
        counts = {*str(old["threads"]).split(" / "), str(new["threads"])}
        if len(counts) > 1:
            out["threads"] = " / ".join(sorted(counts, key=int))
    if any(len(out.get(m) or []) > len(new.get(m) or []) for m in MEASURES):  # rows of an earlier run kept
        out["cpu_mixed"] = old.get("cpu") != new.get("cpu") or bool(old.get("cpu_mixed"))  # from another CPU
    return out
