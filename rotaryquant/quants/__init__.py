"""Numpy references of our ggml types, bit-exact with the C library: ``isoquant`` (ISOQUANT3_0/4_0 KV cache),
``itq3`` (ITQ3_S weights), their tables, and ``gguf_quants`` (the same as gguf.quants classes)."""
