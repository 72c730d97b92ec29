"""Symbolic dimensions of the IR: `SymExpr`, ranges, and binding symbols to sizes.

A dynamic dimension is written, in a `TensorDesc` shape, as the string form of the
sympy expression torch.export's shape environment gives it (``"s43"``, ``"s43*s53"``,
``"12*s53"``); a size computed from shapes that an op takes as an argument (``view``'s
``[s43*s53, 384]``) is a `SymExpr` in the node's attrs. `bind` turns either into an int
for concrete symbol values; `specialise` (``opencann.ir.specialise``) does it for a
whole graph. Expressions are parsed once by sympy (torch's own symbolic-shape library)
and evaluated by `evaluate` with Python's own int and float arithmetic, the arithmetic
torch.compile's Python code runs eagerly, so torch's shape functions (``FloorDiv``,
``Mod``, ``IntTrueDiv``, ``ToFloat``, ``TruncToInt``, ``FloorToInt``, ``FloatPow``,
``Min``/``Max``...) give eager's exact values. Float arithmetic on sizes
(``F.interpolate(scale_factor=1.5)``: ``TruncToInt(1.5*ToFloat(s0))``; a scale
``IntTrueDiv(s1, s0)`` passed to an op) is written with each float constant's shortest
round-trip form (`expr_string`), so the parsed constant is the same double.
"""
from __future__ import annotations

import functools
import math
from fractions import Fraction
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Set, Tuple, Union

import sympy
from sympy.printing.str import StrPrinter

Bindings = Mapping[str, int]
Number = Union[int, float, bool]


@dataclass(frozen=True)
class SymExpr:
    """A size argument that depends on symbolic dims (``view(x, [SymExpr("s0*s1"), 384])``).

    ``expr``: the sympy expression's string form over shape-environment symbols."""

    expr: str

    def __str__(self) -> str:
        return self.expr

    def __repr__(self) -> str:
        return f"sym({self.expr})"


def _sympy_locals() -> Dict[str, Any]:
    """torch's sympy shape functions, so their string forms parse back."""
    try:
        import torch.utils._sympy.functions as f
    except ImportError:  # pragma: no cover - very old torch
        return {}
    return {k: getattr(f, k) for k in dir(f) if isinstance(getattr(f, k), type)
            and issubclass(getattr(f, k), sympy.Basic)}


@functools.lru_cache(maxsize=4096)
def parse(expr: str) -> sympy.Expr:
    """The sympy expression of ``expr`` (a dim string such as ``"s0*s1"``); every name
    is a symbol (never a sympy constant such as ``E`` or ``N``). Raises ValueError for a
    string that is not an expression."""
    try:
        names = {s: sympy.Symbol(s, integer=True, positive=True)
                 for s in _names(expr)}
        return sympy.sympify(expr, locals={**_LOCALS, **names})
    except (sympy.SympifyError, SyntaxError, TypeError) as e:
        raise ValueError(f"symbolic dim {expr!r} is not an expression: {e}") from None


def _names(expr: str) -> Set[str]:
    """The names in ``expr`` that are not called (``Eq(s0, 2)``: only ``s0``)."""
    return {m for m in re.findall(r"\b([A-Za-z_][A-Za-z_0-9]*)\b(?!\s*\()", expr)
            if m not in ("True", "False")}


_LOCALS = _sympy_locals()


def symbols_of(dim: Any) -> Set[str]:
    """Names of the symbols a dim (int, string or `SymExpr`) depends on (empty for ints)."""
    if isinstance(dim, SymExpr):
        dim = dim.expr
    if not isinstance(dim, str):
        return set()
    return {str(s) for s in parse(dim).free_symbols}


def is_symbol(dim: Any) -> bool:
    """True when ``dim`` is a plain symbol (``"s43"``), not an int or a compound expression."""
    return isinstance(dim, str) and parse(dim).is_Symbol


def bind(dim: Any, values: Bindings, memo: Dict[str, Any] | None = None) -> Any:
    """``dim`` with its symbols replaced by ``values`` (symbol name -> int): a number for
    a string dim or a `SymExpr` (an int for sizes; a float for a float-valued size
    computation passed to an op, such as a resize scale ``IntTrueDiv(s1, s0)``), ``dim``
    itself otherwise. Raises KeyError naming a symbol without a value, ValueError when
    the expression cannot be evaluated (a function `evaluate` does not know)."""
    if isinstance(dim, SymExpr):
        dim = dim.expr
    elif not isinstance(dim, str):
        return dim
    if memo is not None and dim in memo:
        return memo[dim]
    e = parse(dim)
    missing = {str(s) for s in e.free_symbols} - set(values)
    if missing:
        raise KeyError(f"symbolic dim {dim!r} needs a value for {sorted(missing)}")
    r = evaluate(e, values)
    if isinstance(r, bool):
        r = int(r)
    elif isinstance(r, Fraction):
        r = int(r) if r.denominator == 1 else float(r)
    if memo is not None:
        memo[dim] = r
    return r


def _pow(a, b):
    """Python's ``**`` (``PowByNatural``: ints; ``FloatPow``: floats)."""
    return a ** b


def _round_decimal(x, n):
    return round(x, int(n))


# torch's sympy shape functions (torch/utils/_sympy/functions.py) and sympy's own heads,
# each with the Python operation torch.compile's generated code runs for it (the
# reference: torch/utils/_sympy/reference.py, PythonReferenceAnalysis)
_PY_FUNCS: Dict[str, Callable[..., Any]] = {
    "FloorDiv": operator.floordiv, "CleanDiv": operator.floordiv,
    "CeilDiv": lambda a, b: -(-a // b),
    "ModularIndexing": lambda x, d, m: (x // d) % m,
    "Mod": operator.mod, "PythonMod": operator.mod,
    "IntTrueDiv": operator.truediv, "FloatTrueDiv": operator.truediv,
    "ToFloat": float, "Identity": lambda x: x,
    "TruncToInt": math.trunc, "TruncToFloat": lambda x: float(math.trunc(x)),
    "FloorToInt": math.floor, "CeilToInt": math.ceil, "RoundToInt": round,
    "RoundDecimal": _round_decimal,
    "floor": math.floor, "ceiling": math.ceil,
    "PowByNatural": _pow, "FloatPow": _pow,
    "Min": min, "Max": max, "Abs": abs,
    "LShift": operator.lshift, "RShift": operator.rshift,
    "BitwiseFn_bitwise_and": operator.and_, "BitwiseFn_bitwise_or": operator.or_,
    "BitwiseFn_bitwise_xor": operator.xor,
    "Where": lambda c, a, b: a if c else b,
    "Equality": operator.eq, "Unequality": operator.ne,
    "StrictLessThan": operator.lt, "LessThan": operator.le,
    "StrictGreaterThan": operator.gt, "GreaterThan": operator.ge,
    "And": lambda *a: all(a), "Or": lambda *a: any(a), "Not": operator.not_,
}


def evaluate(expr: sympy.Basic, values: Bindings) -> "Number | Fraction":
    """The value of ``expr`` (a parsed dim, size computation or guard) for ``values``
    (symbol name -> int) with Python's int/float/bool arithmetic, the arithmetic eager
    Python runs on sizes: ints stay exact, ``IntTrueDiv(12, 8)`` is ``12 / 8``, a float
    constant is its double; sympy's own rationals (``floor(s0/4 - 1/4)``, how ``//``
    parses) are exact `Fraction` values. Raises KeyError for a symbol without a value, ValueError
    naming a function it does not know."""
    if expr.is_Symbol:
        return int(values[str(expr)])
    if expr.is_Integer:
        return int(expr)
    if expr.is_Float:
        return float(expr)
    if expr.is_Rational:   # sympy's own a / b (``//`` parses as floor(a/b)): exact
        return Fraction(int(expr.p), int(expr.q))
    if expr is sympy.true or expr is sympy.false:
        return bool(expr)
    if isinstance(expr, sympy.Piecewise):
        return next(evaluate(e, values) for e, c in expr.args if evaluate(c, values))
    args = [evaluate(a, values) for a in expr.args]
    if expr.is_Add:
        return functools.reduce(operator.add, args)
    if expr.is_Mul:
        return functools.reduce(operator.mul, args)
    if expr.is_Pow:
        base, exp = args
        if isinstance(exp, int) and exp < 0 and isinstance(base, (int, Fraction)):
            return Fraction(1) / base ** -exp   # sympy spells a / b as a * b**-1: exact
        return base ** exp
    name = type(expr).__name__
    fn = _PY_FUNCS.get(name)
    if fn is None and name.startswith("OpaqueUnaryFn_"):
        fn = getattr(math, name[len("OpaqueUnaryFn_"):], None)
    if fn is None:
        raise ValueError(f"symbolic size {expr} uses {name}, which opencann cannot evaluate "
                         "per call")
    return fn(*args)


class _ExactFloats(StrPrinter):
    """sympy's printer with each Float as its shortest round-trip form (``repr``)."""

    def _print_Float(self, expr):
        return repr(float(expr))


def expr_string(expr: sympy.Basic) -> str:
    """The string form of a shape-environment expression that parses back to the same
    expression (float constants exact: ``str`` keeps 15 digits, which changes 2/3)."""
    return _ExactFloats().doprint(expr)


def bind_tree(obj: Any, values: Bindings, memo: Dict[str, int] | None = None) -> Any:
    """``obj`` (an attr: scalars, lists, tuples, dicts) with every `SymExpr` bound."""
    if isinstance(obj, SymExpr):
        return bind(obj, values, memo)
    if isinstance(obj, (list, tuple)):
        return type(obj)(bind_tree(x, values, memo) for x in obj)
    if isinstance(obj, dict):
        return {k: bind_tree(v, values, memo) for k, v in obj.items()}
    return obj


def holds(guard: str, values: Bindings) -> bool:
    """Whether the condition ``guard`` (a relation over symbols, ``"Eq(Mod(s0, 2), 0)"``)
    is true for ``values``. Raises KeyError naming a symbol without a value."""
    e = parse(guard)
    missing = {str(s) for s in e.free_symbols} - set(values)
    if missing:
        raise KeyError(f"shape guard {guard!r} needs a value for {sorted(missing)}")
    return bool(evaluate(e, values))


def has_symbolic(obj: Any) -> bool:
    """True when an attr value contains a `SymExpr` (or a string dim in a shape tuple)."""
    if isinstance(obj, SymExpr):
        return True
    if isinstance(obj, (list, tuple)):
        return any(has_symbolic(x) for x in obj)
    if isinstance(obj, dict):
        return any(has_symbolic(v) for v in obj.values())
    return False


def graph_has_symbols(graph: Any) -> bool:
    """True when any value of ``graph`` (an IR `Graph`: its inputs and node outputs) has a
    symbolic dim or any node holds a `SymExpr` attr. A graph can be symbolic with every
    input static (a slice bounded by a size argument, ``x[:n]``), so the inputs alone do
    not tell."""
    return (any(not v.desc.is_static for v in graph.inputs)
            or any(not o.desc.is_static for n in graph.nodes for o in n.outputs)
            or any(has_symbolic(n.attrs) for n in graph.nodes))


def linear_in(dim: Any, sym: str) -> Optional[Tuple[int, Any]]:
    """(a, b) when the string dim ``dim`` is ``a * sym + b`` with an integer ``a`` != 0 and
    ``b`` free of ``sym`` (an int or an expression of other symbols, as a string): a
    derived dim (torch.export's ``2 * Dim("_seq")``) whose root ``sym`` a size determines.
    None otherwise."""
    if not isinstance(dim, str):
        return None
    e = parse(dim)
    x = next((f for f in e.free_symbols if str(f) == sym), None)
    if x is None:
        return None
    a = sympy.expand(e).coeff(x, 1)
    b = sympy.expand(e - a * x)
    if not a.is_Integer or a == 0 or x in b.free_symbols:
        return None
    return int(a), (int(b) if b.is_Integer else str(b))


def shape_symbols(shapes: Iterable[Tuple[Any, ...]]) -> Set[str]:
    """All symbols the given shapes depend on."""
    return {s for shape in shapes for d in shape for s in symbols_of(d)}


def node_symbols(node) -> Set[str]:
    """The symbols a node's output shapes or size arguments depend on (empty: static)."""
    out = shape_symbols(o.desc.shape for o in node.outputs)
    for v in node.attrs.values():
        if has_symbolic(v):
            out |= {s for x in _flat(v) for s in symbols_of(x)}
    return out


def _flat(obj: Any):
    if isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _flat(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _flat(x)
    else:
        yield obj


def dynamic_skip_reason(node, what: str) -> "str | None":
    """A Skip reason when ``node``'s shapes depend on dynamic dims (``what``: the rewrite
    that needs static shapes, e.g. "folding at compile time"), else None."""
    syms = node_symbols(node)
    if not syms:
        return None
    return (f"shape depends on the dynamic dim(s) {', '.join(sorted(syms))}; {what} needs "
            "static shapes (guard: every dim static); it runs per call")


def fits(sizes: Iterable[int], shape: Tuple[Any, ...]) -> bool:
    """True when concrete ``sizes`` can be ``shape``: same rank, equal static dims (a
    symbolic dim takes any size; its range is checked where the symbols are bound)."""
    sizes = tuple(sizes)
    return len(sizes) == len(shape) and all(
        not isinstance(d, int) or int(s) == d for s, d in zip(sizes, shape))


def as_expr(dim: Any) -> sympy.Expr:
    """A dim (int, string form or `SymExpr`) as an expanded sympy expression, for
    comparing symbolic sizes (``384*s1`` equals ``s1*384``)."""
    if isinstance(dim, SymExpr):
        dim = dim.expr
    return sympy.expand(parse(dim)) if isinstance(dim, str) else sympy.Integer(int(dim))
