"""Measurements behind `rq-eval` (one subcommand each; `rq-bench` is `rq-eval bench`): KV-cache quality
(perplexity/KLD, decode-time KLD, NIAH, the quality gate), speed and memory, weight types, llama-server under
load, conversion speed, the IsoQuant variants on synthetic data, and the report that collects them."""
