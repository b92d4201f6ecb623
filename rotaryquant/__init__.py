"""RotaryQuant: IsoQuant 3-bit KV cache and ITQ3_S 3-bit weights for llama.cpp.

Sub-packages: ``rotaryquant.bindings`` (the patched libraries from Python),
``rotaryquant.converter`` (HF/GGUF -> GGUF), ``rotaryquant.eval`` (measurements),
``rotaryquant.quants`` (numpy references of our formats).
"""

__version__ = "0.1.0"
