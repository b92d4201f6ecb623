"""rotaryquant.eval.alternatives: versus-*.json merged per model and configuration, the verdicts checked."""

from __future__ import annotations

import json

import pytest

from rotaryquant.eval import alternatives as alt

GEMMA = "gemma-3-270m-q4_k_m.gguf"


def _kld(config: str, bits: float, kld: float | None, **extra) -> dict:
    r = {"config": config, "build": config.split(":")[0], "bits_per_value": bits, "kld_mean": kld, "kld_p99": 0.1,
         "same_top_p": 90.0, "notes": [], **extra}
    if kld is None:
        r.pop("kld_mean")
    return r


def _write(tmp_path, name: str, rows: dict) -> None:
    builds = {b: {"name": b, "commit": "abc", "cmake": {"GGML_AVX2": "ON"}} for b in ("ours", "stock", "ik")}
    (tmp_path / name).write_text(json.dumps({"model": GEMMA, "builds": builds, **rows}))


@pytest.fixture()
def results(tmp_path):
    _write(tmp_path, "versus-kld-gemma3.json", {"kld": [
        _kld("ours:f16", 16, None), _kld("ours:isoquant3_0", 3.5, 0.025),
        _kld("stock:f16", 16, None), _kld("stock:q4_0", 4.5, 0.088), _kld("stock:q8_0", 8.5, 0.006),
        _kld("ik:iq4_nl -khad -vhad", 4.5, 0.084),
        {"config": "ik:q5_0 -khad", "build": "ik", "bits_per_value": 5.5, "error": "killed by signal 6",
         "log_tail": ["K cache q5_0 coupled with V cache q5_0 is not a supported combination"]}]})
    _write(tmp_path, "versus-8k-gemma3.json", {"decode": [
        {"config": "ours:isoquant3_0", "build": "ours", "prefill": 8192, "kld_mean": 0.03, "kld_p99": 0.2,
         "prefill_tps_vs_f16": 1.1, "decode_tps_vs_f16": 1.15, "decode_tps": 66.0},
        {"config": "stock:q4_0", "build": "stock", "prefill": 8192, "error": "killed by signal 9",
         "log_tail": ["(timed out after 2700 s)"]}]})
    return tmp_path


def test_rows_merge_across_files_per_configuration(results):
    data = alt.load(results)
    ours = data[GEMMA]["ours:isoquant3_0"]
    assert ours["kld"]["kld_mean"] == 0.025 and ours["decode"][8192]["decode_tps_vs_f16"] == 1.15
    assert ours["files"] == {"versus-kld-gemma3.json", "versus-8k-gemma3.json"}
    assert alt.bits(ours) == 3.5


def test_verdict_compares_only_peers_between_our_bits_and_the_budget(results):
    v = alt.verdicts(alt.load(results))[0]
    assert v.startswith("2K KLD") and v.endswith("Gemma3 0.0250 at 3.50 bits vs 0.0840 (ik:iq4_nl -khad -vhad, 4.50)")
    # stock q8_0 (8.5 bits, better KLD) is past the budget: not a rival


def test_a_verdict_that_stops_holding_is_refused(results):
    data = alt.load(results)
    data[GEMMA]["stock:q4_0"]["kld"]["kld_mean"] = 0.02  # a peer at 4.5 bits now beats ours
    with pytest.raises(alt.VerdictError, match="no longer holds"):
        alt.verdicts(data)


def test_report_section_says_what_did_not_run_and_why(results):
    md = "\n".join(alt.report_section(results))
    assert "| ik:q5_0 -khad | 5.50 | did not run (killed by signal 6)" in md
    assert "not a supported combination" in md
    assert "| stock:q4_0 | 4.50 | 0.0880 |" in md and "timed out" in md
    assert "[versus-8k-gemma3.json](versus-8k-gemma3.json)" in md


def test_short_table_takes_each_builds_best_under_the_budget(results):
    rows = alt.short_table(results)
    assert rows[0].startswith("| ours:isoquant3_0 | 3.50 b: 0.025, 1.15×")
    assert any(r.startswith("| ik:iq4_nl -khad -vhad | 4.50 b: 0.084") for r in rows)
    assert any(r.startswith("| stock:q4_0 |") for r in rows) and not any("q8_0" in r for r in rows)


def test_start_up_gap_is_stated_and_checked(results):
    data = alt.load(results)
    for label, added in (("ours:f16", 0.0), ("ours:isoquant3_0", 2.2), ("stock:f16", 0.0), ("stock:q4_0", 0.02)):
        data[GEMMA][label]["ttft"] = {"added_s": added, "first_token_s": 0.5 + added}
    assert "Gemma3 first start +2.2 s, every start (peers at most +0.02 s)" in alt.verdicts(data)[-1]
    data[GEMMA]["ours:isoquant3_0"]["ttft"]["added_kept_s"] = 0.04  # K statistics kept from the first start
    assert "Gemma3 first start +2.2 s, later starts +0.04 s (peers" in alt.verdicts(data)[-1]
    data[GEMMA]["ours:isoquant3_0"]["ttft"]["added_kept_s"] = 0.9  # a later start that still pays: not what it says
    with pytest.raises(alt.VerdictError):
        alt.verdicts(data)
    data[GEMMA]["ours:isoquant3_0"]["ttft"].update(added_s=0.0, added_kept_s=0.0)  # once ours starts as fast
    with pytest.raises(alt.VerdictError):
        alt.verdicts(data)


def test_attention_slope_is_the_cost_per_1k_keys_between_two_depths():
    c = {"decode": {8192: {"prefill": 8192, "decode_tps": 50.0}, 32704: {"prefill": 32704, "decode_tps": 25.0}}}
    # 20 ms -> 40 ms per token over 24512 keys: 20 / 23.9375 ms per 1024 keys
    assert alt.attention_slope(c, 32704) == pytest.approx(20 / (24512 / 1024))
    assert alt.attention_slope({"decode": {8192: c["decode"][8192]}}, 32704) is None


def test_a_known_gap_is_named_and_its_answer_checked(results, monkeypatch):
    data = alt.load(results)
    data[GEMMA]["stock:q4_0"]["kld"]["kld_mean"] = 0.02  # a peer at 4.5 bits beats our 3.5-bit default
    data[GEMMA]["ours:isoquant4_0"] = {"build": {"name": "ours"}, "decode": {}, "niah": {}, "files": set(),
                                       "kld": _kld("ours:isoquant4_0", 4.5, 0.015)}
    monkeypatch.setitem(alt.KNOWN_GAPS, (GEMMA, "stock:q4_0", "kld"), ("one bit more", "ours:isoquant4_0"))
    more = alt.verdicts(data)[0]
    assert "except Gemma3 stock:q4_0 0.0200 at 4.50 bits (one bit more: ours:isoquant4_0 0.0150 at 4.50 bits)" in more
    data[GEMMA]["ours:isoquant4_0"]["kld"]["kld_mean"] = 0.03  # the answer no longer answers: refused
    with pytest.raises(alt.VerdictError, match="beats stock:q4_0"):
        alt.verdicts(data)


def test_needles_verdict_counts_ours_against_each_peer_under_the_budget(results):
    _write(results, "versus-niah-gemma3.json", {"niah": [
        {"config": c, "build": c.split(":")[0], "ctx": 8192, "depth": d, "found": n, "asked": 8}
        for c, found in (("ours:isoquant3_0", (8, 8)), ("stock:q4_0", (7, 8)), ("stock:q8_0", (8, 8)))
        for d, n in zip((0.1, 0.5), found)]})
    data = alt.load(results)
    line = next(v for v in alt.verdicts(data) if v.startswith("needles"))
    assert line.startswith("needles at 8K (") and "16K" not in line
    assert "Gemma3 at 8K 16/16; stock:q4_0 15/16" in line and "q8_0" not in line  # 8.5 bits: not a rival
    # a context with peer rows joins the same line, each checked
    data[GEMMA]["ours:isoquant3_0"]["niah"][16384] = [{"found": 7, "asked": 8}]
    data[GEMMA]["stock:q4_0"]["niah"][16384] = [{"found": 3, "asked": 8}]
    line = next(v for v in alt.verdicts(data) if v.startswith("needles"))
    assert line.startswith("needles at 8K and 16K") and "Gemma3 at 16K 7/8; stock:q4_0 3/8" in line
    data[GEMMA]["stock:q4_0"]["niah"][16384][0]["found"] = 8
    with pytest.raises(alt.VerdictError, match="needles"):
        alt.verdicts(data)
    data[GEMMA]["stock:q4_0"]["niah"][16384][0]["found"] = 3
    data[GEMMA]["stock:q4_0"]["niah"][8192][0]["found"] = 8
    data[GEMMA]["ours:isoquant3_0"]["niah"][8192][0]["found"] = 6
    with pytest.raises(alt.VerdictError, match="needles"):
        alt.verdicts(data)
    data[GEMMA]["ours:isoquant3_0"]["niah"][8192][0]["found"] = 8
    # a peer that measured one of our haystacks is counted on that one only, and the line says so
    data[GEMMA]["stock:q4_0"]["niah"][8192] = [{"depth": 0.5, "found": 5, "asked": 8}]
    line = next(v for v in alt.verdicts(data) if v.startswith("needles"))
    assert "Gemma3 at 8K 16/16; stock:q4_0 5/8 (ours 8/8 on the same haystack)" in line
    data[GEMMA]["ours:isoquant3_0"]["niah"][8192][1]["found"] = 4  # ours loses on that haystack: refused
    with pytest.raises(alt.VerdictError, match="needles"):
        alt.verdicts(data)


def test_weight_verdict_names_each_peer_type_and_refuses_an_unexplained_loss(tmp_path):
    def row(label, bpw, kld):
        b, ft = label.split(":")
        return {"label": label, "build": b, "ftype": ft.split("+")[0], "bpw": bpw, "kld_mean": kld}

    def write(rows):
        (tmp_path / "versus-weights-qwen.json").write_text(json.dumps({"model": "q.gguf", "quality": rows}))

    write([row("ours:itq3-s", 3.51, 0.13), row("ours:itq3-m", 3.87, 0.10), row("ours:IQ3_S+imat", 3.88, 0.14),
           row("ik:IQ3_KT+imat", 3.54, 0.21)])
    v = alt.weight_verdict(tmp_path)
    assert "stock:IQ3_S+imat 0.1400 at 3.880 vs itq3-m 0.1000" in v and "ik:IQ3_KT+imat 0.2100 at 3.540 vs itq3-s" in v
    write([row("ours:itq3-s", 3.51, 0.13), row("ik:IQ3_XX+imat", 3.60, 0.12)])  # a loss with no stated cause
    with pytest.raises(alt.VerdictError):
        alt.weight_verdict(tmp_path)
    write([row("ours:itq3-s", 3.51, 0.13), row("ik:IQ3_K+imat", 3.74, 0.11)])  # the known one is named, not refused
    v = alt.weight_verdict(tmp_path)
    assert "ik:IQ3_K+imat 0.1100 at 3.740 vs itq3-s 0.1300 at 3.510 (behind)" in v and v.endswith(
        ". Behind: " + alt.KNOWN_WEIGHT_GAPS["ik:IQ3_K+imat"])
    # a mixture of the known type (its llama-quantize overrides) has the same cause; another type does not
    write([row("ours:itq3-s --tensor-type ffn_down=q4_K", 3.81, 0.10), row("ik:IQ3_K+imat --attn-k-type q6_K", 3.87,
                                                                           0.09)])
    assert "vs itq3-s --tensor-type ffn_down=q4_K 0.1000 at 3.810 (behind)" in alt.weight_verdict(tmp_path)
    write([row("ours:itq3-s", 3.51, 0.13), row("ik:IQ3_KS+imat --attn-k-type q6_K", 3.6, 0.12)])
    with pytest.raises(alt.VerdictError):
        alt.weight_verdict(tmp_path)
    write([row("ours:itq3-s", 3.51, 0.13), row("ik:IQ2_KT+imat", 2.6, 0.5)])  # nothing of ours at so few bits
    with pytest.raises(alt.VerdictError):
        alt.weight_verdict(tmp_path)


def test_deep_decode_speed_compares_rows_of_one_run_only(results):
    data = alt.load(results)

    def put(label: str, tps: float | None, source: str = "versus-32k-gemma3.json", **extra) -> None:
        r = {"config": label, "prefill": 32704, "source": source}
        r = {**r, "error": "killed by signal 9"} if tps is None else {**r, "decode_tps": tps, "decode_tps_vs_f16": tps / 20}
        c = data[GEMMA].setdefault(label, {"build": {"name": label.split(":")[0]}, "decode": {}, "niah": {},
                                           "files": set()})
        c["decode"][32704] = c.setdefault("decode_runs", {}).setdefault(32704, {})[source] = {**r, **extra}
    put("ours:isoquant3_0", 40.0)
    put("ik:iq4_nl -khad -vhad", 30.0)
    put("stock:q4_0", None)
    put("stock:q8_0", 90.0)  # past the budget: not a rival
    v = next(x for x in alt.verdicts(data) if "decode after a long prompt" in x)
    assert "Gemma3 after 32K: ours 40.0 t/s (2.00× its f16); " in v and "ik:iq4_nl -khad -vhad 30.0 t/s (1.50×)" in v
    assert "stock:q4_0 did not run (killed by signal 9)" in v and "q8_0" not in v
    put("ik:iq4_nl -khad -vhad", 50.0, "another-run.json")  # another day, without ours: not compared
    v = next(x for x in alt.verdicts(data) if "decode after a long prompt" in x)
    assert "30.0 t/s" in v and "50.0" not in v
    put("ours:isoquant3_0", 45.0, "another-run.json")  # ours in that run too: compared there, each run its own part
    with pytest.raises(alt.VerdictError, match="no longer holds"):  # faster there, and no f16 rows to say why
        alt.verdicts(data)
    put("ik:iq4_nl -khad -vhad", 40.0, "another-run.json")
    v = next(x for x in alt.verdicts(data) if "decode after a long prompt" in x)
    assert "Gemma3 after 32K (another-run): ours 45.0 t/s (2.25× its f16); ik:iq4_nl -khad -vhad 40.0 t/s" in v
    assert "Gemma3 after 32K (versus-32k-gemma3): ours 40.0 t/s" in v
    put("ik:iq4_nl -khad -vhad", 50.0)  # in our run, faster
    with pytest.raises(alt.VerdictError, match="no longer holds"):
        alt.verdicts(data)
    # a known gap holds where the peer's own f16 is the faster one in the same run and ours gains more over its f16
    # (2.0x vs 1.5x)
    put("ik:f16", 33.0, decode_tps_vs_f16=1.0)
    put("ours:f16", 20.0, decode_tps_vs_f16=1.0)
    put("ik:iq4_nl -khad -vhad", 50.0, decode_tps_vs_f16=1.5)
    put("ik:f16", 10.0, "another-run.json", decode_tps_vs_f16=1.0)  # another run's f16 rows do not count here
    v = next(x for x in alt.verdicts(data) if "decode after a long prompt" in x)
    assert "ik:iq4_nl -khad -vhad 50.0 t/s (1.50×), behind: its f16 33.0 t/s against ours 20.0" in v
    assert v.endswith(". Behind: " + alt.F16_PATH)
    put("ik:iq4_nl -khad -vhad", 50.0, decode_tps_vs_f16=2.5)  # its cache gains more: refused
    with pytest.raises(alt.VerdictError):
        alt.verdicts(data)


def test_a_cache_filled_call_by_call_is_its_own_run_and_marked(results):
    def dec(config: str, tps: float, fill: str | None = None) -> dict:
        return {"config": config, "build": config.split(":")[0], "prefill": 32704, "decode_tps": tps,
                "decode_tps_vs_f16": tps / 20, **({"fill": fill} if fill else {})}
    ik = "ik:iq4_nl -khad -vhad"
    _write(results, "versus-32k-a.json", {"decode": [dec("ours:isoquant3_0", 40.0), dec("stock:q4_0", 15.0)]})
    _write(results, "versus-32k-b.json", {"decode": [dec("ours:isoquant3_0", 38.0, "independent"),
                                                      dec("ours:isoquant3_0", 36.0), dec(ik, 30.0, "independent"),
                                                      dec("stock:q4_0", 14.0, "independent")]})
    data = alt.load(results)
    ours, stock, peer = (data[GEMMA][x]["decode"][32704] for x in ("ours:isoquant3_0", "stock:q4_0", ik))
    # a prompt-filled row stands for its configuration before an independent one, whichever file is later
    assert ours["decode_tps"] == 36.0 and stock["decode_tps"] == 15.0 and "fill" not in stock
    assert peer["decode_tps"] == 30.0 and peer["fill"] == "independent"  # where no prompt-filled row is
    assert set(data[GEMMA]["ours:isoquant3_0"]["decode_runs"][32704]) == {
        "versus-32k-a.json", "versus-32k-b.json", "versus-32k-b.json#independent"}
    v = next(x for x in alt.verdicts(data) if "decode after a long prompt" in x)
    # each peer against ours in the same fill of the same run
    assert "Gemma3 after 32K (versus-32k-a): ours 40.0 t/s (2.00× its f16); stock:q4_0 15.0 t/s" in v
    assert ("Gemma3 after 32K (versus-32k-b, independent fill): ours 38.0 t/s (1.90× its f16); "
            f"stock:q4_0 14.0 t/s (0.70×), {ik} 30.0 t/s (1.50×)") in v
    table = "\n".join(alt.model_table(GEMMA, data[GEMMA]))
    assert "| 30.00 ⁱ |" in table and "| 36.00 |" in table and "| 15.00 |" in table
    note = " ".join(alt.fill_note(data))
    assert note.startswith("ⁱ decode t/s after a cache filled call by call")
    assert "Gemma3 ours:isoquant3_0 at 32K 1.06×" in note  # 38 over 36, the same run's prompt-filled row
    (results / "versus-32k-a.json").unlink()
    _write(results, "versus-32k-b.json", {"decode": [dec("ours:isoquant3_0", 38.0, "independent"),
                                                      dec(ik, 30.0, "independent")]})
    v = next(x for x in alt.verdicts(alt.load(results)) if "decode after a long prompt" in x)
    assert "Gemma3 after 32K (independent fill): ours 38.0 t/s" in v  # one run at the depth: its fill still named
    _write(results, "versus-32k-b.json", {"decode": [dec("ours:isoquant3_0", 38.0, "independent"),
                                                      dec(ik, 40.0, "independent")]})
    with pytest.raises(alt.VerdictError, match="no longer holds"):  # faster than ours within the same fill
        alt.verdicts(alt.load(results))


def test_the_kernels_note_names_each_files_cpu(results):
    note = alt.kernels_note(results)
    assert "CPU not recorded (runs before it was: the machine varied by day, with and without AVX-512): " \
           "versus-8k-gemma3.json, versus-kld-gemma3.json" in note
    f = results / "versus-32k-gemma3.json"
    f.write_text(json.dumps({"model": GEMMA, "builds": {}, "cpu": {"model": "AMD EPYC", "avx512_vnni_bf16": False}}))
    assert "AMD EPYC without AVX-512 VNNI/BF16: float AVX2 kernels: versus-32k-gemma3.json" in alt.kernels_note(results)
