"""Measurements: KV-cache speed and size now; perplexity/KLD, NIAH and the quality gate grow here."""
