"""rotaryquant.eval.versus and .builds (rq-eval versus): configurations, the cache sizes builds log, rq-probe
against our own Python measurement path (its slow twin), failures recorded rather than raised."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from rotaryquant.eval import builds, decode, niah, versus, versus_md

# --- configurations -------------------------------------------------------------------------------------------


def test_config_parses_types_and_flags():
    c = versus.parse_config("ik:q4_0 -khad -vhad", ["ours", "ik"])
    assert (c.build, c.k, c.v, c.flags) == ("ik", "q4_0", "q4_0", ("-khad", "-vhad"))
    assert c.args() == ["-ctk", "q4_0", "-ctv", "q4_0", "-khad", "-vhad"]
    assert c.label == "ik:q4_0 -khad -vhad" and not c.is_base
    t = versus.parse_config("turbo:q8_0/turbo3", ["turbo"])
    assert (t.k, t.v, t.cache) == ("q8_0", "turbo3", "q8_0/turbo3")
    assert versus.parse_config("ours:f16", ["ours"]).is_base


@pytest.mark.parametrize("spec,match", [("ours", "a configuration BUILD:K"), ("ours:", "a configuration BUILD:K"), ("nope:q8_0", "names build 'nope'")])
def test_bad_configs_are_refused_by_name(spec, match):
    with pytest.raises(versus.VersusError, match=match):
        versus.parse_config(spec, ["ours"])


def test_every_build_gets_its_own_f16_first():
    cs = [versus.parse_config(s, ["a", "b"]) for s in ("b:q4_0", "a:q8_0", "b:f16", "a:q4_0 -x")]
    assert [c.label for c in versus.with_baselines(cs)] == ["b:f16", "b:q4_0", "a:f16", "a:q8_0", "a:q4_0 -x"]


def test_rounds_alternate_order():
    cs = [versus.Config("a", t, t) for t in ("f16", "q8_0")]
    assert [(r, c.k) for r, c in versus._rounds_order(cs, 3)] == [
        (0, "f16"), (0, "q8_0"), (1, "q8_0"), (1, "f16"), (2, "f16"), (2, "q8_0")]


# --- bits per value from the log -------------------------------------------------------------------------------

SHAPE = versus.KvShape(n_layer=18, n_head_kv=1, k_len=256, v_len=256)


def test_bits_from_upstream_lines_sum_every_cache_and_our_window():
    log = ("llama_kv_cache: size =    1.17 MiB (  1024 cells,   3 layers,  2/2 seqs), K (isoquant3_0):    0.59 MiB, "
           "V (isoquant3_0):    0.59 MiB\n"
           "init_window: recent window = 16 positions (K and V in F16 ...: 32 rows, 0.10 MiB)\n"
           "llama_kv_cache: size =    1.46 MiB (   768 cells,  15 layers,  2/1 seqs), K (isoquant3_0):    0.73 MiB, "
           "V (isoquant3_0):    0.73 MiB\n")
    r = versus.kv_bits(log, SHAPE)
    values = (1024 * 2 * 3 + 768 * 15) * 512  # cells are per stream: 2 streams of 1024
    assert r["bits_per_value"] == pytest.approx((0.59 * 2 + 0.10 + 0.73 * 2) * 2**23 / values, abs=1e-3)
    assert r["kv_mib"] == pytest.approx(2.74) and r["logged_types"] == ["isoquant3_0/isoquant3_0"]


def test_bits_from_ik_lines_use_its_n_ctx_and_every_layer():
    log = ("llama_init_from_model: n_ctx         = 4096\n"
           "llama_init_from_model: KV self size  =   20.25 MiB, K (q4_0):   10.12 MiB, V (q4_0):   10.12 MiB\n"
           "llama_init_from_model: k_cache_hadam = 1\n")
    r = versus.kv_bits(log, SHAPE)
    assert r["bits_per_value"] == pytest.approx(20.24 * 2**23 / (4096 * 18 * 512), abs=1e-3)  # ~4.5
    assert r["notes"] == ["k_cache_hadam = 1"]


def test_a_log_without_size_lines_gives_no_bits():
    r = versus.kv_bits("something else\n", SHAPE)
    assert r["bits_per_value"] is None and r["kv_mib"] is None


def test_notes_keep_what_a_build_changed_once():
    log = ("llama_kv_cache: auto-asymmetric: GQA ratio 6:1 (n_head=12, n_head_kv=2) — upgrading K from turbo3 to q8_0\n"
           "init_k_center: K centring = on, self-calibrated (1024 tokens, 7.2 s; 3 of 3 layers)\n"
           "init_k_center: K centring = on, self-calibrated (1024 tokens, 8.1 s; 3 of 3 layers)\n"
           "rq_default_layer_types: per-layer K/V types (default): K of full-attention layer(s) 11 at 4 bits\n")
    notes = versus.kv_bits(log, SHAPE)["notes"]
    assert len(notes) == 3 and notes[0].startswith("auto-asymmetric") and "N s" in notes[1]
    assert notes[2].startswith("per-layer K/V types (default)")  # our cache's own types, which no size line names


def test_ratios_are_over_the_same_builds_f16_per_round():
    rows = [{"build": "a", "cache": "f16", "flags": [], "decode_tps": 10.0, "decode_tps_rounds": [10.0, 8.0]},
            {"build": "a", "cache": "q8_0", "flags": [], "decode_tps": 12.0, "decode_tps_rounds": [11.0, 10.0]},
            {"build": "b", "cache": "q8_0", "flags": [], "decode_tps": 5.0, "decode_tps_rounds": [5.0]}]
    versus._ratios(rows, ("decode_tps",))
    assert rows[1]["decode_tps_vs_f16"] == 1.2 and rows[1]["decode_tps_vs_f16_rounds"] == [1.1, 1.25]
    assert "decode_tps_vs_f16" not in rows[2]  # build b has no F16 row: no ratio rather than a wrong one


# --- builds ---------------------------------------------------------------------------------------------------


def test_build_spec_errors_name_the_fix(tmp_path):
    with pytest.raises(builds.BuildError, match="NAME=BIN_DIR"):
        builds.parse("just-a-path")
    with pytest.raises(builds.BuildError, match="no libllama.so in"):
        builds.parse(f"x={tmp_path}")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "libllama.so").write_bytes(b"")
    with pytest.raises(builds.BuildError, match="not a CMake build folder"):
        builds.parse(f"x={tmp_path / 'bin'}")


def test_our_build_is_found_with_its_api_switches(bin_dir):
    b = builds.ours()
    assert {"RQ_PROBE_FA_TYPE", "RQ_PROBE_RQ", "RQ_PROBE_SWA_FULL"} <= b.features
    assert "RQ_PROBE_HAD" not in b.features and "RQ_PROBE_BATCH4" not in b.features
    assert "RQ_PROBE_SEQ" in b.features  # llama_memory_seq_cp and kv_unified: --fill independent
    assert b.tool("llama-cli-missing", "llama-perplexity").name == "llama-perplexity"
    assert b.describe()["cmake"]["CMAKE_BUILD_TYPE"] == "Release"


@pytest.mark.parametrize("header, want", [
    ("struct p { bool kv_unified; };\nLLAMA_API void llama_memory_seq_cp(llama_memory_t mem,", {"RQ_PROBE_SEQ"}),
    ("LLAMA_API void llama_memory_seq_cp(llama_memory_t mem,", set()),  # no unified cache to copy within
    ("LLAMA_API void llama_kv_cache_seq_cp(\n struct llama_context * ctx,", {"RQ_PROBE_SEQ_KV"}),  # the older API
])
def test_the_fill_switches_read_from_llama_h(header, want):
    got = {k for k, rx in builds._FEATURES.items() if rx.search(header)}
    assert got & {"RQ_PROBE_SEQ", "RQ_PROBE_SEQ_KV"} == want


def test_probe_refuses_a_flag_this_build_lacks(bin_dir, smollm2, tmp_path):
    probe = builds.probe(builds.ours())
    (tmp_path / "t.txt").write_text("1 2 3 4\n")
    p = subprocess.run([str(probe), "decode", "-m", str(smollm2), "-c", "256", "--tokens", str(tmp_path / "t.txt"),
                        "--prefill", "2", "--steps", "1", "-khad"], capture_output=True, text=True)
    assert p.returncode == 2 and "unknown flag for this build: -khad" in p.stderr


# --- rq-probe against our Python path (the slow twin) ---------------------------------------------------------


@pytest.mark.slow
def test_probe_decode_logits_equal_the_python_decode_path(bin_dir, smollm2, text_file, tmp_path):
    n, m = 40, 3
    toks = decode.text_tokens(smollm2, text_file, n + m + 1)
    ref = decode.run_once(smollm2, toks, n=n, m=m, cache="f16", threads=2)["logits"]
    tf = versus._tokens_file(tmp_path / "t.txt", toks)
    out = tmp_path / "l.f32"
    cfg = versus.Config("ours", "f16", "f16")
    cmd = versus._probe_cmd(builds.ours(), "decode", smollm2, 256, cfg, 2, "--tokens", str(tf), "--prefill", str(n),
                            "--steps", str(m), "--logits", str(out))
    subprocess.run(cmd, check=True, capture_output=True)
    got = np.fromfile(out, np.float32).reshape(ref.shape)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.slow
def test_probe_needles_answer_as_the_python_needles(bin_dir, smollm2, text_file):
    kw = dict(ctxs=[1024], depths=[0.5], n_needles=2, threads=2, progress=lambda _: None)
    mine = versus.niah({"ours": builds.ours()}, [versus.Config("ours", "f16", "f16")], smollm2, text_file, **kw)
    ref = niah.run(smollm2, text_file, cache_types=["f16"], **kw)["rows"]
    assert [r["found"] for r in mine] == [r["found"] for r in ref]
    assert mine[0]["answers"] == ref[0]["answers"]


def test_needles_rows_are_saved_as_they_finish_and_held_ones_skipped(bin_dir, smollm2, text_file, monkeypatch):
    ran: list[str] = []

    def fake_run(cmd, timeout=None, env=None):
        ran.append(cmd[1])
        return 0, "1 2\n1 2\n", "", 0.1
    monkeypatch.setattr(versus, "_probe_cmd", lambda b, mode, model, ctx, cfg, t, *extra: ["rq-probe", cfg.label])
    monkeypatch.setattr(versus, "_run", fake_run)
    cfgs = [versus.Config("ours", "f16", "f16"), versus.Config("ours", "q8_0", "q8_0")]
    rows: list[dict] = []
    saved: list[int] = []
    out = versus.niah({"ours": builds.ours()}, cfgs, smollm2, text_file, ctxs=[512], depths=[0.1, 0.5],
                      n_needles=2, progress=lambda _: None, rows=rows, saved=lambda: saved.append(len(rows)),
                      skip={("ours:q8_0", 512, 42, 0.5)})
    assert out is rows and saved == [1, 2, 3]  # each haystack saved as it finished
    assert ran == ["ours:f16", "ours:q8_0", "ours:f16"]  # the held one was not run again
    assert [(r["config"], r["depth"]) for r in rows] == [("ours:f16", 0.1), ("ours:q8_0", 0.1), ("ours:f16", 0.5)]


def _fake_probe(monkeypatch, timings) -> list[list[str]]:
    """rq-probe replaced: each call recorded, logits of zeros written where asked, timings(cmd) as its JSON line."""
    calls: list[list[str]] = []

    def fake_run(cmd, timeout=None, env=None):
        calls.append(cmd)
        if "--logits" in cmd:
            np.zeros((5, 1 << 16), np.float32).tofile(cmd[cmd.index("--logits") + 1])
        return 0, json.dumps({"prefill_s": 1.0, "n_vocab": 1 << 16, **timings(cmd)}), "", 0.1
    monkeypatch.setattr(versus, "_probe_cmd", lambda b, mode, model, ctx, cfg, t, *extra: ["rq-probe", *cfg.args(),
                                                                                           *extra])
    monkeypatch.setattr(versus, "_run", fake_run)
    return calls


def test_decode_repeats_time_the_steps_again_and_take_their_median(bin_dir, smollm2, text_file, monkeypatch):
    def timings(cmd):
        x = 2.0 if "q8_0" in cmd else 1.0
        return {"decode_s": 9 * x, "decode_s_repeats": [9 * x, 1 * x, 2 * x]}
    calls = _fake_probe(monkeypatch, timings)
    rows = versus.decode({"ours": builds.ours()}, [versus.Config("ours", "q8_0", "q8_0")], smollm2, text_file,
                         prefill=8, steps=4, repeats=3, progress=lambda _: None)
    assert len(calls) == 2 and all(c[c.index("--repeat") + 1] == "3" for c in calls)
    q = next(r for r in rows if r["cache"] == "q8_0")
    assert q["decode_tps_repeats"] == [[0.222, 2.0, 1.0]]
    assert q["decode_tps"] == 1.0 and q["decode_tps_vs_f16"] == 0.5  # medians: 4 steps in 4 s, f16's in 2 s
    assert "timed 3 times after each prefill" in versus_md.to_markdown(
        {"model": "m", "text": "t", "threads": 2, "builds": {}, "decode": rows})


def test_decode_fills_run_each_configuration_once_per_fill(bin_dir, smollm2, text_file, monkeypatch):
    calls = _fake_probe(monkeypatch, lambda cmd: {"decode_s": 4 * (2.0 if "q8_0" in cmd else 1.0)
                                                  * (3.0 if "independent" in cmd else 1.0)})
    ours = builds.ours()
    cfgs = [versus.Config("ours", "q8_0", "q8_0")]
    rows = versus.decode({"ours": ours}, cfgs, smollm2, text_file, prefill=8, steps=4,
                         fills=("prompt", "independent"), progress=lambda _: None)
    assert [(r["cache"], r.get("fill")) for r in rows] == [("f16", None), ("q8_0", None), ("f16", "independent"),
                                                           ("q8_0", "independent")]
    indep = [c for c in calls if "independent" in c]
    assert len(calls) == 4 and len(indep) == 2 and not any("--logits" in c for c in indep)
    q, qi = rows[1], rows[3]
    assert q["kld_mean"] == 0.0 and "kld_mean" not in qi  # an independent fill caches other values: speed only
    assert qi["decode_tps"] == 0.167 and qi["decode_tps_vs_f16"] == pytest.approx(0.5, abs=0.01)  # over the independent f16's 4 steps in 12 s
    md = versus_md.to_markdown({"model": "m", "text": "t", "threads": 2, "builds": {}, "decode": rows})
    assert "| ours:q8_0 (independent fill) | – | – | – | – | – | – | 0.17 | 0.50 |" in md
    assert "Rows marked independent fill: each 512-token call" in md
    with pytest.raises(versus.VersusError, match="unknown fill sideways"):
        versus.decode({"ours": ours}, cfgs, smollm2, text_file, prefill=8, steps=4, fills=("sideways",))
    calls.clear()
    old = builds.Build("old", ours.bin_dir, ours.src, ours.lib_dirs, None,
                       ours.features - {"RQ_PROBE_SEQ", "RQ_PROBE_SEQ_KV"})
    with pytest.raises(versus.VersusError, match="llama_memory_seq_cp and kv_unified, or llama_kv_cache_seq_cp, "
                                                 "in llama.h, which old lack"):
        versus.decode({"old": old}, [versus.Config("old", "q8_0", "q8_0")], smollm2, text_file, prefill=8, steps=4,
                      fills=("independent",))
    assert not calls  # refused before anything ran


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["f16", "isoquant3_0"])
def test_probe_independent_fill_hands_its_cells_to_the_decode(bin_dir, smollm2, text_file, tmp_path, cache):
    """One call's prompt filled on its own gives the decode the same cache as the prompt (same logits: the cells
    reached sequence 0, with our window's rows); two calls do not (the second did not attend to the first)."""
    toks = decode.text_tokens(smollm2, text_file, 800)
    tf = versus._tokens_file(tmp_path / "t.txt", toks)
    cfg = versus.Config("ours", cache, cache)
    got = {}
    for prefill in (300, 700):
        for fill in ("prompt", "independent"):
            out = tmp_path / f"{prefill}{fill}.f32"
            cmd = versus._probe_cmd(builds.ours(), "decode", smollm2, 768, cfg, 2, "--tokens", str(tf), "--prefill",
                                    str(prefill), "--steps", "8", "--logits", str(out), "--fill", fill)
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            got[prefill, fill] = np.fromfile(out, np.float32).reshape(9, -1)
    scale = np.abs(got[300, "prompt"]).max()
    assert np.abs(got[300, "prompt"] - got[300, "independent"]).max() < 1e-4 * scale
    assert np.abs(got[700, "prompt"] - got[700, "independent"]).max() > 1e-2 * scale


@pytest.mark.slow
def test_probe_repeats_keep_the_first_steps_logits(bin_dir, smollm2, text_file, tmp_path):
    toks = decode.text_tokens(smollm2, text_file, 200)
    tf = versus._tokens_file(tmp_path / "t.txt", toks)
    cfg = versus.Config("ours", "f16", "f16")
    got = {}
    for rep in (1, 3):
        out = tmp_path / f"l{rep}.f32"
        cmd = versus._probe_cmd(builds.ours(), "decode", smollm2, 256, cfg, 2, "--tokens", str(tf), "--prefill", "160",
                                "--steps", "16", "--logits", str(out), "--repeat", str(rep))
        p = subprocess.run(cmd, check=True, capture_output=True, text=True)
        got[rep] = (np.fromfile(out, np.float32), versus._json_line(p.stdout)["decode_s_repeats"])
    assert np.array_equal(got[1][0], got[3][0]) and len(got[1][1]) == 1
    assert len(got[3][1]) == 3 and min(got[3][1]) > 0  # the state restored: each repeat decoded its 16 steps


@pytest.mark.slow
def test_a_config_that_cannot_run_is_recorded_not_raised(bin_dir, smollm2, text_file):
    cfgs = [versus.Config("ours", "no_such_type", "no_such_type")]
    rows = versus.decode({"ours": builds.ours()}, cfgs, smollm2, text_file, prefill=8, steps=2,
                         progress=lambda _: None)
    bad = next(r for r in rows if r["cache"] == "no_such_type")
    assert bad["error"] == "exit 2" and "this build has no cache type 'no_such_type'" in bad["log_tail"][-1]
    assert "rq-probe decode" in bad["command"]
    good = next(r for r in rows if r["cache"] == "f16")
    assert good["kld_mean"] == 0.0 and good["decode_tps_vs_f16"] == 1.0
    md = versus_md.to_markdown({"model": "m", "text": "t", "threads": 2, "builds": {}, "decode": rows})
    assert "did not run (exit 2)" in md and "this build has no cache type" in md


# --- weight variants ------------------------------------------------------------------------------------------


def test_weight_variants_parse_type_imatrix_and_quantize_args():
    from rotaryquant.eval import versus_weights as vw

    v = vw.parse_variant("ik:IQ3_KT+imat --custom-q ffn_down=iq4_kt", ["ik"])
    assert (v.build, v.ftype, v.imatrix, v.args) == ("ik", "IQ3_KT", True, ("--custom-q", "ffn_down=iq4_kt"))
    assert v.label == "ik:IQ3_KT+imat --custom-q ffn_down=iq4_kt" and "/" not in v.file_label
    assert not vw.parse_variant("ik:IQ3_K", ["ik"]).imatrix
    with pytest.raises(versus.VersusError, match="names build"):
        vw.parse_variant("x:IQ3_K", ["ik"])


def test_a_mixtures_regex_does_not_split_the_weights_table():
    from rotaryquant.eval import versus_weights as vw

    label = vw.parse_variant(r"ik:IQ3_K --custom-q 'blk\.(1|2)\.ffn_down=q4_K'", ["ik"]).label
    row = {"label": label, "bpw": 3.9, "ppl": 10.0, "ppl_base": 9.0, "kld_mean": 0.1, "kld_p99": 0.5, "same_top_p": 80.0}
    md = vw.to_markdown({"model": "m", "calib_tokens": 4096, "ctx": 512, "chunks": 10, "quality": [row]})
    line = next(ln for ln in md.splitlines() if ln.startswith("| ik:"))
    assert r"(1\|2)" in line and line.replace(r"\|", "").count("|") == 8


def test_merge_keeps_the_rows_a_run_did_not_redo():
    old = {"builds": {"a": {}, "b": {}}, "kld": [{"config": "a:q8_0", "x": 1}, {"config": "b:q8_0", "x": 2}],
           "runs": [["r1"]]}
    new = {"builds": {"b": {}}, "kld": [{"config": "b:q8_0", "x": 3}], "runs": [["r2"]]}
    m = versus.merge(old, new)
    assert m["kld"] == [{"config": "a:q8_0", "x": 1}, {"config": "b:q8_0", "x": 3}] and m["runs"] == [["r1"], ["r2"]]
    assert set(m["builds"]) == {"a", "b"} and versus.merge({}, new) is new
    # needles at one context keep the same configuration's rows at another
    old = {"niah": [{"config": "a:x", "ctx": 8192, "found": 1}, {"config": "a:x", "ctx": 16384, "found": 2}]}
    new = {"niah": [{"config": "a:x", "ctx": 8192, "found": 3}]}
    assert versus.merge(old, new)["niah"] == [{"config": "a:x", "ctx": 16384, "found": 2},
                                              {"config": "a:x", "ctx": 8192, "found": 3}]
    # and a haystack at another depth or seed keeps the ones before it; the same haystack is replaced
    old = {"niah": [{"config": "a:x", "ctx": 32768, "seed": 42, "depth": 0.1, "found": 8},
                    {"config": "a:x", "ctx": 32768, "seed": 42, "depth": 0.9, "found": 1}]}
    new = {"niah": [{"config": "a:x", "ctx": 32768, "seed": 42, "depth": 0.9, "found": 4},
                    {"config": "a:x", "ctx": 32768, "seed": 7, "depth": 0.1, "found": 5}]}
    assert [r["found"] for r in versus.merge(old, new)["niah"]] == [8, 4, 5]
    # runs at different thread counts in one file: the header names both
    assert versus.merge({**old, "threads": 2}, {**new, "threads": 1})["threads"] == "1 / 2"
    assert versus.merge({**old, "threads": "1 / 2"}, {**new, "threads": 2})["threads"] == "1 / 2"
    assert versus.merge({**old, "threads": 2}, {**new, "threads": 2})["threads"] == 2


def test_environment_words_are_the_runs_environment_not_flags():
    c = versus.parse_config("ours:isoquant3_0 GGML_RQ_CPU_AVX512=0 --kv-window 0", ["ours"])
    assert c.args() == ["-ctk", "isoquant3_0", "-ctv", "isoquant3_0", "--kv-window", "0"]
    assert c.env() == {"GGML_RQ_CPU_AVX512": "0"}
    assert versus._cmdline(c, ["probe", "x y"]) == "GGML_RQ_CPU_AVX512=0 probe 'x y'"


@pytest.mark.slow
def test_kld_rows_carry_the_bits_the_build_logged(bin_dir, smollm2, text_file):
    rows = versus.kld({"ours": builds.ours()}, [versus.Config("ours", "q8_0", "q8_0", ("--no-k-center",))], smollm2,
                      text_file, ctx=256, chunks=1, progress=lambda _: None)
    f16, q8 = rows
    assert f16["bits_per_value"] == pytest.approx(16.0, abs=0.01)
    assert q8["bits_per_value"] == pytest.approx(8.5, abs=0.01)  # q8_0: 34 bytes per 32 values
    assert q8["kld_mean"] > 0 and "--kl-divergence" in q8["command"]


def test_a_configuration_may_name_its_own_file_of_the_model():
    c = versus.parse_config("ours:isoquant3_0 --kv-layer-types model model=/x/g3-alloc.gguf", ["ours"])
    assert c.model == versus.Path("/x/g3-alloc.gguf")
    assert c.args() == ["-ctk", "isoquant3_0", "-ctv", "isoquant3_0", "--kv-layer-types", "model"]
    assert c.label == "ours:isoquant3_0 --kv-layer-types model model=g3-alloc.gguf"
    assert versus.parse_config("ours:q8_0", ["ours"]).model is None


def test_reuse_scores_an_existing_file_and_otherwise_quantises(tmp_path, monkeypatch):
    from rotaryquant.eval import versus_weights as vw

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for t in ("llama-perplexity", "llama-quantize", "llama-imatrix"):
        (bin_dir / t).touch()
    b = builds.Build("ik", bin_dir, tmp_path)
    ran: list[str] = []

    def fake_run(cmd, *a, **k):
        tool = cmd[0].rsplit("/", 1)[-1]
        ran.extend([] if "--help" in cmd else [tool])
        if tool == "llama-quantize":
            (tmp_path / "w" / "ik-Q4_0.gguf.partial").write_bytes(b"x" * 100)
        return 0, "Mean PPL(Q) : 10.0 ± 0.1\nMean KLD: 0.1 ± 0.01\n99.0% KLD: 0.5\n", "", 1.0

    monkeypatch.setattr(vw, "_run", fake_run)
    monkeypatch.setattr(vw.weights, "requantize_f16", lambda src, dst: dst)
    monkeypatch.setattr(vw.weights, "_n_params", lambda f: 200)
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "ik.F16.c512x10.kld").touch()
    v = [vw.parse_variant("ik:Q4_0", ["ik"])]
    args = ({"ik": b}, v, tmp_path / "m.gguf", tmp_path / "w", tmp_path / "e.txt", tmp_path / "c.txt")
    row, = vw.quality(*args, progress=lambda s: None)
    assert ran == ["llama-quantize", "llama-perplexity"] and "quantize_s" in row and row["bpw"] == 4.0
    ran.clear()
    row, = vw.quality(*args, reuse=True, progress=lambda s: None)
    assert ran == ["llama-perplexity"] and row["reused_file"] and "quantize_s" not in row and row["kld_mean"] == 0.1


def test_a_run_records_its_cpu_and_a_merge_across_cpus_says_so(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx2 avx512f avx512_vnni avx512_bf16\n")
    assert builds.cpu(info) == {"model": "AMD EPYC 9R14", "avx512_vnni_bf16": True}
    info.write_text("model name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n")
    zen2 = builds.cpu(info)
    assert zen2 == {"model": "AMD EPYC", "avx512_vnni_bf16": False} and builds.cpu(tmp_path / "none") == {}
    old = {"cpu": {"model": "x", "avx512_vnni_bf16": True}, "kld": [{"config": "a:q8_0"}]}
    assert versus.merge(old, {"cpu": zen2, "kld": [{"config": "b:q8_0"}]})["cpu_mixed"]
    assert "cpu_mixed" not in versus.merge(old, {"cpu": zen2, "kld": [{"config": "a:q8_0"}]})  # nothing kept


def test_weight_speed_merge_keeps_other_variants_with_their_own_run():
    from rotaryquant.eval import versus_weights as vw

    def row(label: str, build: str = "ik", threads: int = 2, tps: float = 10.0) -> dict:
        return {"label": label, "build": build, "threads": threads, "file": {"name": label},
                "pp": {"median": tps, "ratio": {"median": tps / 10}}, "tg": {"median": tps, "ratio": {"median": 1.0}}}
    runs = [["rq-eval", "versus-weights", "--measure", "quality"], ["rq-eval", "versus-weights"],
            ["rq-eval", "versus-weights", "--measure=quality"], ["rq-eval", "versus-weights", "--measure", "speed"]]
    old = [row("ik:Q4_K_M"), row("ik:IQ3_KT+imat", tps=5.0), row("ik:Q4_K_M", threads=1)]
    merged = vw.merge_speed(old, [row("ik:Q4_K_M", tps=12.0), row("ik:IQ3_K mix", tps=11.0)], 3, runs)
    by = {(r["label"], r["threads"], r["run"]): r for r in merged}
    assert len(merged) == 5
    assert by[("ik:IQ3_KT+imat", 2, 1)] and by[("ik:Q4_K_M", 1, 1)]  # run 1: the last earlier run that measured speed
    assert by[("ik:Q4_K_M", 2, 3)]["pp"]["median"] == 12.0
    assert by[("ik:Q4_K_M", 2, 1)]["pp"]["median"] == 10.0  # IQ3_KT's baseline stays beside it
    md = vw.to_markdown({"model": "m", "calib_tokens": 4096, "ctx": 512, "chunks": 10, "quality": [], "speed": merged})
    assert "| run |" in md and "compare t/s within one run only" in md
    body = [x for x in md.splitlines() if x.startswith("| ik:")]
    assert [x.rsplit("|", 2)[-2].strip() for x in body] == ["1", "1", "1", "3", "3"]  # grouped by run
    # once no row of run 1 needs it, its baseline goes with the rows it measured
    again = vw.merge_speed(merged, [row("ik:Q4_K_M"), row("ik:IQ3_KT+imat", tps=6.0)], 4, [*runs, runs[-1]])
    assert not any(r["run"] == 1 and r["threads"] == 2 for r in again)
    one = vw.to_markdown({"model": "m", "calib_tokens": 4096, "ctx": 512, "chunks": 10, "quality": [],
                          "speed": vw.merge_speed([], [row("ik:Q4_K_M")], 0, runs[:1])})
    assert "| run |" not in one


def test_weight_speed_refuses_a_variant_without_its_file_before_running(tmp_path):
    from rotaryquant.eval import versus_weights as vw

    v = [vw.parse_variant("ik:IQ3_K+imat --custom-q 'blk\\.1\\.ffn_down=q4_K'", ["ik"])]
    with pytest.raises(versus.VersusError, match=r"no quantised file .* for ik:IQ3_K\+imat --custom-q"):
        vw.speed({}, v, tmp_path / "m.gguf", tmp_path)  # no build is needed to refuse
