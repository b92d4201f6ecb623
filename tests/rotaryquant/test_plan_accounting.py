"""rq-plan's and the demo's memory figures come from llama.cpp's C API (llama_rq_get_memory,
llama_rq_model_tensor_buft), not from its log: the planner's dry run against a real context, and a check that
no regex reads llama.cpp's output there."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rotaryquant import plan as P
from rotaryquant.bindings import accounting

REPO = Path(__file__).resolve().parents[2]


def _real(gguf: Path, spec: str, n_ctx: int) -> dict[str, int]:
    """llama_rq_get_memory of a real (allocating) context with the planner's settings for ``spec``."""
    import llama_cpp as L

    from rotaryquant import bindings, kvtypes

    with accounting.captured_log():
        model = L.llama_model_load_from_file(str(gguf).encode(), L.llama_model_default_params())
        assert model
        try:
            cp = L.llama_context_default_params()
            cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, P.N_BATCH, P.N_UBATCH, 1
            cp.type_k, cp.type_v = (bindings.type_from_name(t) for t in kvtypes.split(spec))
            cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
            cp.swa_full, cp.kv_unified, cp.n_outputs_max = False, False, 1
            cp.n_threads = cp.n_threads_batch = 1
            bindings.apply(cp, k_center="auto" if kvtypes.k_center(spec) else "off")
            ctx = L.llama_init_from_model(model, cp)
            assert ctx
            try:
                return accounting.memory(ctx)
            finally:
                L.llama_free(ctx)
        finally:
            L.llama_model_free(model)


SPECS = ("f16", "q8_0", "isoquant4_0/isoquant3_0")


@pytest.fixture(scope="module")
def gemma3_dry(gemma3) -> P.DryRun:
    return P.dry_run(gemma3, SPECS, n_ctx=4096)


@pytest.mark.parametrize("spec", SPECS)
def test_planner_kv_is_what_a_real_context_allocates(gemma3, gemma3_dry, spec):
    """Gemma3 (iSWA: a 512-token window cache and a full one): the planner's bytes = a real context's."""
    cost = gemma3_dry.contexts[spec]
    real = _real(gemma3, spec, 4096)
    assert not cost.error, cost.error
    assert (cost.k, cost.v) == (real["kv_k"], real["kv_v"]) and cost.kv == real["kv_k"] + real["kv_v"] > 0
    assert cost.output == real["output"] > 0
    assert cost.compute == real["compute"] > 0       # the dry run reserves the graphs the real context does


def test_kv_bytes_scale_with_the_full_cache_only(gemma3_dry, gemma3):
    # 3 of Gemma3's 18 layers are full-context; doubling the context adds their K and V rows only
    twice = P.dry_run(gemma3, ["f16"], n_ctx=8192).contexts["f16"]
    from rotaryquant.bindings import row_size, type_from_name

    f16 = type_from_name("f16")
    assert twice.kv - gemma3_dry.contexts["f16"].kv == 3 * 4096 * 2 * row_size(f16, 256)   # 1 KV head x 256


def test_placement_names_every_tensor_once_or_twice(gemma3, gemma3_dry):
    h = P.read_header(gemma3)
    placed = [n for names in gemma3_dry.placement.values() for n in names]
    assert set(placed) == {t.name for t in h.tensors}
    # only a tied output's own copy is listed twice
    assert {n for n in placed if placed.count(n) > 1} <= {accounting.TIED}


# --- no regex on llama.cpp's log text ----------------------------------------------------------------

FILES = sorted((REPO / "rotaryquant" / "plan").glob("*.py")) + [REPO / "bindings" / "accounting.py",
                                                             REPO / "rotaryquant" / "demo.py"]
LOG_FRAGMENTS = ("buffer size", "llama_kv_cache", "overridden to", "tokens per second", "eval time",
                 "MiB, V (", "size = ")
READS_LLAMA_OUTPUT = ("captured_log", "llama_log_set", "subprocess", "llama-completion", "llama-cli")


def _strings(tree: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _imports_re(tree: ast.AST) -> bool:
    return any((isinstance(n, ast.Import) and any(a.name == "re" for a in n.names))
               or (isinstance(n, ast.ImportFrom) and n.module == "re") for n in ast.walk(tree))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_no_regex_on_llama_cpp_log_text(path):
    src = path.read_text()
    tree = ast.parse(src, str(path))
    # no pattern or literal that matches a line of llama.cpp's log (its figures come from the C API)
    hits = [s for s in _strings(tree) for f in LOG_FRAGMENTS if f in s]
    assert not hits, f"{path.name} looks for llama.cpp log text: {hits}"
    # a module that sees llama.cpp's log or output does not use regular expressions at all
    if any(w in src for w in READS_LLAMA_OUTPUT):
        assert not _imports_re(tree), f"{path.name} reads llama.cpp's output and imports re"


def test_the_check_sees_the_old_code():
    old = ('import re\nfrom rotaryquant.bindings.accounting import captured_log\n'
           'RX = re.compile(r"llama_kv_cache: size = +([0-9.]+) MiB")\n')
    tree = ast.parse(old)
    assert _imports_re(tree) and any("llama_kv_cache" in s for s in _strings(tree))


def test_planner_sees_the_default_per_layer_types(gemma3):
    """With the window the tools keep (+w16), the dry run takes libllama's default types as a real start does: on
    Gemma3 at 16K, 4-bit K on full layers 11 and 5 (the budget's two); named types ('@none') are taken as given."""
    from rotaryquant.bindings import row_size, type_from_name

    with accounting.NoAllocModel(gemma3) as m:
        dflt, plain = m.context("isoquant3_0+w16", 16384), m.context("isoquant3_0+w16@none", 16384)
        two = m.context("isoquant3_0+w16@5=isoquant4_0/isoquant3_0;11=isoquant4_0/isoquant3_0", 16384)
    step = 16384 * (row_size(type_from_name("isoquant4_0"), 256) - row_size(type_from_name("isoquant3_0"), 256))
    assert dflt.k - plain.k == 2 * step and (dflt.k, dflt.v) == (two.k, two.v)
