"""The decode-step fusions: `fuse_add_rms_norm` (residual Add + RmsNorm ⇒ AddRmsNorm,
torch_npu's npu_add_rms_norm, both outputs), `fuse_rotary_mul` (x·cos + rotate_half(x)·sin
⇒ RotaryMul, torch_npu's npu_rotary_mul), `fuse_apply_rotary_pos_emb` (a query's and a
key's RotaryMul ⇒ ApplyRotaryPosEmb) and `fuse_decode_kv_update` (two KvCacheUpdates
+ DecodeAttention ⇒ DecodeAttentionKvUpdate). Golden before/expected graphs of ≤ 10 nodes and a does-not-apply reason per
pass; their CPU kernels against eager on random inputs with NaN/Inf, a second call,
``out=`` and output independence; one compiled module through both against eager.
Tolerances: RotaryMul is eager's bits; AddRmsNorm's sum is eager's bits and its norm
fp32 rounding (another summation order of the mean square)."""
import pytest
import torch
import torch.nn as nn

import opencann
from opencann.ir import DataType, Graph, TensorDesc, TensorRef
from opencann.ops.kernels.add_rms_norm_cpu import add_rms_norm
from opencann.ops.kernels.rotary_mul_cpu import apply_rotary_pos_emb, rotary_mul
from opencann.ops.kernels.decode_attention_cpu import (bind_decode_attention_update, decode_attention,
                                                       decode_attention_update)
from opencann.ops.kernels.kv_cache_update_cpu import kv_cache_update
from opencann.passes import FuseAddRmsNorm, FuseApplyRotaryPosEmb, FuseDecodeKvUpdate, FuseDecodeRope, FuseRotaryMul

from helpers import run_pass, skipped

F = DataType.FLOAT
G = torch.Generator().manual_seed(0)


def d(*shape, dtype=F):
    return TensorDesc(tuple(shape), dtype)


run = run_pass


def _binary(g, op, a, b, desc=None):
    return g.create_node(op, [a, b], {"self": TensorRef(0), "other": TensorRef(1)},
                         [desc or a.desc]).output


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


# -- fuse_add_rms_norm ----------------------------------------------------------------------

def _add_rms_graph(a_desc, b_desc):
    g = Graph()
    a, b = g.add_input(a_desc, "a"), g.add_input(b_desc, "b")
    w = g.add_const(torch.randn(8, generator=G), "w")
    s = _binary(g, "Add", a, b, desc=a_desc)
    y = g.create_node("RmsNorm", [s, w], {"input": TensorRef(0), "normalized_shape": [8],
                                          "weight": TensorRef(1), "eps": 1e-6, "upcast": False},
                      [s.desc]).output
    g.outputs = [_binary(g, "Mul", y, s)]     # the sum read again (the residual stream)
    return g


def test_fuse_add_rms_norm_golden():
    g = _add_rms_graph(d(2, 8), d(2, 8))
    text, rep = run(FuseAddRmsNorm(), g)
    assert text == """graph(%a: float32[2,8], %b: float32[2,8]):
  %c0: float32[8] = const
  %0: float32[2,8], %1: float32[2,8] = AddRmsNorm(%a, %b, %c0; epsilon=1e-06)
  %2: float32[2,8] = Mul(%0, %1)
  return %2"""
    assert [a["detail"] for a in rep.applied] == ["residual Add + RMSNorm"]


def test_fuse_add_rms_norm_through_the_squeezed_last_token():
    """Add [2, 1, 8] -> h[:, 0] -> RmsNorm [2, 8] (a decode step's final norm)."""
    g = Graph()
    a, b = g.add_input(d(2, 1, 8), "a"), g.add_input(d(2, 1, 8), "b")
    w = g.add_const(torch.randn(8, generator=G), "w")
    s = _binary(g, "Add", a, b)
    h = g.create_node("SelectInt", [s], {"self": TensorRef(0), "dim": 1, "index": 0}, [d(2, 8)]).output
    g.outputs = [g.create_node("RmsNorm", [h, w], {"input": TensorRef(0), "normalized_shape": [8],
                                                   "weight": TensorRef(1), "eps": 1e-5, "upcast": False},
                               [h.desc]).output]
    text, rep = run(FuseAddRmsNorm(), g)
    assert text == """graph(%a: float32[2,1,8], %b: float32[2,1,8]):
  %c0: float32[8] = const
  %0: float32[2,8], %1: float32[2,1,8] = AddRmsNorm(%a, %b, %c0; epsilon=1e-05)
  return %0"""
    assert [a["detail"] for a in rep.applied] == ["residual Add + RMSNorm (through a squeezed view)"]
    x1, x2 = torch.randn(2, 1, 8, generator=G), torch.randn(2, 1, 8, generator=G)
    y = torch.empty(2, 8)
    add_rms_norm(x1, x2, g.nodes[0].inputs[2].const, 1e-5, out=(y, torch.empty(2, 1, 8)))
    torch.testing.assert_close(y, torch.rms_norm((x1 + x2)[:, 0], [8], g.nodes[0].inputs[2].const, 1e-5))


def test_fuse_add_rms_norm_does_not_apply_to_a_broadcast_add():
    g = _add_rms_graph(d(2, 8), d(1, 8))
    text, rep = run(FuseAddRmsNorm(), g)
    assert "AddRmsNorm" not in text
    assert [r for _, r in skipped(rep)] == [
        "the Add broadcasts (float32[2,8] + float32[1,8]); the fused kernel adds two tensors "
        "of the result's shape"]


def test_fuse_add_rms_norm_is_cpu_only():
    text, rep = run(FuseAddRmsNorm(), _add_rms_graph(d(2, 8), d(2, 8)), device="vnpu:ascend910b")
    assert "AddRmsNorm" not in text


# -- fuse_rotary_mul ----------------------------------------------------------------------

def _rope_graph(cos_desc, half=4):
    g = Graph()
    x = g.add_input(d(1, 2, 3, 8), "x")
    cos, sin = g.add_input(cos_desc, "cos"), g.add_input(cos_desc, "sin")
    hd = d(1, 2, 3, 4)
    hi = g.create_node("StridedSlice", [x], {"self": TensorRef(0), "dim": 3, "start": half,
                                             "end": 2 ** 63 - 1}, [hd]).output
    lo = g.create_node("StridedSlice", [x], {"self": TensorRef(0), "dim": 3, "start": 0,
                                             "end": half}, [hd]).output
    neg = g.create_node("Neg", [hi], {"self": TensorRef(0)}, [hd]).output
    rot = g.create_node("ConcatD", [neg, lo], {"tensors": [TensorRef(0), TensorRef(1)], "dim": -1},
                        [x.desc]).output
    g.outputs = [_binary(g, "Add", _binary(g, "Mul", x, cos), _binary(g, "Mul", rot, sin))]
    return g


def test_fuse_rotary_mul_golden():
    text, rep = run(FuseRotaryMul(), _rope_graph(d(1, 1, 3, 8)))
    assert text == """graph(%x: float32[1,2,3,8], %cos: float32[1,1,3,8], %sin: float32[1,1,3,8]):
  %0: float32[1,2,3,8] = RotaryMul(%x, %cos, %sin)
  return %0"""
    assert [a["detail"] for a in rep.applied] == ["rotary embedding x·cos + rotate_half(x)·sin"]


def test_fuse_rotary_mul_does_not_apply_when_cos_broadcasts_along_d():
    text, rep = run(FuseRotaryMul(), _rope_graph(d(1, 1, 3, 1)))
    assert "RotaryMul" not in text
    assert [r for _, r in skipped(rep)] == [
        "cos float32[1,1,3,1] / sin float32[1,1,3,1] do not broadcast to x float32[1,2,3,8] "
        "along its leading dims only"]


def test_fuse_rotary_mul_leaves_other_halves_alone():
    text, rep = run(FuseRotaryMul(), _rope_graph(d(1, 1, 3, 8), half=2))
    assert "RotaryMul" not in text and not rep.skipped   # not a rotate_half: no match at all


# -- fuse_apply_rotary_pos_emb ------------------------------------------------------------

def _pair_graph(reader_between=False):
    g = Graph()
    q, k = g.add_input(d(1, 4, 1, 8), "q"), g.add_input(d(1, 2, 1, 8), "k")
    cos, sin = g.add_input(d(1, 1, 1, 8), "cos"), g.add_input(d(1, 1, 1, 8), "sin")

    def rope(x):
        return g.create_node("RotaryMul", [x, cos, sin], {"input": TensorRef(0), "r1": TensorRef(1),
                                                          "r2": TensorRef(2)}, [x.desc]).output
    qr = rope(q)
    n = g.create_node("Neg", [qr], {"self": TensorRef(0)}, [qr.desc]).output if reader_between else qr
    g.outputs = [n, rope(k)]
    return g


def test_fuse_apply_rotary_pos_emb_golden():
    text, rep = run(FuseApplyRotaryPosEmb(), _pair_graph())
    assert text == """graph(%q: float32[1,4,1,8], %k: float32[1,2,1,8], %cos: float32[1,1,1,8], %sin: float32[1,1,1,8]):
  %0: float32[1,4,1,8], %1: float32[1,2,1,8] = ApplyRotaryPosEmb(%q, %k, %cos, %sin)
  return %0, %1"""
    assert [a["detail"] for a in rep.applied] == ["RotaryMul x2 sharing cos/sin"]


def test_fuse_apply_rotary_pos_emb_does_not_apply_with_a_reader_between():
    text, rep = run(FuseApplyRotaryPosEmb(), _pair_graph(reader_between=True))
    assert "ApplyRotaryPosEmb" not in text
    assert [r for _, r in skipped(rep)] == [
        "neg reads rotarymul's rotation before rotarymul_1 runs; the merged node would come "
        "after that read"]


def test_apply_rotary_pos_emb_kernel_is_two_rotary_muls():
    q = torch.randn(2, 5, 3, 16, generator=G).transpose(1, 2)     # [2, 3, 5, 16], strided
    k = torch.randn(2, 1, 5, 16, generator=G)
    cos, sin = torch.randn(2, 1, 5, 16, generator=G), torch.randn(2, 1, 5, 16, generator=G)
    q[1, 2, 4, 0], k[0, 0, 3, 9] = float("nan"), float("inf")
    out = (torch.empty(2, 3, 5, 16), torch.empty(2, 1, 5, 16))
    got = apply_rotary_pos_emb(q, k, cos, sin, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    for y, x in zip(got, (q, k)):
        ref = x * cos + _rotate_half(x) * sin
        assert torch.equal(torch.isnan(y), torch.isnan(ref)) and not torch.isfinite(y).all()
        assert torch.equal(y.nan_to_num(0.0), ref.nan_to_num(0.0))
    again = apply_rotary_pos_emb(q, k, cos, sin)                   # a second call, fresh outputs
    assert all(torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)) and a is not b
               for a, b in zip(again, got))
    big = torch.randn(1, 8, 600, 16, generator=G)                  # past the grain: two calls
    c2, s2 = torch.randn(1, 1, 600, 16, generator=G), torch.randn(1, 1, 600, 16, generator=G)
    yq, yk = apply_rotary_pos_emb(big, big[:, :2], c2, s2)
    assert torch.equal(yq, big * c2 + _rotate_half(big) * s2)
    assert torch.equal(yk, yq[:, :2])


# -- fuse_decode_kv_update ----------------------------------------------------------------

def _decode_graph(extra_reader=False):
    g = Graph()
    kc, vc = g.add_input(d(1, 2, 16, 8), "kc"), g.add_input(d(1, 2, 16, 8), "vc")
    kn, vn = g.add_input(d(1, 2, 1, 8), "kn"), g.add_input(d(1, 2, 1, 8), "vn")
    pos, lens = g.add_input(d(1, dtype=DataType.INT64), "pos"), g.add_input(d(1, dtype=DataType.INT64), "lens")
    q = g.add_input(d(1, 4, 1, 8), "q")
    up = [g.create_node("KvCacheUpdate", [c, n, pos], {"cache": TensorRef(0), "new": TensorRef(1),
                                                      "positions": TensorRef(2)}, [c.desc]).output
          for c, n in ((kc, kn), (vc, vn))]
    att = g.create_node("DecodeAttention", [q, up[0], up[1], lens],
                        {"query": TensorRef(0), "key": TensorRef(1), "value": TensorRef(2),
                         "lengths": TensorRef(3), "scale": 0.5}, [q.desc]).output
    g.outputs = [att, *up]
    if extra_reader:
        g.outputs.append(g.create_node("Neg", [up[0]], {"self": TensorRef(0)}, [up[0].desc]).output)
    return g


def test_fuse_decode_kv_update_golden():
    text, rep = run(FuseDecodeKvUpdate(), _decode_graph())
    assert text == """graph(%kc: float32[1,2,16,8], %vc: float32[1,2,16,8], %kn: float32[1,2,1,8], %vn: float32[1,2,1,8], %pos: int64[1], %lens: int64[1], %q: float32[1,4,1,8]):
  %0: float32[1,4,1,8], %1: float32[1,2,16,8], %2: float32[1,2,16,8] = DecodeAttentionKvUpdate(%q, %kc, %vc, %kn, %vn, %pos, %lens; scale=0.5)
  return %0, %1, %2"""
    assert [a["detail"] for a in rep.applied] == ["KvCacheUpdate x2 + DecodeAttention"]


def test_fuse_decode_kv_update_does_not_apply_when_another_node_reads_the_cache():
    text, rep = run(FuseDecodeKvUpdate(), _decode_graph(extra_reader=True))
    assert "DecodeAttentionKvUpdate" not in text
    reason = [r for _, r in skipped(rep)][0]
    assert reason.startswith("the cache ") and reason.endswith(
        "is read by neg too; fusing would move the write after that read")


def test_decode_attention_update_kernel_matches_the_three_ops():
    q = torch.randn(2, 6, 1, 16, generator=G)
    kc, vc = torch.randn(2, 3, 40, 16, generator=G), torch.randn(2, 3, 40, 16, generator=G)
    kn, vn = torch.randn(2, 3, 1, 16, generator=G), torch.randn(2, 3, 1, 16, generator=G)
    kn[1, 2, 0, 3] = float("nan")                       # a NaN key: that group's row is NaN
    kc[0, :, 30:] = float("inf")                         # past the live length: never read
    pos, lens = torch.tensor([9, 20]), torch.tensor([10, 21])
    k1, v1 = kc.clone(), vc.clone()
    ref = decode_attention(q, kv_cache_update(k1, kn, pos), kv_cache_update(v1, vn, pos), lens, 0.3)
    k2, v2 = kc.clone(), vc.clone()
    out = torch.empty(2, 6, 1, 16)
    got, kk, vv = decode_attention_update(q, k2, v2, kn, vn, pos, lens, 0.3, out=out)
    assert got is out and kk is k2 and vv is v2
    assert torch.equal(k2.nan_to_num(0.0), k1.nan_to_num(0.0)) and torch.isnan(k2[1, 2, 20, 3])
    assert torch.equal(v2, v1)
    assert torch.equal(torch.isnan(got), torch.isnan(ref)) and torch.isnan(got[1, 4:]).all()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6, equal_nan=True)
    again = decode_attention_update(q, k2, v2, kn, vn, pos, lens, 0.3)[0]   # a second call
    assert torch.equal(again.nan_to_num(0.0), got.nan_to_num(0.0)) and again is not got
    with pytest.raises(ValueError, match="positions 40..40"):
        decode_attention_update(q, k2, v2, kn, vn, torch.tensor([40, 0]), lens, 0.3)


def _force_path(monkeypatch, path):
    """"one": every call of the bound kernel in one part (the calling thread); "parts":
    the (b, kv head) groups dealt over 2 parts (`_by_group_update`'s ``parts``), whatever
    the live work and the host's load. Returns the module."""
    import opencann.ops.kernels.decode_attention_cpu as dac
    monkeypatch.setattr(dac, "torch_threads", lambda: 2)     # 6 groups: enough for 2 threads
    monkeypatch.setattr(dac, "launch_threads", lambda work: 2 if path == "parts" else 1)
    if path == "parts":
        monkeypatch.setattr(dac, "SERIAL_MAX", -1)
        monkeypatch.setattr(dac, "GRAIN", 0)
    return dac


def _spy(monkeypatch, dac, names):
    """Wrap the kernels ``names`` of ``dac`` to record their calls: {name: [the last
    argument of each call (``parts`` for the by-group kernels)]}. A by-group kernel runs
    through `general_entry` with its layouts, the machine code the unspied call runs."""
    from opencann.ops.kernels.numba_cache import general_entry
    layouts = {"_by_group_update": dac._UPDATE_ANY_LAYOUT,
               "_by_group_rope_update": dac._ROPE_UPDATE_ANY_LAYOUT}
    calls = {}
    for n in names:
        f = getattr(dac, n)

        def wrapped(*a, _f=f, _n=n):
            calls.setdefault(_n, []).append(a[-1])
            return general_entry(_f, a, layouts[_n])(*a) if _n in layouts else _f(*a)
        monkeypatch.setattr(dac, n, wrapped)
    return calls


@pytest.mark.parametrize("smax", [40, 4096])
@pytest.mark.parametrize("path", ["one", "parts"])
def test_bound_decode_attention_update_is_the_unbound_kernel_and_checks_ranges(smax, path,
                                                                              monkeypatch):
    """The kernel bound to static descriptions (checks made once, ranges in the kernel)
    gives the unbound call's bits on both paths (strided new rows, as the QKV GEMM's
    views, take the fast path too), writes nothing on a bad position or length (the same
    one-line errors), and falls back to the general path where it must."""
    dac = _force_path(monkeypatch, path)
    calls = _spy(monkeypatch, dac, ["_by_group_update"])  # before binding: bound there
    descs = [d(2, 6, 1, 16), d(2, 3, smax, 16), d(2, 3, smax, 16), d(2, 3, 1, 16),
             d(2, 3, 1, 16), d(2, dtype=DataType.INT64), d(2, dtype=DataType.INT64)]
    bound = bind_decode_attention_update(*descs, 0.3)
    assert bound.__name__ == "run"
    q, kn, vn = (torch.randn(*x.shape, generator=G) for x in (descs[0], descs[3], descs[4]))
    kc, vc = torch.randn(2, 3, smax, 16, generator=G), torch.randn(2, 3, smax, 16, generator=G)
    q[1, 0, 0, 2], vn[0, 1, 0, 5], kc[0, :, 30:] = float("nan"), float("inf"), float("inf")
    pos, lens = torch.tensor([9, 39]), torch.tensor([10, 40])
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    ref = decode_attention_update(q, k1, v1, kn, vn, pos, lens, 0.3)[0]
    kn = torch.empty(2, 3, 1, 32)[..., ::2].copy_(kn)   # strided, the same values
    out = torch.empty(2, 6, 1, 16)
    calls.clear()                                        # the reference ran it too
    for _ in range(2):                                   # a second call: same bits
        got, kk, vv = bound(q, k2, v2, kn, vn, pos, lens, out=out)
        assert got is out and kk is k2 and vv is v2
        assert torch.equal(got.nan_to_num(7.0), ref.nan_to_num(7.0))
        assert torch.equal(torch.isnan(got), torch.isnan(ref)) and torch.isnan(got[1, 0]).all()
        assert torch.equal(k2.nan_to_num(7.0), k1.nan_to_num(7.0)) and torch.equal(v2, v1)
    parts = 2 if path == "parts" else 1                  # the fast path, not the general one
    assert calls == {"_by_group_update": [parts, parts]}
    for bad_pos, bad_len, match in (([smax, 0], [10, 40], f"positions {smax}..{smax}"),
                                    ([-1, 0], [10, 40], "positions"),
                                    ([9, 0], [smax + 1, 1], "lengths must lie in")):
        before = k2.clone()
        with pytest.raises(ValueError, match=match):
            bound(q, k2, v2, kn, vn, torch.tensor(bad_pos), torch.tensor(bad_len), out=out)
        assert torch.equal(k2.nan_to_num(7.0), before.nan_to_num(7.0))   # nothing written
    fresh = bound(q, k2, v2, kn, vn, pos, lens)[0]        # no out: the general path
    assert fresh is not out and torch.equal(fresh.nan_to_num(7.0), ref.nan_to_num(7.0))


def test_bound_kernel_chooses_by_live_length_not_cache_size(monkeypatch):
    """One (b, kv head) group and a long cache: a short live length runs serially in the
    bound kernel, a long one splits the keys (the general path, FlashDecoding), both
    equal to the unbound call; the choice is made per call from the lengths."""
    import opencann.ops.kernels.decode_attention_cpu as dac
    monkeypatch.setattr(dac, "torch_threads", lambda: 2)
    few = [d(1, 2, 1, 16), d(1, 1, 8192, 16), d(1, 1, 8192, 16), d(1, 1, 1, 16), d(1, 1, 1, 16),
           d(1, dtype=DataType.INT64), d(1, dtype=DataType.INT64)]
    calls = _spy(monkeypatch, dac, ["_by_group_update", "_partials"])
    bound = bind_decode_attention_update(*few, 0.3)
    q, kn, vn = (torch.randn(*x.shape, generator=G) for x in (few[0], few[3], few[4]))
    kc, vc = torch.randn(1, 1, 8192, 16, generator=G), torch.randn(1, 1, 8192, 16, generator=G)
    for n, kernel in ((40, "_by_group_update"), (8000, "_partials")):
        pos, lens = torch.tensor([n - 1]), torch.tensor([n])
        k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        ref = decode_attention_update(q, k1, v1, kn, vn, pos, lens, 0.3)[0]
        calls.clear()
        got = bound(q, k2, v2, kn, vn, pos, lens, out=torch.empty(1, 2, 1, 16))[0]
        assert list(calls) == [kernel] and len(calls[kernel]) == 1
        assert torch.equal(got, ref) and torch.equal(k2, k1) and torch.equal(v2, v1)


# -- fuse_decode_rope ------------------------------------------------------------------------

def _rope_decode_graph(reader=False):
    g = Graph()
    kc, vc = g.add_input(d(1, 2, 16, 8), "kc"), g.add_input(d(1, 2, 16, 8), "vc")
    q, kn = g.add_input(d(1, 4, 1, 8), "q"), g.add_input(d(1, 2, 1, 8), "kn")
    vn = g.add_input(d(1, 2, 1, 8), "vn")
    cos, sin = g.add_input(d(1, 1, 1, 8), "cos"), g.add_input(d(1, 1, 1, 8), "sin")
    pos, lens = g.add_input(d(1, dtype=DataType.INT64), "pos"), g.add_input(d(1, dtype=DataType.INT64), "lens")
    rope = g.create_node("ApplyRotaryPosEmb", [q, kn, cos, sin],
                         {"query": TensorRef(0), "key": TensorRef(1), "cos": TensorRef(2),
                          "sin": TensorRef(3)}, [q.desc, kn.desc], "rope")
    att = g.create_node("DecodeAttentionKvUpdate", [rope.outputs[0], kc, vc, rope.outputs[1], vn, pos, lens],
                        {**{n: TensorRef(i) for i, n in enumerate(("query", "key", "value", "key_new",
                                                                   "value_new", "positions", "lengths"))},
                         "scale": 0.5}, [q.desc, kc.desc, vc.desc], "att")
    g.outputs = list(att.outputs)
    if reader:
        g.outputs.append(g.create_node("Neg", [rope.outputs[0]], {"self": TensorRef(0)},
                                       [q.desc], "neg").output)
    return g


def test_fuse_decode_rope_golden():
    text, rep = run(FuseDecodeRope(), _rope_decode_graph())
    assert text == """graph(%kc: float32[1,2,16,8], %vc: float32[1,2,16,8], %q: float32[1,4,1,8], %kn: float32[1,2,1,8], %vn: float32[1,2,1,8], %cos: float32[1,1,1,8], %sin: float32[1,1,1,8], %pos: int64[1], %lens: int64[1]):
  %0: float32[1,4,1,8], %1: float32[1,2,16,8], %2: float32[1,2,16,8] = DecodeAttentionKvUpdate(%q, %kc, %vc, %kn, %vn, %pos, %lens, %cos, %sin; scale=0.5)
  return %0, %1, %2"""
    assert [a["detail"] for a in rep.applied] == ["ApplyRotaryPosEmb + DecodeAttentionKvUpdate"]


def test_fuse_decode_rope_does_not_apply_when_the_rotation_is_read_elsewhere():
    text, rep = run(FuseDecodeRope(), _rope_decode_graph(reader=True))
    assert "ApplyRotaryPosEmb" in text
    assert skipped(rep) == [("fuse_decode_rope", "rope's rotation is read by neg too")]


@pytest.mark.parametrize("smax,path", [(40, "one"), (4096, "one"), (40, "parts")])
@pytest.mark.parametrize("per_row", [False, True])   # cos/sin one for all rows, or per row
def test_rope_decode_kernel_is_the_rotation_then_the_kernel_bit_for_bit(smax, path, per_row,
                                                                        monkeypatch):
    """The bound kernel with cos/sin gives apply_rotary_pos_emb + decode_attention_update's
    bits (NaN/Inf in the query, the new key and the cache; strided q/k/v as the merged
    Q/K/V GEMM's views, on the fast path; a second call) in one part or dealt over two,
    and its range errors write nothing."""
    dac = _force_path(monkeypatch, path)
    calls = _spy(monkeypatch, dac, ["_by_group_rope_update"])
    B, Hq, Hkv, D = 2, 6, 3, 16
    cs = (B if per_row else 1, 1, 1, D)
    descs = [d(B, Hq, 1, D), d(B, Hkv, smax, D), d(B, Hkv, smax, D), d(B, Hkv, 1, D),
             d(B, Hkv, 1, D), d(B, dtype=DataType.INT64), d(B, dtype=DataType.INT64)]
    bound = bind_decode_attention_update(*descs, 0.3, d(*cs), d(*cs))
    assert bound.__name__ == "run"
    merged = torch.randn(B, 1, (Hq + 2 * Hkv) * D, generator=G)      # one GEMM's output
    q = merged[..., :Hq * D].view(B, 1, Hq, D).transpose(1, 2)
    kn = merged[..., Hq * D:(Hq + Hkv) * D].view(B, 1, Hkv, D).transpose(1, 2)
    vn = merged[..., (Hq + Hkv) * D:].view(B, 1, Hkv, D).transpose(1, 2)
    q[1, 2, 0, 3], kn[0, 1, 0, 5], vn[1, 0, 0, 1] = float("nan"), float("inf"), float("-inf")
    cos, sin = torch.randn(*cs, generator=G), torch.randn(*cs, generator=G)
    kc, vc = torch.randn(B, Hkv, smax, D, generator=G), torch.randn(B, Hkv, smax, D, generator=G)
    kc[0, :, 30:] = float("inf")
    pos, lens = torch.tensor([9, 30]), torch.tensor([10, 31])
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    qr, kr = apply_rotary_pos_emb(q, kn, cos, sin)
    ref = decode_attention_update(qr, k1, v1, kr, vn, pos, lens, 0.3)[0]
    out = torch.empty(B, Hq, 1, D)
    for _ in range(2):
        got, kk, vv = bound(q, k2, v2, kn, vn, pos, lens, cos, sin, out=out)
        assert got is out and kk is k2 and vv is v2
        assert torch.equal(torch.isnan(got), torch.isnan(ref)) and torch.isnan(got).any()
        assert torch.equal(got.nan_to_num(7.0), ref.nan_to_num(7.0))
        assert torch.equal(k2.nan_to_num(7.0), k1.nan_to_num(7.0)) and torch.equal(v2, v1)
    parts = 2 if path == "parts" else 1
    assert calls == {"_by_group_rope_update": [parts, parts]}       # the fast path
    before = k2.clone()
    with pytest.raises(ValueError, match=f"positions {smax}..{smax}"):
        bound(q, k2, v2, kn, vn, torch.tensor([smax, 0]), lens, cos, sin, out=out)
    assert torch.equal(k2.nan_to_num(7.0), before.nan_to_num(7.0))       # nothing written
    fresh = bound(q, k2, v2, kn, vn, pos, lens, cos, sin)[0]              # no out: general path
    assert torch.equal(fresh.nan_to_num(7.0), ref.nan_to_num(7.0))


# -- kernels against eager ---------------------------------------------------------------

def test_rotary_mul_kernel_is_eager_bit_for_bit():
    x = torch.randn(2, 5, 3, 16, generator=G).transpose(1, 2)     # [2, 3, 5, 16], strided
    cos, sin = torch.randn(2, 1, 5, 16, generator=G), torch.randn(2, 1, 5, 16, generator=G)
    x[0, 1, 2, 3], x[1, 0, 4, 12], cos[1, 0, 0, 5] = float("nan"), float("inf"), -float("inf")
    ref = x * cos + _rotate_half(x) * sin
    y = rotary_mul(x, cos, sin)
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.isnan(ref).any()
    assert torch.equal(y.nan_to_num(0.0), ref.nan_to_num(0.0))
    out = torch.empty(2, 3, 5, 16)
    assert rotary_mul(x, cos[0], sin[0][None], out=out) is out    # fewer dims broadcast too
    r0 = x * cos[0] + _rotate_half(x) * sin[0]
    assert torch.equal(out.nan_to_num(0.0), r0.nan_to_num(0.0))
    again = rotary_mul(x, cos, sin)
    assert torch.equal(again.nan_to_num(0.0), y.nan_to_num(0.0)) and again is not y
    big = torch.randn(1, 4, 600, 64, generator=G)                 # the parallel kernel
    c2, s2 = torch.randn(1, 1, 600, 64, generator=G), torch.randn(1, 1, 600, 64, generator=G)
    assert torch.equal(rotary_mul(big, c2, s2), big * c2 + _rotate_half(big) * s2)


@pytest.mark.parametrize("batch,seq", [(1, 512), (2, 77)])
def test_rotary_prefill_rows_are_eager_bit_for_bit(batch, seq):
    """Past the grain, q/k viewed out of a fused QKV linear's output (unit stride along D,
    strided elsewhere) run the vectorised flat rows, q and k in one loop: eager's bits,
    NaN and inf included, into the given buffers; again into fresh ones."""
    qkv = torch.randn(batch, seq, 20 * 64, generator=G)
    q = qkv[..., :768].view(batch, seq, 12, 64).transpose(1, 2)
    k = qkv[..., 768:1024].view(batch, seq, 4, 64).transpose(1, 2)
    q[0, 3, seq - 1, 7], k[-1, 2, 0, 40], q[-1, 0, 1, 33] = float("nan"), float("inf"), -float("inf")
    cos, sin = torch.randn(batch, 1, seq, 64, generator=G), torch.randn(batch, 1, seq, 64, generator=G)
    cos[0, 0, 2, 1] = float("inf")
    refs = [x * cos + _rotate_half(x) * sin for x in (q, k)]
    out = (torch.empty(batch, 12, seq, 64), torch.empty(batch, 4, seq, 64))
    got = apply_rotary_pos_emb(q, k, cos, sin, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    for y, ref in zip(got, refs):
        assert torch.equal(y.view(torch.int32), ref.view(torch.int32))
    few = (cos[0], sin[0]) if batch == 1 else (cos, sin)            # 3-D cos/sin at batch 1
    strided = (torch.empty(batch, seq, 12, 64).transpose(1, 2),    # eager's layout of the
               torch.empty(batch, seq, 4, 64).transpose(1, 2))     # results: written in place
    got = apply_rotary_pos_emb(q, k, cos, sin, out=strided)
    assert got[0] is strided[0] and got[1] is strided[1]
    for y, ref in zip(got, refs):
        assert torch.equal(y.view(torch.int32), ref.view(torch.int32))
    again = apply_rotary_pos_emb(q, k, *few)                        # fresh outputs
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(again, refs))
    assert again[0] is not got[0]
    heads = torch.randn(batch, 12, seq, 64, generator=G)           # cos varying per head: alone
    assert torch.equal(rotary_mul(q, heads, sin).view(torch.int32),
                       (q * heads + _rotate_half(q) * sin).view(torch.int32))
    strided = torch.randn(batch, 1, seq, 128, generator=G)[..., ::2]   # not unit-stride: the
    assert torch.equal(rotary_mul(q, strided, sin).view(torch.int32),  # strided rows instead
                       (q * strided + _rotate_half(q) * sin).view(torch.int32))


@pytest.mark.parametrize("args,match", [
    (lambda x, c: (x[0], c, c), r"\[B, N, S, D\]"),
    (lambda x, c: (x[..., :15], c[..., :15], c[..., :15]), "D even"),
    (lambda x, c: (x, c.double(), c), "float32"),
    (lambda x, c: (x, c[..., :1], c), "do not broadcast"),
])
def test_rotary_mul_bad_input_is_one_clear_error(args, match):
    x, c = torch.randn(1, 2, 3, 16), torch.randn(1, 1, 3, 16)
    with pytest.raises(ValueError, match=match):
        rotary_mul(*args(x, c))


@pytest.mark.parametrize("seq", [3, 2000])     # below and above ATen's grain
def test_rotary_into_an_output_overlapping_its_input_is_eager_bit_for_bit(seq):
    """``out=x`` (or the pair's ``out=(q, k)``, or swapped) used to be silently wrong: a
    row's second half read the first half the kernel had just overwritten."""
    G = torch.Generator().manual_seed(seq)
    c, s = torch.randn(1, 1, seq, 8, generator=G), torch.randn(1, 1, seq, 8, generator=G)
    x = torch.randn(2, 4, seq, 8, generator=G)
    x[0, 0, 0, 0], x[1, 3, -1, 5] = float("nan"), float("inf")
    want = x * c + _rotate_half(x) * s
    assert rotary_mul(x, c, s, out=x) is x
    assert torch.equal(x.view(torch.int32), want.view(torch.int32))
    q, k = torch.randn(2, 4, seq, 8, generator=G), torch.randn(2, 4, seq, 8, generator=G)
    wq, wk = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    yk, yq = apply_rotary_pos_emb(q, k, c, s, out=(k, q))     # each written over the other
    assert yq is q and yk is k
    assert torch.equal(yk.view(torch.int32), wq.view(torch.int32))
    assert torch.equal(yq.view(torch.int32), wk.view(torch.int32))


def test_cos_broadcast_along_d_is_one_error_at_prefill_sizes_too():
    """Above ATen's grain the pair runs `_pair_flat`'s unit-stride rows: a cos/sin of D 1
    was read D elements past its end there (silently wrong), refused only below it."""
    q, k = torch.randn(3, 2, 4097, 8), torch.randn(3, 2, 4097, 8)
    c = torch.randn(1, 1, 4097, 1)
    with pytest.raises(ValueError, match="do not broadcast"):
        apply_rotary_pos_emb(q, k, c, c)
    with pytest.raises(ValueError, match="do not broadcast"):
        rotary_mul(q, c, c)


@pytest.mark.parametrize("rows", [4, 300])     # the calling-thread and the parallel kernel
def test_add_rms_norm_kernel_matches_eager(rows):
    a, b = torch.randn(rows, 1, 96, generator=G) * 3, torch.randn(rows, 1, 96, generator=G)
    w = torch.randn(96, generator=G)
    a[0, 0, 5] = float("nan")
    b[1, 0, 7], a[2, 0, 0] = float("inf"), 3e19          # inf; s² overflowing: zeros as eager
    s_ref = a + b
    y_ref = torch.rms_norm(s_ref, [96], w, 1e-6)
    y, s = add_rms_norm(a, b, w, 1e-6)
    assert torch.equal(s.nan_to_num(0.0), s_ref.nan_to_num(0.0))
    assert torch.equal(torch.isnan(y), torch.isnan(y_ref)) and torch.isnan(y).any()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6, equal_nan=True)
    out = (torch.empty(rows, 1, 96), torch.empty(rows, 1, 96))
    got = add_rms_norm(a, b, w, 1e-6, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    assert torch.equal(out[0].nan_to_num(0.0), y.nan_to_num(0.0))    # a second call: same bits
    s.add_(1)                                                        # results are the caller's
    assert not torch.equal(out[1].nan_to_num(0.0), s.nan_to_num(0.0))


@pytest.mark.parametrize("rows", [4, 300])     # the calling-thread and the parallel kernel
def test_add_rms_norm_kernel_zero_row_with_eps_zero_is_nan_as_eager(rows):
    """eps = 0 and a row summing to zeros: eager's rsqrt(0) = inf and 0·inf = NaN; the
    kernel gave Python's ZeroDivisionError (numba's default error model) before."""
    a, b = torch.randn(rows, 12, generator=G), torch.randn(rows, 12, generator=G)
    w = torch.randn(12, generator=G)
    a[1], b[1] = torch.randn(12, generator=G), 0.0
    b[1] = -a[1]                                                      # s = a + b = 0 exactly
    y_ref = torch.rms_norm(a + b, [12], w, 0.0)
    y, s = add_rms_norm(a, b, w, 0.0)
    assert torch.isnan(y[1]).all() and torch.isnan(y_ref[1]).all()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert torch.equal(s, a + b)


def test_add_rms_norm_bad_input_is_one_clear_error():
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(torch.randn(2, 8), torch.randn(2, 8), torch.randn(4), 1e-6)
    with pytest.raises(ValueError, match="float32"):
        add_rms_norm(torch.randn(2, 8).double(), torch.randn(2, 8).double(), torch.randn(8), 1e-6)


# -- compiled end to end -------------------------------------------------------------------

class RopeBlock(nn.Module):
    """h2 = h + x; (rmsnorm(h2)·w, h2, rope(q)) as a Llama layer spells them."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, generator=G))

    def forward(self, h, x, q, cos, sin):
        h2 = h + x
        v = h2 * torch.rsqrt(h2.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.w * v, h2 * 2, q * cos + _rotate_half(q) * sin


def test_compiled_block_matches_eager_with_both_fusions():
    m = RopeBlock().eval()

    def inputs(special):
        h, x = torch.randn(1, 3, 32, generator=G), torch.randn(1, 3, 32, generator=G)
        q = torch.randn(1, 3, 4, 16, generator=G).transpose(1, 2)
        cos, sin = torch.randn(1, 1, 3, 16, generator=G), torch.randn(1, 1, 3, 16, generator=G)
        if special:
            h[0, 1, 4], q[0, 2, 1, 9] = float("nan"), float("inf")
        return h, x, q, cos, sin

    cm = opencann.compile(m, inputs(False))
    ops = cm.graph.op_counts()
    assert ops.get("AddRmsNorm") == 1 and ops.get("RotaryMul") == 1 and "Neg" not in ops  # one rope: no pair
    kept = []
    for special in (False, True, False):
        xs = inputs(special)
        with torch.no_grad():
            ref = m(*xs)
        got = cm(*xs)
        for a, r in zip(got, ref):
            assert torch.equal(torch.isnan(a), torch.isnan(r))
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6, equal_nan=True)
        kept.append(([t.clone() for t in got], got))
    for keep, got in kept:                       # later calls left earlier results alone
        for a, b in zip(keep, got):
            assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.mark.parametrize("path", ["one", "parts"])
def test_rope_decode_kernel_at_batch_8_mixed_lengths_against_eager(path, monkeypatch):
    """A 125M Llama's decode step at batch 8 (12 query / 4 KV heads, D 64) with mixed live
    lengths 0, 1, short and the whole cache, against eager: RoPE (x·cos + rotate_half(x)
    ·sin), the cache rows written by indexing, SDPA over the repeated KV heads with a
    length mask (zeros for the length-0 row). NaN past every row's length is never read;
    the caches are eager's bits; a second call gives the same bits."""
    _force_path(monkeypatch, path)
    B, Hq, Hkv, D, S = 8, 12, 4, 64, 48
    lens = torch.tensor([0, 1, 40, 7, 48, 2, 33, 1])
    pos = (lens - 1).clamp(min=0)                          # the new row's position
    merged = torch.randn(B, 1, (Hq + 2 * Hkv) * D, generator=G)
    q = merged[..., :Hq * D].view(B, 1, Hq, D).transpose(1, 2)
    kn = merged[..., Hq * D:(Hq + Hkv) * D].view(B, 1, Hkv, D).transpose(1, 2)
    vn = merged[..., (Hq + Hkv) * D:].view(B, 1, Hkv, D).transpose(1, 2)
    cos, sin = torch.randn(B, 1, 1, D, generator=G), torch.randn(B, 1, 1, D, generator=G)
    kc, vc = torch.randn(B, Hkv, S, D, generator=G), torch.randn(B, Hkv, S, D, generator=G)
    for b, n in enumerate(lens.tolist()):
        kc[b, :, n:], vc[b, :, n:] = float("nan"), float("nan")   # never read
    qr, kr = q * cos + _rotate_half(q) * sin, kn * cos + _rotate_half(kn) * sin
    ke, ve = kc.clone(), vc.clone()
    for b, p in enumerate(pos.tolist()):
        ke[b, :, p], ve[b, :, p] = kr[b, :, 0], vn[b, :, 0]
    keep = torch.arange(S)[None, :] < lens[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(
        qr, ke.nan_to_num(0.0).repeat_interleave(3, 1), ve.nan_to_num(0.0).repeat_interleave(3, 1),
        attn_mask=keep[:, None, None, :], scale=0.125)
    ref[0] = 0.0                                            # length 0: zeros
    descs = [d(B, Hq, 1, D), d(B, Hkv, S, D), d(B, Hkv, S, D), d(B, Hkv, 1, D), d(B, Hkv, 1, D),
             d(B, dtype=DataType.INT64), d(B, dtype=DataType.INT64), d(B, 1, 1, D), d(B, 1, 1, D)]
    bound = bind_decode_attention_update(*descs[:7], 0.125, *descs[7:])
    out = torch.empty(B, Hq, 1, D)
    first = None
    for _ in range(2):
        k2, v2 = kc.clone(), vc.clone()
        got = bound(q, k2, v2, kn, vn, pos, lens, cos, sin, out=out)[0]
        assert torch.equal(k2.nan_to_num(7.0), ke.nan_to_num(7.0))
        assert torch.equal(v2.nan_to_num(7.0), ve.nan_to_num(7.0))
        assert torch.isfinite(got).all() and torch.equal(got[0], torch.zeros(Hq, 1, D))
        assert ((got - ref).abs() <= 1e-5 + 1e-5 * ref.abs()).all()
        first = got.clone() if first is None else first
        assert torch.equal(got, first)


@pytest.mark.parametrize("batch,seq", [(1, 32), (3, 7), (2, 16)])
def test_rotary_small_prefill_span_rows_are_eager_bit_for_bit(batch, seq):
    """Below the grain, q/k sliced out of a fused QKV output (heads D apart, rows strided)
    or contiguous, run the span rows (`_serial_pair_span`): eager's bits, NaN and inf
    included, into the given buffers and again into fresh ones; cos per row or shared."""
    from opencann.ops.kernels import rotary_mul_cpu as R
    qkv = torch.randn(batch, seq, 20 * 64, generator=G)
    q = qkv[..., :768].view(batch, seq, 12, 64).transpose(1, 2)
    k = qkv[..., 768:1024].view(batch, seq, 4, 64).transpose(1, 2)
    q[0, 3, seq - 1, 7], k[-1, 2, 0, 40], q[-1, 0, 1, 33] = float("nan"), float("inf"), -float("inf")
    cos = torch.randn(batch, 1, seq, 64, generator=G)
    sin = torch.randn(1, 1, seq, 64, generator=G)
    sin[0, 0, 2, 50] = float("inf")
    assert R._span_args(q, k, R._as4(cos, q.shape), R._as4(sin, q.shape),
                        torch.empty(q.shape), torch.empty(k.shape)) is not None
    for qq, kk in ((q, k), (q.contiguous(), k.contiguous())):
        refs = [x * cos + _rotate_half(x) * sin for x in (qq, kk)]
        out = (torch.empty(qq.shape), torch.empty(kk.shape))
        got = apply_rotary_pos_emb(qq, kk, cos, sin, out=out)
        assert got[0] is out[0] and got[1] is out[1]
        again = apply_rotary_pos_emb(qq, kk, cos, sin)
        for ys in (got, again):
            for y, ref in zip(ys, refs):
                assert torch.equal(y.view(torch.int32), ref.view(torch.int32))
        assert again[0] is not got[0]


def test_rotary_span_memo_follows_values_and_buffers():
    """A graph node's memo reuses the spans of the same buffers (new values in them are
    read, not the old ones) and rebuilds them for other buffers or layouts."""
    memo: dict = {}
    qkv = torch.randn(1, 32, 20 * 64, generator=G)
    q = qkv[..., :768].view(1, 32, 12, 64).transpose(1, 2)
    k = qkv[..., 768:1024].view(1, 32, 4, 64).transpose(1, 2)
    cos, sin = torch.randn(1, 1, 32, 64, generator=G), torch.randn(1, 1, 32, 64, generator=G)
    out = (torch.empty(1, 32, 12, 64).transpose(1, 2), torch.empty(1, 32, 4, 64).transpose(1, 2))
    for step in range(3):
        if step == 2:                      # other buffers, another layout: new spans
            out = (torch.empty(1, 12, 32, 64), torch.empty(1, 4, 32, 64))
        qkv.copy_(torch.randn(qkv.shape, generator=G))       # new values, same memory
        cos.copy_(torch.randn(cos.shape, generator=G))
        got = apply_rotary_pos_emb(q, k, cos, sin, out=out, memo=memo)
        assert len(memo) == 1 and got[0] is out[0]
        for y, x in zip(got, (q, k)):
            assert torch.equal(y.view(torch.int32), (x * cos + _rotate_half(x) * sin).view(torch.int32))
