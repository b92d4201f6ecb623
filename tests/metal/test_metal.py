"""Our Metal kernels (ggml-patches/src/metal: IsoQuant GET_ROWS, SET_ROWS and fused flash attention; ITQ3_S GET_ROWS,
mul_mv, mul_mm and mul_mv_id) run here as C++: tests/metal/shim/metal_stdlib stands in for Metal's
standard library (vector types, half, simd_* ops, threadgroup_barrier) and runs each thread of a threadgroup as a
fiber, lanes in two orders. Checked against ggml's C reference bit for bit (the kernels keep its float operations
and order), on the row counts and widths test-backend-ops uses for GET_ROWS; deliberately broken builds (a wrong
shuffle partner, a missing barrier) must fail the same check. This checks logic, indexing and data layout, not
Apple's compiler (fast-math, contraction) or speed: no Metal compiler exists on this machine."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from rotaryquant import bindings, paths

HERE = Path(__file__).resolve().parent
METAL_SRC = paths.REPO / "ggml-patches" / "src" / "metal"
ISO_TYPES = ("isoquant3_0", "isoquant4_0", "isoquant3_64", "isoquant4_64")

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the Metal emulation needs g++ (C++17, _Float16)")


def _tables(out: Path) -> None:
    """rq-iso-tables.h and rq-itq3-tables.h, made from the C tables as the Metal build makes them."""
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("no cmake: the Metal tables are made by rq-metal-tables.cmake")
    subprocess.run([cmake, f"-DOUT_DIR={out}", "-P", str(METAL_SRC / "rq-metal-tables.cmake")], check=True,
                   capture_output=True, timeout=120)


def _build(out: Path, upstream_tree: Path, *defines: str) -> Path:
    """Compiles tests/metal/run_kernels.cpp with the kernel sources. The one textual change: `[[threadgroup(N)]]`
    (a parameter attribute whose name is also an address space, which no macro can erase in both roles) becomes
    a comment; the rest of the source is compiled as written."""
    src = out / "src"
    src.mkdir(parents=True, exist_ok=True)
    _tables(src)
    for p in METAL_SRC.iterdir():
        text = p.read_text()
        if p.suffix == ".metal":
            text = re.sub(r"\[\[threadgroup\((\d+)\)\]\]", r"/* [[threadgroup(\1)]] */", text)
        (src / p.name).write_text(text)
    impl = upstream_tree / "vendor" / "llama.cpp" / "ggml" / "src" / "ggml-metal"
    exe = out / "run_kernels"
    cmd = ["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-Wall", "-Werror", "-Wno-attributes",
           "-Wno-unused-function", *[f"-D{d}" for d in defines], "-I", str(src), "-I", str(HERE / "shim"),
           "-I", str(impl), str(HERE / "run_kernels.cpp"), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return exe


@pytest.fixture(scope="module")
def harness(tmp_path_factory, upstream_tree) -> Path:
    return _build(tmp_path_factory.mktemp("metal"), upstream_tree)


def _get_rows(exe: Path, t: str, x: np.ndarray, order: int, tmp: Path) -> tuple[np.ndarray, np.ndarray, str]:
    """(the kernel's rows, ggml's, stderr): the kernel gathers the rows in reverse order."""
    tid = bindings.type_from_name(t)
    q = bindings.quantize(x, tid)
    ref = bindings.dequantize(q, tid, x.shape[1])[::-1]
    (tmp / "in.bin").write_bytes(q.tobytes())
    proc = subprocess.run([str(exe), "get_rows", t, str(x.shape[0]), str(x.shape[1]), str(order),
                           str(tmp / "in.bin"), str(tmp / "out.bin")], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return np.full_like(ref, np.nan), ref, proc.stderr
    return np.fromfile(tmp / "out.bin", dtype=np.float32).reshape(ref.shape), ref, proc.stderr


def _rows(n_rows: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_rows, n)).astype(np.float32) * rng.uniform(0.01, 50.0, (n_rows, 1)).astype(np.float32)
    x[0, :] = 0.0                      # an all-zero block: d = 0
    x[-1, 5] = 1e4                     # one outlier
    return x


@pytest.mark.parametrize("t", ISO_TYPES)
@pytest.mark.parametrize("order", [0, 1])
def test_get_rows_is_the_c_reference(harness, t, order, tmp_path):
    # test-backend-ops' GET_ROWS widths: one block, and a head of 256 (2 or 4 blocks), K/V-row sized 4 x 128
    for n_rows, width in ((3, 128), (5, 256), (2, 512)):
        qk = 64 if t.endswith("_64") else 128
        if width % qk:
            continue
        got, ref, err = _get_rows(harness, t, _rows(n_rows, width, seed=width + order), order, tmp_path)
        assert not err, err
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), (t, width, np.nanmax(np.abs(got - ref)))


@pytest.mark.parametrize("broken", ["RQ_MTL_BREAK_SHUFFLE", "RQ_MTL_BREAK_BARRIER"])
def test_broken_kernels_are_caught(broken, tmp_path, upstream_tree):
    # a wrong shuffle partner in one Walsh-Hadamard stage; the staging barrier left out (lanes read block bytes other
    # lanes have not copied yet: poison in forward order, the previous block's in reverse)
    exe = _build(tmp_path / "b", upstream_tree, broken)
    for t in ("isoquant3_0", "isoquant4_64"):
        for order in (0, 1):
            got, ref, _ = _get_rows(exe, t, _rows(4, 256, seed=1), order, tmp_path)
            assert not np.array_equal(got.view(np.uint32), ref.view(np.uint32)), (broken, t, order)
    # the fused attention: the rotation's shuffles, and the barrier before simdgroup 0 merges the others' softmax
    # state (a lane order that lets the others finish first can hide it: one order must catch it)
    for kt, vt, d in (FA_CASES[0], FA_CASES[4]):
        errs = [_nmse(*_fa(exe, kt, vt, d, 1, 4, 2, 64, order, seed=7, tmp=tmp_path)[:2]) for order in (0, 1)]
        assert max(errs) > 1e-3, (broken, kt, errs)
    # ITQ3_S: the shuffle of the WHT-256 (both kernels), the barrier after the activations' rotation (mul_mv)
    r = [_itq3(exe, 9, 768, 2, order, seed=3, tmp=tmp_path) for order in (0, 1)]
    assert max(_nmse(x["mv"], x["mv_ref"]) for x in r) > 1e-3, broken
    assert max(_nmse(x["mm"], x["mv_ref"]) for x in r) > 1e-3, broken
    if broken == "RQ_MTL_BREAK_SHUFFLE":
        assert not any(np.array_equal(x["rows"], x["rows_ref"]) for x in r)


@pytest.mark.parametrize("t", ISO_TYPES)
def test_set_rows_packs_as_the_c_reference(harness, t, tmp_path):
    # the KV cache write: Metal has no float64, so the kernel normalises in float where the C reference uses a
    # float64 norm and division; a value within an ulp of a codebook boundary may then take the neighbouring index.
    # Measured: 800 of 800 blocks per type byte-identical; required: >= 99.5% identical, and the dequantised rows
    # within NMSE 1e-4 of the C reference's
    n, width = 300, 256
    x = _rows(n, width, seed=11)
    tid = bindings.type_from_name(t)
    ref = bindings.quantize(x, tid)
    (tmp_path / "x.bin").write_bytes(x.tobytes())
    for order in (0, 1):
        proc = subprocess.run([str(harness), "set_rows", t, str(n), str(width), str(order), str(tmp_path / "x.bin"),
                               str(tmp_path / "q.bin")], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and not proc.stderr, proc.stderr
        got = np.fromfile(tmp_path / "q.bin", dtype=np.uint8).reshape(n, -1)[::-1]   # row i went to n-1-i
        blk = bindings.row_size(tid, 64 if t.endswith("_64") else 128)
        same = (got.reshape(-1, blk) == ref.reshape(-1, blk)).all(1).mean()
        assert same >= 0.995, (t, order, same)
        dg, dr = bindings.dequantize(np.ascontiguousarray(got), tid, width), bindings.dequantize(ref, tid, width)
        assert ((dg - dr) ** 2).sum() <= 1e-4 * (dr ** 2).sum()


@pytest.mark.parametrize("t", ISO_TYPES)
def test_cpy_both_ways(harness, t, tmp_path):
    # CPY F32 -> type (as SET_ROWS: >= 99.5% identical blocks) and type -> F32 / F16 (bit for bit: ggml dequantises
    # to F32, then rounds to F16 to nearest even), from source rows 64 bytes apart (a strided view)
    n, width = 6, 256
    x = _rows(n, width, seed=13)
    tid = bindings.type_from_name(t)
    ref_q = bindings.quantize(x, tid)
    ref_f = bindings.dequantize(ref_q, tid, width)

    def run(src: str, dst: str, data: bytes, order: int) -> bytes:
        (tmp_path / "in.bin").write_bytes(data)
        proc = subprocess.run([str(harness), "cpy", src, dst, str(n), str(width), str(order), str(tmp_path / "in.bin"),
                               str(tmp_path / "out.bin")], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and not proc.stderr, proc.stderr
        return (tmp_path / "out.bin").read_bytes()

    blk = bindings.row_size(tid, 64 if t.endswith("_64") else 128)
    for order in (0, 1):
        q = np.frombuffer(run("f32", t, x.tobytes(), order), dtype=np.uint8)
        assert (q.reshape(-1, blk) == ref_q.reshape(-1, blk)).all(1).mean() >= 0.995
        f32 = np.frombuffer(run(t, "f32", ref_q.tobytes(), order), dtype=np.float32).reshape(n, width)
        assert np.array_equal(f32.view(np.uint32), ref_f.view(np.uint32))
        f16 = np.frombuffer(run(t, "f16", ref_q.tobytes(), order), dtype=np.float16).reshape(n, width)
        assert np.array_equal(f16.view(np.uint16), ref_f.astype(np.float16).view(np.uint16))


FA_CASES = [  # (K type, V type, head size); test-backend-ops' FLASH_ATTN_EXT widths for our types
    ("isoquant3_0", "isoquant3_0", 128), ("isoquant4_0", "isoquant3_0", 128), ("isoquant4_0", "isoquant4_0", 128),
    ("isoquant3_0", "isoquant3_0", 256), ("isoquant3_64", "isoquant3_64", 64), ("isoquant4_64", "isoquant4_64", 64),
]


def _fa(exe: Path, kt: str, vt: str, d: int, n_q: int, n_head: int, n_head_kv: int, n_kv: int, order: int,
        seed: int, tmp: Path) -> tuple[np.ndarray, np.ndarray, str]:
    """(the kernel's output [n_q, n_head, d], float64 attention over ggml's dequantised K/V, stderr); a causal mask
    over the last n_q keys and one masked column."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n_head, n_q, d)).astype(np.float32)
    k = (rng.standard_normal((n_head_kv, n_kv, d)) * rng.uniform(0.2, 3.0, (n_head_kv, n_kv, 1))).astype(np.float32)
    v = rng.standard_normal((n_head_kv, n_kv, d)).astype(np.float32)
    mask = np.zeros((n_q, n_kv), np.float16)
    for i in range(n_q):
        mask[i, n_kv - n_q + i + 1:] = -np.inf
    mask[:, 3] = -np.inf
    scale = np.float32(1.0 / np.sqrt(d))
    tk, tv = bindings.type_from_name(kt), bindings.type_from_name(vt)
    kq, vq = bindings.quantize(k.reshape(-1, d), tk), bindings.quantize(v.reshape(-1, d), tv)
    kd = bindings.dequantize(kq, tk, d).reshape(n_head_kv, n_kv, d).astype(np.float64)
    vd = bindings.dequantize(vq, tv, d).reshape(n_head_kv, n_kv, d).astype(np.float64)
    ref = np.zeros((n_q, n_head, d))
    for h in range(n_head):
        hk = h // (n_head // n_head_kv)
        s = q[h].astype(np.float64) @ kd[hk].T * scale + mask.astype(np.float64)
        p = np.exp(s - s.max(1, keepdims=True))
        ref[:, h] = (p / p.sum(1, keepdims=True)) @ vd[hk]
    files = []
    for name, a in (("q", q), ("k", kq), ("v", vq), ("m", mask)):
        (tmp / f"{name}.bin").write_bytes(np.ascontiguousarray(a).tobytes())
        files.append(str(tmp / f"{name}.bin"))
    proc = subprocess.run([str(exe), "fa", kt, vt, str(d), str(n_q), str(n_head), str(n_head_kv), str(n_kv),
                           repr(float(scale)), str(order), *files, str(tmp / "o.bin")],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return np.full(ref.shape, np.nan), ref, proc.stderr
    return np.fromfile(tmp / "o.bin", dtype=np.float32).reshape(ref.shape), ref, proc.stderr


def _nmse(got: np.ndarray, ref: np.ndarray) -> float:
    err = float(((got - ref) ** 2).sum() / (ref ** 2).sum())
    return err if np.isfinite(err) else math.inf


@pytest.mark.parametrize("kt,vt,d", FA_CASES)
def test_fused_attention_is_attention_over_the_dequantised_cache(harness, kt, vt, d, tmp_path):
    # the query rotated once, keys scored packed, values summed rotated, one inverse rotation: equal to attention over
    # the C reference's dequantised K/V up to float32 rounding (measured NMSE ~1e-13; test-backend-ops allows 5e-4).
    # Decode (1 query) and 3-token steps; GQA 4 heads on 2 and test-backend-ops' 16 on 4 with 512 keys; 4 simdgroups
    # split the keys
    for n_q, n_head, n_head_kv, n_kv in ((1, 4, 2, 256), (3, 4, 2, 113), (3, 16, 4, 512)):
        for order in (0, 1):
            got, ref, err = _fa(harness, kt, vt, d, n_q, n_head, n_head_kv, n_kv, order, seed=d + n_kv, tmp=tmp_path)
            assert not err, err
            assert _nmse(got, ref) < 1e-10, (kt, vt, d, n_q, order, _nmse(got, ref))


def _itq3(exe: Path, n_rows: int, width: int, n_cols: int, order: int, seed: int, tmp: Path) -> dict:
    """ITQ3_S GET_ROWS (bits, ggml's), mul_mv and mul_mm (the kernels' X W^T, float64 over ggml's dequantised W)."""
    rng = np.random.default_rng(seed)
    tid = bindings.type_from_name("itq3_s")
    w = (rng.standard_normal((n_rows, width)) * rng.uniform(0.01, 3.0, (n_rows, 1))).astype(np.float32)
    q = bindings.quantize(w, tid)
    wd = bindings.dequantize(q, tid, width)
    x = rng.standard_normal((n_cols, width)).astype(np.float32)
    (tmp / "w.bin").write_bytes(q.tobytes())
    (tmp / "x.bin").write_bytes(x.tobytes())
    out = {"rows_ref": wd[::-1], "mv_ref": x.astype(np.float64) @ wd.astype(np.float64).T}
    for what, argv, shape in (
            ("rows", ["get_rows", "itq3_s", str(n_rows), str(width), str(order), str(tmp / "w.bin")], (n_rows, width)),
            ("mv", ["mul_mv", str(n_rows), str(width), str(n_cols), str(order), str(tmp / "w.bin"), str(tmp / "x.bin")],
             (n_cols, n_rows)),
            ("mm", ["mul_mm", str(n_rows), str(width), str(n_cols), str(order), str(tmp / "w.bin"), str(tmp / "x.bin")],
             (n_cols, n_rows))):
        proc = subprocess.run([str(exe), *argv, str(tmp / "o.bin")], capture_output=True, text=True, timeout=300)
        out[what] = (np.fromfile(tmp / "o.bin", dtype=np.float32).reshape(shape) if proc.returncode == 0
                     else np.full(shape, np.nan, np.float32))
        out[what + "_err"] = proc.stderr
    return out


@pytest.fixture(scope="module")
def harness_ch2(tmp_path_factory, upstream_tree) -> Path:
    # mul_mv's activation chunks of 2 blocks (the host's 16 need rows over 4096 wide to show)
    return _build(tmp_path_factory.mktemp("metal_ch2"), upstream_tree, "RQ_MTL_MV_CH=2")


@pytest.mark.parametrize("order", [0, 1])
def test_itq3_s_rows_and_matrix_products(harness, harness_ch2, order, tmp_path):
    # GET_ROWS bit for bit (the C reference's operations and order); mul_mv on rotated F32 activations against float64
    # X W^T over ggml's dequantised weights (measured NMSE 2e-14; bound 1e-10); mul_mm (8 columns a threadgroup, 4 rows
    # a simdgroup) equal to mul_mv bit for bit. 9 rows: a partial row group; 768 wide with 2-block chunks: a partial
    # chunk; 3 and 19 columns: partial column groups
    for exe, (n_rows, width, n_cols) in ((harness, (9, 768, 3)), (harness, (16, 256, 1)), (harness_ch2, (9, 768, 2)),
                                         (harness, (21, 768, 19))):
        r = _itq3(exe, n_rows, width, n_cols, order, seed=width + n_cols, tmp=tmp_path)
        assert not r["rows_err"] and not r["mv_err"] and not r["mm_err"], r["rows_err"] + r["mv_err"] + r["mm_err"]
        assert np.array_equal(r["rows"].view(np.uint32), r["rows_ref"].view(np.uint32))
        assert _nmse(r["mv"], r["mv_ref"]) < 1e-10, _nmse(r["mv"], r["mv_ref"])
        assert np.array_equal(r["mm"].view(np.uint32), r["mv"].view(np.uint32)), np.nanmax(np.abs(r["mm"] - r["mv"]))


def _mul_mat_id(exe: Path, n_rows: int, width: int, n_expert: int, n_used: int, n_xrow: int, n_tok: int, order: int,
                seed: int, tmp: Path) -> tuple[np.ndarray, np.ndarray, str]:
    """(the kernel's MUL_MAT_ID [n_tok, n_used, n_rows], float64 over ggml's dequantised experts, stderr)."""
    rng = np.random.default_rng(seed)
    tid = bindings.type_from_name("itq3_s")
    w = (rng.standard_normal((n_expert * n_rows, width)) * rng.uniform(0.01, 3.0, (n_expert * n_rows, 1))).astype(np.float32)
    q = bindings.quantize(w, tid)
    wd = bindings.dequantize(q, tid, width).reshape(n_expert, n_rows, width).astype(np.float64)
    x = rng.standard_normal((n_tok, n_xrow, width)).astype(np.float32)
    ids = np.stack([rng.permutation(n_expert)[:n_used] for _ in range(n_tok)]).astype(np.int32)
    ref = np.stack([np.stack([wd[ids[t, s]] @ x[t, s % n_xrow] for s in range(n_used)]) for t in range(n_tok)])
    for name, a in (("w", q), ("x", x), ("ids", ids)):
        (tmp / f"{name}.bin").write_bytes(np.ascontiguousarray(a).tobytes())
    proc = subprocess.run([str(exe), "mul_mv_id", str(n_rows), str(width), str(n_expert), str(n_used), str(n_xrow),
                           str(n_tok), str(order), *(str(tmp / f"{n}.bin") for n in ("w", "x", "ids")),
                           str(tmp / "o.bin")], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return np.full(ref.shape, np.nan), ref, proc.stderr
    return np.fromfile(tmp / "o.bin", dtype=np.float32).reshape(ref.shape), ref, proc.stderr


@pytest.mark.parametrize("order", [0, 1])
def test_itq3_s_mixture_of_experts_product(harness, order, tmp_path):
    # MUL_MAT_ID: each (token, slot) takes its expert from ids; test-backend-ops' shapes: the token's activation row
    # shared by every slot (the gate/up projections) or one row per slot (the down projection)
    for n_xrow in (1, 2):
        got, ref, err = _mul_mat_id(harness, 9, 512, n_expert=4, n_used=2, n_xrow=n_xrow, n_tok=3, order=order,
                                    seed=n_xrow, tmp=tmp_path)
        assert not err, err
        assert _nmse(got, ref) < 1e-10, _nmse(got, ref)


def test_emulation_refuses_a_barrier_some_threads_skip(tmp_path):
    # the runtime itself: a thread that returns while the others wait at a barrier is an error, not a hang
    (tmp_path / "k.cpp").write_text('''
#include <metal_stdlib>
using namespace metal;
kernel void k(device float * out, ushort tid [[thread_index_in_threadgroup]]) {
    if (tid == 3) { return; }
    out[tid] = simd_sum((float) tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
}
int main() {
    float out[32] = {};
    std::vector<unsigned char> shmem;
    rq_mtl::dispatch(1, 32, 0, shmem, [&](unsigned, unsigned tid) { k(out, (ushort) tid); }, 0);
    return 0;
}
''')
    exe = tmp_path / "k"
    subprocess.run(["g++", "-std=c++17", "-Wno-attributes", "-I", str(HERE / "shim"), str(tmp_path / "k.cpp"),
                    "-o", str(exe)], check=True, capture_output=True, timeout=300)
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and "returned while others wait at a threadgroup_barrier" in proc.stderr, proc.stderr


def test_the_library_source_the_build_makes_runs(tmp_path, upstream_tree):
    # kernels/rq.metal as rq-metal.cmake writes it on a Mac (our headers inlined, after upstream's common.h): it must
    # be complete on its own, and name every kernel rq-metal.cpp asks the library for
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("no cmake")
    src = tmp_path / "src"
    src.mkdir()
    subprocess.run([cmake, f"-DRQ_METAL_DIR={METAL_SRC}", f"-DOUT={src / 'rq.metal.orig'}", "-P",
                    str(METAL_SRC / "rq-metal-flatten.cmake")], check=True, capture_output=True, timeout=120)
    text = (src / "rq.metal.orig").read_text()
    assert text.count('#include "') == 1 and '#include "common.h"' in text    # nothing else left to resolve
    (src / "rq.metal").write_text(re.sub(r"\[\[threadgroup\((\d+)\)\]\]", r"/* [[threadgroup(\1)]] */", text))
    # upstream's common.h: metal_stdlib, ggml-metal-impl.h, N_SIMDWIDTH
    (src / "common.h").write_text('#pragma once\n#include <metal_stdlib>\n#include "ggml-metal-impl.h"\n'
                                  "using namespace metal;\n#define N_SIMDWIDTH 32\n")
    impl = upstream_tree / "vendor" / "llama.cpp" / "ggml" / "src" / "ggml-metal"
    exe = tmp_path / "run_flat"
    proc = subprocess.run(["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-Wno-attributes", "-DRQ_MTL_FLAT",
                           "-I", str(src), "-I", str(HERE / "shim"), "-I", str(impl), str(HERE / "run_kernels.cpp"),
                           "-o", str(exe)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got, ref, err = _get_rows(exe, "isoquant3_0", _rows(3, 256, seed=2), 0, tmp_path)
    assert not err and np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    got, ref, err = _fa(exe, "isoquant3_0", "isoquant3_0", 128, 1, 4, 2, 64, 0, seed=2, tmp=tmp_path)
    assert not err and _nmse(got, ref) < 1e-10
    r = _itq3(exe, 9, 768, 3, 0, seed=2, tmp=tmp_path)
    assert _nmse(r["mv"], r["mv_ref"]) < 1e-10 and _nmse(r["mm"], r["mv_ref"]) < 1e-10
    got, ref, err = _mul_mat_id(exe, 9, 256, 3, 2, 1, 2, 0, seed=2, tmp=tmp_path)
    assert not err and _nmse(got, ref) < 1e-10
    # the names rq-metal.cpp builds: kernel_get_rows_<type>, kernel_set_rows_<type>_<i64|i32>,
    # kernel_flash_attn_ext_iso_<K>_<V>_dk<D> for what rq_fa_instantiated accepts, the ITQ3_S products
    host = (METAL_SRC / "rq-metal.cpp").read_text()
    names = {f"kernel_get_rows_{t}" for t in (*ISO_TYPES, "itq3_s")}
    names |= {f"kernel_set_rows_{t}_{i}" for t in ISO_TYPES for i in ("i64", "i32")}
    names |= {f"kernel_cpy_{a}_{b}" for t in ISO_TYPES for a, b in (("f32", t), (t, "f32"), (t, "f16"))}
    names |= {f"kernel_flash_attn_ext_iso_{k}_{v}_dk{d}" for k, v, d in FA_CASES}
    names |= {"kernel_mul_mv_itq3_s_f32", "kernel_mul_mm_itq3_s_f32", "kernel_mul_mv_id_itq3_s_f32"}
    assert set(re.findall(r'"(kernel_\w+)"', host)) <= names    # every name the host spells out in full
    for name in sorted(names):
        assert (f'host_name("{name}")' in text or f'RQ_FA_ISO("{name}",' in text     # a template's instance
                or f"kernel void {name}(" in text), name                                # a plain kernel
    fa = re.search(r"bool rq_fa_instantiated.*?\n}\n", host, re.S).group(0)
    for k, v, d in FA_CASES:
        assert f"case {d}:" in fa and f"GGML_TYPE_{k.upper()} && v == GGML_TYPE_{v.upper()}" in fa, (k, v, d)


def test_host_side_compiles(upstream_tree):
    # what of the host side is plain C++ (patch 0013's ggml-metal-ops.cpp hook, rq-metal.cpp) compiles here against
    # the pinned tree; ggml-metal-device.m is Objective-C (no compiler for it here): its two hooks are checked by text
    ggml = upstream_tree / "vendor" / "llama.cpp" / "ggml"
    inc = ["-I", str(ggml / "include"), "-I", str(ggml / "src"), "-I", str(ggml / "src" / "ggml-metal")]
    for src in (ggml / "src" / "ggml-metal" / "ggml-metal-ops.cpp", METAL_SRC / "rq-metal.cpp"):
        proc = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-Wall", "-DGGML_RQ_METAL", *inc, str(src)],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0 and "error" not in proc.stderr, (src.name, proc.stderr[-3000:])
    ops = (ggml / "src" / "ggml-metal" / "ggml-metal-ops.cpp").read_text()
    assert "if (ggml_metal_rq_encode(ctx->lib, ctx->enc, node))" in ops
    dev = (ggml / "src" / "ggml-metal" / "ggml-metal-device.m").read_text()
    assert "#define GGML_METAL_LIBS_RQ X(RQ, rq)" in dev and "    GGML_METAL_LIBS_RQ\n" in dev
    assert "ggml_metal_rq_supports_op(&dev->props, op)" in dev
    assert "rq-metal.cmake" in (ggml / "src" / "ggml-metal" / "CMakeLists.txt").read_text()


def test_metal_tables_are_generated_from_the_c_tables(tmp_path):
    # every C table, with its values, becomes a Metal constant: the C headers stay the only source of the numbers
    _tables(tmp_path)
    for c_name, m_name in (("isoquant-tables.h", "rq-iso-tables.h"), ("itq3-tables.h", "rq-itq3-tables.h")):
        c_text = (paths.REPO / "ggml-patches" / "src" / c_name).read_text()
        m_text = (tmp_path / m_name).read_text()
        decls = re.findall(r"^static const (float|int8_t) (\w+)([^;]*);", c_text, re.M)
        assert decls, c_name
        for ty, name, body in decls:
            assert f"constexpr constant static {ty} {name}{body};" in m_text, (c_name, name)
        assert "static const" not in m_text.replace("constexpr constant static", "")
