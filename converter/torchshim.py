"""A numpy stand-in for the part of ``torch`` that llama.cpp's ``conversion/`` package uses on the
common path (safetensors -> per-architecture renames/permutes/stacks -> numpy).

The vendored converter imports torch at module level and passes ``torch.Tensor`` objects through each
architecture's ``modify_tensors``. Its tensor code is mostly array plumbing (reshape, swapaxes, stack,
cat, split, slicing), so a numpy ``ndarray`` subclass with torch's method *semantics* lets us run the
upstream per-architecture code unchanged without installing torch (a 200 MB wheel) — see
docs/converter.md ("torch decision").

Semantics follow torch where the two libraries disagree: ``view(*shape)`` reshapes, ``view(dtype)``
reinterprets bytes; ``transpose(a, b)`` swaps two dims; ``size()`` is callable; ``repeat`` tiles;
``squeeze(d)`` on a non-1 dim is a no-op; reductions take ``dim``/``keepdim``. BF16 bytes become float32
(exact). Anything not provided raises :class:`ShimUnsupported`, which the converter turns into
"this architecture needs ``--tensor-backend torch``". Equivalence with real torch is tested per op
(tests/converter/test_torchshim.py) and end to end against upstream's own conversion.
"""

from __future__ import annotations

import builtins as _bi
import contextlib
import math
import sys
import types
from collections import namedtuple
from typing import Any, Iterable, Sequence

import numpy as np

from rotaryquant.converter.dtypes import bf16_bits_to_f32


class ShimUnsupported(NotImplementedError):
    """The numpy stand-in lacks a torch feature that a converter code path used."""


class ShimMissingAttribute(AttributeError):
    """A torch tensor method the stand-in does not provide (an AttributeError, so hasattr() works)."""


# --- dtypes -----------------------------------------------------------------------------------
# Real numpy dtypes where numpy has the type; distinct sentinel dtypes (never equal to a real array's
# dtype) for the ones it lacks. Tensors never carry a sentinel: bf16 is widened to f32 on load.
def _sentinel(name: str, width: str) -> np.dtype:
    return np.dtype([(name, width)])


float32 = float = np.dtype(np.float32)
float16 = half = np.dtype(np.float16)
float64 = double = np.dtype(np.float64)
int8 = np.dtype(np.int8)
int16 = short = np.dtype(np.int16)
int32 = int = np.dtype(np.int32)          # noqa: A001 (torch's own names)
int64 = long = np.dtype(np.int64)
uint8 = np.dtype(np.uint8)
uint16 = np.dtype(np.uint16)
uint32 = np.dtype(np.uint32)
uint64 = np.dtype(np.uint64)
bool = np.dtype(np.bool_)                 # noqa: A001
bfloat16 = _sentinel("bfloat16", "<u2")
float8_e4m3fn = _sentinel("float8_e4m3fn", "u1")
float8_e5m2 = _sentinel("float8_e5m2", "u1")
float8_e8m0fnu = _sentinel("float8_e8m0fnu", "u1")
dtype = np.dtype
_SENTINELS = {bfloat16: "bfloat16", float8_e4m3fn: "float8_e4m3fn", float8_e5m2: "float8_e5m2",
              float8_e8m0fnu: "float8_e8m0fnu"}

Size = tuple
finfo = np.finfo
iinfo = np.iinfo


def _np_dtype(dt: Any) -> np.dtype | None:
    if dt is None:
        return None
    d = np.dtype(dt)
    if d in _SENTINELS:
        raise ShimUnsupported(f"torch.{_SENTINELS[d]} arithmetic (install torch and use --tensor-backend torch)")
    return d


class device:  # noqa: N801 (torch's spelling)
    def __init__(self, kind: str = "cpu", index: Any = None) -> None:
        self.type = str(kind).split(":")[0]

    def __repr__(self) -> str:
        return f"device(type='{self.type}')"


class _Size(np.int64):
    """ndarray.size is an int attribute; torch's size() is a method. This is both."""

    _shape: tuple

    def __new__(cls, n: Any, shape: tuple) -> "_Size":
        obj = super().__new__(cls, n)
        obj._shape = shape
        return obj

    def __call__(self, dim: Any = None) -> Any:
        return tuple(self._shape) if dim is None else self._shape[dim]


MaxMin = namedtuple("MaxMin", ["values", "indices"])


def _b(x: Any) -> np.ndarray:
    """The plain-ndarray view (numpy's own functions then never re-enter the torch-style methods)."""
    return np.asarray(x)


def _t(x: Any) -> "Tensor":
    """Any array-like as a Tensor (no copy when already an ndarray)."""
    a = np.asarray(x)
    return a.view(Tensor)


def _dims(args: tuple) -> tuple:
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return tuple(args[0])
    return tuple(args)


class Tensor(np.ndarray):
    """ndarray with torch's tensor methods (the subset the converter uses)."""

    # -- identity / conversion
    @property
    def device(self) -> device:
        return device("cpu")

    @property
    def size(self) -> _Size:  # type: ignore[override]
        return _Size(np.ndarray.size.__get__(self), self.shape)

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        return _bi.int(np.ndarray.size.__get__(self))

    def element_size(self) -> int:
        return self.itemsize

    def is_floating_point(self) -> bool:
        return np.issubdtype(self.dtype, np.floating)

    def numpy(self) -> np.ndarray:
        return np.asarray(self)

    def cpu(self) -> "Tensor":
        return self

    def detach(self) -> "Tensor":
        return self

    def contiguous(self, *a: Any, **k: Any) -> "Tensor":
        return _t(np.ascontiguousarray(_b(self)))

    def clone(self, *a: Any, **k: Any) -> "Tensor":
        return _t(np.array(_b(self), copy=True))

    def to(self, *args: Any, **kwargs: Any) -> "Tensor":
        target = kwargs.get("dtype")
        for a in args:
            if isinstance(a, np.dtype) or (isinstance(a, type) and issubclass(a, np.generic)):
                target = a
        if target is None:
            return self  # a device move
        return _t(_b(self).astype(_np_dtype(target)))

    def type(self, dt: Any = None) -> Any:  # noqa: A003
        if dt is None:
            return f"torch.{self.dtype.name}"
        return self.to(dt)

    def float(self) -> "Tensor":  # noqa: A003
        return _t(_b(self).astype(np.float32))

    def half(self) -> "Tensor":
        return _t(_b(self).astype(np.float16))

    def double(self) -> "Tensor":
        return _t(_b(self).astype(np.float64))

    def long(self) -> "Tensor":
        return _t(_b(self).astype(np.int64))

    def int(self) -> "Tensor":  # noqa: A003
        return _t(_b(self).astype(np.int32))

    def bool(self) -> "Tensor":  # noqa: A003
        return _t(_b(self).astype(np.bool_))

    def bfloat16(self) -> "Tensor":
        raise ShimUnsupported("Tensor.bfloat16() (install torch and use --tensor-backend torch)")

    # -- shape
    def view(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        if kwargs or not args:
            return np.ndarray.view(self, *args, **kwargs)          # numpy's own callers (dtype=/type=)
        a0 = args[0]
        if len(args) == 1 and isinstance(a0, type) and issubclass(a0, np.ndarray):
            return np.ndarray.view(self, a0)
        if len(args) == 1 and not isinstance(a0, (tuple, list)) and not _is_int(a0):
            d = np.dtype(a0)
            if d == bfloat16:
                if self.dtype == np.uint8 or self.dtype == np.int16 or self.dtype == np.uint16:
                    raw = np.ascontiguousarray(_b(self))
                    if not self.ndim:
                        return bf16_bits_to_f32(raw).view(Tensor)
                    out = bf16_bits_to_f32(raw.view(np.uint8).reshape(-1))
                    return out.reshape(*self.shape[:-1], self.shape[-1] * self.itemsize // 2).view(Tensor)
                raise ShimUnsupported(f"view of {self.dtype} as bfloat16")
            if d in _SENTINELS:
                raise ShimUnsupported(f"{_SENTINELS[d]} weights (install torch and use --tensor-backend torch)")
            return _t(np.ascontiguousarray(_b(self)).view(d))
        return self.reshape(_dims(args))

    def reshape(self, *args: Any, **kwargs: Any) -> "Tensor":  # type: ignore[override]
        return np.ndarray.reshape(self, *args, **kwargs)

    def permute(self, *dims: Any) -> "Tensor":
        return _t(np.transpose(_b(self), _dims(dims)))

    def transpose(self, *args: Any) -> "Tensor":  # type: ignore[override]
        if len(args) == 2 and _bi.all(_is_int(a) for a in args):
            return _t(np.swapaxes(_b(self), args[0], args[1]))       # torch: swap two dims
        return np.ndarray.transpose(self, *args)

    def t(self) -> "Tensor":
        return self.T

    def unsqueeze(self, dim: Any) -> "Tensor":
        return _t(np.expand_dims(_b(self), dim))

    def squeeze(self, dim: Any = None, axis: Any = None) -> "Tensor":  # type: ignore[override]
        if axis is not None:
            return np.ndarray.squeeze(self, axis=axis)
        if dim is None:
            return np.ndarray.squeeze(self)
        dims = dim if isinstance(dim, (tuple, list)) else (dim,)
        keep = [d % self.ndim for d in dims if self.shape[d] == 1]
        return np.ndarray.squeeze(self, axis=tuple(keep)) if keep else self

    def flatten(self, start_dim: Any = 0, end_dim: Any = -1) -> "Tensor":  # type: ignore[override]
        if isinstance(start_dim, str):                              # numpy's order argument
            return np.ndarray.flatten(self, start_dim)
        if self.ndim == 0:
            return self.reshape(1)
        s, e = start_dim % self.ndim, end_dim % self.ndim
        return self.reshape(*self.shape[:s], -1, *self.shape[e + 1:])

    def expand(self, *sizes: Any) -> "Tensor":
        sizes = _dims(sizes)
        lead = len(sizes) - self.ndim
        shape = tuple(self.shape[i - lead] if s == -1 else s for i, s in enumerate(sizes))
        return _t(np.broadcast_to(_b(self), shape))

    def repeat(self, *args: Any, **kwargs: Any) -> "Tensor":  # type: ignore[override]
        # numpy's own code (np.repeat, np.tile) calls ndarray.repeat(n, axis); everyone else means torch's
        if "axis" in kwargs or sys._getframe(1).f_globals.get("__name__", "").startswith("numpy"):
            return np.ndarray.repeat(self, *args, **kwargs)
        reps = _dims(args)
        return _t(np.tile(_b(self), reps))

    def repeat_interleave(self, repeats: Any, dim: Any = None) -> "Tensor":
        return _t(np.repeat(_b(self), repeats, axis=dim))

    def split(self, split_size: Any, dim: Any = 0) -> tuple:
        return split(self, split_size, dim)

    def chunk(self, chunks: Any, dim: Any = 0) -> tuple:
        return chunk(self, chunks, dim)

    def unbind(self, dim: Any = 0) -> tuple:
        return tuple(_t(x) for x in np.moveaxis(_b(self), dim, 0))

    def narrow(self, dim: Any, start: Any, length: Any) -> "Tensor":
        idx = [slice(None)] * self.ndim
        idx[dim] = slice(start, start + length)
        return self[tuple(idx)]

    # -- elementwise / reductions
    def abs(self) -> "Tensor":
        return _t(np.abs(_b(self)))

    def exp(self) -> "Tensor":
        return _t(np.exp(_b(self)))

    def log(self) -> "Tensor":
        return _t(np.log(_b(self)))

    def sqrt(self) -> "Tensor":
        return _t(np.sqrt(_b(self)))

    def neg(self) -> "Tensor":
        return -self

    def _reduce(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        if "dim" in kwargs:
            kwargs["axis"] = kwargs.pop("dim")
        if "keepdim" in kwargs:
            kwargs["keepdims"] = kwargs.pop("keepdim")
        if args and "axis" not in kwargs and _is_int(args[0]) or (args and isinstance(args[0], tuple)):
            kwargs["axis"], args = args[0], args[1:]
        return fn(np.asarray(self), *args, **kwargs)

    def sum(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return _t(self._reduce(np.sum, args, dict(kwargs)))

    def mean(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return _t(self._reduce(np.mean, args, dict(kwargs)))

    def _maxmin(self, fn: Any, argfn: Any, args: tuple, kwargs: dict) -> Any:
        torch_style = "dim" in kwargs or (args and _is_int(args[0]) and "axis" not in kwargs)
        if not torch_style:
            return _t(fn(np.asarray(self), *args, **kwargs))
        dim = kwargs.pop("dim", None) if "dim" in kwargs else args[0]
        keep = kwargs.pop("keepdim", False)
        a = np.asarray(self)
        return MaxMin(_t(fn(a, axis=dim, keepdims=keep)), _t(np.expand_dims(argfn(a, axis=dim), dim) if keep
                                                             else argfn(a, axis=dim)))

    def max(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self._maxmin(np.max, np.argmax, args, dict(kwargs))

    def min(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self._maxmin(np.min, np.argmin, args, dict(kwargs))

    def amax(self, *args: Any, **kwargs: Any) -> Any:
        return _t(self._reduce(np.max, args, dict(kwargs)))

    def amin(self, *args: Any, **kwargs: Any) -> Any:
        return _t(self._reduce(np.min, args, dict(kwargs)))

    def div_(self, other: Any) -> "Tensor":
        np.divide(_b(self), other, out=_b(self))
        return self

    def mul_(self, other: Any) -> "Tensor":
        np.multiply(_b(self), other, out=_b(self))
        return self

    def add_(self, other: Any) -> "Tensor":
        np.add(_b(self), other, out=_b(self))
        return self

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise ShimMissingAttribute(f"Tensor.{name} (install torch and use --tensor-backend torch)")


def _is_int(x: Any) -> _bi.bool:
    return isinstance(x, (_bi.int, np.integer)) and not isinstance(x, _bi.bool)


# --- module-level functions ---------------------------------------------------------------------
def from_numpy(a: np.ndarray) -> Tensor:
    return _t(a)


def tensor(data: Any, dtype: Any = None, device: Any = None, **_: Any) -> Tensor:  # noqa: A001
    d = _np_dtype(dtype)
    if d is None:
        a = np.asarray(data)
        if a.dtype == np.float64:
            a = a.astype(np.float32)  # torch's default float dtype
        return _t(np.array(a, copy=True))
    return _t(np.array(data, dtype=d))


as_tensor = tensor


def _shape_args(args: tuple) -> tuple:
    return _dims(args)


def zeros(*size: Any, dtype: Any = None, device: Any = None, **_: Any) -> Tensor:
    return _t(np.zeros(_shape_args(size), dtype=_np_dtype(dtype) or np.float32))


def ones(*size: Any, dtype: Any = None, device: Any = None, **_: Any) -> Tensor:
    return _t(np.ones(_shape_args(size), dtype=_np_dtype(dtype) or np.float32))


def empty(*size: Any, dtype: Any = None, device: Any = None, **_: Any) -> Tensor:
    return _t(np.empty(_shape_args(size), dtype=_np_dtype(dtype) or np.float32))


def full(size: Any, fill_value: Any, dtype: Any = None, device: Any = None, **_: Any) -> Tensor:
    d = _np_dtype(dtype) or (np.float32 if isinstance(fill_value, _bi.float) else None)
    return _t(np.full(tuple(size), fill_value, dtype=d))


def zeros_like(a: Any, dtype: Any = None, **_: Any) -> Tensor:
    return _t(np.zeros_like(np.asarray(a), dtype=_np_dtype(dtype)))


def ones_like(a: Any, dtype: Any = None, **_: Any) -> Tensor:
    return _t(np.ones_like(np.asarray(a), dtype=_np_dtype(dtype)))


def arange(start: Any, end: Any = None, step: Any = 1, dtype: Any = None, device: Any = None, **_: Any) -> Tensor:
    if end is None:
        start, end = 0, start
    d = _np_dtype(dtype)
    if d is None:
        d = np.int64 if _bi.all(_is_int(v) for v in (start, end, step)) else np.float32
    return _t(np.arange(start, end, step, dtype=d))


def stack(tensors: Sequence[Any], dim: Any = 0, axis: Any = None) -> Tensor:
    return _t(np.stack([np.asarray(t) for t in tensors], axis=dim if axis is None else axis))


def cat(tensors: Sequence[Any], dim: Any = 0, axis: Any = None) -> Tensor:
    return _t(np.concatenate([np.asarray(t) for t in tensors], axis=dim if axis is None else axis))


concat = concatenate = cat


def split(t: Any, split_size_or_sections: Any, dim: Any = 0) -> tuple:
    a = np.asarray(t)
    n = a.shape[dim]
    if _is_int(split_size_or_sections):
        s = split_size_or_sections
        idx = list(range(s, n, s))
    else:
        idx = list(np.cumsum(split_size_or_sections)[:-1])
        if sum(split_size_or_sections) != n:
            raise ValueError(f"split sizes {split_size_or_sections} do not sum to {n}")
    return tuple(_t(p) for p in np.split(a, idx, axis=dim))


def chunk(t: Any, chunks: Any, dim: Any = 0) -> tuple:
    n = np.asarray(t).shape[dim]
    return split(t, math.ceil(n / chunks), dim)


def _unary(fn: Any) -> Any:
    return lambda x, *a, **k: _t(fn(np.asarray(x), *a, **k))


exp = _unary(np.exp)
exp2 = _unary(np.exp2)
log = _unary(np.log)
sqrt = _unary(np.sqrt)
sin = _unary(np.sin)
cos = _unary(np.cos)
tanh = _unary(np.tanh)
abs = _unary(np.abs)  # noqa: A001
sign = _unary(np.sign)
bitwise_and = _unary(np.bitwise_and)
bitwise_or = _unary(np.bitwise_or)
bitwise_right_shift = _unary(np.right_shift)
bitwise_left_shift = _unary(np.left_shift)


def sigmoid(x: Any) -> Tensor:
    return _t(1.0 / (1.0 + np.exp(-np.asarray(x))))


def reshape(t: Any, shape: Any) -> Tensor:
    return _t(np.reshape(np.asarray(t), shape))


def permute(t: Any, dims: Any) -> Tensor:
    return _t(np.transpose(np.asarray(t), tuple(dims)))


def transpose(t: Any, d0: Any, d1: Any) -> Tensor:
    return _t(np.swapaxes(np.asarray(t), d0, d1))


def unsqueeze(t: Any, dim: Any) -> Tensor:
    return _t(np.expand_dims(np.asarray(t), dim))


def squeeze(t: Any, dim: Any = None) -> Tensor:
    return _t(t).squeeze(dim)


def flatten(t: Any, start_dim: Any = 0, end_dim: Any = -1) -> Tensor:
    return _t(t).flatten(start_dim, end_dim)


def equal(a: Any, b: Any) -> Any:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and _bi.bool(np.array_equal(a, b))


def all(t: Any) -> Tensor:  # noqa: A001
    return _t(np.all(np.asarray(t)))


def any(t: Any) -> Tensor:  # noqa: A001
    return _t(np.any(np.asarray(t)))


def where(cond: Any, a: Any, b: Any) -> Tensor:
    return _t(np.where(np.asarray(cond), np.asarray(a), np.asarray(b)))


def repeat_interleave(t: Any, repeats: Any, dim: Any = None) -> Tensor:
    return _t(t).repeat_interleave(repeats, dim)


def is_tensor(x: Any) -> Any:
    return isinstance(x, np.ndarray)


@contextlib.contextmanager
def inference_mode(*a: Any, **k: Any) -> Iterable[None]:
    yield


no_grad = inference_mode


def load(*a: Any, **k: Any) -> Any:
    raise ShimUnsupported("pytorch_model.bin checkpoints (install torch and use --tensor-backend torch, "
                          "or convert the checkpoint to safetensors)")


def _softplus(x: Any, beta: Any = 1.0, threshold: Any = 20.0) -> Tensor:
    a = np.asarray(x)
    return _t(np.where(a * beta > threshold, a, np.log1p(np.exp(a * beta)) / beta).astype(a.dtype))


nn = types.SimpleNamespace(functional=types.SimpleNamespace(softplus=_softplus))

__version__ = "0.0+numpy-shim"


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    raise ShimUnsupported(f"torch.{name} (install torch and use --tensor-backend torch)")


@contextlib.contextmanager
def installed() -> Iterable[types.ModuleType]:
    """Make ``import torch`` return this module while the block runs (then restore what was there).

    Modules imported inside keep their reference to the stand-in; code imported later (transformers'
    lazy tokenizer paths, say) sees the real state of the environment again.
    """
    me = sys.modules[__name__]
    saved = {k: sys.modules[k] for k in ("torch",) if k in sys.modules}
    sys.modules["torch"] = me
    try:
        yield me
    finally:
        if "torch" in saved:
            sys.modules["torch"] = saved["torch"]
        else:
            sys.modules.pop("torch", None)
