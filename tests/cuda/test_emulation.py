"""Our CUDA code (ggml-patches/src/cuda: every kernel, and the host functions that choose their grids and launch them)
executed here without a GPU: compiled by g++ as host C++ against tests/cuda/shim (the CUDA subset it uses: warp
shuffles, __syncthreads(_or), half/bfloat16 with CUDA's rounding, the rounding intrinsics, dp4a, byte_perm), each
thread of a block a fiber (tests/emu/fibers.h, shared with the Metal emulation), lanes in two orders, __shared__
memory poisoned before every block. tests/cuda/run_cuda.cpp calls the entry points the CUDA backend calls, on ggml
tensors in host memory. Checked against ggml's C reference bit for bit where the kernels keep its operations and
order (quantiser, dequantisers, copies), else against float64 with a stated bound; deliberately broken sources (a
wrong shuffle partner, a missing barrier, a tail off by one, a race on shared memory) must fail the same checks.
What this cannot answer (nvcc's code, timing, occupancy, real warp scheduling): scripts/cuda/gpu-check.sh on a GPU."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from rotaryquant import bindings, paths
from rotaryquant.quants import itq3

HERE = Path(__file__).resolve().parent
CUDA_SRC = paths.REPO / "ggml-patches" / "src" / "cuda"
ISO_TYPES = ("isoquant3_0", "isoquant4_0", "isoquant3_64", "isoquant4_64")
# `k<<<grid, block, smem, stream>>>(args)`: the kernel expression (a name, with template arguments one level deep)
LAUNCH = re.compile(r"([A-Za-z_]\w*(?:<(?:[^<>;{}()]|<[^<>;{}()]*>)*>)?)<<<(.*?)>>>\(", re.S)
UNITS = ("rq-cuda", "rq-iso", "rq-itq3", "fattn-iso")

pytestmark = pytest.mark.skipif(shutil.which("g++") is None or shutil.which("nm") is None,
                                reason="the CUDA emulation needs g++ (C++17, _Float16) and nm")


def _sources(dst: Path, mutate: Callable[[str, str], str] | None = None) -> int:
    """Our CUDA sources into dst, with the one textual change (the launch syntax, which no macro can express) and the
    tables generated as rq-cuda.cmake generates them; mutate(name, text) breaks a copy on purpose. Returns the number
    of launches rewritten."""
    dst.mkdir(parents=True, exist_ok=True)
    n = 0
    for p in sorted(CUDA_SRC.iterdir()):
        if p.suffix not in (".cu", ".cuh"):
            continue
        text = p.read_text()
        text, k = LAUNCH.subn(lambda m: f"rq_cuda_launch({m.group(1)}, {m.group(2)})(", text)
        assert k == text.count("rq_cuda_launch(") and "<<<" not in text, p.name
        n += k
        if mutate:
            text = mutate(p.name, text)
        (dst / p.name).write_text(text)
    for tab in ("isoquant-tables", "itq3-tables"):
        text = (paths.REPO / "ggml-patches" / "src" / f"{tab}.h").read_text()
        assert "static const " in text
        (dst / f"{tab}.cuh").write_text(text.replace("static const ", "static __device__ const "))
    return n


def _build(out: Path, upstream_tree: Path, mutate: Callable[[str, str], str] | None = None) -> Path:
    src = out / "src"
    n = _sources(src, mutate)
    assert n >= 20, n   # every launch of ours (23 when this was written)
    ggml = upstream_tree / "vendor" / "llama.cpp" / "ggml"
    flags = ["-std=c++17", "-O1", "-ffp-contract=off", "-fno-pie", "-Wall", "-Werror", "-Wno-unknown-pragmas",
             "-Wno-unused-function", "-DGGML_RQ_CUDA", "-I", str(HERE / "shim"), "-I", str(src),
             "-I", str(ggml / "include"), "-I", str(ggml / "src")]
    jobs = [(HERE / "run_cuda.cpp", out / "run_cuda.o")] + [(src / f"{u}.cu", out / f"{u}.o") for u in UNITS]

    def compile_one(job: tuple[Path, Path]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["g++", "-x", "c++", *flags, "-c", str(job[0]), "-o", str(job[1])],
                              capture_output=True, text=True, timeout=900)

    with ThreadPoolExecutor(max_workers=2) as pool:
        for (s, _), proc in zip(jobs, pool.map(compile_one, jobs)):
            assert proc.returncode == 0, f"{s.name}:\n{proc.stderr[-4000:]}"
    exe = out / "run_cuda"
    lib = paths.bin_dir("cpu")
    proc = subprocess.run(["g++", "-no-pie", *(str(o) for _, o in jobs), "-L", str(lib), "-lggml-base",
                           f"-Wl,-rpath,{lib}", "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return exe


@pytest.fixture(scope="module")
def harness(tmp_path_factory, upstream_tree) -> Path:
    return _build(tmp_path_factory.mktemp("cuda_emu"), upstream_tree)


def _run(exe: Path, *args) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, timeout=600)


def _ran(proc: subprocess.CompletedProcess[str]) -> dict[str, int]:
    """The runner's report: launches, blocks and the __shared__ bytes it poisoned before each block."""
    assert proc.returncode == 0 and not proc.stderr, proc.stderr[-3000:]
    words = proc.stdout.split()
    return {words[i]: int(words[i + 1]) for i in range(0, len(words) - 1, 2)}


def _rows(n_rows: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_rows, n)).astype(np.float32) * rng.uniform(0.01, 50.0, (n_rows, 1)).astype(np.float32)
    x[0, :] = 0.0                      # an all-zero block: d = 0
    x[-1, 5] = 1e4                     # one outlier
    return x


def _qk(t: str) -> int:
    return 64 if t.endswith("_64") else 256 if t == "itq3_s" else 128


def _as(dst: str, f32: np.ndarray) -> np.ndarray:
    """F32 values as CUDA stores them in dst: F16 and BF16 rounded to nearest even (bits as uint16)."""
    if dst == "f32":
        return f32.view(np.uint32)
    if dst == "f16":
        return f32.astype(np.float16).view(np.uint16)
    u = f32.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _read(path: Path, dst: str, shape: tuple[int, ...]) -> np.ndarray:
    return np.fromfile(path, dtype=np.uint32 if dst == "f32" else np.uint16).reshape(shape)


def _nmse(got: np.ndarray, ref: np.ndarray) -> float:
    err = float(((got - ref) ** 2).sum() / (ref ** 2).sum())
    return err if np.isfinite(err) else math.inf


# ------------------------------------------------------------------------------------------------------------------
# IsoQuant quantiser, dequantisers and copies: bit for bit


@pytest.mark.parametrize("t", ISO_TYPES)
def test_set_rows_is_the_c_quantiser(harness, t, tmp_path):
    # the KV cache write: float64 norm tree, division and square root as isoquant.c does them, across the warp;
    # I32 and I64 row ids, rows scattered in reverse, two heads (the index math of 3-D tensors)
    tid = bindings.type_from_name(t)
    for n_rows, width, heads in ((5, 256, 2), (3, _qk(t), 1), (9, 512, 1)):
        x = _rows(heads * n_rows, width, seed=width + n_rows).reshape(heads, n_rows, width)
        ref = bindings.quantize(x.reshape(-1, width), tid).reshape(heads, n_rows, -1)
        x.tofile(tmp_path / "x.bin")
        for idx in ("i32", "i64"):
            for order in (0, 1):
                ran = _ran(_run(harness, "set_rows", t, idx, width, n_rows, heads, order, tmp_path / "x.bin",
                                tmp_path / "q.bin"))
                assert ran["launches"] == 1 and ran["blocks"] > 0 and ran["shared_bytes"] > 100_000, ran
                got = np.fromfile(tmp_path / "q.bin", dtype=np.uint8).reshape(heads, n_rows, -1)[:, ::-1]
                assert np.array_equal(got, ref), (t, idx, order, width)


def _extreme_rows(rng: np.random.Generator) -> np.ndarray:
    """1,298 rows of 128: normal, t3 x 1e3, a DC offset, magnitudes 1e-40 .. 1e38 mixed, zeros, 1e30, subnormals,
    and rows with a NaN, a +inf and all -inf."""
    x = [rng.standard_normal((512, 128)), rng.standard_t(3, (256, 128)) * 1e3, rng.standard_normal((256, 128)) + 1.0,
         np.exp(rng.uniform(np.log(1e-40), np.log(1e38), (256, 128))) * rng.choice([-1, 1], (256, 128)),
         np.zeros((4, 128)), np.full((4, 128), 1e30), np.full((4, 128), 1e-42)]
    spec = rng.standard_normal((6, 128))
    spec[0, 3], spec[1, 7], spec[2, :] = np.nan, np.inf, -np.inf
    with np.errstate(over="ignore"):
        return np.concatenate(x + [spec]).astype(np.float32)


@pytest.mark.parametrize("t", ISO_TYPES)
def test_quantiser_and_dequantiser_on_extreme_values(harness, t, tmp_path):
    # the C reference's bytes and float bits on every block, including subnormal, huge, NaN and infinite inputs (the
    # 64-wide types read each row as two blocks; 1,298 rows: the last CUDA block holds a group past the end)
    tid = bindings.type_from_name(t)
    x = _extreme_rows(np.random.default_rng(20260401))
    n = x.shape[0]
    with np.errstate(all="ignore"):
        ref = bindings.quantize(x, tid)
        deq = bindings.dequantize(ref, tid, 128)
    x.tofile(tmp_path / "x.bin")
    ref.tofile(tmp_path / "q.bin")
    _ran(_run(harness, "set_rows", t, "i32", 128, n, 1, 0, tmp_path / "x.bin", tmp_path / "o.bin"))
    got = np.fromfile(tmp_path / "o.bin", dtype=np.uint8).reshape(n, -1)[::-1]
    bad = np.nonzero((got != ref).any(1))[0]
    assert bad.size == 0, (t, bad.size, bad[:5])
    _ran(_run(harness, "to", t, "f32", 128, n, 0, tmp_path / "q.bin", tmp_path / "o.bin"))
    assert np.array_equal(_read(tmp_path / "o.bin", "f32", (n, 128)), deq.view(np.uint32)), t


@pytest.mark.parametrize("t", ISO_TYPES + ("itq3_s",))
def test_dequantisers_are_the_c_reference(harness, t, tmp_path):
    # GET_ROWS and the to_fp32/fp16/bf16 dequantisers (contiguous, and their _nc twins over rows one block apart
    # more): ggml's F32 dequantisation bit for bit, F16/BF16 rounded from it to nearest even. 9 rows: a warp's last
    # CUDA block with a group past the end (it joins the shuffles, stores nothing)
    tid = bindings.type_from_name(t)
    n_rows, width = 9, 512
    q = bindings.quantize(_rows(n_rows, width, seed=3), tid)
    ref = bindings.dequantize(q, tid, width)
    q.tofile(tmp_path / "q.bin")
    for dst in ("f32", "f16", "bf16"):
        want = _as(dst, ref)
        for cmd in ("get_rows", "to", "to_nc"):
            for order in (0, 1):
                _ran(_run(harness, cmd, t, dst, width, n_rows, order, tmp_path / "q.bin", tmp_path / "o.bin"))
                got = _read(tmp_path / "o.bin", dst, (n_rows, width))
                got = got[::-1] if cmd == "get_rows" else got
                assert np.array_equal(got, want), (t, cmd, dst, order)


@pytest.mark.parametrize("t", ISO_TYPES)
def test_cpy_both_ways(harness, t, tmp_path):
    # CPY F32 -> type (the quantiser again, from rows a block apart more than their size), type -> F32 / F16 (bit for
    # bit) and type -> type between a strided view and contiguous rows (whole blocks copied)
    tid = bindings.type_from_name(t)
    n_rows, width = 6, 256
    x = _rows(n_rows, width, seed=13)
    ref_q = bindings.quantize(x, tid)
    ref_f = bindings.dequantize(ref_q, tid, width)
    x.tofile(tmp_path / "x.bin")
    ref_q.tofile(tmp_path / "q.bin")
    for order in (0, 1):
        _ran(_run(harness, "cpy", "f32", t, width, n_rows, order, tmp_path / "x.bin", tmp_path / "o.bin"))
        assert np.array_equal(np.fromfile(tmp_path / "o.bin", np.uint8).reshape(ref_q.shape), ref_q), (t, order)
        for dst in ("f32", "f16"):
            _ran(_run(harness, "cpy", t, dst, width, n_rows, order, tmp_path / "q.bin", tmp_path / "o.bin"))
            assert np.array_equal(_read(tmp_path / "o.bin", dst, (n_rows, width)), _as(dst, ref_f)), (t, dst, order)
        _ran(_run(harness, "cpy", t, t, width, n_rows, order, tmp_path / "q.bin", tmp_path / "o.bin"))
        assert np.array_equal(np.fromfile(tmp_path / "o.bin", np.uint8).reshape(ref_q.shape), ref_q), (t, order)


# ------------------------------------------------------------------------------------------------------------------
# ITQ3_S matrix-vector products


def _itq3_blocks(q: np.ndarray, n_rows: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(d, m, codes) of every block of ITQ3_S rows: d, m [n_rows, nb] float64, codes [n_rows, nb, 256] (0..7)."""
    nb = width // 256
    b = q.reshape(n_rows, nb, -1)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    qs, qh = b[..., 4:68].astype(np.int64), b[..., 68:100].astype(np.int64)
    i = np.arange(256)
    lo = (qs[..., i & 63] >> (2 * (i >> 6))) & 3
    hi = (qh[..., i & 31] >> (i >> 5)) & 1
    return d, m, lo | hi << 2


def _itq3_mmvq_model(q: np.ndarray, n_rows: int, width: int, x: np.ndarray) -> np.ndarray:
    """The kernel's arithmetic, written from its description in numpy: each 256-block of an activation row rotated
    (signs, FWHT-256), quantised to int8 with amax/127; w.x = sum_b dw dy <grid[q], qy> + mw dy sum(qy), in float64.
    x: [n, width] -> [n, n_rows]."""
    nb = width // 256
    y = itq3.rotate(x.reshape(-1, 256).astype(np.float32)).reshape(x.shape[0], nb, 256)
    amax = np.abs(y).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    qy = np.rint((y * inv).astype(np.float32)).astype(np.int64)
    dy = (amax[..., 0] / np.float32(127.0)).astype(np.float32).astype(np.float64)
    d, m, codes = _itq3_blocks(q, n_rows, width)
    g = itq3.GRID_I8.astype(np.int64)[codes]                                       # [n_rows, nb, 256]
    dots = np.einsum("rbi,nbi->nrb", g, qy).astype(np.float64)
    return (d[None] * dy[:, None] * dots + m[None] * (dy * qy.sum(-1))[:, None]).sum(-1)


@pytest.mark.parametrize("order", [0, 1])
def test_itq3_s_mat_vec(harness, order, tmp_path):
    # MUL_MAT at each of 1-8 columns: the int8 scheme of the kernel modelled in numpy (NMSE bound 1e-10: float sums in
    # another order), and X W^T in float64 over ggml's dequantised weights (bound 1e-3: what int8 activations cost);
    # 9 rows, 768 wide (3 blocks for 4 warps), 2 channels sharing one matrix
    tid = bindings.type_from_name("itq3_s")
    cases = [(9, 768, 1, 1), (7, 512, 8, 2)] + [(16, 256, n, 1) for n in range(2, 8)]   # every column count 1-8
    for n_rows, width, n_cols, n_ch in cases:
        rng = np.random.default_rng(width + n_cols)
        w = (rng.standard_normal((n_rows, width)) * rng.uniform(0.01, 3.0, (n_rows, 1))).astype(np.float32)
        q = bindings.quantize(w, tid)
        x = rng.standard_normal((n_ch, n_cols, width)).astype(np.float32)
        q.tofile(tmp_path / "w.bin")
        x.tofile(tmp_path / "x.bin")
        _ran(_run(harness, "mmvq", width, n_rows, n_cols, n_ch, order, tmp_path / "w.bin", tmp_path / "x.bin",
                  tmp_path / "o.bin"))
        got = np.fromfile(tmp_path / "o.bin", np.float32).reshape(n_ch, n_cols, n_rows)
        model = _itq3_mmvq_model(q, n_rows, width, x.reshape(-1, width)).reshape(got.shape)
        exact = x.astype(np.float64) @ bindings.dequantize(q, tid, width).astype(np.float64).T
        assert _nmse(got, model) < 1e-10, (n_rows, width, n_cols, _nmse(got, model))
        assert _nmse(got, exact) < 1e-3, (n_rows, width, n_cols, _nmse(got, exact))


@pytest.mark.parametrize("order", [0, 1])
def test_itq3_s_mixture_of_experts(harness, order, tmp_path):
    # MUL_MAT_ID: each (token, slot) takes its expert from ids; the token's activation row shared by every slot (the
    # gate/up projections) or one row per slot (the down projection)
    tid = bindings.type_from_name("itq3_s")
    n_rows, width, n_exp, n_used, n_tok = 9, 512, 4, 2, 3
    for n_xrow in (1, 2):
        rng = np.random.default_rng(n_xrow)
        w = (rng.standard_normal((n_exp * n_rows, width)) * rng.uniform(0.01, 3.0, (n_exp * n_rows, 1))).astype(np.float32)
        q = bindings.quantize(w, tid)
        x = rng.standard_normal((n_tok, n_xrow, width)).astype(np.float32)
        ids = np.stack([rng.permutation(n_exp)[:n_used] for _ in range(n_tok)]).astype(np.int32)
        for name, a in (("w", q), ("x", x), ("ids", ids)):
            np.ascontiguousarray(a).tofile(tmp_path / f"{name}.bin")
        _ran(_run(harness, "mmvq_id", width, n_rows, n_exp, n_used, n_xrow, n_tok, order, tmp_path / "w.bin",
                  tmp_path / "x.bin", tmp_path / "ids.bin", tmp_path / "o.bin"))
        got = np.fromfile(tmp_path / "o.bin", np.float32).reshape(n_tok, n_used, n_rows)
        qe = q.reshape(n_exp, n_rows, -1)
        model = np.stack([np.stack([_itq3_mmvq_model(qe[ids[t, s]], n_rows, width, x[t, s % n_xrow][None])[0]
                                    for s in range(n_used)]) for t in range(n_tok)])
        assert _nmse(got, model) < 1e-10, (n_xrow, _nmse(got, model))


# ------------------------------------------------------------------------------------------------------------------
# fused IsoQuant flash attention


def _fa(exe: Path, kt: str, vt: str, d: int, n_q: int, n_head: int, n_head_kv: int, n_kv: int, n_seq: int, order: int,
        tmp: Path, *, n_sm: int = 132, softcap: float = 0.0, max_bias: float = 0.0, sinks: bool = False,
        seed: int = 0) -> tuple[np.ndarray, np.ndarray, str]:
    """(the kernels' output [n_seq, n_q, n_head, d], float64 attention over ggml's dequantised K/V, stderr): a causal
    mask over the last n_q keys and one masked column; ggml's softcap, ALiBi slopes and sinks when asked."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n_seq, n_head, n_q, d)).astype(np.float32)
    k = (rng.standard_normal((n_seq, n_head_kv, n_kv, d)) * rng.uniform(0.2, 3.0, (n_seq, n_head_kv, n_kv, 1))).astype(np.float32)
    v = rng.standard_normal((n_seq, n_head_kv, n_kv, d)).astype(np.float32)
    mask = np.zeros((n_q, n_kv), np.float16)
    for i in range(n_q):
        mask[i, n_kv - n_q + i + 1:] = -np.inf
    mask[:, 3] = -np.inf
    sk = rng.standard_normal(n_head).astype(np.float32)
    scale = np.float32(1.0 / np.sqrt(d))

    def packed(a: np.ndarray, t: str) -> tuple[np.ndarray, np.ndarray]:
        if t == "f16":
            return a.astype(np.float16), a.astype(np.float16).astype(np.float64)
        tt = bindings.type_from_name(t)
        p = bindings.quantize(a.reshape(-1, d), tt)
        return p, bindings.dequantize(p, tt, d).reshape(a.shape).astype(np.float64)

    kq, kd = packed(k, kt)
    vq, vd = packed(v, vt)
    n_log2 = 1 << int(math.floor(math.log2(n_head)))
    m0, m1 = 2.0 ** (-max_bias / n_log2), 2.0 ** (-(max_bias / 2.0) / n_log2)
    ref = np.zeros((n_seq, n_q, n_head, d))
    for s in range(n_seq):
        for h in range(n_head):
            hk = h // (n_head // n_head_kv)
            slope = 1.0 if max_bias <= 0 else m0 ** (h + 1) if h < n_log2 else m1 ** (2 * (h - n_log2) + 1)
            sc = q[s, h].astype(np.float64) @ kd[s, hk].T * float(scale)
            if softcap:
                sc = softcap * np.tanh(sc / softcap)
            sc = sc + slope * mask.astype(np.float64)
            mx = np.maximum(sc.max(1, keepdims=True), sk[h]) if sinks else sc.max(1, keepdims=True)
            p = np.exp(sc - mx)
            den = p.sum(1, keepdims=True) + (np.exp(sk[h] - mx) if sinks else 0.0)
            ref[s, :, h] = (p / den) @ vd[s, hk]
    for name, a in (("q", q), ("k", kq), ("v", vq), ("m", mask), ("s", sk)):
        np.ascontiguousarray(a).tofile(tmp / f"{name}.bin")
    proc = _run(exe, "fa", kt, vt, d, n_q, n_head, n_head_kv, n_kv, n_seq, repr(float(scale)), repr(softcap),
                repr(max_bias), n_sm, order, tmp / "q.bin", tmp / "k.bin", tmp / "v.bin", tmp / "m.bin",
                tmp / "s.bin" if sinks else "-", tmp / "o.bin")
    if proc.returncode != 0:
        return np.full(ref.shape, np.nan), ref, proc.stderr
    return np.fromfile(tmp / "o.bin", dtype=np.float32).reshape(ref.shape), ref, proc.stderr


FA_PAIRS = [  # (K type, V type, head size): every K/V pairing the CUDA dispatch takes, at each head size it takes
    ("isoquant3_0", "isoquant3_0", 128), ("isoquant4_0", "isoquant3_0", 128), ("isoquant3_0", "isoquant4_0", 256),
    ("isoquant4_0", "isoquant4_0", 256), ("isoquant3_64", "isoquant3_64", 64), ("isoquant4_64", "isoquant3_64", 64),
    ("f16", "isoquant3_0", 128), ("q8_0", "isoquant4_0", 256), ("isoquant3_0", "f16", 128),
    ("isoquant4_0", "q8_0", 256), ("f16", "isoquant3_64", 64), ("isoquant3_64", "q8_0", 64),
]
FA_SHAPES = [  # (n_q, n_head, n_head_kv, n_kv, n_seq): decode with KV splits; 3 queries x 2 sequences with a partial
    # tile; test-backend-ops' GQA 16 on 4 at 513 keys (a 1-column tile of 4 columns, 5 KV tiles)
    (1, 4, 2, 300, 1), (3, 8, 2, 77, 2), (1, 16, 4, 513, 1),
]


@pytest.mark.parametrize("kt,vt,d", FA_PAIRS)
def test_fused_attention_is_attention_over_the_dequantised_cache(harness, kt, vt, d, tmp_path):
    # Q rotated once, packed keys scored from the codebook, values accumulated rotated, R^T once in the combine
    # kernel: attention over the C reference's dequantised K/V up to float rounding (measured NMSE ~1e-13; bound
    # 1e-10; test-backend-ops allows 5e-4), both lane orders giving the same bits
    for shape in FA_SHAPES:
        outs = []
        for order in (0, 1):
            got, ref, err = _fa(harness, kt, vt, d, *shape, order, tmp_path, seed=d + shape[3])
            assert not err, err
            assert _nmse(got, ref) < 1e-10, (kt, vt, d, shape, order, _nmse(got, ref))
            outs.append(got)
        assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)), (kt, vt, d, shape)


@pytest.mark.parametrize("n_sm", [1, 132])
def test_fused_attention_softcap_alibi_sinks_and_splits(harness, n_sm, tmp_path):
    # Gemma2-style softcap, ALiBi slopes (max_bias 8 over 12 heads: both slope series), gpt-oss-style sinks; the KV
    # range split as the host code splits it for a 1-SM and a 132-SM GPU (1 split, and one per 128-key tile)
    for kt, vt, d in (("isoquant3_0", "isoquant3_0", 128), ("isoquant4_64", "isoquant4_64", 64)):
        got, ref, err = _fa(harness, kt, vt, d, 3, 12, 4, 400, 1, 0, tmp_path, n_sm=n_sm, softcap=30.0,
                            max_bias=8.0, sinks=True, seed=5)
        assert not err, err
        assert _nmse(got, ref) < 1e-10, (kt, n_sm, _nmse(got, ref))


# ------------------------------------------------------------------------------------------------------------------
# the checks catch what they are for


def _mutant(name: str) -> Callable[[str, str], str]:
    """A deliberately broken copy of the sources: each replacement must apply exactly once."""
    edits = {
        # the Walsh-Hadamard butterfly of stride 2 pairs lane l with l ^ 1 (every kernel's rotation)
        "shuffle": ("rq-device.cuh", "__shfl_xor_sync(RQ_FULL_MASK, v[e], m);",
                    "__shfl_xor_sync(RQ_FULL_MASK, v[e], m == 2 ? 1 : m);"),
        # the barrier between staging a K tile in shared memory and scoring it
        "barrier": ("fattn-iso.cu", "rq_fa_stage<NB, SW, KB, QK>(K, p.nbk1, kv0, kv_end, stage, dsh);\n            __syncthreads();",
                    "rq_fa_stage<NB, SW, KB, QK>(K, p.nbk1, kv0, kv_end, stage, dsh);"),
        # the last KV tile scores one row past the end
        "tail": ("fattn-iso.cu", "const bool in    = kv < kv_end;", "const bool in    = kv <= kv_end;"),
        # warp 0 reads the other warps' partial sums without waiting for them
        "race": ("rq-itq3.cu", "            red[warp][j] = s;\n        }\n    }\n    __syncthreads();",
                 "            red[warp][j] = s;\n        }\n    }"),
    }
    unit, old, new = edits[name]

    def mutate(fname: str, text: str) -> str:
        if fname != unit:
            return text
        assert text.count(old) == 1, (name, fname)
        return text.replace(old, new)
    return mutate


@pytest.mark.parametrize("broken", ["shuffle", "barrier", "tail", "race"])
def test_broken_sources_are_caught(broken, tmp_path, upstream_tree):
    exe = _build(tmp_path / "b", upstream_tree, _mutant(broken))
    if broken == "shuffle":
        x = _rows(4, 256, seed=1)
        x.tofile(tmp_path / "x.bin")
        for t in ("isoquant3_0", "isoquant4_64"):
            ref = bindings.quantize(x, bindings.type_from_name(t))
            proc = _run(exe, "set_rows", t, "i64", 256, 4, 1, 0, tmp_path / "x.bin", tmp_path / "q.bin")
            got = np.fromfile(tmp_path / "q.bin", np.uint8).reshape(4, -1)[::-1] if proc.returncode == 0 else None
            assert got is None or not np.array_equal(got, ref), t
    if broken in ("shuffle", "barrier", "tail"):
        # at least one lane order must see it (a barrier left out can be hidden by the order that happens to finish
        # the writers first)
        errs = [_nmse(*_fa(exe, "isoquant3_0", "isoquant3_0", 128, 1, 4, 2, 300, 1, order, tmp_path, seed=7)[:2])
                for order in (0, 1)]
        assert max(errs) > 1e-3, (broken, errs)
    if broken == "race":
        tid = bindings.type_from_name("itq3_s")
        rng = np.random.default_rng(2)
        w = rng.standard_normal((9, 512)).astype(np.float32)
        q = bindings.quantize(w, tid)
        x = rng.standard_normal((1, 2, 512)).astype(np.float32)
        q.tofile(tmp_path / "w.bin")
        x.tofile(tmp_path / "x.bin")
        errs = []
        for order in (0, 1):
            proc = _run(exe, "mmvq", 512, 9, 2, 1, order, tmp_path / "w.bin", tmp_path / "x.bin", tmp_path / "o.bin")
            got = np.fromfile(tmp_path / "o.bin", np.float32).reshape(1, 2, 9) if proc.returncode == 0 else np.nan
            errs.append(_nmse(got, _itq3_mmvq_model(q, 9, 512, x.reshape(-1, 512)).reshape(1, 2, 9)))
        assert max(errs) > 1e-3, errs


def _custom(tmp: Path, body: str) -> subprocess.CompletedProcess[str]:
    """A small kernel of the test's own against the shim (the runtime checks themselves)."""
    (tmp / "k.cpp").write_text('#include "cuda_emu.h"\n#include <cstdio>\n' + body)
    exe = tmp / "k"
    subprocess.run(["g++", "-std=c++17", "-fno-pie", "-no-pie", "-Wno-unknown-pragmas", "-I", str(HERE / "shim"),
                    str(tmp / "k.cpp"), "-o", str(exe)], check=True, capture_output=True, timeout=300)
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)


def test_emulation_refuses_undefined_warp_and_barrier_use(tmp_path):
    # a full-mask shuffle after a lane of the warp returned; a __syncthreads that some threads skip
    proc = _custom(tmp_path, '''
static __global__ void k(float * out) {
    if (threadIdx.x == 3) { return; }
    out[threadIdx.x] = __shfl_xor_sync(0xffffffff, (float) threadIdx.x, 1);
}
int main() { float out[32] = {}; rq_cuda_launch(k, dim3(1), dim3(32), 0, nullptr)(out); return 0; }
''')
    assert proc.returncode == 3 and "after a lane of the warp returned" in proc.stderr, proc.stderr
    proc = _custom(tmp_path, '''
static __global__ void k(float * out) {
    if (threadIdx.y == 1) { return; }
    __syncthreads();
    out[threadIdx.x] = 1.0f;
}
int main() { float out[64] = {}; rq_cuda_launch(k, dim3(1), dim3(32, 2), 0, nullptr)(out); return 0; }
''')
    assert proc.returncode == 3 and "returned while others wait at a __syncthreads" in proc.stderr, proc.stderr


def test_shared_memory_is_poisoned_before_every_block(tmp_path):
    # a block that reads its __shared__ array before any thread wrote it sees 0xff bytes, in every block (the
    # previous block's values are gone)
    proc = _custom(tmp_path, '''
static __global__ void k(unsigned * out) {
    __shared__ unsigned s[64];
    const unsigned t = threadIdx.x;
    out[blockIdx.x*64 + t] = s[t];
    __syncthreads();
    s[t] = t;
}
unsigned out[3*64];   // not a function-local static: those are what the shim poisons
int main() {
    rq_cuda_launch(k, dim3(3), dim3(64), 0, nullptr)(out);
    unsigned bad = 0;
    for (unsigned v : out) bad += v != 0xffffffffu;
    printf("%u %zu\\n", bad, rq_cuda::shared_bytes());
    return 0;
}
''')
    assert proc.returncode == 0, proc.stderr
    bad, nbytes = map(int, proc.stdout.split())
    assert bad == 0 and nbytes == 256, proc.stdout
