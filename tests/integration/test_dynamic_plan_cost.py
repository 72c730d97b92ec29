"""What a new shape of a dynamic model costs (#12, item 4): no GEMM weight repacked per
shape (a GEMM packed at the first shape runs addmm at the others), one generated source
for every shape (compiled once), values still matching eager."""
import torch

import opencann
from opencann.engine.dynamic import pin_kernel_choices
from opencann.ops.kernels import cpu as cpu_kernels
from opencann.ir.specialise import specialise


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) + x


def _compile():
    torch.manual_seed(0)
    m = MLP().eval()
    cm = opencann.compile(m, (torch.randn(2, 5, 32),),
                          dynamic_shapes={"x": {0: "batch", 1: "seq"}},
                          dim_ranges={"batch": (1, 8), "seq": (2, 64)})
    return m, cm


def test_a_packed_gemm_runs_addmm_at_other_shapes():
    _, cm = _compile()
    bound = specialise(cm.graph, dict(zip(cm.binder.order, (3, 7))))
    gemms = [n for n in bound.nodes if "kernel" in n.meta]
    assert gemms
    for n in gemms:
        n.meta["kernel"] = "mkl_packed"      # as if measured faster at the first shape
    assert pin_kernel_choices(cm.graph, bound) == (len(gemms), len(gemms))
    names = {n.name for n in gemms}
    assert all(n.meta["kernel"] == "addmm" for n in cm.graph.nodes if n.name in names)


def _three_shapes(m, cm):
    """Runs three shapes, each against eager and twice; returns their pools."""
    for b, t in ((1, 9), (4, 33), (2, 5)):
        x = torch.randn(b, t, 32)
        with torch.no_grad():
            ref = m(x)
        out = cm(x)
        assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5
        assert torch.equal(cm(x), out)                  # a second call
    pools = [cm.plans._pools[k] for k in cm.plans.keys()]
    assert len(pools) == 3
    return pools


def test_every_shape_generates_one_source_and_matches_eager(monkeypatch):
    # one GEMM kernel everywhere: the race's winners differ per host and load (below)
    monkeypatch.setattr(cpu_kernels, "_available", lambda kernel, *a, **k: kernel == "addmm")
    pools = _three_shapes(*_compile())
    srcs = {p.first._src for p in pools}
    codes = {id(p.first._code) for p in pools}
    assert len(srcs) == 1 and len(codes) == 1


def test_shapes_whose_gemms_return_alike_share_one_source_whatever_the_race_chose():
    """The GEMM race may choose per shape (a GEMV pinned at a few rows is raced again at
    more, `pin_kernel_choices`); a kernel returning its own allocation (oneDNN's, MKL's
    packed: `FRESH_RESULT_KERNELS`) is emitted differently from one writing a planned
    buffer, and that alone gives a shape another source."""
    pools = _three_shapes(*_compile())
    def fresh(p):
        return tuple(n.meta.get("kernel") in cpu_kernels.FRESH_RESULT_KERNELS
                     for n in p.graph.nodes if "kernel" in n.meta)
    assert len({p.first._src for p in pools}) == len({fresh(p) for p in pools})


class Attention(torch.nn.Module):
    """Projection, per-head SDPA, projection: views sized from the input (size args)."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.heads, self.qkv, self.o = heads, torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return torch.nn.functional.layer_norm(self.o(a.transpose(1, 2).reshape(b, t, d)) + x, (d,))


def _attention():
    torch.manual_seed(0)
    m = Attention().eval()
    cm = opencann.compile(m, (torch.randn(2, 6, 16),),
                          dynamic_shapes={"x": {0: "batch", 1: "seq"}},
                          dim_ranges={"batch": (1, 8), "seq": (2, 64)})
    return m, cm


def test_a_new_shape_reuses_the_order_and_the_kernel_proofs(monkeypatch):
    """After the first shape, a new shape runs no schedule search and no fast-call proof
    (counted), and its values are eager's (random inputs, NaN positions, second call)."""
    from opencann.passes import schedule_order
    from opencann.runtime import fast_call
    m, cm = _attention()
    calls = {"order": 0, "proof": 0}
    real_order, real_proof = schedule_order.memory_aware_order, fast_call.fast_callable

    def order(*a, **k):
        calls["order"] += 1
        return real_order(*a, **k)

    def proof(*a, **k):
        calls["proof"] += 1
        return real_proof(*a, **k)
    monkeypatch.setattr(schedule_order, "memory_aware_order", order)
    monkeypatch.setattr(fast_call, "fast_callable", proof)
    for b, t in ((3, 9), (5, 31), (2, 17)):
        x = torch.randn(b, t, 16)
        x[b - 1, t // 2, 3] = float("nan")
        with torch.no_grad():
            ref = m(x)
        out = cm(x)
        assert torch.equal(out.isnan(), ref.isnan())
        assert (out - ref).nan_to_num().abs().max().item() < 1e-4
        torch.testing.assert_close(cm(x), out, rtol=0, atol=0, equal_nan=True)   # second call
    assert calls == {"order": 0, "proof": 0}
    assert cm.plans.misses == 3
    ratios = [p["arena_over_lower_bound"] for p in cm.report.dynamic["plans"]]
    assert len(ratios) == 4 and max(ratios) <= 1.02


def test_kernels_proven_at_one_shape_are_the_ones_proven_at_another():
    """`fast_callable_keyed` (ints by type for value_free overloads) binds, at a second
    shape, exactly what a fresh proof at that shape's values binds, node by node."""
    from opencann.ops import call_args, get_op
    from opencann.runtime import fast_call
    from opencann.runtime.codegen import _fast
    _, cm = _attention()
    assert fast_call.value_free(torch.ops.aten.view.default)
    assert not fast_call.value_free(torch.ops.aten.reshape.default)   # a composite
    g = specialise(cm.graph, dict(zip(cm.binder.order, (4, 23))))
    checked = 0
    for n in g.nodes:
        aten = get_op(n.op).aten or n.meta.get("aten")
        if aten is None or get_op(n.op).kernel(n.device) not in (None, aten):
            continue
        metas = [torch.empty(v.desc.shape, dtype=v.desc.dtype.torch, device="meta")
                 for v in n.inputs]
        args, kwargs = call_args(n, metas)
        assert _fast(n, aten) is fast_call.fast_callable(aten, args, kwargs), n.name
        checked += 1
    assert checked >= 5
