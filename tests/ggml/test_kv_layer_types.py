"""Per-layer KV cache types (llama_context_params.kv_layer_types, --kv-layer-types, Llama(kv_layer_types=)).

Each layer's K/V tensors take the type the spec names for it; everything downstream (flash attention,
K centring, K-shift, deferred prefill, state) reads the layer's own tensor. Checked here: a spec that names
every layer gives the plain cache of that type bit for bit, both ways round; the bytes each layer holds are
the named type's; K-shift and deferred prefill keep their guarantees on a mixed cache; bad specs fail the
context with a message that names the fix.
"""

from __future__ import annotations

import os
import re
import subprocess

import gguf
import numpy as np
import pytest

from rotaryquant import bindings
from rotaryquant.eval.logits import kld as _kld

pytestmark = pytest.mark.slow

PROMPT = "The three most important inventions of the nineteenth century were"
MIXED = "full=q8_0/isoquant3_0"  # Gemma3: the 3 global layers keep 8-bit K, the 15 sliding-window layers 3 bits


def _ids(model, n: int, offset: int = 0) -> list[int]:
    import llama_cpp

    from rotaryquant.data import evaluation_text

    tok = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)
    return tok.tokenize(evaluation_text().read_bytes()[offset * 8:(offset + n) * 8], add_bos=offset == 0)[:n]


def _llm(model, t: str, n_ctx: int = 512, **kw):
    import llama_cpp

    tt = bindings.type_from_name(t)
    return llama_cpp.Llama(model_path=str(model), n_ctx=n_ctx, n_batch=512, n_threads=2, verbose=False,
                           logits_all=True, flash_attn=True, type_k=tt, type_v=tt, **kw)


def _scores(model, t: str, ids: list[int], **kw) -> np.ndarray:
    llm = _llm(model, t, **kw)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)])


def _row(t: str, n: int) -> int:
    blck, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.upper()]]
    return n // blck * size


def test_a_spec_naming_every_layer_is_the_plain_cache(gemma3):
    ids = _ids(gemma3, 96)
    assert np.array_equal(_scores(gemma3, "isoquant3_0", ids, kv_layer_types="*=f16"), _scores(gemma3, "f16", ids))
    iso = _scores(gemma3, "isoquant3_0", ids)
    assert np.array_equal(_scores(gemma3, "f16", ids, kv_layer_types="swa=isoquant3_0,full=isoquant3_0"), iso)
    mixed = _scores(gemma3, "isoquant3_0", ids, kv_layer_types=MIXED)
    assert not np.array_equal(mixed, iso)


def test_each_layer_holds_its_own_type(gemma3, smollm2):
    import llama_cpp

    def mem(model, t, spec=None):
        llm = _llm(model, t, kv_layer_types=spec)
        return llama_cpp.llama_rq_get_memory(llm.ctx)

    # Gemma3: head 256, 1 KV head; layers 5, 11, 17 attend the whole context (512 cells in this context)
    a, b = mem(gemma3, "isoquant3_0"), mem(gemma3, "isoquant3_0", MIXED)
    assert b.kv_k - a.kv_k == 3 * 512 * (_row("q8_0", 256) - _row("isoquant3_0", 256))
    assert b.kv_v == a.kv_v
    # SmolLM2: 30 layers of 3 KV heads of 64; isoquant3_0 resolves to its 64-wide sibling per layer too
    a, b = mem(smollm2, "isoquant3_0"), mem(smollm2, "f16", "0-9=q8_0,10-29=isoquant3_0/q4_0")
    assert b.kv_k == 512 * (10 * _row("q8_0", 192) + 20 * _row("isoquant3_64", 192))
    assert b.kv_v == 512 * (10 * _row("q8_0", 192) + 20 * _row("q4_0", 192))
    assert a.kv_k == 512 * 30 * _row("isoquant3_64", 192)


@pytest.mark.parametrize("spec,why", [
    ("40=q8_0", "'40' is not a layer"),
    ("full=q8_1", "unknown cache type 'q8_1'"),
    ("q8_0", "is not LAYERS=K[/V]"),
])
def test_a_bad_spec_fails_with_the_fix(bin_dir, smollm2, spec, why):
    cmd = [str(bin_dir / "llama-completion"), "-m", str(smollm2), "-p", PROMPT, "-n", "2", "-no-cnv", "-t", "2",
           "-c", "256", "--no-warmup", "-fa", "on", "-ctk", "q8_0", "--kv-layer-types", spec]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert why in proc.stderr, proc.stderr[-2000:]
    # the tools without the flag (llama-bench) and llama-server's deterministic runs read it from the environment
    env = {**os.environ, "LLAMA_KV_LAYER_TYPES": spec}
    proc = subprocess.run(cmd[:-2], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0 and why in proc.stderr, proc.stderr[-2000:]


def test_a_quantised_v_layer_needs_flash_attention(smollm2):
    import llama_cpp

    with pytest.raises(ValueError):
        llama_cpp.Llama(model_path=str(smollm2), n_ctx=256, verbose=False, flash_attn=False,
                        kv_layer_types="0=q8_0/q4_0")


def test_kshift_on_a_mixed_cache(gemma3, kv_shift):
    # what shifting costs on the mixed cache stays near what it costs an F16 cache (measured: f16 +0.024, q8_0
    # +0.017, isoquant3_0 +0.018, this mix +0.021; a wrong rotation or a layer shifted as another's type adds far
    # more). A BOS-led text: without BOS, Gemma3's shift costs even F16 +0.27
    ids = _ids(gemma3, 364)
    a, b = ids[:300], ids[300:]
    keep, nd = 4, 150
    retained = a[:keep] + a[keep + nd:]

    def run(shift: bool) -> np.ndarray:
        llm = _llm(gemma3, "isoquant3_0", n_ctx=1024, kv_layer_types=MIXED)
        if not shift:
            llm.eval(retained + b)
            return np.array(llm.scores[len(retained):len(retained) + len(b)])
        kv_shift(llm, a, keep, nd)
        llm.eval(b)
        return np.array(llm.scores[llm.n_tokens - len(b):llm.n_tokens])

    truth = _scores(gemma3, "f16", retained + b, n_ctx=1024)[len(retained):]
    fresh, shifted = _kld(truth, run(False)), _kld(truth, run(True))
    assert shifted - fresh < 0.04, (fresh, shifted)


def test_deferred_prefill_on_a_mixed_cache_is_f16_exact(gemma3):
    import llama_cpp

    prompt, steps = _ids(gemma3, 300), _ids(gemma3, 4, offset=400)

    def run(t, **kw):
        tt = bindings.type_from_name(t)
        llm = llama_cpp.Llama(model_path=str(gemma3), n_ctx=1024, n_batch=512, n_ubatch=128, n_threads=2,
                              verbose=False, flash_attn=True, type_k=tt, type_v=tt, **kw)
        out = []
        llm.eval(prompt)
        for tok in [None, *steps]:
            if tok is not None:
                llm.eval([tok])
            out.append(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy())
        return np.stack(out), bindings.kv_stats(llm)

    f16, _ = run("f16")
    dfr, c = run("isoquant3_0", kv_layer_types=MIXED, kv_deferred=True)
    assert np.array_equal(dfr[0], f16[0])  # the prompt attended exact F16 rows in every layer, whatever its type
    assert _kld(f16[1:], dfr[1:]) > 1e-5  # decoding reads the compressed cache
    assert c["kv_deferred_conversions"] == 2 and c["kv_deferred_bytes"] == 0


def test_server_slots_under_load_answer_as_alone_on_a_mixed_cache(gemma3, monkeypatch):
    # the tools read LLAMA_KV_LAYER_TYPES (common); 4 slots x 2 requests, deterministic: every answer under load
    # equals the same request sent alone
    from rotaryquant.eval import serve

    monkeypatch.setattr(serve, "DETERMINISTIC_ENV", {**serve.DETERMINISTIC_ENV, "LLAMA_KV_LAYER_TYPES": MIXED})
    r = serve.load_test(gemma3, cache="isoquant3_0", clients=4, per_client=2, n_predict=24, deterministic=True,
                        progress=lambda *_: None)
    assert r.requests == 8 and r.failures == 0 and r.empty == 0
    assert r.mismatches == 0, r.examples


# --- the default (no kv_layer_types): 4-bit K within 3.5 bits on a sliding-window model's full-attention layers, or on
# --- the layers a full-attention model's K statistics rank first

def _start_log(bin_dir, model, n_ctx: int, *extra: str) -> str:
    cmd = [str(bin_dir / "llama-completion"), "-m", str(model), "-p", PROMPT, "-n", "1", "-no-cnv", "-t", "2",
           "-c", str(n_ctx), "--no-warmup", "-fa", "on", "-ctk", "isoquant3_0", "-ctv", "isoquant3_0", "-lv", "4",
           *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("n_ctx,layers", [(2048, "5 11 17"), (8192, "5 11"), (32768, "5 11")])
def test_default_types_are_within_the_budget_that_the_caches_log(bin_dir, gemma3, n_ctx, layers):
    from rotaryquant.eval import versus

    shape = versus.kv_shape(gemma3)
    log = _start_log(bin_dir, gemma3, n_ctx)
    line = next(ln for ln in log.splitlines() if "per-layer K/V types" in ln)
    b = versus.kv_bits(log, shape)
    logged = b["bits_per_value"]
    assert f"layer(s) {layers} at 4 bits" in line, line
    predicted = float(re.search(r"at 4 bits, ([\d.]+) bits/value", line).group(1))
    # the log prints each cache's K, V and window in MiB to 2 decimals (Gemma3's whole cache is ~8 MiB at 8K), the
    # prediction in bits to 2 decimals: they agree within those roundings
    figures = 3 * len(re.findall(r"llama_kv_cache: size =", log))
    tol = figures * 0.005 * b["bits_per_value"] / b["kv_mib"] + 0.005
    assert abs(predicted - logged) <= tol and logged <= 3.5, (line, logged, tol)
    # one more full layer would not fit: the budget, not the order, stops the rule (at 2K every full layer fits)
    more = sorted({5, 11, 17} - {int(x) for x in layers.split()})[:1]
    spec = ",".join(f"{i}=isoquant4_0/isoquant3_0" for i in [*layers.split(), *more])
    assert not more or versus.kv_bits(_start_log(bin_dir, gemma3, n_ctx, "--kv-layer-types", spec), shape)["bits_per_value"] > 3.5
    plain = versus.kv_bits(_start_log(bin_dir, gemma3, n_ctx, "--kv-layer-types", "none"), shape)
    assert plain["bits_per_value"] < logged and plain["logged_types"] == ["isoquant3_0/isoquant3_0"]


def test_default_types_on_full_attention_follow_the_measured_ranking(bin_dir, smollm2, tmp_path):
    # SmolLM2 (30 full-attention layers, head 64): 4-bit K on the layers the K statistics' copy task ranks first, as
    # many as fit in 3.5 bits/value; the next layer in the ranking would not fit
    from gguf import GGUFReader

    from rotaryquant.eval import versus

    stats, shape, n_ctx = tmp_path / "ks.gguf", versus.kv_shape(smollm2), 8192
    log = _start_log(bin_dir, smollm2, n_ctx, "--k-stats", str(stats))
    line = next(ln for ln in log.splitlines() if "per-layer K/V types" in ln)
    loss = np.asarray(GGUFReader(stats).fields["rotaryquant.k_stats.retrieval"].contents())
    ranked = sorted(range(len(loss)), key=lambda il: -loss[il])
    chosen = [int(x) for x in re.search(r"layer\(s\) ([\d ]+) at 4 bits", line).group(1).split()]
    assert 0 < len(chosen) < len(loss) and sorted(ranked[:len(chosen)]) == chosen, (line, loss)
    assert "ranked by the retrieval" in line
    logged = versus.kv_bits(log, shape)["bits_per_value"]
    assert logged <= 3.5
    spec = ",".join(f"{il}=isoquant4_0/isoquant3_0" for il in ranked[:len(chosen) + 1])
    more = versus.kv_bits(_start_log(bin_dir, smollm2, n_ctx, "--kv-layer-types", spec, "--k-stats", str(stats)), shape)
    assert more["bits_per_value"] > 3.5
    # opted out, or without K centring (no statistics, no ranking): every layer at 3 bits
    for extra in (("--kv-layer-types", "none"), ("--no-k-center",)):
        plain = versus.kv_bits(_start_log(bin_dir, smollm2, n_ctx, "--k-stats", str(stats), *extra), shape)
        assert plain["bits_per_value"] < logged and plain["logged_types"] == ["isoquant3_64/isoquant3_64"], extra


def test_default_types_on_gemma3_are_the_same_for_every_sliding_window_size(gemma3):
    import llama_cpp

    def mem(spec, swa_full):
        llm = _llm(gemma3, "isoquant3_0", n_ctx=8192, kv_layer_types=spec, swa_full=swa_full)  # alive while read
        return llama_cpp.llama_rq_get_memory(llm.ctx)

    step = 2 * 8192 * (_row("isoquant4_0", 256) - _row("isoquant3_0", 256))
    # as the tools size them (1024-cell sliding-window caches): two full layers fit in 3.5 bits
    a, b, c = mem(None, False), mem("none", False), mem("5=isoquant4_0/isoquant3_0,11=isoquant4_0/isoquant3_0", False)
    assert a.kv_k - b.kv_k == step and (a.kv_k, a.kv_v) == (c.kv_k, c.kv_v) and a.kv_v == b.kv_v
    # llama.h's default, full-size sliding-window caches (Llama's too) take the same types: the budget is reckoned
    # on the tools' cache sizes, which the full-size caches' extra 3-bit cells only undercut
    a, b = mem(None, True), mem("none", True)
    assert a.kv_k - b.kv_k == step
    # and so does a context without the window, or with another ubatch: one layout for A/B runs and state files
    for kw in ({"kv_window": 0}, {"n_ubatch": 128}):
        k = []
        for spec in (None, "none"):
            llm = _llm(gemma3, "isoquant3_0", n_ctx=8192, swa_full=False, kv_layer_types=spec, **kw)
            k.append(llama_cpp.llama_rq_get_memory(llm.ctx).kv_k)
        assert k[0] - k[1] == step, kw
