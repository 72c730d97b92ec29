"""`fuse_elementwise` rounds every intermediate as eager does (float32 overflow included).

Each fused op's result is rounded to its dtype (``(a·1e30)·1e30/1e30`` is inf where eager's
is; ``a + b − b`` loses ``a`` as eager does). Float sums and means are not fused: the
kernel summed in float64, which did not overflow where eager's float32 partial sums do
([3e38, 3e38, −3e38, −3e38]: eager inf/NaN, fused 0) and kept bits eager's float32 cascade
rounds away ([1e8, 1, −1e8]). Exact comparison with eager (NaN/Inf positions), a second
call, outputs independent of each other and of the next call."""
import torch

import opencann

ON = {"enable": ["fuse_elementwise"]}


def _compile(fn, *xs):
    class M(torch.nn.Module):
        def forward(self, *a):
            return fn(*a)
    return opencann.compile(M(), xs, options=ON)


def _special(x):
    x = x.clone()
    x[0, 0], x[0, 1], x[1, 0] = float("nan"), float("inf"), -float("inf")
    return x


def _check(cm, fn, inputs_per_call):
    """Bit-for-bit eager on every call; the first call's outputs survive the second."""
    kept = []
    for xs in inputs_per_call:
        want, got = fn(*xs), cm(*xs)
        want = want if isinstance(want, tuple) else (want,)
        got = got if isinstance(got, tuple) else (got,)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
        kept.append((got, [g.clone() for g in got]))
    for g, c in zip(*kept[0]):
        torch.testing.assert_close(g, c, rtol=0, atol=0, equal_nan=True)
    ptrs = [g.untyped_storage().data_ptr() for g in kept[0][0]]
    assert len(set(ptrs)) == len(ptrs)


def _inputs(seed, big=1e10):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(4, 16, generator=g)
    a[2] *= big                                   # products past float32's max
    return _special(a)


def test_products_overflow_as_eager():
    def fn(a):
        return (a * 1e30) * 1e30 / 1e30, a * 3e38 * 0.5
    cm = _compile(fn, _inputs(0))
    assert "FusedElementwise" in cm.graph.op_counts()
    want = fn(_inputs(1))[0]
    assert want.isinf().sum() > 3                 # overflow happens, not just the inputs' inf
    _check(cm, fn, [(_inputs(1),), (_inputs(2),)])


def test_add_then_sub_rounds_as_eager():
    def fn(a, b):
        return a + b - b, (a - b) + b
    b = torch.full((4, 16), 3e38)
    b[1] = -3e38
    cm = _compile(fn, _inputs(0, 1e37), b)
    assert "FusedElementwise" in cm.graph.op_counts()
    _check(cm, fn, [(_inputs(1, 1e37), b), (_inputs(2, 1e37), b * 0.9)])


def test_float_sums_and_means_run_in_aten_with_a_reason():
    def fn(a, b):
        t = a * 2 - b
        return t.sum(-1), t.mean(-1, keepdim=True)
    rows = torch.tensor([[1.5e38, 1.5e38, -1.5e38, -1.5e38] * 4,   # partial sums overflow
                         [5e7, 0.5, -5e7, 0.0] * 4,                  # float32 drops the 0.5s
                         [1.0] * 16, [2.0] * 16])
    b = torch.zeros(16)
    cm = _compile(fn, rows, b)
    ops = cm.graph.op_counts()
    assert ops.get("FusedElementwise") == 1 and ops.get("ReduceSum") == 1 and ops.get("ReduceMean") == 1
    why = [s["reason"] for s in cm.report.skipped if s["pass"] == "fuse_elementwise"]
    assert any("ReduceSum of float32: eager adds in float32 in ATen's cascade order" in r for r in why), why
    _check(cm, fn, [(rows, b), (_special(torch.randn(4, 16)), torch.randn(16))])


def test_max_and_integer_sums_stay_fused():
    def fn(a, i):
        return (a * 2 - 1).amax(-1), (i * 3 + 1).sum(-1)
    g = torch.Generator().manual_seed(4)
    i = torch.randint(-2**31, 2**31 - 1, (4, 16), generator=g, dtype=torch.int32)
    cm = _compile(fn, _inputs(0), i)
    assert cm.graph.op_counts().get("FusedElementwise") == 2
    assert "ReduceSum" not in cm.graph.op_counts()
    _check(cm, fn, [(_inputs(1), i), (_inputs(2), i // 3)])
