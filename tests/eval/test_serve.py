"""rotaryquant.eval.serve: llama-server with an isoquant3_0 cache under concurrent load (small CI version),
its /metrics counters, and slot save/restore."""

from __future__ import annotations

import json
import urllib.request

import pytest

from rotaryquant.eval import serve

pytestmark = pytest.mark.slow


def test_concurrent_clients_all_get_full_answers(gemma3):
    # Default server: greedy text under load is counted against the same request alone, not asserted:
    # upstream's repacked and tiled matmuls change algorithm with the batch size (see the next test).
    r = serve.load_test(gemma3, cache="isoquant3_0", clients=4, per_client=2, n_predict=16, progress=lambda *_: None)
    assert r.requests == 8
    assert r.failures == 0 and r.empty == 0
    assert r.concurrent_tps > 0 and r.solo_tps > 0
    # the fused path served them: attention calls counted, no K/V row dequantised
    assert r.metrics["isoquant_fused_calls_total"] > 0
    assert r.metrics["isoquant_dequant_rows_total"] == 0
    assert "| isoquant3_0 | default | - | 4 | 8 | 0 | 0 |" in serve.to_markdown([serve.as_dict(r)])


@pytest.mark.parametrize("cache", ["isoquant3_0", "f16"])
def test_deterministic_server_answers_under_load_as_alone(gemma3, cache):
    # --no-repack and GGML_CPU_TILED_MM=0 leave only kernels whose per-row result does not depend on
    # the batch; the fused IsoQuant attention is one of them
    r = serve.load_test(gemma3, cache=cache, clients=4, per_client=2, n_predict=24, deterministic=True,
                        progress=lambda *_: None)
    assert r.requests == 8 and r.failures == 0 and r.empty == 0
    assert r.mismatches == 0, r.examples


def _post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def test_slot_save_and_restore_round_trip(gemma3, tmp_path):
    prompt = "The three most important inventions of the nineteenth century were"
    body = {"prompt": prompt, "n_predict": 12, "temperature": 0, "top_k": 1, "id_slot": 0, "cache_prompt": True}
    # --swa-full: Gemma3's sliding-window layers otherwise keep too little cache for llama-server to reuse a prefix.
    # The first answer is not the reference: its prompt ran as one batch with deferred prefill (attention on exact
    # K/V), a reused prompt re-evaluates only its last token against the compressed cache. The reference is that
    # reuse before the save, which the restored slot must repeat token for token.
    with serve.server(gemma3, cache="isoquant3_0", parallel=1, env=serve.DETERMINISTIC_ENV,
                      extra=["--slot-save-path", str(tmp_path), "--swa-full", *serve.DETERMINISTIC_ARGS]) as srv:
        first = _post(srv.url + "/completion", body)
        reused = _post(srv.url + "/completion", body)
        saved = _post(srv.url + "/slots/0?action=save", {"filename": "slot0.bin"})
        assert saved["n_saved"] > 0 and (tmp_path / "slot0.bin").stat().st_size > 0
        _post(srv.url + "/slots/0?action=erase", {})
        restored = _post(srv.url + "/slots/0?action=restore", {"filename": "slot0.bin"})
        assert restored["n_restored"] == saved["n_saved"]
        again = _post(srv.url + "/completion", body)
    assert again["content"] == reused["content"]
    # the restored isoquant3_0 cache was reused, not recomputed
    assert again["timings"]["prompt_n"] == reused["timings"]["prompt_n"] < first["timings"]["prompt_n"]
