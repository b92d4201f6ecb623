"""rotaryquant.assets: the default models and text come from pinned packages, located with clear errors."""

from __future__ import annotations

import pytest

from rotaryquant import assets


def test_default_models_are_assembled(smollm2, gemma3):
    assert smollm2.stat().st_size == assets.MODELS["smollm2-135m"].size
    assert gemma3.stat().st_size == assets.MODELS["gemma3-270m"].size
    for p in (smollm2, gemma3):
        with open(p, "rb") as f:
            assert f.read(4) == b"GGUF"


def test_text_is_plain_shakespeare(text_file):
    head = text_file.read_text(errors="strict")[:200_000]
    assert "HAMLET" in text_file.read_text() or "Hamlet" in head
    assert len(text_file.read_bytes()) > 1_000_000


def test_missing_model_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("RQ_CACHE", str(tmp_path))
    with pytest.raises(assets.AssetError, match="make setup"):
        assets.model_path("smollm2-135m")
    with pytest.raises(assets.AssetError, match="unknown model"):
        assets.model_path("no-such-model")
    with pytest.raises(assets.AssetError, match="make setup"):
        assets.text_path()
