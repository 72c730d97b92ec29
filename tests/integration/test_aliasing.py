"""Aliasing (issue #9, items 1, 3, 4, 8): kernels' aliasing comes from their ATen schemas
or OpDefs and the planner, the in-place rewrites and the runtime follow every alias;
outputs are like eager's: values (NaN positions too), strides, a second call leaves the
first call's results alone, and mutating one output changes another output or an input
exactly when it does in eager. ``check_aliasing`` finds kernels that alias undeclared."""
import pytest
import torch
import torch.nn as nn

import opencann
from opencann.ops import get_op, output_aliases, storage_roots
from opencann.runtime import AliasingError

G = torch.Generator().manual_seed(0)


class Fn(nn.Module):
    """A module whose forward is ``fn(self, *inputs)``."""

    def __init__(self, fn, **mods):
        super().__init__()
        self.fn = fn
        for k, m in mods.items():
            setattr(self, k, m)

    def forward(self, *xs):
        return self.fn(self, *xs)


def _rand_like(x: torch.Tensor, nan: bool) -> torch.Tensor:
    if x.dtype.is_floating_point:
        y = (torch.rand(x.shape, generator=G) + 0.5) * torch.where(
            torch.rand(x.shape, generator=G) < 0.5, -1.0, 1.0)
        y = y.to(x.dtype)
        if nan and y.numel() > 1:
            y.view(-1)[1] = float("nan")
        return y.as_strided(x.shape, x.stride()) if x.is_contiguous() else \
            y.contiguous(memory_format=torch.channels_last)
    return torch.randint(1, 1000, x.shape, generator=G, dtype=x.dtype)


def _flat(o):
    return list(o) if isinstance(o, (tuple, list)) else [o]


def _same(a, b, tol=1e-5):
    assert a.shape == b.shape and a.dtype == b.dtype
    if a.dtype.is_floating_point:
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, equal_nan=True)
    else:
        assert torch.equal(a, b)


def check_like_eager(model, *inputs, device="cpu", nan=True, tol=1e-5, options=None):
    """Compile ``model``; compare with eager on fresh random inputs (a NaN in each float
    input when ``nan``): values, strides, a second call, output/input independence."""
    model.eval()
    cm = opencann.compile(model, inputs, device=device, options=options)
    xs = [_rand_like(x, nan) for x in inputs]
    with torch.no_grad():
        ref = _flat(model(*[x.clone() for x in xs]))
    out = _flat(cm(*[x.clone() for x in xs]))
    assert len(out) == len(ref)
    for a, b in zip(out, ref):
        _same(a, b, tol)
        assert a.stride() == b.stride(), f"strides {a.stride()} vs eager {b.stride()}"
    # a second call leaves the first call's results alone
    keep = [o.clone() for o in out]
    xs2 = [_rand_like(x, nan) for x in inputs]
    with torch.no_grad():
        ref2 = _flat(model(*[x.clone() for x in xs2]))
    out2 = _flat(cm(*[x.clone() for x in xs2]))
    for a, b in zip(out2, ref2):
        _same(a, b, tol)
    for a, b in zip(out, keep):
        _same(a, b, 0)
    # mutating output k changes the other outputs and the inputs exactly as in eager
    for k in range(len(ref)):
        xe, xc = [x.clone() for x in xs], [x.clone() for x in xs]
        with torch.no_grad():
            re = _flat(model(*xe))
        rc = _flat(cm(*xc))
        if not re[k].dtype.is_floating_point and re[k].dtype != torch.int64:
            continue
        be = [t.clone() for t in re + xe]
        bc = [t.clone() for t in rc + xc]
        try:
            re[k].add_(100)
        except RuntimeError:  # an expanded or overlapping view: eager refuses too
            continue
        rc[k].add_(100)
        changed_e = [j for j, (t, b) in enumerate(zip(re + xe, be))
                     if j != k and not torch.equal(t.nan_to_num(), b.nan_to_num())]
        changed_c = [j for j, (t, b) in enumerate(zip(rc + xc, bc))
                     if j != k and not torch.equal(t.nan_to_num(), b.nan_to_num())]
        assert changed_c == changed_e, f"mutating output {k}: changed {changed_c}, eager {changed_e}"
    return cm, out


def _conv(cin, cout, seed):
    torch.manual_seed(seed)
    return nn.Conv2d(cin, cout, 3, padding=1)


# -- item 1: kernels that return views are planned as fresh memory -------------------

def test_issue_view_dtype_host_fallback_not_reused():
    def f(m, x):
        y = x.view(torch.int32) * 2
        z = y.view(torch.int64)
        w = (x + 7) * 3
        return z, w - 1
    x = torch.randint(0, 100, (4, 8), dtype=torch.int64, generator=G)
    cm, _ = check_like_eager(Fn(f), x)
    fb = [n for n in cm.graph.nodes if n.op == "HostFallback"]
    assert fb and all(output_aliases(n) == [(0,)] for n in fb)


def test_view_dtype_returned_directly_survives_next_call():
    check_like_eager(Fn(lambda m, x: ((x * 3).view(torch.int32), x - 1)),
                     torch.randint(0, 100, (4, 8), dtype=torch.int64, generator=G))


@pytest.mark.parametrize("which", ["unfold", "diagonal", "split", "expand", "unbind"])
def test_views_of_intermediates(which):
    """Host-fallback and library views of an intermediate, read after an unrelated
    intermediate of the same size is computed, and returned."""
    view = {"unfold": lambda t: (t.unfold(1, 3, 1),),
            "diagonal": lambda t: (t.diagonal(),),
            "split": lambda t: t.split(2, dim=0),
            "expand": lambda t: (t[:1].expand(3, 8),),
            "unbind": lambda t: t.unbind(0)}[which]

    def f(m, x):
        vs = view(x * 2)
        w = (x + 7) * 3
        return (*vs, w - 1, vs[0].sum() + w.sum())
    check_like_eager(Fn(f), torch.randn(8, 8, generator=G))


def test_elementwise_not_in_place_into_buffer_read_through_host_view():
    def f(m, x):
        t = x * 2
        u = t.unfold(1, 3, 1)        # host fallback, a view of t
        s = torch.neg(t)             # t dies here but u still reads its memory
        return s + 1, u.sum(-1)
    check_like_eager(Fn(f), torch.randn(6, 8, generator=G))


def test_vnpu_transdata_returns_fresh_memory():
    torch.manual_seed(0)
    check_like_eager(nn.Linear(16, 8), torch.randn(12, 16, generator=G),
                     device="vnpu:ascend910b", tol=1e-4)


# -- item 3: CSE merges two graph outputs -------------------------------------------

def test_issue_cse_outputs_are_distinct():
    cm, (a, b) = check_like_eager(Fn(lambda m, x: (x + 1, x + 1)), torch.randn(4, 4, generator=G))
    assert cm.report.passes[0] is not None
    before = b.clone()
    a.add_(100)
    _same(b, before, 0)


def test_merged_views_outputs_are_distinct():
    check_like_eager(Fn(lambda m, x: ((x + 1).view(16), (x + 1).view(16), (x + 1).t())),
                     torch.randn(4, 4, generator=G))


def test_one_tensor_returned_twice_stays_one_tensor():
    """Eager returns the same tensor twice: so does the compiled model."""
    def f(m, x):
        a = x * 2
        return a, a, a.view(16)
    _, (a, b, c) = check_like_eager(Fn(f), torch.randn(4, 4, generator=G))
    a.add_(1)
    _same(b, a, 0)
    _same(c, a.view(16), 0)


def test_views_of_input_alias_the_input_like_eager():
    check_like_eager(Fn(lambda m, x: (x.view(16), x.t(), x * 2)), torch.randn(4, 4, generator=G))


def test_weight_outputs_cannot_corrupt_the_compiled_model():
    """A view of a weight aliases the weight in eager; the compiled model's constants are
    its own, so what it returns is a copy a caller may change freely."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    m = Fn(lambda m, x: (m.lin(x), m.lin.weight.t(), m.lin.bias), lin=lin).eval()
    x = torch.randn(2, 4, generator=G)
    cm = opencann.compile(m, (x,))
    with torch.no_grad():
        ref = m(x)
    y, wt, b = cm(x)
    assert wt.stride() == ref[1].stride()
    wt.add_(100)
    b.add_(100)
    y2, wt2, b2 = cm(x)
    _same(y2, ref[0])
    _same(wt2, ref[1])
    _same(b2, ref[2])


# -- item 4: in-place Conv+Add into a value whose views are read later ---------------

@pytest.mark.parametrize("later", ["transpose", "view_of_view", "split", "returned_view"])
def test_issue_conv_add_not_in_place_when_a_view_is_read_later(later):
    def f(m, x):
        r = m.a(x)
        if later == "transpose":
            rt = r.transpose(2, 3)
            return torch.relu(m.b(x) + r) + rt
        if later == "view_of_view":
            rt = r.transpose(2, 3)[:, 1:][..., 2:]      # a view of a view of a view
            return (torch.relu(m.b(x) + r)[:, 1:, :, 2:] + rt,)
        if later == "split":
            r1, r2 = r.split(2, dim=1)
            y = torch.relu(m.b(x) + r)
            return y[:, :2] * r1 + r2.sum()
        return torch.relu(m.b(x) + r), r.view(2, -1)
    m = Fn(f, a=_conv(4, 4, 1), b=_conv(4, 4, 2))
    # nan=False: oneDNN's fused ReLU post-op maps NaN to 0 (eager keeps NaN), a separate fault
    cm, _ = check_like_eager(m, torch.randn(2, 4, 8, 8, generator=G), tol=1e-4, nan=False)
    fused = [n for n in cm.graph.nodes if n.op == "ConvAddAct"]
    assert fused and not any(n.attrs.get("inplace") for n in fused)
    assert any((s["pass"], s["detail"]) == ("fuse_conv_add_act", "in place") for s in cm.report.skipped)


def test_conv_add_still_in_place_when_the_addend_dies():
    m = Fn(lambda m, x: torch.relu(m.b(x) + m.a(x)), a=_conv(4, 4, 1), b=_conv(4, 4, 2))
    cm, _ = check_like_eager(m, torch.randn(2, 4, 8, 8, generator=G), tol=1e-4, nan=False)
    assert any(n.op == "ConvAddAct" and n.attrs.get("inplace") for n in cm.graph.nodes)


# -- item 8: outputs have eager's strides --------------------------------------------

def test_issue_conv_output_strides_and_view_of_returned_activation():
    torch.manual_seed(0)

    def f(m, x):
        f_ = torch.relu(m.c(x)) * 0.5
        return m.fc(f_.view(x.shape[0], -1)), f_
    m = Fn(f, c=_conv(3, 8, 3), fc=nn.Linear(8 * 8 * 8, 4))
    _, (y, feat) = check_like_eager(m, torch.randn(2, 3, 8, 8, generator=G), tol=1e-4,
                                    nan=False)  # oneDNN's fused ReLU maps NaN to 0
    assert feat.view(2, -1).shape == (2, 512)


@pytest.mark.parametrize("tail", ["none", "relu", "mul", "add_input"])
def test_conv_model_outputs_are_nchw_like_eager(tail):
    def f(m, x):
        y = m.c(x)
        y = {"none": y, "relu": torch.relu(y), "mul": y * 0.5, "add_input": y + x}[tail]
        return y
    _, (y,) = check_like_eager(Fn(f, c=_conv(4, 4, 4)), torch.randn(2, 4, 8, 8, generator=G),
                               tol=1e-4, nan=tail != "relu")  # oneDNN's fused ReLU: NaN -> 0
    assert y.view(2, -1).shape == (2, 256)


def test_channels_last_example_keeps_channels_last_like_eager():
    x = torch.randn(2, 4, 8, 8, generator=G).contiguous(memory_format=torch.channels_last)
    check_like_eager(Fn(lambda m, x: (torch.relu(x) * 2, m.c(x) + 1), c=_conv(4, 4, 5)), x, tol=1e-4)


@pytest.mark.parametrize("kind", ["conv_bn_relu", "conv_add_residual", "conv_conv"])
def test_vnpu_channels_last_outputs_keep_eagers_strides(kind):
    """The TransData back to the origin format stands for the traced value: it keeps
    eager's (channels-last) strides, so views behave as in eager."""
    torch.manual_seed(0)
    mods = {"conv_bn_relu": lambda m, x: torch.relu(m.bn(m.c(x))),
            "conv_add_residual": lambda m, x: m.c(x) + x,
            "conv_conv": lambda m, x: m.d(m.c(x))}
    bn = nn.BatchNorm2d(4).eval()
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
    m = Fn(mods[kind], c=_conv(4, 4, 1), d=_conv(4, 4, 2), bn=bn)
    x = torch.randn(2, 4, 6, 6, generator=G).contiguous(memory_format=torch.channels_last)
    _, (y,) = check_like_eager(m, x, device="vnpu:ascend910b", tol=1e-4,
                               nan=kind == "conv_add_residual")
    with torch.no_grad():
        want = m(x)
    assert y.stride() == want.stride() == (144, 1, 24, 4)
    with pytest.raises(RuntimeError):   # not viewable as (2, -1): eager refuses too
        want.view(2, -1)
    with pytest.raises(RuntimeError):
        y.view(2, -1)
    assert y.permute(0, 2, 3, 1).view(2, -1).shape == want.permute(0, 2, 3, 1).view(2, -1).shape


# -- the aliasing facts and the debug check ------------------------------------------

def test_aliasing_facts_from_schemas_and_opdefs():
    assert all(any(get_op(n).aliases) for n in ("Reshape", "UnsafeReshape", "SplitV", "Transpose",
                                                 "BroadcastTo", "AsStrided", "Alias"))
    for name in ("Add", "Cast", "Identity", "ConcatD", "ConvBiasAct", "LinearAct", "TransData",
                 "FlashAttention"):
        assert not any(get_op(name).aliases), name
    assert get_op("HostFallback").aliases is None   # unknown: per node from its ATen schema
    for o in opencann.ops.all_ops():
        if o.kind == opencann.ops.OpKind.VIEW:
            assert o.aliases and all(o.aliases), f"{o.name} is a view but declares fresh outputs"


def test_unknown_aliasing_means_may_alias():
    from opencann.ir import DataType, Graph, TensorDesc, TensorRef
    g = Graph("t")
    a = g.add_input(TensorDesc((4,), DataType.FLOAT))
    b = g.add_input(TensorDesc((4,), DataType.FLOAT))
    n = g.create_node("HostFallback", [a, b], {"self": TensorRef(0), "other": TensorRef(1)},
                      [TensorDesc((4,), DataType.FLOAT)])
    assert output_aliases(n) == [(0, 1)]          # no schema: every input
    assert storage_roots(g)[n.outputs[0].id] == {a.id, b.id}


def test_check_aliasing_names_an_undeclared_view(monkeypatch):
    """A kernel that returns a view while its op is declared fresh is caught at run time."""
    def factory(node, in_descs, consts):
        return lambda x: x.view(x.shape)          # Neg that "forgot" to compute
    monkeypatch.setitem(opencann.ops.get_op("Neg").kernel_factories, "cpu", factory)
    m = Fn(lambda m, x: (-(x * 2), x * 3))
    x = torch.randn(4, 4, generator=G)
    cm = opencann.compile(m, (x,), options={"check_aliasing": True})
    with pytest.raises(AliasingError, match=r"check_aliasing: neg .*\(Neg\).*does not declare"):
        cm(x)
    monkeypatch.setenv("OPENCANN_CHECK_ALIASING", "1")
    with pytest.raises(AliasingError, match="Neg"):
        opencann.compile(m, (x,))(x)


def test_check_aliasing_passes_on_declared_aliasing():
    r"""Views, host-fallback views, in-place reuse and Conv+Add in place are declared."""
    def f(m, x):
        t = x * 2
        u = t.view(torch.int32)
        s = torch.relu(t).transpose(2, 3) + 1
        return torch.relu(m.b(x) + m.a(x)) + s, u.sum()
    m = Fn(f, a=_conv(4, 4, 1), b=_conv(4, 4, 2))
    check_like_eager(m, torch.randn(2, 4, 8, 8, generator=G), tol=1e-4, nan=False,
                     options={"check_aliasing": True})


def test_check_aliasing_option_is_validated():
    with pytest.raises(ValueError, match="check_aliasing"):
        opencann.compile(Fn(lambda m, x: x + 1), (torch.randn(2),), options={"check_aliasing": 1})


@pytest.mark.parametrize("fused", ["conv", "conv_relu", "conv_add", "linear"])
def test_fused_outputs_keep_eager_strides(fused):
    """A fused node stands for the node whose output it replaces: it keeps that node's
    traced strides (a channels-last conv output stays channels-last, as in eager)."""
    x = torch.randn(2, 4, 8, 8, generator=G).contiguous(memory_format=torch.channels_last)
    f = {"conv": lambda m, x: m.a(x),
         "conv_relu": lambda m, x: torch.relu(m.a(x)),
         "conv_add": lambda m, x: m.a(x) + m.b(x),
         "linear": lambda m, x: torch.relu(m.fc(x))}[fused]
    torch.manual_seed(0)
    m = Fn(f, a=_conv(4, 4, 1), b=_conv(4, 4, 2), fc=nn.Linear(8, 3))
    check_like_eager(m, x, tol=1e-4, nan=False)


def _tiny_graph():
    from opencann.ir import DataType, Graph, TensorDesc, TensorRef
    g = Graph("t")
    d = TensorDesc((4,), DataType.FLOAT)
    x = g.add_input(d, "x")
    y = g.create_node("Relu", [x], {"self": TensorRef(0)}, [d], name="relu").outputs[0]
    z = g.create_node("Neg", [y], {"self": TensorRef(0)}, [d], name="neg").outputs[0]
    return g, x, y, z, TensorRef


def test_outputs_merged_with_an_input_or_each_other_are_copied():
    from opencann.runtime.executor import independent_outputs
    g, x, y, z, _ = _tiny_graph()
    g.outputs = [x, y, y, z, z]
    # eager: output 0 was fresh (say, a clone a pass removed), 1 and 2 distinct tensors,
    # 3 and 4 one tensor returned twice
    g.signature = g.signature.replace(output_storage=(
        frozenset({-1}), frozenset({-2}), frozenset({-3}), frozenset({z.id}), frozenset({z.id})))
    assert independent_outputs(g) == [0, 2]


def test_planner_refuses_a_declared_write_into_memory_read_later():
    from opencann.passes import plan_memory
    g, x, y, z, TensorRef = _tiny_graph()
    w = g.create_node("Neg", [y, z], {"self": TensorRef(0), "inplace_input": 0}, [y.desc],
                      name="bad").outputs[0]
    g.create_node("Add", [w, y], {"self": TensorRef(0), "other": TensorRef(1)}, [y.desc])
    g.outputs = [g.nodes[-1].outputs[0]]
    with pytest.raises(ValueError, match="bad .* writes in place into .* still read afterwards"):
        plan_memory(g)


@pytest.mark.parametrize("causal,mask", [(True, False), (False, True), (False, False)])
def test_torch_compile_attention_output_has_eager_strides(causal, mask):
    """Under torch.compile, SDPA reaches the backend as the CPU flash kernel, whose
    decomposition returned (L, B, H, D)-ordered strides; it is kept whole now."""
    import torch.nn.functional as F

    class Attn(torch.nn.Module):
        def forward(self, q, k, v, m):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m if mask else None,
                                                  is_causal=causal)

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4) for _ in range(3))
    m = torch.randn(5, 5)
    model = Attn()
    fast = torch.compile(model, backend="opencann", dynamic=False)
    for _ in range(2):
        want, got = model(q, k, v, m), fast(q, k, v, m)
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert got.view(2, -1).shape == (2, 60)


def test_merged_outputs_keep_eagers_sharing_among_themselves():
    """`return v3, v2, v2` with v2 and v3 merged by CSE: outputs 1 and 2 are one tensor
    (as in eager), output 0 is separate (found by the fuzzer, seed 50114)."""
    class M(nn.Module):
        def forward(self, x0, x1):
            v2 = x0 - x1
            v3 = x0 - x1
            return v3, v2, v2

    x0 = torch.randn(2, 4, 5).to(torch.float16)
    x1 = torch.randint(-8, 9, (2, 4, 5), dtype=torch.int32)
    for cm in (opencann.compile(M(), (x0, x1)), opencann.compile(M(), (x0, x1), device="vnpu:ascend910b")):
        a, b, c = cm(x0, x1)
        e = M()(x0, x1)
        for got, want in zip((a, b, c), e):
            torch.testing.assert_close(got, want)
        assert b is c or b.data_ptr() == c.data_ptr()
        assert a.data_ptr() != b.data_ptr()
        b.add_(100)
        torch.testing.assert_close(c, b)
        torch.testing.assert_close(a, e[0])


_MUTATED_VIEWS = {"select": lambda x: x[0].add_(1), "slice": lambda x: x.mul_(2)[1:],
                  "three": lambda x: (x.add_(1), x.view(2, 12), x[0]),
                  "transpose": lambda x: x.add_(1).t()}


@pytest.mark.parametrize("kind", sorted(_MUTATED_VIEWS))
def test_views_of_a_mutated_input_are_views_of_the_callers_tensor(kind, tmp_path):
    """In eager the returned views share memory with the mutated input: so do ours
    (values, strides, offsets, a second call, writes through the view reach the input),
    also after a model file round trip."""
    m = Fn(lambda m, x: _MUTATED_VIEWS[kind](x)).eval()
    x = torch.randn(2, 12, generator=G)
    cm = opencann.compile(m, (x.clone(),))
    opencann.save(cm, str(tmp_path / "m.ocm"))
    for c in (cm, cm, opencann.load(str(tmp_path / "m.ocm"))):
        xs = torch.randn(2, 12, generator=G)
        a, b = xs.clone(), xs.clone()
        want, got = _flat(m(a)), _flat(c(b))
        assert torch.equal(a, b)
        for g, w in zip(got, want):
            assert torch.equal(g, w) and g.stride() == w.stride()
            assert g.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            assert g.storage_offset() - b.storage_offset() == w.storage_offset() - a.storage_offset()
        got[-1].add_(100)
        want[-1].add_(100)
        assert torch.equal(a, b)


def test_view_of_a_mutated_non_contiguous_input_is_a_copy_with_eagers_values():
    """A caller's tensor laid out otherwise than the traced one: the view cannot be
    rebuilt on it, the output is a copy (documented), values and input as in eager."""
    m = Fn(lambda m, x: x[0].add_(1)).eval()
    cm = opencann.compile(m, (torch.randn(2, 12, generator=G),))
    xs = torch.randn(12, 2, generator=G).t()
    a, b = xs.clone(memory_format=torch.preserve_format), xs.t().clone().t()
    want, got = m(a), cm(b)
    assert torch.equal(got, want) and torch.equal(a, b)


@pytest.mark.parametrize("device", ["cpu", "vnpu:ascend910b"])
def test_outputs_keep_eagers_strides_after_in_place_ops_on_views(device):
    """An in-place op on a transposed view of an intermediate, then the base used:
    decomposition (functionalization) re-derives the base as a permute of a contiguous
    clone, so the decomposed graph's strides are (1, 2) where eager's are (2, 1); the
    outputs get eager's (found by the fuzzer, seed 70116)."""
    import torch.nn.functional as F

    class M(nn.Module):
        def forward(self, x0):
            v1 = x0.transpose(-1, -2) @ x0
            v2 = v1.T
            v2.masked_fill_(v2 > 0, -2.0)
            return F.hardswish(v1), v1 * 2

    torch.manual_seed(0)
    x = torch.randn(3, 2)
    cm = opencann.compile(M(), (x,), device=device)
    first = None
    for i in range(2):
        xi = torch.randn(3, 2)
        got, want = cm(xi), M()(xi)
        for g, w in zip(got, want):
            assert g.stride() == w.stride()
            torch.testing.assert_close(g, w)
            assert g.view(-1).shape == w.view(-1).shape
        if first is None:
            first, keep = got, [t.clone() for t in got]
    for a, b in zip(first, keep):
        torch.testing.assert_close(a, b)   # the second call left the first's results alone
