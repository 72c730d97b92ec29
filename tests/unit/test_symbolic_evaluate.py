"""`opencann.ir.symbolic.evaluate` / `bind` / `expr_string`: symbolic size arithmetic
(torch's shape functions, float arithmetic on sizes) gives the numbers eager Python
computes, for every size; float constants survive the string round trip exactly."""
import math

import pytest
import sympy
import torch.utils._sympy.functions as F

from opencann.ir.symbolic import SymExpr, bind, bind_tree, evaluate, expr_string, holds, parse

s0, s1 = sympy.Symbol("s0", integer=True, positive=True), sympy.Symbol("s1", integer=True, positive=True)

# (expression over s0, s1 built the way torch's shape environment builds it, eager Python)
CASES = [
    (F.IntTrueDiv(s1, s0), lambda a, b: b / a),
    (F.TruncToInt(1.5 * F.ToFloat(s0)), lambda a, b: math.trunc(a * 1.5)),
    (F.FloorToInt((2 / 3) * F.ToFloat(s0)), lambda a, b: math.floor(a * (2 / 3))),
    (F.TruncToInt(3.7 * F.ToFloat(s0)), lambda a, b: int(a * 3.7)),
    (F.CeilToInt(F.IntTrueDiv(s0, 3)), lambda a, b: math.ceil(a / 3)),
    (F.FloorDiv(s0, 2) * 2, lambda a, b: a // 2 * 2),
    (F.Mod(s0, 3), lambda a, b: a % 3),
    (F.Max(F.FloorDiv(s1, 2), F.Min(s0, 3)), lambda a, b: max(b // 2, min(a, 3))),
    (F.PowByNatural(s0, 2), lambda a, b: a ** 2),
    (F.FloatPow(F.ToFloat(s0), 0.5), lambda a, b: float(a) ** 0.5),
    (F.RoundToInt(F.IntTrueDiv(s1, 4)), lambda a, b: round(b / 4)),
    (s0 * s1 - 1, lambda a, b: a * b - 1),
]


@pytest.mark.parametrize("k", range(len(CASES)))
def test_evaluate_matches_python_for_every_size(k):
    expr, py = CASES[k]
    text = expr_string(expr)
    for a in range(1, 40):
        for b in (1, 2, 7, 30, 31):
            want = py(a, b)
            got = bind(SymExpr(text), {"s0": a, "s1": b})
            assert got == want and type(got) is type(want), (text, a, b, got, want)


def test_float_constants_round_trip_exactly():
    # str() keeps 15 digits: 2/3 would parse back as 0.666666666666667, and
    # floor(s0 * that) differs from eager's floor(s0 * (2/3)) for some s0
    for c in (2 / 3, 0.1 + 0.2, 1 / 7, 3.7, 1e-12, 123456.789):
        e = sympy.Float(c) * F.ToFloat(s0)
        assert evaluate(parse(expr_string(e)), {"s0": 3}) == c * 3


def test_bind_tree_binds_float_scalars_and_guards_hold():
    attrs = {"other": SymExpr(expr_string(F.IntTrueDiv(s1, s0))), "size": [SymExpr("s0"), 4]}
    assert bind_tree(attrs, {"s0": 8, "s1": 12}) == {"other": 1.5, "size": [8, 4]}
    assert holds("Eq(Mod(s0, 2), 0)", {"s0": 4}) and not holds("Eq(Mod(s0, 2), 0)", {"s0": 5})


def test_unknown_function_and_missing_symbol_are_named():
    with pytest.raises(KeyError, match="s1"):
        bind("s0*s1", {"s0": 2})
    with pytest.raises(ValueError, match="cannot evaluate"):
        evaluate(sympy.Function("Mystery")(s0), {"s0": 2})


def test_floor_division_strings_evaluate_exactly():
    # ceil-mode pooling twice then narrow by a third: sympy parses // as floor(a/b) with
    # rationals; float arithmetic gave floor(5/3 + 1/3) = floor(1.9999999999999998) = 1
    e = "Max(1, (((((s0 - 1)//4)) + 1)//3))"
    for s in range(1, 200):
        assert bind(e, {"s0": s}) == max(1, (((s - 1) // 4) + 1) // 3), s
    assert bind("s0/4", {"s0": 6}) == 1.5 and bind("s0/2", {"s0": 6}) == 3


def test_a_graph_with_static_inputs_can_be_symbolic():
    """A slice bounded by a size argument (``x[:n]`` under torch.compile): every input is
    static, the slice's bound and output are symbolic; the inputs alone do not tell."""
    from opencann.ir import DataType, Graph, TensorDesc
    from opencann.ir.symbolic import graph_has_symbols

    def sliced(end, out_rows):
        g = Graph("g")
        x = g.add_input(TensorDesc((6, 4), DataType.FLOAT), "x")
        n = g.create_node("StridedSlice", [x], {"dim": 0, "start": 0, "end": end},
                          [TensorDesc((out_rows, 4), DataType.FLOAT)])
        g.outputs = [n.outputs[0]]
        return g

    assert not graph_has_symbols(sliced(3, 3))
    assert graph_has_symbols(sliced(SymExpr("s0"), "s0"))
    assert graph_has_symbols(sliced(SymExpr("s0"), 3))       # a symbolic attr alone
