"""rq-plan: byte predictions against ggml and llama.cpp, ranking, errors, JSON, and one measured case."""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import pytest

from rotaryquant import assets, kvtypes
from rotaryquant import plan as P
from rotaryquant.bindings import row_size, type_from_name
from rotaryquant.plan.results import _norm_spec
from rotaryquant.plan_cli import main


@pytest.fixture(scope="module")
def smol_header(smollm2) -> P.Header:
    return P.read_header(smollm2)


@pytest.fixture(scope="module")
def toy_moe(smollm2, tmp_path_factory):
    """(HF folder, its rq-convert output without kurtosis promotion): a tiny random Qwen2-MoE."""
    from rotaryquant.converter.convert import Options, convert
    from rotaryquant.converter.hf_folders import qwen2moe_toy_folder, smollm2_hf_folder

    root = tmp_path_factory.mktemp("plan-moe")
    tok = smollm2_hf_folder(smollm2, root / "smol-2L", n_layers=2)
    hf = qwen2moe_toy_folder(root / "moe-hf", tok, n_experts=8)
    out = root / "moe.gguf"
    convert(hf, out, Options(recipe="rotaryquant", promote=False, progress=False))
    return hf, out


# --- sizes and the GGUF header -----------------------------------------------------------------------

def test_parse_size():
    assert P.parse_size("16G") == 16 << 30 == P.parse_size("16GiB") == P.parse_size("16 g")
    assert P.parse_size("16GB") == 16 * 10**9
    assert P.parse_size("512M") == 512 << 20
    assert P.parse_size("1.5G") == 3 << 29
    for bad in ("", "16Q", "-1G", "0", "G"):
        with pytest.raises(P.PlanError, match="size"):
            P.parse_size(bad)


def test_header_bytes_are_ggml_row_sizes(smollm2, smol_header):
    h = smol_header
    assert (h.arch, h.get("block_count"), h.n_vocab) == ("llama", 30, 49152)
    for t in h.tensors:
        assert t.nbytes == row_size(t.type, t.ne[0]) * math.prod(t.ne[1:])
    # the data region is exactly the tensors, aligned
    last = max(h.tensors, key=lambda t: t.offset)
    assert h.data_offset + last.offset + last.nbytes == smollm2.stat().st_size
    assert P.identify(h)[0].id == "smollm2-135m"


def test_skeleton_is_sparse_and_llama_cpp_accounts_for_it(smol_header, tmp_path):
    q8 = type_from_name("q8_0")
    types = {t.name: q8 for t in smol_header.tensors if len(t.ne) == 2}
    sk = tmp_path / "q8.gguf"
    size = P.write_skeleton(smol_header, types, sk)
    h2 = P.read_header(sk)
    assert {t.name: t.type for t in h2.tensors if len(t.ne) == 2} == types
    assert h2.data_bytes == sum(P.tensor_bytes(types.get(t.name, t.type), t.ne) for t in smol_header.tensors)
    assert sk.stat().st_size == h2.data_offset + size
    assert sk.stat().st_blocks * 512 < 8 << 20           # a hole, not 130 MB of zeros
    assert h2.fields["tokenizer.ggml.tokens"] == smol_header.fields["tokenizer.ggml.tokens"]
    with P.NoAllocModel(sk) as m:                        # llama.cpp loads it without reading data
        placed = [n for names in m.placement.values() for n in names]
        cost = m.context("q8_0", 1024)
    assert set(placed) == {t.name for t in h2.tensors}
    assert cost.kv > 0 and cost.compute > 0 and not cost.error


def test_kv_bytes_from_llama_cpp_match_ggml_rows(smollm2, smol_header):
    """llama.cpp's KV accounting = layers x (K + V rows) x cells; eq. 12 = an F16 cache of T tokens."""
    dims = P._layer_dims(smol_header)
    assert dims == [(192, 192)] * 30                    # 3 KV heads x 64
    with P.NoAllocModel(smollm2) as m:
        for spec in ("f16", "q8_0", "q4_0", "q8_0/q4_0"):
            k, v = (type_from_name(x) for x in (spec.split("/") * 2)[:2])
            want = sum(row_size(k, dk) + row_size(v, dv) for dk, dv in dims) * 4096
            assert abs(m.context(spec, 4096).kv - want) <= 0.01 * P.MiB, spec
        f16 = m.context("f16", 4096).kv
    assert abs(P.deferred_transient(smol_header, 4096) - f16) <= 0.01 * P.MiB
    assert P.deferred_transient(smol_header, 2048) == 2 * 30 * 3 * 64 * 2048 * 2   # 2·L·H_kv·d·T·2


def test_isoquant_on_head_size_64_is_the_64_wide_type(smollm2):
    # llama resolves isoquant3_0 to isoquant3_64 for SmolLM2's 64-wide heads: planned, at that type's size
    from rotaryquant import bindings

    with P.NoAllocModel(smollm2) as m:
        cost = m.context("isoquant3_0", 512)
    assert not cost.error, cost.error
    want = 2 * 30 * 512 * bindings.row_size(bindings.GGMLType.ISOQUANT3_64, 3 * 64)   # K+V, L, T, H_kv*d
    assert abs(cost.kv - want) <= 0.01 * P.MiB, (cost.kv, want)
    # and ranked at that type's bits per value, which is what the cache holds (llama.cpp pads the cache a little: 0.2 %)
    assert P._kv_bits("isoquant3_0", P._head_widths(P.read_header(smollm2))) == pytest.approx(8 * cost.kv / (2 * 30 * 512 * 3 * 64), rel=5e-3)
    assert P._kv_bits("isoquant3_0", (64, 64)) > P._kv_bits("isoquant3_0") == pytest.approx(3.125)
    assert P._kv_bits("q8_0/isoquant4_0", (64, 64)) == pytest.approx((8.5 + 4.25) / 2)


def test_recipe_prediction_equals_rq_convert_output(toy_moe):
    """HF input: the plan's types and bytes per tensor are what rq-convert writes (promotions off)."""
    hf, out = toy_moe
    with pytest.MonkeyPatch.context():
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            h = P.hf_header(hf, Path(tmp))
            types, _ = P.recipe_types(h, "rotaryquant")
            real = P.read_header(out)
            got = {t.name: (types.get(t.name, t.type), P.tensor_bytes(types.get(t.name, t.type), t.ne)) for t in h.tensors}
            assert got == {t.name: (t.type, t.nbytes) for t in real.tensors}
            roles, total, _ = P._role_bytes(h, types)
            assert total == real.data_bytes and roles["ffn_routed"] > 0 and roles["ffn_shared"] > 0


def test_plan_from_an_hf_folder(toy_moe):
    hf, _ = toy_moe
    plan = P.make_plan(hf, budget=1 << 30, ctx=1024, recipes=["rotaryquant", "bf16"], kv=["f16", "q8_0"])
    assert plan.source_kind == "hf" and {c.weights for c in plan.candidates} == {"rotaryquant", "bf16"}
    bf16 = next(c for c in plan.candidates if c.weights == "bf16")
    assert bf16.weights_quality.text() == "0 (exact)"        # the folder is BF16: lossless
    assert plan.commands[0].startswith("rq-convert ") and f"--recipe {plan.winner.weights}" in plan.commands[0]


def test_expert_rule_selects_exactly_the_experts(toy_moe):
    _, out = toy_moe
    h = P.read_header(out)
    experts = {t.name for t in h.tensors if P._EXPERTS.match(t.name)}
    assert experts and all("_exps." in n for n in experts)
    rule = P.expert_rule([0])
    rx = re.compile(rule.rsplit("=", 1)[0])
    assert {t.name for t in h.tensors if rx.search(t.name)} == {n for n in experts if n.startswith("blk.0.")}
    # a GPU budget below the weights moves experts to RAM, layer by layer, and says how many bytes
    all_in = P.make_plan(out, budget=1 << 40, ctx=512, device="cuda", kv=["f16"], recipes=[]).winner
    assert all_in.experts_on_cpu == 0 and "-ot" not in " ".join(all_in.predicted)
    exp_bytes = sum(t.nbytes for t in h.tensors if t.name in experts)
    plan = P.make_plan(out, budget=all_in.peak - exp_bytes // 3, ctx=512, device="cuda", kv=["f16"], recipes=[])
    c = plan.winner
    assert c.experts_on_cpu >= 1 and c.bytes["experts_cpu"] == sum(
        t.nbytes for t in h.tensors if (m := P._EXPERTS.match(t.name)) and int(m.group(1)) < c.experts_on_cpu)
    assert "-ngl 99" in plan.commands[-1] and '-ot "blk\\.(0' in plan.commands[-1]


# --- quality and ranking -----------------------------------------------------------------------------

def test_quality_comes_only_from_measurements(tmp_path):
    meas = P.load_measurements()
    qwen = next(k for k in P.KNOWN_MODELS if k.id == "qwen2.5-coder-1.5b")
    q = P._kv_quality("isoquant4_0+calib", meas, qwen, True)
    assert q.kld == pytest.approx(0.0198, abs=1e-4) and "qwen.kc.gguf" in q.where and "ctx 512" in q.where
    smol = next(k for k in P.KNOWN_MODELS if k.id == "smollm2-135m")
    q = P._kv_quality("isoquant3_0+calib", meas, smol, True)   # measured on SmolLM2's calibrated file
    assert q.kld is not None and "smollm2.kc.gguf" in q.where and "ctx 512" in q.where
    # a model without its own measurement: unknown, with the other models' numbers as evidence
    q = P._kv_quality("q8_0", [m for m in meas if m.model != smol.id], smol, True)
    assert q.kld is None and q.text() == "unknown" and {e["model"].split(" (")[0] for e in q.elsewhere} >= {
        "Gemma3-270M Q4_K_M", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M"}
    assert P._kv_quality("f16", meas, smol, True).text() == "0 (exact)"
    # other weights than the measured file: the same numbers are only evidence
    assert P._kv_quality("isoquant4_0+calib", meas, qwen, False).kld is None
    # no results at all: unknown everywhere, and ranked after anything with evidence
    q = P._kv_quality("q8_0", P.load_measurements(tmp_path), smol, True)
    assert q.kld is None and not q.elsewhere and q.key == math.inf


def _cand(w, kv, peak, fits, wq, kq, error=""):
    return P.Candidate(w, kv, 512, 512, peak=peak, fits=fits, error=error, weights_quality=wq, kv_quality=kq)


def test_ranking():
    exact = P.Quality(0.0, True)
    ev = lambda x: P.Quality(elsewhere=[{"model": "m", "ctx": 512, "kld": x, "source": "s"}])  # noqa: E731
    cands = [_cand("keep", "isoquant3_0+calib", 80, True, exact, P.Quality(0.057)),
             _cand("keep", "q8_0", 90, True, exact, ev(0.007)),
             _cand("keep", "f16", 200, False, exact, exact),
             _cand("itq3", "f16", 70, True, P.Quality(), exact),
             _cand("keep", "isoquant4_0", 0, False, exact, P.Quality(), error="head size"),
             _cand("keep", "q4_0+calib", 85, True, exact, P.Quality(0.018))]
    order = [(c.weights, c.kv) for c in P._sort(cands)]
    assert order == [("keep", "q8_0"), ("keep", "q4_0+calib"), ("keep", "isoquant3_0+calib"), ("itq3", "f16"),
                     ("keep", "f16"), ("keep", "isoquant4_0")]
    assert [c.rank for c in P._sort(cands)] == list(range(1, 7))


def test_plan_picks_the_best_that_fits(gemma3):
    plan = P.make_plan(gemma3, budget=400 * P.MiB, ctx=8192, recipes=[])
    w = plan.winner
    assert w.fits and w.peak <= 400 * P.MiB and w.weights == "keep"
    assert w.kv_quality.kld is not None                    # measured on this very file
    better = [c for c in plan.candidates if c.quality_key < w.quality_key and not c.error]
    assert all(not c.fits for c in better)
    assert plan.commands[-1].split()[0].endswith("llama-server") and "-c 8192" in plan.commands[-1]
    k, v = kvtypes.split(w.kv)
    assert f"-ctk {k} -ctv {v}" in plan.commands[-1]
    if w.kv.endswith("+calib"):
        assert plan.commands[0].startswith("rq-calibrate ")


def test_plan_counts_and_commands_the_default_window(gemma3):
    # on the CPU an IsoQuant V cache runs with llama.cpp's default window: the plan costs the window's rows, ranks it
    # by the window's measured KLD (docs/results/kv-quality-window-gemma3: 0.0193 vs 0.0797 without, 2K) and its
    # command names the window (it used to plan "isoquant3_0+calib" and pass --kv-window 0: the default turned off)
    assert kvtypes.as_run("isoquant3_0+calib") == "isoquant3_0+w16+calib"
    assert kvtypes.as_run("isoquant3_0/q8_0+calib") == "isoquant3_0/q8_0+calib"   # V not IsoQuant: no window
    assert _norm_spec("isoquant3_0/isoquant3_0+w16+calib") == "isoquant3_0+w16+calib"
    plan = P.make_plan(gemma3, budget=1 << 40, ctx=2048, recipes=[])
    c = next(c for c in plan.candidates if c.kv == "isoquant3_0+w16+calib")
    assert c.kv_quality.kld is not None and "window" in c.kv_quality.where, c.kv_quality.where
    assert plan.winner.kv_quality.kld <= c.kv_quality.kld
    plain = P.make_plan(gemma3, budget=1 << 40, ctx=2048, recipes=[], kv=["isoquant3_0+calib", "isoquant3_0+w16+calib"])
    one, win = (next(x for x in plain.candidates if x.kv == k) for k in ("isoquant3_0+calib", "isoquant3_0+w16+calib"))
    assert win.bytes["kv"] > one.bytes["kv"] or win.peak > one.peak
    top = P.make_plan(gemma3, budget=1 << 40, ctx=2048, recipes=[], kv=["isoquant3_0+calib+w16"])
    assert "--kv-window 16" in top.commands[-1] and top.commands[0].startswith("rq-calibrate ")
    # a GPU plan has no window: the device kernels lack it
    gpu = P.make_plan(gemma3, budget=1 << 40, ctx=2048, recipes=[], device="cuda")
    assert not any(kvtypes.window(x.kv) for x in gpu.candidates)


# --- the command line --------------------------------------------------------------------------------

def test_cli_json(smollm2, capsys):
    assert main([str(smollm2), "--budget", "1G", "--ctx", "2048", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["winner"]["fits"] and d["winner"]["peak"] <= 1 << 30 and d["commands"]
    assert {"weights_mapped", "kv", "compute", "base"} <= set(d["winner"]["bytes"])
    # head size 64: the IsoQuant specs are planned (llama uses the 64-wide siblings), not refused
    # on the CPU, as llama.cpp runs them: IsoQuant V with its default window
    assert any(c["kv"] == "isoquant3_0+w16+calib" and not c["error"] for c in d["candidates"])
    assert not any(c["kv"] == "isoquant3_0+calib" for c in d["candidates"])


def test_cli_errors(smollm2, tmp_path, capsys):
    def err(*argv) -> str:
        assert main(list(argv)) == 1
        return capsys.readouterr().err.strip().splitlines()[-1]

    msg = err(str(smollm2), "--budget", "64M", "--ctx", "4096")
    assert msg.startswith("rq-plan: error: no candidate fits 64 MiB at --ctx 4096") and "needs" in msg
    msg = err(str(smollm2), "--budget", "300M", "--ctx", "32768", "--recipe", "q8_0")
    assert "largest context that fits is --ctx" in msg
    n = int(re.search(r"--ctx (\d+)$", msg).group(1))
    assert 1024 <= n < 32768 and P.make_plan(smollm2, budget=300 * P.MiB, ctx=n, recipes=[]).winner
    assert "does not exist" in err(str(tmp_path / "nope.gguf"), "--budget", "1G", "--ctx", "512")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all" * 100)
    assert "neither a GGUF file" in err(str(junk), "--budget", "1G", "--ctx", "512")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2.read_bytes()[:100_000])
    assert "truncated" in err(str(cut), "--budget", "1G", "--ctx", "512")
    assert "cannot read the size" in err(str(smollm2), "--budget", "lots", "--ctx", "512")


def test_cli_unknown_hf_architecture(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"]}))
    assert main([str(tmp_path), "--budget", "1G", "--ctx", "512"]) == 1
    msg = capsys.readouterr().err.strip().splitlines()[-1]
    assert "'NoSuchModelForCausalLM'" in msg and "not supported by llama.cpp's converter" in msg


def test_cli_unknown_architecture(smol_header, tmp_path, capsys):
    """A GGUF whose architecture llama.cpp does not know: llama.cpp's reason, one line."""
    h = smol_header
    raw = h.kv_raw
    key = b"general.architecture"
    i = raw.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4
    n = struct.unpack_from("<Q", raw, i)[0]
    h2 = P.Header(h.path, h.version, h.fields, raw[:i] + struct.pack("<Q", 5) + b"nosuc" + raw[i + 8 + n:],
                  h.n_kv, h.tensors, h.alignment, h.data_offset, h.file_size)
    out = tmp_path / "alien.gguf"
    P.write_skeleton(h2, {}, out)
    assert main([str(out), "--budget", "1G", "--ctx", "512"]) == 1
    msg = capsys.readouterr().err.strip().splitlines()[-1]
    assert msg.startswith("rq-plan: error: llama.cpp cannot load alien.gguf") and "nosuc" in msg


def test_plans_qwen_1_5b_at_32k():
    # the < 5 s answer time is a benchmark (rq-plan --verify writes it to plan-verify.json), not a test
    try:
        qwen = assets.model_path("qwen2.5-coder-1.5b")
    except assets.AssetError:
        pytest.skip("the optional Qwen2.5-Coder-1.5B asset is not fetched")
    plan = P.make_plan(qwen, budget=2 << 30, ctx=32768)
    assert plan.winner.peak <= 2 << 30


# --- measured: predicted peak RSS vs llama-server's VmHWM --------------------------------------------

@pytest.mark.slow
def test_predicted_peak_rss_within_10_percent(smollm2):
    from rotaryquant import plan_verify as V

    row = V.measure(V.Case("smollm2-135m", smollm2, 1024, "f16"), progress=lambda s: None)
    assert row["within"], row
    assert abs(row["error_pct"]) <= 100 * V.TOLERANCE
