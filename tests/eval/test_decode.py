"""rotaryquant.eval.decode (rq-eval decode) and rq-eval ppl --deferred: scoring, a small real run, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from rotaryquant.eval import cli, decode, kvquality, logits, perplexity

# --- scoring: pure functions ----------------------------------------------------------------------


def test_identical_logits_score_zero_kld_and_full_agreement():
    x = np.random.default_rng(0).normal(size=(9, 50)).astype(np.float32) * 4
    s = decode.score(x, x.copy(), np.arange(9))
    assert s["kld_mean"] == s["kld_max"] == s["kld_p99"] == s["kld_step0"] == 0.0
    assert s["same_top1_pct"] == 100.0
    assert s["kld_steps"] == [0.0] * 9


def test_kld_per_step_top1_and_step0():
    rng = np.random.default_rng(1)
    base = rng.normal(size=(4, 30))
    run = base.copy()
    run[2] = base[2] + rng.normal(size=30) * 3  # one step disturbed
    run[2, base[2].argmax()] -= 100  # ... and its top-1 moved
    s = decode.score(base, run, np.zeros(4, dtype=int), rows=3)  # blocks of 3 rows: 3 + 1
    per = logits.kld_rows(base, run)
    assert per[[0, 1, 3]].tolist() == [0.0, 0.0, 0.0] and per[2] > 0.5
    assert s["kld_steps"][2] == pytest.approx(per[2], rel=1e-5)
    assert s["kld_mean"] == pytest.approx(per.mean()) and s["kld_max"] == pytest.approx(per[2])
    assert s["kld_step0"] == 0.0
    assert s["same_top1_pct"] == 75.0
    assert logits.kld(base, run) == pytest.approx(per.mean())


def test_perplexity_of_the_true_tokens():
    assert decode.perplexity(np.log([0.5, 0.125])) == pytest.approx(4.0)
    # uniform over V tokens: PPL is V whatever the targets
    s = decode.score(np.zeros((3, 7)), np.zeros((3, 7)), np.array([0, 3, 6]))
    assert s["ppl"] == pytest.approx(7.0)
    # the run's own logits, not the baseline's: a confident run on the right token has PPL ~1
    confident = np.full((2, 5), -50.0)
    confident[[0, 1], [4, 2]] = 50.0
    assert decode.score(np.zeros((2, 5)), confident, np.array([4, 2]))["ppl"] == pytest.approx(1.0)


def test_score_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="shapes"):
        decode.score(np.zeros((3, 5)), np.zeros((3, 6)), np.zeros(3, dtype=int))
    with pytest.raises(ValueError, match="shapes"):
        decode.score(np.zeros((3, 5)), np.zeros((3, 5)), np.zeros(2, dtype=int))


def test_prefill_is_never_a_single_token_call():
    for n in [2, 3, 511, 512, 513, 1025, 2049, 8192]:
        sizes = decode.prefill_chunks(n)
        assert sum(sizes) == n and max(sizes) <= decode.N_BATCH and min(sizes) >= 2, (n, sizes)
    with pytest.raises(decode.DecodeError, match="at least 2"):
        decode.prefill_chunks(1)


def test_markdown_explains_the_baseline_and_flags_a_switch_without_effect():
    row = dict(kld_mean=0.1, kld_p99=0.2, kld_max=0.3, same_top1_pct=90.0, ppl=12.0, kld_step0=0.0,
               prefill_tps=100.0, decode_tps=10.0, kld_steps=[0.0, 0.2])
    res = {"model": "m.gguf", "text": "t.txt", "tokens": 1, "rows": [
        {**row, "prefill": 64, "cache": "f16", "deferred": False, "counters": None},
        {**row, "prefill": 64, "cache": "q4_0", "deferred": True, "counters": {"kv_deferred_conversions": 0}}]}
    md = decode.to_markdown(res)
    assert "against the F16-KV run" in md and "step 0 is the prefill's own logits" in md
    assert "| 64 | f16 | – | (baseline) |" in md  # rows from before bits_per_value was recorded
    assert "| 64 | q4_0 | – | on (no effect¹) |" in md and "kv_deferred_conversions = 0" in md
    assert "| 100.0 | 10.0 | 1.00 | 1.00 |" in md  # ratios to the same run's f16, for results stored without them
    res["rows"][1]["counters"] = {"kv_deferred_conversions": 1}
    res["rows"][1]["bits_per_value"] = 4.5
    assert "| 64 | q4_0 | 4.500 | on |" in decode.to_markdown(res)


def _speed_rows() -> list[dict]:
    row = dict(kld_mean=0.0, kld_p99=0.0, kld_max=0.0, same_top1_pct=100.0, ppl=12.0, kld_step0=0.0, counters=None)
    return [{**row, "prefill": 64, "cache": "f16", "deferred": False, "prefill_tps": 80.0, "decode_tps": 20.0},
            {**row, "prefill": 64, "cache": "isoquant3_0", "deferred": True, "prefill_tps": 80.0, "decode_tps": 19.0},
            {**row, "prefill": 4096, "cache": "f16", "deferred": False, "prefill_tps": 40.0, "decode_tps": 5.0},
            {**row, "prefill": 4096, "cache": "isoquant3_0", "deferred": True, "prefill_tps": 38.0,
             "decode_tps": 8.0}]


def test_speeds_are_compared_with_f16_at_the_same_prefill():
    rows = _speed_rows()
    decode.compare(rows)
    assert rows[3]["prefill_vs_f16"] == pytest.approx(0.95) and rows[3]["decode_vs_f16"] == pytest.approx(1.6)
    assert rows[1]["decode_vs_f16"] == pytest.approx(0.95) and rows[2]["decode_vs_f16"] == 1.0
    rows = [r for r in _speed_rows() if r["prefill"] == 4096 and r["cache"] != "f16"]
    decode.compare(rows)  # no baseline at that prefill: no ratio, not an error
    assert rows[0]["decode_vs_f16"] is None


def test_roofline_adds_the_slower_of_read_and_arithmetic_to_f16s_shortest_step():
    rows = _speed_rows()
    bw, rate = 10e9, 100e9
    # (K/V bytes, FLOPs): at 4096 the f16 read (0.05 s) binds, the iso3 read is cheaper than its arithmetic (0.02 s)
    costs = {("f16", 64): (1e6, 1e6), ("isoquant3_0", 64): (2e5, 1e6),
             ("f16", 4096): (5e8, 2e9), ("isoquant3_0", 4096): (1e8, 2e9)}
    decode.with_roofline(rows, costs, bw, rate)
    assert rows[2]["roofline_tps"] == pytest.approx(1 / (1 / 20 + 0.05))
    assert rows[3]["roofline_tps"] == pytest.approx(1 / (1 / 20 + 0.02))
    assert rows[3]["decode_over_roofline"] == pytest.approx(8.0 * (1 / 20 + 0.02))
    with pytest.raises(decode.DecodeError, match="f16 baseline"):
        decode.with_roofline([r for r in _speed_rows() if r["cache"] != "f16"], costs, bw, rate)


def test_markdown_shows_roofline_columns_only_when_measured():
    rows = _speed_rows()
    decode.compare(rows)
    res = {"model": "m.gguf", "text": "t.txt", "tokens": 8, "threads": 2, "n_batch": 512, "rows": rows}
    md = decode.to_markdown(res)
    assert "| decode vs f16 |" in md and "roofline" not in md and "Note:" not in md
    assert "Note: a build ran beside it\n" in decode.to_markdown({**res, "note": "a build ran beside it"})
    assert "| 4096 | isoquant3_0 | – | on (no effect¹) |" in md and "| 38.0 | 8.0 | 0.95 | 1.60 |" in md
    decode.with_roofline(rows, {(c, n): (1e8, 1e9) for c in ("f16", "isoquant3_0") for n in (64, 4096)}, 1e10, 1e11)
    res["roofline"] = {"bandwidth": [1e10, 1.2e10], "f32_rate": [1e11, 1.1e11], "step0_prefill": 64}
    md = decode.to_markdown(res)
    assert "decode / roofline |" in md and "10.0 GB/s before, 12.0 after" in md
    head, sep = (ln for ln in md.splitlines() if ln.startswith("| prefill N") or ln.startswith("|---:"))
    assert head.count("|") == sep.count("|")


def test_rounds_interleave_abba_and_keep_each_rounds_ratio(monkeypatch, tmp_path):
    from rotaryquant.bindings import accounting

    calls = []
    secs = {("f16", 1): 2.0, ("q4_0", 1): 4.0, ("q4_0", 2): 3.0, ("f16", 2): 2.5}  # prefill seconds per round

    def fake_run_once(model, toks, *, n, m, cache, deferred=False, threads=2):
        calls.append(cache)
        rnd = 1 + sum(c == cache for c in calls[:-1])
        logits = np.zeros((m + 1, 8), np.float32)
        logits[:, 0] = 1.0 if cache == "f16" or rnd > 1 else 0.0  # only round 1's logits are scored
        return {"logits": logits, "prefill_s": secs[(cache, rnd)], "decode_s": 1.0, "counters": None}

    monkeypatch.setattr(decode, "run_once", fake_run_once)
    monkeypatch.setattr(decode, "text_tokens", lambda model, text, k: [i % 8 for i in range(k)])
    monkeypatch.setattr(accounting, "kv_bits_or_none", lambda *a, **k: {})
    res = decode.run(tmp_path / "m.gguf", tmp_path / "t.txt", cache_types=["q4_0"], prefill=[100], tokens=2,
                     deferred=[False], rounds=2, progress=lambda *_: None)
    assert calls == ["f16", "q4_0", "q4_0", "f16"]
    base, q4 = res["rows"]
    assert base["prefill_tps_rounds"] == [50.0, 40.0] and base["prefill_tps"] == 45.0
    assert q4["prefill_tps_rounds"] == [25.0, pytest.approx(33.33)] and q4["prefill_vs_f16_rounds"] == [
        0.5, pytest.approx(33.33 / 40)]
    assert q4["prefill_vs_f16"] == pytest.approx((25 + 33.33) / 2 / 45, rel=1e-3) and q4["kld_mean"] > 0
    md = decode.to_markdown(res)
    assert "medians of 2 interleaved rounds" in md and "| 0.50 / 0.83 |" in md
    head, sep = (ln for ln in md.splitlines() if ln.startswith("| prefill N") or ln.startswith("|---:"))
    assert head.count("|") == sep.count("|") == md.splitlines()[-1].count("|")
    with pytest.raises(decode.DecodeError, match="rounds must be at least 1"):
        decode.run(tmp_path / "m.gguf", tmp_path / "t.txt", cache_types=["q4_0"], prefill=[100], rounds=0)


def test_report_picks_up_decode_results(tmp_path):
    from rotaryquant.eval import report

    row = dict(kld_mean=0.05, kld_p99=0.2, kld_max=0.3, same_top1_pct=90.0, ppl=12.0, kld_step0=0.01,
               prefill_tps=100.0, decode_tps=10.0, kld_steps=[0.01, 0.09], counters=None)
    for name, n in (("decode", 512), ("decode-qwen", 2048)):
        res = {"model": f"{name}.gguf", "text": "t.txt", "tokens": 1, "rows": [
            {**row, "prefill": n, "cache": "f16", "deferred": False},
            {**row, "prefill": n, "cache": "q4_0", "deferred": False}]}
        (tmp_path / f"{name}.json").write_text(json.dumps(res))
    md = report.build(tmp_path).read_text()
    assert "## Decode-time KV quality: decode.gguf" in md and "## Decode-time KV quality: decode-qwen.gguf" in md
    assert "| 2048 | q4_0 | – | off | 0.05000 |" in md
    assert "_not run: `rq-eval decode`_" not in md and "_not run: `rq-eval niah`_" in md
    res["rounds"] = 2
    (tmp_path / "prefill-32k.json").write_text(json.dumps(res))
    md = report.build(tmp_path).read_text()
    assert "## Prefill speed (and decode-time KV quality): decode-qwen.gguf" in md and "medians of 2 interleaved" in md
    assert "Source: [prefill-32k.json](prefill-32k.json)" in md


# --- a small real run ----------------------------------------------------------------------------


@pytest.mark.slow
def test_gemma3_f16_is_exact_and_q4_0_is_not(gemma3):
    from rotaryquant import data

    res = decode.run(gemma3, data.evaluation_text(), cache_types=["f16", "q4_0"], prefill=[64], tokens=8,
                     deferred=[False], progress=lambda *_: None)
    rows = {r["cache"]: r for r in res["rows"]}
    assert len(res["rows"]) == 2
    f16, q4 = rows["f16"], rows["q4_0"]
    assert f16["kld_mean"] == 0.0 and f16["kld_max"] == 0.0 and f16["same_top1_pct"] == 100.0
    assert len(q4["kld_steps"]) == 9 and q4["kld_mean"] > 0 and q4["kld_max"] > 0
    assert 1 < f16["ppl"] < 1e4 and 1 < q4["ppl"] < 1e4 and q4["ppl"] != f16["ppl"]
    assert f16["prefill_tps"] > 0 and q4["decode_tps"] > 0
    assert "| 64 | q4_0 | 4.500 | off |" in decode.to_markdown(res)
    assert [r["bits_per_value"] for r in res["rows"]] == [16.0, 4.5]
    # a second F16 run gives the same logits bit for bit: what "step 0 equals the F16 run" relies on
    toks = decode.text_tokens(gemma3, data.evaluation_text(), 64 + 8 + 1)
    a = decode.run_once(gemma3, toks, n=64, m=2, cache="f16")["logits"]
    b = decode.run_once(gemma3, toks, n=64, m=2, cache="f16")["logits"]
    assert np.array_equal(a, b)


@pytest.mark.slow
def test_gemma3_deferred_prefill_step0_is_exact(gemma3):
    """Deferred prefill: the prompt attends exact F16 K/V, so the prefill's logits are the F16 run's;
    the decode steps then read the quantised cache."""
    from rotaryquant import data

    assert decode.deferred_supported()
    toks = decode.text_tokens(gemma3, data.evaluation_text(), 64 + 4 + 1)
    base = decode.run_once(gemma3, toks, n=64, m=4, cache="f16")
    r = decode.run_once(gemma3, toks, n=64, m=4, cache="q4_0", deferred=True)
    assert base["counters"]["kv_deferred_conversions"] == 0  # counters are the context's own
    s = decode.score(base["logits"], r["logits"], np.asarray(toks[64:69]))
    assert r["counters"]["kv_deferred_conversions"] >= 1, r["counters"]
    assert np.array_equal(base["logits"][0], r["logits"][0]) and s["kld_step0"] == 0.0
    assert max(s["kld_steps"][1:]) > 0


@pytest.mark.slow
def test_gemma3_cpu_kernels_ab(gemma3):
    """The AVX-512 IsoQuant kernels (int8 query and K codebook, bf16 V weights) against the float ones on a real model:
    each run says which kernels ran, and the roundings cost nothing against F16. They do move the logits: Gemma3-270M
    turns any rounding in attention into KLD ~0.01-0.07 between two runs (the unfused F16 twin differs from the float
    kernel as much), so the check is each run's distance to F16 (measured 0.0250 vs 0.0253 over 16 steps with K statistics from
    positions 0-1023; 0.0411 vs 0.0322 with spread ones, too few steps for a ratio, hence 64), not to each other."""
    from rotaryquant import bindings, data

    n, m = 256, 64
    toks = decode.text_tokens(gemma3, data.evaluation_text(), n + m + 1)
    spec = "isoquant3_0+w16+self"
    base = decode.run_once(gemma3, toks, n=n, m=m, cache="f16")
    fast = decode.run_once(gemma3, toks, n=n, m=m, cache=spec)
    bindings.set_cpu_avx512(False)
    try:
        slow = decode.run_once(gemma3, toks, n=n, m=m, cache=spec)
    finally:
        bindings.set_cpu_avx512(True)
    assert base["cpu_kernels"] is None and slow["cpu_kernels"] == "float"
    if fast["cpu_kernels"] == "float":
        pytest.skip("this CPU has no AVX-512 VNNI/BF16: both runs took the float kernels")
    assert fast["cpu_kernels"] == "AVX-512"
    t = np.asarray(toks[n:n + m + 1])
    k_fast = decode.score(base["logits"], fast["logits"], t)["kld_mean"]
    k_slow = decode.score(base["logits"], slow["logits"], t)["kld_mean"]
    assert decode.score(slow["logits"], fast["logits"], t)["kld_mean"] > 0  # they are different kernels
    assert k_fast < 1.25*k_slow, (k_fast, k_slow)


# --- command lines -------------------------------------------------------------------------------


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "rotaryquant.eval.cli", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("args, message", [
    (["--kv", "q4_0,q9_9"], "unknown ggml type 'q9_9'"),
    (["--tokens", "0"], "at least 1"),
    (["--prefill", "64", "--deferred", "maybe"], "--deferred takes off, on or off,on"),
    (["--prefill", "5000000"], "too short"),  # more tokens than the text has bytes: no model load
    # tokenised: fewer tokens than the run needs
    (["--prefill", "512", "--tokens", "8", "--text", "SHORT"], "the longest run needs 521"),
    (["--prefill", "64", "--text", "/nonexistent.txt"], "does not exist"),
])
def test_decode_cli_rejects_bad_input_and_writes_nothing(tmp_path, args, message):
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be, that is the question. " * 15)  # ~650 bytes, ~150 tokens
    out = tmp_path / "decode"
    proc = _cli("decode", *[str(short) if a == "SHORT" else a for a in args], "-o", str(out))
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert message in proc.stderr and "rq-eval: error:" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.with_suffix(".json").exists() and not out.with_suffix(".md").exists()


def test_perplexity_command_sets_the_deferred_switch_and_clears_the_callers(monkeypatch, tmp_path):
    monkeypatch.setenv("LLAMA_KV_DEFERRED", "1")  # the caller's setting must not leak into plain runs
    cmd, env = perplexity.command(tmp_path / "m.gguf", tmp_path / "t.txt", cache_type="q4_0")
    assert "LLAMA_KV_DEFERRED" not in env and cmd[cmd.index("-ctk") + 1] == "q4_0"
    _, env = perplexity.command(tmp_path / "m.gguf", tmp_path / "t.txt", cache_type="q4_0", deferred=True)
    assert env["LLAMA_KV_DEFERRED"] == "1"


def test_ppl_deferred_reaches_the_subprocess(monkeypatch, tmp_path):
    calls = []

    def fake_run(cmd, env, **_):
        calls.append((cmd, env))
        if "--kl-divergence" not in cmd:  # the baseline saves its logits; kvquality deletes the file
            open(cmd[cmd.index("--kl-divergence-base") + 1], "w").close()
        out = "Final estimate: PPL = 12.5000 +/- 0.5\nMean    KLD:   0.010000 ± 0.001\n"
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    monkeypatch.delenv("LLAMA_KV_DEFERRED", raising=False)
    monkeypatch.setattr(perplexity.subprocess, "run", fake_run)
    out = tmp_path / "kvq"
    assert cli.main(["ppl", "--kv", "q4_0,isoquant3_0", "--ctx", "128", "--chunks", "1", "--deferred",
                     "-o", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    labels = [r["label"] for r in res["rows"]]
    assert labels == ["f16", "q4_0", "q4_0 deferred", "isoquant3_0", "isoquant3_0 deferred"]
    for (cmd, env), r in zip(calls, res["rows"]):
        assert (env.get("LLAMA_KV_DEFERRED") == "1") == r["deferred"] == r["label"].endswith(" deferred")
        assert cmd[cmd.index("-ctk") + 1] == r["label"].split()[0]
    md = out.with_suffix(".md").read_text()
    assert "| 128 | q4_0 deferred |" in md and "rq-eval decode" in md
    # the fake runs give the same KLD with and without the switch: the table says it had no effect
    assert "Deferred prefill had no effect" in md
    # without --deferred, no deferred rows
    calls.clear()
    kvquality.run(tmp_path / "m.gguf", tmp_path / "t.txt", kv_types=["q4_0"], ctxs=[128], chunks=1,
                  progress=lambda *_: None)
    assert [("LLAMA_KV_DEFERRED" in env) for _, env in calls] == [False, False]
