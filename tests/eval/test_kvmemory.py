"""rotaryquant.eval.kvmemory: the eq. 12 prediction from the model's shapes, and the CLI's input checks."""

from __future__ import annotations

from rotaryquant.eval import cli, kvmemory


def test_eq12_is_an_f16_kv_cache_for_the_prompt(gemma3, smollm2):
    # Gemma3-270M: 18 layers, 1 KV head of 256 (K and V); SmolLM2-135M: 30 layers, 3 KV heads of 64
    assert kvmemory.eq12_bytes(gemma3, 512) == 2 * 18 * 1 * 256 * 512 * 2
    assert kvmemory.eq12_bytes(smollm2, 100) == 2 * 30 * 3 * 64 * 100 * 2


def test_cli_rejects_bad_prompt_lengths(tmp_path, capsys):
    out = tmp_path / "mem"
    assert cli.main(["memory", "--prompt", "1", "-o", str(out)]) == 1
    assert cli.main(["memory", "--prompt", "x", "-o", str(out)]) == 1
    assert cli.main(["memory", "--kv", "q5_9", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "--prompt" in err and "q5_9" in err
    assert not out.with_suffix(".json").exists()
