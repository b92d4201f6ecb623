"""Metrics on raw logits (rows = positions): KL divergence of one run against a reference run."""

from __future__ import annotations

import numpy as np


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kld_rows(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(softmax(ref) || softmax(logits)) per position (row), in float64."""
    lp, lq = log_softmax(np.asarray(ref_logits, np.float64)), log_softmax(np.asarray(logits, np.float64))
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)


def kld(ref_logits: np.ndarray, logits: np.ndarray) -> float:
    """Mean over positions of KL(softmax(ref) || softmax(logits)), as llama-perplexity's --kl-divergence."""
    return float(kld_rows(ref_logits, logits).mean())
