"""Measurements behind `rq-eval` and `rq-bench`: KV-cache quality (perplexity/KLD, decode-time KLD, NIAH, the
quality gate), speed and memory, weight types, llama-server under load, and the report that collects them."""
