"""`make demo`: the log parsing it prints from, and one real run of its KV part."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from rotaryquant import demo

LOG = """\
llama_kv_cache: size =   18.00 MiB (  1024 cells,   3 layers,  1/1 seqs), K (f16):    9.00 MiB, V (f16):    9.00 MiB
llama_kv_cache: size =    2.25 MiB (   512 cells,  15 layers,  1/1 seqs), K (f16):    1.12 MiB, V (f16):    1.12 MiB
common_perf_print: prompt eval time =      60.70 ms /    11 tokens (    5.52 ms per token,   181.20 tokens per second)
common_perf_print:        eval time =     320.08 ms /    23 runs   (   13.92 ms per token,    71.86 tokens per second)
"""


def test_kv_mib_adds_both_caches_of_an_iswa_model():
    assert demo.kv_mib(LOG) == pytest.approx(20.25)
    assert demo.kv_mib("no cache here") == 0


def test_decode_speed_is_the_eval_line_not_the_prompt_line():
    assert demo._perf(LOG, "eval") == pytest.approx(71.86)


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
    # f16, then isoquant4_0 K / isoquant3_0 V, then isoquant3_0 K+V: each smaller than the one before
    assert kv[0] > kv[1] > kv[2] > 0
    assert kv[0] / kv[2] > 4.5
    assert "docs/results/REPORT.md" in proc.stdout
    assert "| The three most important inventions of the nineteenth century were " in proc.stdout
