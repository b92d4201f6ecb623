"""Reference (numpy) implementations of the rotaryquant KV-cache quantisation types."""
