"""The batches of the runtime's K statistics pass (llama-rq-kstats.cpp), rebuilt independently in Python: the
statistics' 8 sequences and the copy task that follows them (llama_rq_copy_task), from the same token stream."""

from __future__ import annotations

from pathlib import Path

import numpy as np

COPY_L = 48  # llama_rq_copy_task::L


def self_batches(model: Path, n_tokens: int) -> tuple[list[int], list[tuple[int, int]], list[int], int]:
    """8 sequences of n/8 tokens at 0 and at 1/64, 1/32 .. 1/2 and the end of the trained context, each a BOS and
    then ordinary tokens drawn by std::mt19937(20260401) (numpy's legacy MT19937 seeding is the same generator);
    then, from the same stream, the copy task: BOS, COPY_L distinct ordinary tokens, the same again.
    Returns the statistics' ids and (position, seq), the copy task's ids and the first copy's position."""
    import llama_cpp as L

    m = L.llama_model_load_from_file(str(model).encode(), L.llama_model_default_params())
    try:
        vocab = L.llama_model_get_vocab(m)
        n_train = L.llama_model_n_ctx_train(m)
        n_tok = min(n_tokens, n_train)
        ordinary = [t for t in range(L.llama_vocab_n_tokens(vocab))
                    if L.llama_vocab_get_attr(vocab, t) & L.LLAMA_TOKEN_ATTR_NORMAL]
        bos = L.llama_vocab_bos(vocab) if L.llama_vocab_get_add_bos(vocab) else None
    finally:
        L.llama_model_free(m)
    bg = np.random.MT19937(0)
    bg._legacy_seeding(20260401)

    def draw() -> int:
        return ordinary[int(bg.random_raw()) % len(ordinary)]

    n_seq, n_per = 8, n_tok // 8
    span = max(n_train, n_tok)
    ids, pos = [], []
    for s in range(n_seq):
        p0 = 0 if s == 0 else (span - n_per) >> (n_seq - 1 - s)
        for i in range(n_per):
            ids.append(bos if i == 0 and bos is not None else draw())
            pos.append((p0 + i, s))
    body: list[int] = []
    while len(body) < min(COPY_L, len(ordinary)):
        t = draw()
        if t not in body:
            body.append(t)
    head = [bos] if bos is not None else []
    return ids, pos, [*head, *body, *body], len(head)
