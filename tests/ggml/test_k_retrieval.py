"""The copy task of the K statistics' pass (llama-rq-retrieval.cpp): per layer, the share of an induction head's
attention on the earlier occurrence's successor that a 3-bit K cache gives up. Recomputed here in numpy from the
Q/K of the same tokens, captured from an F16 pass, with the statistics the runtime stored."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from gguf import GGUFReader
from self_tokens import COPY_L, self_batches  # tests/helpers

from rotaryquant import bindings

pytestmark = pytest.mark.slow

WINDOW = 16  # LLAMA_RQ_KV_WINDOW_DEFAULT: keys this close to the query stay exact


@pytest.fixture(scope="module")
def stats(bin_dir, smollm2, tmp_path_factory):
    f = tmp_path_factory.mktemp("retrieval") / "ks.gguf"
    cmd = [str(bin_dir / "llama-completion"), "-m", str(smollm2), "-p", "Hello", "-n", "1", "-no-cnv", "-t", "2",
           "-c", "256", "--no-warmup", "-fa", "on", "-ctk", "isoquant3_0", "-ctv", "isoquant3_0", "--k-stats", str(f)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {name: fld.contents() for name, fld in GGUFReader(f).fields.items() if name.startswith("rotaryquant.")}


def _loss(q: np.ndarray, k: np.ndarray, mu: np.ndarray, lam: np.ndarray, off: int) -> float:
    """q [n, nq, hd] (times the softmax scale), k [n, nkv, hd]; mu/lam [nkv, hd]."""
    n, nq, hd = q.shape
    g = nq // k.shape[1]
    kc = ((k - mu) / lam).astype(np.float32)
    kx = bindings.iso_roundtrip(kc.reshape(-1, hd), bindings.type_from_name("isoquant3_64")).reshape(kc.shape)
    lost = []
    for h in range(nq):
        for t in range(off + COPY_L, n):
            qs = q[t, h].astype(np.float64) * lam[h // g]
            s = kc[:t + 1, h // g] @ qs
            near = t - np.arange(t + 1) < WINDOW
            sx = np.where(near, s, kx[:t + 1, h // g] @ qs)
            p, px = np.exp(s - s.max()), np.exp(sx - sx.max())
            target = t - COPY_L + 1
            lost.append(max(p[target] / p.sum() - px[target] / px.sum(), 0.0))
    return float(np.mean(lost))


def test_the_runtime_ranking_is_numpys_on_the_same_tokens(smollm2, stats):
    from rotaryquant.bindings.capture import capture

    _, _, copy, off = self_batches(smollm2, int(stats["rotaryquant.k_stats.n_tokens"]))
    f16 = bindings.type_from_name("f16")
    cap = capture(smollm2, copy, ["attn_q_sm", "attn_k_in"], type_k=f16, type_v=f16, n_ctx=256)
    got = np.asarray(stats["rotaryquant.k_stats.retrieval"], np.float64)
    mu = np.asarray(stats["rotaryquant.k_center.mean"], np.float32).reshape(30, 3, 64)
    lam = np.asarray(stats["rotaryquant.k_center.scale"], np.float32).reshape(30, 3, 64)
    n = len(copy)
    want = np.array([_loss(cap[f"attn_q_sm-{il}"].reshape(n, -1, 64), cap[f"attn_k_in-{il}"].reshape(n, 3, 64),
                           mu[il], lam[il], off) for il in range(30)])
    assert got.shape == (30,) and np.all(got >= 0)
    assert want.max() > 10 * np.median(want) > 0  # some layers retrieve, most do not: a ranking worth having
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-6)
