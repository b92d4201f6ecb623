"""rotaryquant.eval.serve's soak pieces that need no server: the request mix and the results file."""

from __future__ import annotations

from rotaryquant.eval import serve


def test_mixed_requests_vary_lengths_and_kinds():
    reqs = serve.mixed_requests(64)
    assert {r.kind for r in reqs} == set(serve.KINDS)
    assert {r.n_predict for r in reqs} == {16, 48, 96}
    sentences = {len([p for p in serve.PROMPTS if p in r.prompt]) for r in reqs}
    assert min(sentences) == 1 and max(sentences) == 8


def test_soak_markdown_reports_what_was_left_behind():
    res = {"cache": "isoquant3_0", "minutes": 30.0, "requests": 900, "dropped": 100, "malformed": 0, "stalled": False,
           "mixed": True, "server_args": ["--cache-ram", "0"], "rss_kib": [(0.0, 300 * 1024), (1800.0, 310 * 1024)],
           "rss_growth_pct": 0.4, "after": {"slots_processing": 0, "kv_deferred_bytes": 0.0}}
    md = serve.soak_markdown(res)
    assert "# llama-server soak: isoquant3_0, --cache-ram 0" in md and "mixed prompt/answer lengths" in md
    assert "| 900 | 100 | 0 | no | 300 / 310 | 0.4% | 0 | 0.0 |" in md
