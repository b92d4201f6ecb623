"""K centring / Q-K rebalancing in the patched llama.cpp, on real models calibrated by rq-calibrate.

The rewrite (k - mu)/lam, q*lam is exact for softmax: with an F16/F32 cache forced through it, every
layer's attention output must stay what it was; with a quantised cache it must cut the error. K-shift,
state save/load and the switches must keep working on the rewritten cache.
"""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
from gguf import GGUFReader
from self_tokens import self_batches  # tests/helpers

from rotaryquant import bindings
from rotaryquant.eval.logits import kld as _kld
from rotaryquant.converter import kcenter

pytestmark = pytest.mark.slow

PROMPT = "The three most important inventions of the nineteenth century were"


@pytest.fixture(scope="module")
def gemma3_cal(gemma3, tmp_path_factory):
    out = tmp_path_factory.mktemp("kc") / "gemma3-cal.gguf"
    kcenter.calibrate(gemma3, out, n_tokens=1024, n_ctx=1024, progress=False)
    return out


def _eval_ids(model, text_file, n):
    import llama_cpp

    from rotaryquant.data import evaluation_text

    tok = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)
    return tok.tokenize(evaluation_text().read_bytes()[:n * 8])[:n]




def _scores(model, t, ids, **kw):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model), n_ctx=1024, n_threads=2, logits_all=True, verbose=False,
                          flash_attn=True, type_k=t, type_v=t, **kw)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)])


def test_calibration_is_stored_as_metadata(gemma3, gemma3_cal):
    from gguf import GGUFReader

    cal = kcenter.read_calibration(gemma3_cal)
    assert cal["version"] == 1 and cal["tokens"] >= 1000 and len(cal["text_sha256"]) == 64
    assert cal["layers"] == list(range(18))  # Gemma3-270M: 18 layers, 1 KV head of 256
    assert len(cal["mean"]) == len(cal["scale"]) == 18 * 256
    assert min(cal["scale"]) > 0
    a, b = GGUFReader(gemma3), GGUFReader(gemma3_cal)
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    assert all(np.array_equal(x.data, y.data) for x, y in zip(a.tensors[:20], b.tensors[:20]))


def _attention(q, k, v):
    """Causal softmax attention in float64 (Gemma3 passes kq_scale 1: its Q is pre-scaled); GQA maps query
    head h to KV head h // g. q: [T, n_head, hd], k/v: [T, n_head_kv, hd] -> [T, n_head * hd]."""
    T, nq, hd = q.shape
    g = nq // k.shape[1]
    out = np.empty((T, nq, v.shape[2]))
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for h in range(nq):
        s = q[:, h].astype(np.float64) @ k[:, h // g].astype(np.float64).T + mask
        p = np.exp(s - s.max(1, keepdims=True))
        out[:, h] = (p / p.sum(1, keepdims=True)) @ v[:, h // g]
    return out.reshape(T, -1)


def test_rewrite_is_exact_with_an_unquantised_cache(gemma3_cal, text_file):
    # Forced through an F16 cache, every layer's attention output (kqv_out) must equal exact attention
    # of that layer's own inputs, as the plain run's does: softmax never sees mu or lam. (Comparing the
    # two runs layer by layer only works for layer 0: the Q4_K_M matmuls quantise activations to 8
    # bits, so F16 rounding differences flip codes and the runs drift apart by ~5% by the last layer.)
    # A mu that is not constant per query, lam on one side only, or query heads mapped to the wrong
    # KV head would be O(1) off.
    from rotaryquant.bindings.capture import capture

    prompt = text_file.read_text()[300_000:300_600]
    f16 = bindings.type_from_name("f16")
    names = [f"{n}-{il}" for il in range(18) for n in ("attn_q_in", "attn_k_in", "attn_v_in", "kqv_out")]
    runs = {}
    for mode in ("off", "force"):
        runs[mode] = capture(gemma3_cal, prompt, ["attn_q_in", "attn_k_in", "attn_v_in", "kqv_out"],
                             type_k=f16, type_v=f16, k_center=mode)
        assert set(names) <= set(runs[mode])
    err = {}
    for mode, r in runs.items():
        for il in range(18):
            q, k, v = (r[f"{n}-{il}"] for n in ("attn_q_in", "attn_k_in", "attn_v_in"))
            q, k, v = q.reshape(-1, 4, 256), k.reshape(-1, 1, 256), v.reshape(-1, 1, 256)
            ref = _attention(q, k, v)
            got = r[f"kqv_out-{il}"].reshape(ref.shape)
            err[mode, il] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    worst = {m: max(e for (mm, _), e in err.items() if mm == m) for m in runs}
    assert worst["off"] < 5e-3 and worst["force"] < 5e-3, worst  # F16 K/V/Q rounding in flash attention
    a, b = runs["off"]["kqv_out-0"], runs["force"]["kqv_out-0"]
    assert float(np.linalg.norm(a - b) / np.linalg.norm(a)) < 2e-3  # layer 0: identical inputs


def test_calibration_cuts_the_3bit_k_error(gemma3_cal, text_file):
    import llama_cpp

    ids = _eval_ids(gemma3_cal, text_file, 256)
    f16 = _scores(gemma3_cal, llama_cpp.GGML_TYPE_F16, ids)
    iso = llama_cpp.GGML_TYPE_ISOQUANT3_0
    plain = _kld(f16, _scores(gemma3_cal, iso, ids, k_center=False))
    centred = _kld(f16, _scores(gemma3_cal, iso, ids, k_center=True))
    # measured on this model: ~0.45 -> ~0.1; an inexact rewrite would raise the KLD, not lower it
    assert centred < 0.5 * plain, (plain, centred)


def test_kshift_on_a_centred_cache(gemma3_cal, text_file, kv_shift):
    # K-shift must un-centre, RoPE, re-centre: RoPE applied to (k - mu)/lam would wreck the keys
    import llama_cpp

    ids = _eval_ids(gemma3_cal, text_file, 364)
    a, b = ids[:300], ids[300:]
    keep, nd = 4, 150
    retained = a[:keep] + a[keep + nd:]
    t = llama_cpp.GGML_TYPE_ISOQUANT3_0

    def run(shift: bool):
        llm = llama_cpp.Llama(model_path=str(gemma3_cal), n_ctx=1024, n_threads=2, logits_all=True, verbose=False,
                              flash_attn=True, type_k=t, type_v=t)
        if not shift:
            llm.eval(retained + b)
            return np.array(llm.scores[len(retained):len(retained) + len(b)])
        kv_shift(llm, a, keep, nd)
        llm.eval(b)
        return np.array(llm.scores[llm.n_tokens - len(b):llm.n_tokens])

    truth = _scores(gemma3_cal, llama_cpp.GGML_TYPE_F16, retained + b)[len(retained):]
    fresh, shifted = _kld(truth, run(False)), _kld(truth, run(True))
    assert shifted - fresh < 0.03, (fresh, shifted)  # uncalibrated isoquant3_0: +0.008 (test_kshift.py)


@pytest.mark.parametrize("calibrated", [True, False], ids=["calibrated", "self-calibrated"])
def test_state_save_and_load_continue_identically(gemma3, gemma3_cal, text_file, calibrated):
    # self-calibrated: the second Llama loads the model again and measures mu/lam again; the state saved by the first
    # must still continue bit for bit (the statistics depend on the model only)
    import llama_cpp

    model = gemma3_cal if calibrated else gemma3
    ids = _eval_ids(model, text_file, 96)
    t = llama_cpp.GGML_TYPE_ISOQUANT3_0
    kw = dict(model_path=str(model), n_ctx=512, n_threads=2, logits_all=True, verbose=False, flash_attn=True,
              type_k=t, type_v=t)
    one = llama_cpp.Llama(**kw)
    one.eval(ids[:64])
    state = one.save_state()
    one.eval(ids[64:])
    two = llama_cpp.Llama(**kw)
    two.load_state(state)
    two.eval(ids[64:])
    assert np.array_equal(np.array(one.scores[64:96]), np.array(two.scores[64:96]))


def _complete(bin_dir, model, extra=(), n=8):
    cmd = [str(bin_dir / "llama-completion"), "-m", str(model), "-p", PROMPT, "-n", str(n), "--temp", "0",
           "-no-cnv", "-t", "2", "-c", "256", "--no-warmup", "--no-display-prompt", "-lv", "4", "-fa", "on", *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_K_CENTER", "LLAMA_ARG_NO_K_CENTER")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_log_says_which_mode_is_active(bin_dir, smollm2, smol_cal):
    # head size 64: q8_0/q4_0 K caches take the rewrite as well as the IsoQuant types do
    on = _complete(bin_dir, smol_cal, ["-ctk", "q4_0", "-ctv", "q4_0"])
    assert on.returncode == 0, on.stderr[-2000:]
    assert "K centring = on (rotaryquant.k_center, 30 of 30 layers" in on.stderr
    off = _complete(bin_dir, smol_cal, ["-ctk", "q4_0", "-ctv", "q4_0", "--no-k-center"])
    assert off.returncode == 0 and "K centring = off (--no-k-center" in off.stderr
    f16 = _complete(bin_dir, smol_cal)
    assert f16.returncode == 0 and "K centring = off (the K cache is f16, not quantised)" in f16.stderr
    plain = _complete(bin_dir, smollm2, ["-ctk", "q8_0"])
    assert plain.returncode == 0 and "the model has no rotaryquant.k_center calibration" in plain.stderr


def test_an_uncalibrated_low_bit_k_cache_warns_at_the_default_log_level(bin_dir, smollm2):
    # a new user's first run: no -v, no calibration, a 3-bit K cache; the log must say what the runtime does about it
    # (--k-stats none: measured at this start, as at a first start)
    cmd = [str(bin_dir / "llama-completion"), "-m", str(smollm2), "-p", PROMPT, "-n", "2", "--temp", "0", "-no-cnv",
           "-t", "2", "-c", "256", "--no-warmup", "-fa", "on", "--k-stats", "none", "-ctk", "isoquant3_0", "-ctv",
           "isoquant3_0"]
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_K_CENTER", "LLAMA_ARG_NO_K_CENTER")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    on = [ln for ln in proc.stderr.splitlines() if "K statistics measured on" in ln]
    assert on and "pseudo-random tokens" in on[0] and "not stored" in on[0], proc.stderr[-3000:]
    off = subprocess.run([*cmd, "--no-k-center"], capture_output=True, text=True, timeout=300, env=env)
    warn = [ln for ln in off.stderr.splitlines() if "K centring = off" in ln]
    assert off.returncode == 0 and warn and "isoquant3_64 K cache" in warn[0], off.stderr[-3000:]
    assert "K statistics" not in off.stderr
    q8 = subprocess.run([*cmd[:-4], "-ctk", "q8_0", "-ctv", "q8_0"], capture_output=True, text=True, timeout=300,
                        env=env)
    assert q8.returncode == 0 and "K centring = off" not in q8.stderr  # 8-bit K keeps quality: no warning
    assert "K statistics" not in q8.stderr  # ... and no measuring pass


def test_calibration_of_another_model_is_refused_at_load(bin_dir, gemma3, smol_cal, tmp_path):
    wrong = tmp_path / "wrong.gguf"
    meta = {kcenter.PREFIX + k: (np.array(v, np.int32) if k == "layers" else np.array(v, np.float32))
            for k, v in kcenter.read_calibration(smol_cal).items() if k in ("layers", "mean", "scale")}
    meta[kcenter.PREFIX + "version"] = 1
    kcenter.rewrite_metadata(gemma3, wrong, meta, progress=False)
    proc = _complete(bin_dir, wrong, ["-ctk", "q8_0"])
    assert proc.returncode != 0
    assert "belongs to another model" in proc.stderr and "rq-calibrate" in proc.stderr


def test_server_slots_under_load_answer_as_alone(gemma3_cal):
    # 4 slots decoding side by side share the per-layer mu/lam; in the deterministic setting every
    # answer under load equals the same request sent alone, as without calibration (test_serve.py)
    from rotaryquant.eval import serve

    r = serve.load_test(gemma3_cal, cache="isoquant3_0+calib", clients=4, per_client=2, n_predict=24,
                        deterministic=True, progress=lambda *_: None)
    assert r.requests == 8 and r.failures == 0 and r.empty == 0
    assert r.mismatches == 0, r.examples


def test_an_uncalibrated_model_is_self_calibrated(bin_dir, smollm2, tmp_path):
    # no calibration, a 4-bit K cache (a tiny random Qwen2-MoE, head 64): the runtime measures mu/lam itself from
    # one F16 pass over its pseudo-random tokens. What the graph does to K (attn_k_kc = attn_k_in/lam - mu/lam) must
    # be rq-calibrate's statistics (LayerStats), computed here independently from the same tokens.
    from rotaryquant.bindings.capture import capture
    from rotaryquant.converter.convert import Options, convert
    from rotaryquant.converter.hf_folders import qwen2moe_toy_folder, smollm2_hf_folder

    tok = smollm2_hf_folder(smollm2, tmp_path / "smol-2L", n_layers=2)
    hf = qwen2moe_toy_folder(tmp_path / "moe-hf", tok, n_experts=4)
    model = tmp_path / "moe-f16.gguf"
    convert(hf, model, Options(recipe="f16", progress=False))

    # the tools store what the graph uses for later starts: the batch is rebuilt from its size there
    cmd = [str(bin_dir / "llama-completion"), "-m", str(model), "-p", PROMPT, "-n", "2", "--temp", "0", "-no-cnv",
           "-t", "2", "-c", "256", "--no-warmup", "-fa", "on", "-ctk", "q4_0", "--k-stats", str(tmp_path / "ks.gguf")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "K statistics measured on" in proc.stderr  # a WARN line: shown without -v
    fields = GGUFReader(tmp_path / "ks.gguf").fields
    ids, pos, _, _ = self_batches(model, int(fields["rotaryquant.k_stats.n_tokens"].contents()))
    assert len({s for _, s in pos}) == 8 and pos[-1][0] > len(ids)  # spread beyond one run of positions
    f16 = bindings.type_from_name("f16")
    ref = capture(model, ids, ["attn_k_in", "attn_q_in"], type_k=f16, type_v=f16, n_ctx=len(ids), positions=pos)
    got = capture(model, PROMPT, ["attn_k_in", "attn_k_kc"], type_k=bindings.type_from_name("q4_0"), type_v=f16)
    mean = np.asarray(fields["rotaryquant.k_center.mean"].contents(), np.float32).reshape(2, -1)
    scale = np.asarray(fields["rotaryquant.k_center.scale"].contents(), np.float32).reshape(2, -1)
    for il in range(2):
        k_in, k_kc = got[f"attn_k_in-{il}"], got[f"attn_k_kc-{il}"]
        st = kcenter.LayerStats(n_head_kv=ref[f"attn_k_in-{il}"].size // (len(ids) * 64), head_dim=64)
        st.add_k(ref[f"attn_k_in-{il}"].reshape(len(ids), st.n_head_kv, 64))
        st.add_q(ref[f"attn_q_in-{il}"].reshape(len(ids), -1, 64))
        mu, lam = st.derive()
        k_in, k_kc = k_in.reshape(-1, *mu.shape), k_kc.reshape(-1, *mu.shape)
        assert np.abs(mu).max() > 1e-3 and np.abs(lam - 1).max() > 1e-2  # both parts of the rewrite are at work
        np.testing.assert_allclose(k_kc, (k_in - mu) / lam, rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(mean[il], mu.ravel(), rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(scale[il], lam.ravel(), rtol=2e-4)
    off = capture(model, PROMPT, ["attn_k_kc"], type_k=bindings.type_from_name("q4_0"), type_v=f16, k_center="off")
    assert not off  # --no-k-center: nothing rewritten
