"""gguf-py's quantiser classes of our types: ITQ3_S, ISOQUANT3_0, ISOQUANT4_0, ISOQUANT3_64, ISOQUANT4_64.

``gguf.quants`` keeps one small class per type (``quantize_blocks`` / ``dequantize_blocks`` over numpy
block arrays), registered in its type table by the class statement itself (``__Quant.__init_subclass__``).
Patch 0005 ends gguf/quants.py with a hook that calls :func:`register` with that base class when
rotaryquant is importable, so ``gguf.quants.quantize`` / ``dequantize``, and every tool reading tensors
with ``GGUFReader``, handle our types as they handle Q4_0. The numerics stay here, in
``rotaryquant.quants.itq3`` and ``rotaryquant.quants.isoquant`` (bit-exact with the C library); the
patch only hooks them in.

No import of ``gguf`` at module level: :func:`register` runs while ``gguf.quants`` is still executing,
when only ``gguf.constants`` (imported before it) is complete.
"""

from __future__ import annotations

import numpy as np

from rotaryquant.quants import isoquant, itq3

__all__ = ["register"]


def register(base: type) -> tuple[type, ...]:
    """Define (and thereby register) gguf-py's classes of our types on ``base`` (gguf.quants.__Quant)."""
    # lazy: runs while gguf.quants is being imported (see the docstring)
    from gguf.constants import GGMLQuantizationType as QT

    class ITQ3_S(base, qtype=QT.ITQ3_S):
        @classmethod
        def quantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
            return itq3.quantize_blocks(blocks)

        @classmethod
        def dequantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
            return itq3.dequantize_blocks(blocks)

    def isoquant_class(bits: int, qtype: QT, qk: int = 128) -> type:
        class IsoQuant(base, qtype=qtype):
            @classmethod
            def quantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
                return isoquant.quantize_blocks(blocks, bits=bits, qk=qk)

            @classmethod
            def dequantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
                return isoquant.dequantize_blocks(blocks, bits=bits, qk=qk)

        IsoQuant.__name__ = IsoQuant.__qualname__ = qtype.name
        return IsoQuant

    ISOQUANT3_0 = isoquant_class(3, QT.ISOQUANT3_0)
    ISOQUANT4_0 = isoquant_class(4, QT.ISOQUANT4_0)
    classes = (ITQ3_S, ISOQUANT3_0, ISOQUANT4_0)
    # the 64-wide types (GGML_RQ_VERSION 4), when this gguf-py knows them
    if hasattr(QT, "ISOQUANT3_64") and hasattr(QT, "ISOQUANT4_64"):
        classes += (isoquant_class(3, QT.ISOQUANT3_64, 64), isoquant_class(4, QT.ISOQUANT4_64, 64))
    return classes
