"""bindings.capture: the ctypes mirror of struct ggml_tensor is checked against the build, and the check fails,
naming the field, when the two disagree."""

from __future__ import annotations

import ctypes

import pytest

from rotaryquant.bindings import capture


def _mirror(replace: dict[str, object]) -> type[ctypes.Structure]:
    """GGMLTensor with some fields' types replaced: a deliberately wrong mirror."""
    fields = [(n, replace.get(n, t)) for n, t in capture.GGMLTensor._fields_]
    return type("WrongTensor", (ctypes.Structure,), {"_fields_": fields})


class _ShiftedBuild:
    """libggml-base whose ggml_rq_tensor_offset reports one field 8 bytes further on."""

    def __init__(self, base: ctypes.CDLL, field: str) -> None:
        self.base, self.field = base, field

    def ggml_rq_tensor_offset(self, name: bytes) -> int:
        off = self.base.ggml_rq_tensor_offset(name)
        return off + 8 if name.decode() == self.field else off


def test_the_mirror_matches_the_build():
    base = capture.lib()  # runs the check
    capture.check_layout(base)
    assert base.ggml_rq_tensor_offset(b"type") == 0
    assert base.ggml_rq_tensor_offset(b"sizeof") == ctypes.sizeof(capture.GGMLTensor)
    assert base.ggml_rq_tensor_offset(b"no_such_field") == capture._SIZE_MAX


def test_a_node_reads_a_real_tensor_through_the_mirror():
    class Params(ctypes.Structure):
        _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]

    base = capture.lib()
    base.ggml_init.restype = ctypes.c_void_p
    base.ggml_init.argtypes = [Params]
    base.ggml_new_tensor_2d.restype = ctypes.c_void_p
    base.ggml_new_tensor_2d.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    base.ggml_set_name.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    base.ggml_view_2d.restype = ctypes.c_void_p
    base.ggml_view_2d.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                  ctypes.c_size_t, ctypes.c_size_t]
    base.ggml_free.argtypes = [ctypes.c_void_p]
    ctx = base.ggml_init(Params(1 << 20, None, True))
    try:
        t = base.ggml_new_tensor_2d(ctx, 0, 12, 5)  # GGML_TYPE_F32
        base.ggml_set_name(t, b"attn_k_in-3")
        v = base.ggml_view_2d(ctx, t, 4, 5, 48, 8)
        n, w = capture.Node(t), capture.Node(v)
        assert (n.name, n.type, n.ne, tuple(n.t.nb)) == ("attn_k_in-3", 0, (12, 5, 1, 1), (4, 48, 240, 240))
        assert n.src(0) is None and n.is_contiguous() and not w.is_contiguous()
        assert w.t.view_src == t and w.t.view_offs == 8 and w.ne == (4, 5, 1, 1)
        assert w.op == capture.op_id("VIEW") and w.src(0).addr == t
    finally:
        base.ggml_free(ctx)


def test_a_shifted_field_fails_and_is_named():
    base = capture.lib()
    # op is 4 bytes followed by op_params: an 8-byte op keeps op's own offset and moves op_params
    with pytest.raises(capture.LayoutError, match=r"ggml_tensor\.op_params: the build puts it at byte \d+, "
                                                  r"the ctypes mirror at byte \d+: the build and the mirror disagree"):
        capture.check_layout(base, _mirror({"op": ctypes.c_int64}))
    # the same, seen from the other side: a build that moved one field
    with pytest.raises(capture.LayoutError, match=r"ggml_tensor\.view_offs: .*re-run set-up"):
        capture.check_layout(_ShiftedBuild(base, "view_offs"))


def test_a_wrong_size_fails():
    base = capture.lib()
    with pytest.raises(capture.LayoutError, match=r"sizeof is \d+ bytes in the build, \d+ in the ctypes mirror"):
        capture.check_layout(base, _mirror({"padding": ctypes.c_char * 16}))  # every offset still right


def test_an_unknown_field_fails():
    base = capture.lib()
    wrong = type("WrongTensor", (ctypes.Structure,), {"_fields_": [*capture.GGMLTensor._fields_,
                                                                    ("extra2", ctypes.c_void_p)]})
    with pytest.raises(capture.LayoutError, match="field 'extra2' the build does not know"):
        capture.check_layout(base, wrong)


def test_the_check_runs_on_first_use(monkeypatch):
    real = capture.check_layout

    def wrong(base, mirror=capture.GGMLTensor):
        real(_ShiftedBuild(base, "src"))

    capture.lib.cache_clear()
    capture.op_id.cache_clear()
    monkeypatch.setattr(capture, "check_layout", wrong)
    try:
        with pytest.raises(capture.LayoutError, match=r"ggml_tensor\.src:"):
            capture.EvalCallback(lambda n: False, lambda n: None)
        with pytest.raises(capture.LayoutError, match=r"ggml_tensor\.src:"):
            capture.op_id("MUL_MAT")
    finally:
        monkeypatch.undo()
        capture.lib.cache_clear()
        capture.op_id.cache_clear()
    capture.lib()
    assert capture.op_id("MUL_MAT") > 0
