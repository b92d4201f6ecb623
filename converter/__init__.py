"""HF folder / GGUF -> GGUF with ITQ3_S and per-role mixed precision (being built; see issue 5)."""
