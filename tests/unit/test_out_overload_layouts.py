"""The audit behind `OpDef.out_contiguous`: every op whose ATen ``.out`` overload the
runtime calls (an op with ``out_kernel``), against its functional overload, at strided
operands.

The executor calls ``.out`` overloads on whatever views reach a node (a transposed
activation, a strided slice, an expanded or offset view) and writes into planned buffers
in the traced layout, trusting every ``.out`` kernel to take any strides as the functional
one does. For each op: random inputs (NaN included) laid out transposed (dims reversed),
with dims 0 and 1 swapped, every other element, at a storage offset, expanded (stride 0)
or channels-last, all operands at once and each alone, written into buffers in the
traced layout (the meta kernel's strides: what the runtime plans), contiguous,
channels-last and dims-reversed. A case fails when the ``.out`` result differs from the
functional one on the same operands. Found on torch 2.13 (CPU): BatchNorm's no-stats
overload (BNTrainingUpdateNoStats) on any non-contiguous input or into a non-contiguous
buffer; softmax, log-softmax, their gradients and GELU into a non-contiguous buffer
(ops/library.py's ``_OUT_CONTIGUOUS`` holds the evidence).

Run as a script to print every op's result without the rule (``python
tests/unit/test_out_overload_layouts.py [op-name-substring ...]``).
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import pytest
import torch

from opencann.ops import all_ops, get_op, out_buffers_fit, out_contiguous_inputs

aten = torch.ops.aten
NAN = float("nan")
_G = torch.Generator()


def _f(*shape, nan=True, pos=False, dtype=torch.float32):
    """Normal values (one NaN at flat index 1 unless ``nan=False``; |x| + 0.1 with ``pos``)."""
    t = torch.randn(*shape, generator=_G)
    if pos:
        t = t.abs() + 0.1
    if nan and t.numel() > 2:
        t.view(-1)[1] = NAN
    return t.to(dtype)


def _i(hi, *shape):
    return torch.randint(0, hi, shape, generator=_G)


def _b(*shape):
    return torch.rand(*shape, generator=_G) > 0.5


X = (2, 6, 5, 3)      # the default operand: 4-D, so channels-last layouts apply


def _ln_grad():
    x = _f(4, 5, 6, nan=False)
    _, mean, rstd = aten.native_layer_norm(x, [6], None, None, 1e-5)
    return (_f(4, 5, 6), x, [6], mean, rstd, _f(6), _f(6), [True, True, True]), {}


def _bn_grad_train():
    x = _f(*X, nan=False)
    _, mean, invstd = aten._native_batch_norm_legit.no_stats(x, None, None, True, 0.1, 1e-5)
    return (_f(*X), x, _f(6), None, None, mean, invstd, True, 1e-5, [True, True, True]), {}


def _max_pool_grad():
    x = _f(2, 3, 8, 8, nan=False)
    _, idx = aten.max_pool2d_with_indices(x, [2, 2], [2, 2])
    return (_f(2, 3, 4, 4), x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx), {}


def _samples() -> Dict[str, Callable[[], Tuple[tuple, dict]]]:
    """Op name (or "name/variant") -> a builder of the functional overload's (args, kwargs)."""
    s: Dict[str, Callable] = {}
    for n in ("Neg", "Abs", "Exp", "Log", "Sqrt", "Rsqrt", "Reciprocal", "Sin", "Cos", "Floor",
              "Sign", "Round", "Relu", "Gelu", "Sigmoid", "Tanh", "Erf", "Swish", "HardSigmoid",
              "HardSwish", "IsNan", "LogicalNot", "Identity"):
        s[n] = lambda: ((_f(*X),), {})
    for n in ("Add", "Sub", "Mul", "Div", "PowTensor", "Maximum", "Minimum", "Equal", "NotEqual",
              "Less", "LessEqual", "Greater", "GreaterEqual", "LogicalAnd", "LogicalOr"):
        s[n] = lambda: ((_f(*X), _f(*X)), {})
    for n in ("Adds", "Subs", "RSub", "Muls", "Divs", "Equals", "NotEquals", "Lesss", "LessEquals",
              "Greaters", "GreaterEquals", "Fill"):
        s[n] = lambda: ((_f(*X), 0.5), {})
    for n in ("BitwiseAnd", "BitwiseOr"):
        s[n] = lambda: ((_i(100, *X), _i(100, *X)), {})
    s["BitwiseNot"] = lambda: ((_i(100, *X),), {})
    s.update({
        "Pow": lambda: ((_f(*X), 3.0), {}), "HardTanh": lambda: ((_f(*X), -0.5, 0.75), {}),
        "LeakyRelu": lambda: ((_f(*X), 0.1), {}), "ClipByValue": lambda: ((_f(*X), -0.5, 0.5), {}),
        "ClampTensor": lambda: ((_f(*X), _f(*X) - 1, _f(*X) + 1), {}),
        "Select": lambda: ((_b(*X), _f(*X), _f(*X)), {}),
        "Addcmul": lambda: ((_f(*X), _f(*X), _f(*X)), {"value": 0.5}),
        # reductions, softmax, norms
        "ReduceSum": lambda: ((_f(*X), [1]), {}), "ReduceSumAll": lambda: ((_f(*X),), {}),
        "ReduceMean": lambda: ((_f(*X), [1]), {}), "ReduceMax": lambda: ((_f(*X), [1]), {}),
        "ReduceMin": lambda: ((_f(*X), [1]), {}), "ReduceAny": lambda: ((_b(*X), 1), {}),
        "ReduceAll": lambda: ((_b(*X), 1), {}), "ArgMaxD": lambda: ((_f(*X, nan=False), 1), {}),
        "ArgMinD": lambda: ((_f(*X, nan=False), 1), {}),
        "ReduceVar": lambda: ((_f(*X), [1]), {"correction": 1}), "Cumsum": lambda: ((_f(*X), 1), {}),
        "SoftmaxV2": lambda: ((_f(*X), 1, False), {}), "LogSoftmaxV2": lambda: ((_f(*X), 1, False), {}),
        "LayerNorm": lambda: ((_f(4, 5, 6), [6], _f(6), _f(6), 1e-5), {}),
        "BatchNorm": lambda: ((_f(*X), _f(6), _f(6), _f(6), _f(6, pos=True), 0.1, 1e-5), {}),
        "BNTrainingUpdateNoStats": lambda: ((_f(*X), _f(6), _f(6), True, 0.1, 1e-5), {}),
        "BNTrainingUpdateNoStats/2d": lambda: ((_f(8, 6), None, None, True, 0.1, 1e-5), {}),
        "BNTrainingUpdateNoStats/3d": lambda: ((_f(3, 6, 5), _f(6), None, True, 0.1, 1e-5), {}),
        "GroupNorm": lambda: ((_f(2, 6, 4, 4), _f(6), _f(6), 2, 6, 16, 3, 1e-5), {}),
    })
    s.update(_more_samples())
    return s


def _more_samples() -> Dict[str, Callable]:
    """Pooling, data movement, gradients, GEMMs, convolution, dropout, resizing."""
    s: Dict[str, Callable] = {
        "MaxPoolWithArgmax": lambda: ((_f(2, 3, 8, 8), [2, 2], [2, 2]), {}),
        "AvgPool": lambda: ((_f(2, 3, 8, 8), [2, 2], [2, 2]), {}),
        "AdaptiveAvgPool2d": lambda: ((_f(2, 3, 8, 8), [3, 3]), {}),
        "Embedding": lambda: ((_f(10, 4), _i(10, 3, 5)), {}),
        "GatherElements": lambda: ((_f(4, 5), 1, _i(5, 4, 3)), {}),
        "Index": lambda: ((_f(5, 6), [_i(5, 4, 3)]), {}),
        "IndexSelect": lambda: ((_f(5, 6), 1, _i(6, 4)), {}),
        "ConcatD": lambda: (([_f(4, 5), _f(4, 3)], 1), {}), "Pack": lambda: (([_f(4, 5), _f(4, 5)], 0), {}),
        "PadV3": lambda: ((_f(4, 5), [1, 2], 0.5), {}), "Tile": lambda: ((_f(4, 5), [2, 1]), {}),
        "Triu": lambda: ((_f(5, 6), 0), {}), "Tril": lambda: ((_f(5, 6), 1), {}),
        "ReluGrad": lambda: ((_f(*X), _f(*X), 0.0), {}), "GeluGrad": lambda: ((_f(*X), _f(*X)), {}),
        "TanhGrad": lambda: ((_f(*X), _f(*X)), {}), "SigmoidGrad": lambda: ((_f(*X), _f(*X)), {}),
        "SwishGrad": lambda: ((_f(*X), _f(*X)), {}),
        "DropOutDoMaskGrad": lambda: ((_f(*X), _b(*X), 2.0), {}),
        "SoftmaxGrad": lambda: ((_f(*X), _f(*X), 1, torch.float32), {}),
        "LogSoftmaxGrad": lambda: ((_f(*X), _f(*X), 1, torch.float32), {}),
        "LayerNormGrad": _ln_grad, "BatchNormGrad": _bn_grad_train,
        "BatchNormGrad/eval": lambda: ((_f(*X), _f(*X), _f(6), _f(6), _f(6, pos=True), None, None,
                                        False, 1e-5, [True, True, True]), {}),
        "MaxPoolGradWithArgmax": _max_pool_grad,
        "AvgPoolGrad": lambda: ((_f(2, 3, 4, 4), _f(2, 3, 8, 8), [2, 2], [2, 2], [0, 0], False, True,
                                 None), {}),
        "AdaptiveAvgPool2dGrad": lambda: ((_f(2, 3, 3, 3), _f(2, 3, 8, 8)), {}),
        "EmbeddingDenseGrad": lambda: ((_f(3, 5, 4), _i(10, 3, 5), 10, -1, False), {}),
        "MatMul": lambda: ((_f(4, 5), _f(5, 6)), {}), "BatchMatMul": lambda: ((_f(3, 4, 5), _f(3, 5, 6)), {}),
        "MatMulV2": lambda: ((_f(6), _f(4, 5), _f(5, 6)), {}),
        "Conv2D": lambda: ((_f(2, 3, 6, 6), _f(4, 3, 3, 3), _f(4), [1, 1], [1, 1], [1, 1], False,
                            [0, 0], 1), {}),
        "Conv2DBackprop": lambda: ((_f(2, 4, 6, 6), _f(2, 3, 6, 6), _f(4, 3, 3, 3), [4], [1, 1], [1, 1],
                                    [1, 1], False, [0, 0], 1, [True, True, True]), {}),
        "Dropout": lambda: ((_f(*X), 0.5, True), {}),
        "ResizeNearestNeighborV2Vec": lambda: ((_f(2, 3, 4, 4), [7, 7], None), {}),
        "ResizeBilinearV2Vec": lambda: ((_f(2, 3, 4, 4), [7, 7], True, None), {}),
    }
    for n, k in (("UpsampleNearest1d", 1), ("UpsampleNearestExact1d", 1), ("ResizeNearestNeighborV2", 2),
                 ("UpsampleNearestExact2d", 2), ("UpsampleNearest3d", 3), ("UpsampleNearestExact3d", 3)):
        s[n] = (lambda k: lambda: ((_f(2, 3, *[4] * k), [7] * k), {}))(k)
    for n, k in (("UpsampleLinear1d", 1), ("ResizeBilinearV2", 2), ("ResizeBicubic", 2),
                 ("UpsampleTrilinear3d", 3), ("UpsampleBilinear2dAA", 2), ("UpsampleBicubic2dAA", 2)):
        s[n] = (lambda k: lambda: ((_f(2, 3, *[4] * k), [7] * k, False), {}))(k)
    return s


SAMPLES = _samples()


# -- operand layouts (same values, other strides; None: not applicable) -----------------
def _reversed(t):
    if t.dim() < 2:
        return None
    p = list(range(t.dim()))[::-1]
    return t.permute(p).contiguous().permute(p)


def _swap01(t):
    return None if t.dim() < 2 else t.transpose(0, 1).contiguous().transpose(0, 1)


def _every_other(t):
    if t.dim() == 0:
        return None
    base = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    base[..., ::2] = t
    return base[..., ::2]


def _offset(t):
    base = torch.zeros(t.numel() + 3, dtype=t.dtype)
    base[3:] = t.reshape(-1)
    return base[3:].view(t.shape)


def _expanded(t):   # other values: the last dim broadcast from its first element
    return None if t.dim() == 0 or t.shape[-1] < 2 else t.narrow(-1, 0, 1).expand(t.shape)


def _channels_last(t):
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else None


IN_LAYOUTS = {"contiguous": lambda t: t, "reversed": _reversed, "swap01": _swap01,
              "every-other": _every_other, "offset": _offset, "expanded": _expanded,
              "channels-last": _channels_last}
OUT_LAYOUTS = ("traced", "contiguous", "channels-last", "reversed")


def _meta(a):
    if isinstance(a, torch.Tensor):
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
    if isinstance(a, (list, tuple)):
        return type(a)(_meta(y) for y in a)
    return a


def _tuple(r) -> tuple:
    return tuple(r) if isinstance(r, (tuple, list)) else (r,)


def _buffer(ref: torch.Tensor, traced: Optional[tuple], layout: str) -> torch.Tensor:
    """An output buffer of ``ref``'s shape and dtype in ``layout``."""
    if layout == "traced" and traced is not None:
        return torch.empty_strided(ref.shape, traced, dtype=ref.dtype)
    if layout == "channels-last" and ref.dim() == 4:
        return torch.empty(ref.shape, dtype=ref.dtype).contiguous(memory_format=torch.channels_last)
    if layout == "reversed" and ref.dim() >= 2:
        return torch.empty(ref.shape[::-1], dtype=ref.dtype).permute(list(range(ref.dim()))[::-1])
    return torch.empty(ref.shape, dtype=ref.dtype)


def _tensor_slots(args) -> List[Tuple[int, Optional[int]]]:
    """(argument index, list index or None) of every tensor among ``args``."""
    out = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            out.append((i, None))
        elif isinstance(a, (list, tuple)):
            out.extend((i, j) for j, y in enumerate(a) if isinstance(y, torch.Tensor))
    return out


def _relayout(args, slots, fn) -> Optional[list]:
    """``args`` with the tensors at ``slots`` re-laid out by ``fn`` (one that does not
    apply is left as is, unless it is the only one: None)."""
    args = [list(a) if isinstance(a, (list, tuple)) else a for a in args]
    for i, j in slots:
        t = fn(args[i] if j is None else args[i][j])
        if t is None:
            if len(slots) == 1:
                return None
            continue
        if j is None:
            args[i] = t
        else:
            args[i][j] = t
    return args


def _cases(key: str) -> Iterator[Tuple[str, list, dict]]:
    """(label, args, kwargs) of ``key``'s sample at every operand layout, all tensors at
    once and each alone."""
    _G.manual_seed(sum(map(ord, key)))
    args, kw = SAMPLES[key]()
    schema = [a.name for a in get_op(key.split("/")[0]).aten._schema.arguments]
    slots = _tensor_slots(args)
    subsets = [("all", slots)] + ([(schema[i] + ("" if j is None else f"[{j}]"), [(i, j)])
                                   for i, j in slots] if len(slots) > 1 else [])
    for lname, fn in IN_LAYOUTS.items():
        for sname, which in subsets[:1] if lname == "contiguous" else subsets:
            nc = _relayout(args, which, fn)
            if nc is not None:
                yield f"{lname} {sname}", nc, kw


def _differs(ref, got) -> Optional[str]:
    """How ``got`` differs from ``ref`` (NaN where NaN, values within 1e-5), or None."""
    for x, y in zip(_tuple(ref), _tuple(got)):
        if x is None or y is None:
            continue
        if x.dtype.is_floating_point:
            if not torch.allclose(x, y, rtol=1e-5, atol=1e-5, equal_nan=True):
                d = (x - y).abs()
                return (f"max |diff| {d[~d.isnan()].max().item() if (~d.isnan()).any() else 0:.3g}, "
                        f"NaN at {(x.isnan() != y.isnan()).sum().item()} other places")
        elif not torch.equal(x, y):
            return "values differ"
    return None


def _run_out(op, args, kw, refs, traced, layout: str, rule: bool):
    """``op.out_kernel`` on ``args`` into buffers in ``layout``; with ``rule`` as the
    runtime calls it (`out_contiguous_inputs` made contiguous, or None when
    `out_buffers_fit` sends the call to the functional overload)."""
    bufs = [None if r is None else _buffer(r, t, layout) for r, t in zip(refs, traced)]
    if rule:
        if not out_buffers_fit(op, bufs):
            return None
        names = [a.name for a in op.aten._schema.arguments]
        need = out_contiguous_inputs(op)
        args = [a.contiguous() if isinstance(a, torch.Tensor) and names[i] in need else a
                for i, a in enumerate(args)]
    if op.random:
        torch.manual_seed(1)
    op.out_kernel(*args, **kw, **dict(zip(op.out_names, bufs)))
    return bufs


def audit(key: str, op=None, rule: bool = False) -> List[str]:
    """The cases (operand layout, buffer layout) where ``key``'s ``.out`` overload differs
    from its functional one; ``rule``: called as the runtime calls it (``op``'s
    `OpDef.out_contiguous`; default the registered op's)."""
    op = op or get_op(key.split("/")[0])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # tiny tensors: one thread is the same kernel, minus handoffs
    try:
        return [f"{label}, out {layout}: {d}" for label, layout, d in _audit_cases(key, op, rule)]
    finally:
        torch.set_num_threads(threads)


def _audit_cases(key: str, op, rule: bool) -> Iterator[Tuple[str, str, str]]:
    for label, args, kw in _cases(key):
        if op.random:
            torch.manual_seed(1)
        try:
            refs = _tuple(op.aten(*args, **kw))
        except RuntimeError:      # the functional overload refuses the layout too
            continue
        try:
            traced = [None if r is None else r.stride() for r in _tuple(op.aten(*_meta(args), **kw))]
        except (RuntimeError, NotImplementedError):   # no meta kernel: the "traced"
            traced = [None] * len(refs)                 # buffer falls back to contiguous
        for layout in OUT_LAYOUTS:
            got = _run_out(op, args, kw, refs, traced, layout, rule)
            d = None if got is None else _differs(refs, got)
            if d:
                yield label, layout, d


def _declared() -> List[Tuple[str, str]]:
    return sorted((op.name, a) for op in all_ops() for a in op.out_contiguous)


def test_every_out_overload_has_a_sample():
    """A new op with an ``.out`` overload is audited: it needs a sample here."""
    missing = [op.name for op in all_ops() if op.out_kernel is not None and op.name not in SAMPLES]
    assert missing == [], f"add samples for {missing} to SAMPLES"


@pytest.mark.parametrize("key", sorted(SAMPLES))
def test_out_overload_matches_functional_as_the_runtime_calls_it(key):
    assert audit(key, rule=True) == []


@pytest.mark.parametrize("name,arg", _declared())
def test_each_declared_operand_is_needed(name, arg):
    """The evidence of each `OpDef.out_contiguous` entry: without it some case differs
    (a torch that fixes the kernel fails here: drop the entry)."""
    op = get_op(name)
    fewer = dataclasses.replace(op, out_contiguous=tuple(a for a in op.out_contiguous if a != arg))
    keys = [k for k in SAMPLES if k.split("/")[0] == name]
    assert any(audit(k, fewer, rule=True) for k in keys)


def test_the_misbehaving_overloads_are_found():
    """The audit finds torch 2.13's faults (the ones `OpDef.out_contiguous` declares)."""
    assert audit("BNTrainingUpdateNoStats/2d")
    assert any(c.startswith("contiguous all, out channels-last") for c in audit("BNTrainingUpdateNoStats"))
    assert audit("LogSoftmaxGrad") and audit("Gelu") and not audit("Relu") and not audit("BatchNorm")


def test_out_contiguous_names_an_argument():
    from opencann.ops import OpDef, OpKind, register
    with pytest.raises(ValueError, match="out_contiguous names 'x'.*arguments: \\['self', 'out'\\]"):
        register(OpDef("OutContiguousTypo", OpKind.ELEMENTWISE, aten=aten.erfinv.default,
                       out_contiguous=("x",)))


if __name__ == "__main__":
    for key in sorted(SAMPLES):
        if len(sys.argv) > 1 and not any(s.lower() in key.lower() for s in sys.argv[1:]):
            continue
        found = audit(key)
        print(f"{key}: {'ok' if not found else f'DIFFERS in {len(found)} cases'}")
        for line in found:
            print("    " + line)
