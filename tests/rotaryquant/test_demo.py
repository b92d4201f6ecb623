"""`make demo`: its in-process completion (figures from llama.cpp's API), its output, and one real run of
its KV part."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from rotaryquant import demo, paths


def test_completion_figures_come_from_llama_cpp_api(smollm2):
    """In-process greedy run: KV bytes = llama_rq_get_memory's (layers x cells x K and V rows), speed from
    llama_perf_context."""
    import math

    from rotaryquant.bindings import row_size, type_from_name

    c = demo.complete(smollm2, demo.PROMPT, 4, 1, "q8_0", "f16")
    assert c.text.startswith(" ") and len(c.text.split()) >= 1
    want = 30 * demo.N_CTX * (row_size(type_from_name("q8_0"), 192) + row_size(type_from_name("f16"), 192))
    assert c.kv_bytes == want                       # SmolLM2: 30 layers, 3 KV heads x 64
    assert math.isfinite(c.decode_tps) and c.decode_tps > 0
    assert demo.complete(smollm2, demo.PROMPT, 4, 1, "q8_0", "f16").text == c.text     # greedy: the same text


def test_same_words_counts_the_common_prefix():
    assert demo.same_words(" the steam engine, the telegraph", " the steam engine and the telegraph") == (2, 6)
    assert demo.same_words(" a b c", " a b c") == (3, 3)
    assert demo.same_words(" a b", " x") == (0, 1)


def test_output_keeps_the_space_between_prompt_and_continuation(capsys):
    demo.show("were", [demo.Run("base", " the steam engine", "KV 1 MiB", 10.0),
                       demo.Run("other", " the telegraph", "KV 0.2 MiB", 11.0)])
    out = capsys.readouterr().out
    assert "| were the steam engine" in out and "| were the telegraph" in out
    assert "its first 1 of 2 words match the baseline" in out


@pytest.mark.slow
def test_kv_part_runs_f16_beside_the_compressed_caches(gemma3, tmp_path):
    from rotaryquant.converter import kcenter

    model = tmp_path / "gemma3.kc.gguf"
    kcenter.calibrate(gemma3, model, n_tokens=1024, n_ctx=1024, progress=False)
    proc = subprocess.run([sys.executable, "-m", "rotaryquant.demo", "--skip-convert", "--model", str(model),
                           "-n", "8"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    kv = [float(m) for m in re.findall(r"KV ([\d.]+) MiB, decode [\d.]+ t/s", proc.stdout)]
    assert len(kv) == 3, proc.stdout
    # f16, then isoquant3_0 K+V with its default window (16 positions + one 512-token ubatch of F16 rows, counted),
    # then without the window: each smaller than the one before
    assert kv[0] > kv[1] > kv[2] > 0
    assert kv[0] / kv[2] > 4.5
    assert "docs/results/REPORT.md" in proc.stdout
    assert "| The three most important inventions of the nineteenth century were " in proc.stdout


def test_weights_verdict_reads_the_iq3s_row():
    base = demo.Run("f16", " a b c d e f g h", "", 1.0)
    rq = demo.Run("rq", " a b c x", "", 1.0)
    # IQ3_S leaves the baseline early too: the rows say ITQ3_S is or is not behind, not how good either is
    v = demo._verdict([base, rq, demo.Run("itq3", " a x", "", 1.0), demo.Run("iq3", " x", "", 1.0)], 30)
    assert "leaves the baseline's greedy text early too (after 0 words; ITQ3_S 1, the 4-bit recipe 3)" in v
    assert "ITQ3_S is not behind" in v
    v = demo._verdict([base, rq, demo.Run("itq3", " a x", "", 1.0), demo.Run("iq3", " a b c d e x", "", 1.0)], 30)
    assert "ITQ3_S keeps 1 word of the baseline, IQ3_S + imatrix 5: ITQ3_S is behind it here" in v


def test_setup_for_the_demo_builds_every_tool_it_runs():
    # `make demo` builds only DEMO_TARGETS (setup --demo): each llama.cpp tool the demo calls must be among them, and
    # they must be a part of what the full set-up builds
    from rotaryquant.build.cmake import DEMO_TARGETS, TARGETS

    source = (paths.REPO / "rotaryquant" / "demo.py").read_text()
    called = set(re.findall(r'tools\.binary\("([\w-]+)"\)', source))
    assert called, "the demo calls no tool by name any more: update this test"
    assert called <= set(DEMO_TARGETS), called - set(DEMO_TARGETS)
    assert set(DEMO_TARGETS) <= set(TARGETS)
