"""The differential fuzzer's op table: each entry builds one step of a random program.

A builder gets the generator `g` (``opencann.tools.fuzz.Gen``: random source, the live
values, helpers to pick operands) and returns ``g.step(...)`` or None when no operand
fits. Steps are Python source (``v7 = torch.relu(v3)``); the generator runs each one
eagerly and drops it if eager PyTorch raises, so builders may propose freely and shape
or dtype rules need not be restated here.

Groups (``--kinds``): unary, binary, compare, int, reduction, norm, matmul, conv,
attention, view, data, inplace, input_mut, random, fallback (ATen ops that opencann runs
on the host), dup (a repeated expression: CSE bait). ``exact`` marks ops whose result is
bit-exact given bit-exact operands (views, relu, max...); discontinuous ops (floor,
comparisons, argmax, casts to int) only take exact operands, so rounding differences
between eager and compiled code cannot flip them.
"""
from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional


class FuzzOp(NamedTuple):
    """One op the fuzzer can generate: name, group (for --op and --kinds), its builder ``build(g:
    Gen) -> Optional[Step]`` and its relative weight in sampling."""
    name: str
    group: str
    build: Callable  # build(g) -> Optional[Step]
    weight: float = 1.0


OPS: List[FuzzOp] = []


def op(name: str, group: str, weight: float = 1.0):
    """Decorator registering a builder in `OPS` as a `FuzzOp` named ``name`` in ``group``, sampled
    with ``weight``; returns the builder unchanged."""
    def deco(fn):
        OPS.append(FuzzOp(name, group, fn, weight))
        return fn
    return deco


def _f(x: float) -> str:
    return repr(float(x))


# ---------------------------------------------------------------- unary (float)
_UNARY = {  # name: (expression template, exact-preserving)
    "relu": ("torch.relu({a})", True), "sigmoid": ("torch.sigmoid({a})", False),
    "tanh": ("torch.tanh({a})", False), "exp": ("torch.exp({a})", False),
    "log": ("torch.log({a})", False), "sqrt": ("torch.sqrt({a})", False),
    "rsqrt": ("torch.rsqrt({a})", False), "abs": ("torch.abs({a})", True),
    "neg": ("-{a}", True), "sin": ("torch.sin({a})", False), "cos": ("torch.cos({a})", False),
    "gelu": ("F.gelu({a})", False), "gelu_tanh": ("F.gelu({a}, approximate='tanh')", False),
    "silu": ("F.silu({a})", False), "hardtanh": ("F.hardtanh({a}, -0.5, 0.75)", True),
    "leaky_relu": ("F.leaky_relu({a}, 0.125)", False), "hardsigmoid": ("F.hardsigmoid({a})", False),
    "hardswish": ("F.hardswish({a})", False), "erf": ("torch.erf({a})", False),
    "reciprocal": ("torch.reciprocal({a})", False), "square": ("{a} * {a}", False),
    "pow2": ("{a} ** 2", False), "pow_half": ("{a} ** 0.5", False), "pow3": ("torch.pow({a}, 3)", False),
    "clamp": ("torch.clamp({a}, -0.5, 1.25)", True), "clamp_min": ("{a}.clamp_min(0.25)", True),
    "nan_to_num": ("torch.nan_to_num({a}, 0.0, 100.0, -100.0)", True),
    "isfinite": ("torch.isfinite({a})", True), "isnan": ("torch.isnan({a})", True),
}


def _unary(name, tmpl, exact):
    @op(name, "unary")
    def build(g):
        a = g.pick("float")
        return a and g.step(tmpl.format(a=a.name), [a], exact=exact)


for _n, (_t, _e) in _UNARY.items():
    _unary(_n, _t, _e)

for _n, _t in {"floor": "torch.floor({a})", "sign": "torch.sign({a})",
               "ceil": "torch.ceil({a} * 2.0)"}.items():
    def _disc(name=_n, tmpl=_t):
        @op(name, "unary")
        def build(g):
            a = g.pick("float", exact=True)
            return a and g.step(tmpl.format(a=a.name), [a], exact=True)
    _disc()


# ---------------------------------------------------------------- binary
_BINARY = {"add": ("{a} + {b}", False), "sub": ("{a} - {b}", False), "mul": ("{a} * {b}", False),
           "div": ("{a} / {b}", False), "maximum": ("torch.maximum({a}, {b})", True),
           "minimum": ("torch.minimum({a}, {b})", True), "pow": ("torch.pow({a}, {b})", False),
           "add_alpha": ("torch.add({a}, {b}, alpha=2)", False)}


def _binary(name, tmpl, exact):
    @op(name, "binary", 2.0)
    def build(g):
        a = g.pick("num")
        b = a and g.partner(a, "num")
        return b and g.step(tmpl.format(a=a.name, b=b.name), [a, b], exact=exact)


for _n, (_t, _e) in _BINARY.items():
    _binary(_n, _t, _e)


@op("scalar_op", "binary", 2.0)
def _scalar(g):
    a = g.pick("num")
    if a is None:
        return None
    s = g.rng.choice([2.5, -1.5, 3, 0.5, -2])
    tmpl = g.rng.choice(["{a} + {s}", "{a} * {s}", "{s} - {a}", "{a} / {s}", "{a} - {s}"])
    return g.step(tmpl.format(a=a.name, s=s), [a], exact=False)


@op("where", "binary")
def _where(g):
    c = g.pick("bool")
    a = c and g.partner(c, "num")
    b = a and g.partner(a, "num")
    return b and g.step(f"torch.where({c.name}, {a.name}, {b.name})", [c, a, b], exact=True)


@op("where_scalar", "binary")
def _where_scalar(g):
    c = g.pick("bool")
    a = c and g.partner(c, "float")
    return a and g.step(f"torch.where({c.name}, {a.name}, 0.0)", [c, a], exact=True)


@op("addcmul", "binary")
def _addcmul(g):
    a = g.pick("float")
    b = a and g.partner(a, "float")
    c = b and g.partner(a, "float")
    return c and g.step(f"torch.addcmul({a.name}, {b.name}, {c.name}, value=0.5)", [a, b, c])


# ---------------------------------------------------------------- comparisons, logic
@op("compare", "compare", 2.0)
def _compare(g):
    a = g.pick("num", exact=True)
    b = a and g.partner(a, "num", exact=True)
    if b is None:
        return None
    cmp = g.rng.choice(["==", "!=", "<", "<=", ">", ">="])
    return g.step(f"{a.name} {cmp} {b.name}", [a, b], exact=True)


@op("compare_scalar", "compare")
def _compare_s(g):
    a = g.pick("num", exact=True)
    if a is None:
        return None
    cmp = g.rng.choice(["==", "!=", "<", "<=", ">", ">="])
    return g.step(f"{a.name} {cmp} {g.rng.choice([0, 0.5, -1, 1])}", [a], exact=True)


@op("logical", "compare")
def _logical(g):
    a = g.pick("bool")
    b = a and g.partner(a, "bool")
    if b is None:
        return None
    tmpl = g.rng.choice(["{a} & {b}", "{a} | {b}", "torch.logical_and({a}, {b})",
                         "torch.logical_or({a}, {b})", "~{a}", "torch.logical_not({a})"])
    return g.step(tmpl.format(a=a.name, b=b.name), [a, b] if "{b}" in tmpl else [a], exact=True)


@op("masked_fill", "compare")
def _masked_fill(g):
    m = g.pick("bool")
    a = m and g.partner(m, "num")
    return a and g.step(f"{a.name}.masked_fill({m.name}, {g.rng.choice([-1.0, 0.0, 2.0])})",
                        [a, m], exact=True)


# ---------------------------------------------------------------- integers
@op("int_arith", "int", 2.0)
def _int_arith(g):
    a = g.pick("int")
    b = a and g.partner(a, "int")
    if b is None:
        return None
    tmpl = g.rng.choice(["{a} + {b}", "{a} * {b}", "{a} - {b}", "{a} & {b}", "{a} | {b}",
                         "~{a}", "torch.floor_divide({a}, {b}.abs() + 1)", "{a} // 3",
                         "{a} * 3 - 1", "torch.maximum({a}, {b})"])
    return g.step(tmpl.format(a=a.name, b=b.name), [a, b] if "{b}" in tmpl else [a], exact=True)


@op("cast_to_int", "int")
def _to_int(g):
    a = g.pick("float", exact=True)
    dt = g.rng.choice(["torch.int32", "torch.int64"])
    return a and g.step(f"{a.name}.nan_to_num(0.0, 99.0, -99.0).to({dt})", [a], exact=True)


@op("cast_to_float", "int")
def _int_to_float(g):
    a = g.pick("int") or g.pick("bool")
    dt = g.rng.choice(["torch.float32", "torch.float16", "torch.bfloat16"])
    return a and g.step(f"{a.name}.to({dt})", [a], exact=True)


@op("bool_to_int", "int")
def _bool_int(g):
    a = g.pick("bool")
    return a and g.step(f"{a.name}.long().sum({g.rng.randrange(a.t.dim()) if a.t.dim() else ''})",
                        [a], exact=True)


# ---------------------------------------------------------------- reductions
@op("reduce", "reduction", 2.0)
def _reduce(g):
    a = g.pick("num", min_ndim=1)
    if a is None:
        return None
    d = g.dim(a)
    kd = g.rng.choice([True, False])
    fn = g.rng.choice(["sum", "mean", "amax", "amin", "var", "std", "cumsum", "logsumexp"])
    if fn == "cumsum":
        return g.step(f"torch.cumsum({a.name}, {d})", [a])
    if fn in ("var", "std"):
        return g.step(f"torch.{fn}({a.name}, {d}, keepdim={kd}, correction={g.rng.choice([0, 1])})", [a])
    return g.step(f"torch.{fn}({a.name}, {d}, keepdim={kd})", [a], exact=fn in ("amax", "amin"))


@op("reduce_all", "reduction")
def _reduce_all(g):
    a = g.pick("num")
    fn = g.rng.choice(["sum", "mean"])
    return a and g.step(f"{a.name}.{fn}()", [a])


@op("argmax", "reduction")
def _argmax(g):
    a = g.pick("num", exact=True, min_ndim=1)
    fn = g.rng.choice(["argmax", "argmin"])
    return a and g.step(f"torch.{fn}({a.name}, {g.dim(a)})", [a], exact=True)


@op("max_dim", "reduction")
def _max_dim(g):
    a = g.pick("num", exact=True, min_ndim=1)
    return a and g.step(f"torch.max({a.name}, {g.dim(a)}, keepdim={g.rng.choice([True, False])})",
                        [a], n_out=2, exact=True)


@op("any_all", "reduction")
def _any_all(g):
    a = g.pick("bool", min_ndim=1)
    return a and g.step(f"torch.{g.rng.choice(['any', 'all'])}({a.name}, {g.dim(a)})", [a], exact=True)


# ---------------------------------------------------------------- normalisation
@op("softmax", "norm", 1.5)
def _softmax(g):
    a = g.pick("float", min_ndim=1)
    fn = g.rng.choice(["torch.softmax", "torch.log_softmax"])
    return a and g.step(f"{fn}({a.name}, {g.dim(a)})", [a])


@op("layer_norm", "norm")
def _layer_norm(g):
    a = g.pick("float", min_ndim=1, dtypes=("torch.float32",))
    if a is None:
        return None
    n = a.t.shape[-1]
    if g.rng.random() < 0.5:
        return g.step(f"F.layer_norm({a.name}, ({n},))", [a])
    mod = g.module(f"torch.nn.LayerNorm({n})", [f"torch.nn.init.normal_({{m}}.weight)",
                                                 f"torch.nn.init.normal_({{m}}.bias)"])
    return g.step(f"{mod}({a.name})", [a])


@op("batch_norm", "norm")
def _batch_norm(g):
    a = g.pick("float", ndims=(2, 3, 4), dtypes=("torch.float32",))
    if a is None:
        return None
    c = a.t.shape[1]
    kind = {2: "1d", 3: "1d", 4: "2d"}[a.t.dim()]
    mod = g.module(f"torch.nn.BatchNorm{kind}({c})",
                   ["{m}.running_mean.uniform_(-1, 1)", "{m}.running_var.uniform_(0.5, 2)",
                    "torch.nn.init.normal_({m}.weight)"])
    return g.step(f"{mod}({a.name})", [a])


@op("group_norm", "norm", 0.5)
def _group_norm(g):
    a = g.pick("float", ndims=(3, 4), dtypes=("torch.float32",))
    if a is None or a.t.shape[1] % 2:
        return None
    return g.step(f"F.group_norm({a.name}, 2)", [a])


# ---------------------------------------------------------------- matmul
@op("linear", "matmul", 1.5)
def _linear(g):
    a = g.pick("float", min_ndim=1, dtypes=("torch.float32",))
    if a is None:
        return None
    mod = g.module(f"torch.nn.Linear({a.t.shape[-1]}, {g.rng.randint(1, 6)}, "
                   f"bias={g.rng.random() < 0.8})")
    act = g.rng.choice(["{}", "torch.relu({})", "F.gelu({})", "torch.tanh({})"])
    return g.step(act.format(f"{mod}({a.name})"), [a])


@op("matmul_self", "matmul")
def _matmul_self(g):
    a = g.pick("float", min_ndim=2)
    if a is None:
        return None
    tmpl = g.rng.choice(["{a} @ {a}.transpose(-1, -2)", "{a}.transpose(-1, -2) @ {a}",
                         "torch.matmul({a}, {b}.transpose(-1, -2))"])
    b = g.partner(a, "float", same_shape=True) or a
    return g.step(tmpl.format(a=a.name, b=b.name), [a, b])


@op("bmm", "matmul", 0.5)
def _bmm(g):
    a = g.pick("float", ndims=(3,))
    return a and g.step(f"torch.bmm({a.name}, {a.name}.transpose(1, 2))", [a])


# ---------------------------------------------------------------- convolution, pooling
def _conv_mod(g, c, same):
    k, p = g.rng.choice([(3, 1), (1, 0)]) if same else g.rng.choice([(3, 1), (1, 0), (3, 0), (2, 0)])
    s = 1 if same else g.rng.choice([1, 1, 2])
    cout = c if same else g.rng.randint(1, 5)
    return g.module(f"torch.nn.Conv2d({c}, {cout}, {k}, stride={s}, padding={p}, "
                    f"bias={g.rng.random() < 0.8})")


@op("conv", "conv", 2.0)
def _conv(g):
    a = g.pick("float", ndims=(4,), dtypes=("torch.float32",))
    if a is None:
        return None
    mod = _conv_mod(g, a.t.shape[1], False)
    act = g.rng.choice(["{}", "torch.relu({})", "torch.relu({})", "F.gelu({})", "torch.sigmoid({})",
                        "torch.tanh({})"])
    return g.step(act.format(f"{mod}({a.name})"), [a])


@op("conv_add", "conv", 2.0)
def _conv_add(g):
    a = g.pick("float", ndims=(4,), dtypes=("torch.float32",))
    r = a and g.partner(a, "float", same_shape=True)
    if r is None:
        return None
    mod = _conv_mod(g, a.t.shape[1], True)
    tmpl = g.rng.choice(["{c} + {r}", "{r} + {c}", "torch.relu({c} + {r})", "torch.relu({r} + {c})"])
    return g.step(tmpl.format(c=f"{mod}({a.name})", r=r.name), [a, r])


@op("pool", "conv")
def _pool(g):
    a = g.pick("float", ndims=(4,))
    if a is None:
        return None
    tmpl = g.rng.choice(["F.max_pool2d({a}, 2)", "F.avg_pool2d({a}, 2)", "F.max_pool2d({a}, 3, 1, 1)",
                         "F.adaptive_avg_pool2d({a}, 1)", "F.avg_pool2d({a}, 3, 2, 1)"])
    return g.step(tmpl.format(a=a.name), [a], exact="max" in tmpl)


# ---------------------------------------------------------------- attention
@op("sdpa", "attention")
def _sdpa(g):
    q = g.pick("float", ndims=(3, 4), dtypes=("torch.float32",))
    if q is None:
        return None
    k = g.partner(q, "float", same_shape=True) or q
    v = g.partner(q, "float", same_shape=True) or q
    causal = g.rng.random() < 0.3
    return g.step(f"F.scaled_dot_product_attention({q.name}, {k.name}, {v.name}, is_causal={causal})",
                  [q, k, v])


@op("attention_pattern", "attention")
def _attn(g):
    q = g.pick("float", ndims=(3, 4), dtypes=("torch.float32",))
    if q is None:
        return None
    k = g.partner(q, "float", same_shape=True) or q
    v = g.partner(q, "float", same_shape=True) or q
    s = 1.0 / q.t.shape[-1] ** 0.5
    return g.step(f"torch.softmax({q.name} @ {k.name}.transpose(-2, -1) * {s!r}, -1) @ {v.name}",
                  [q, k, v])


# ---------------------------------------------------------------- views
@op("view", "view", 4.0)
def _view(g):
    a = g.pick("any", min_ndim=1)
    if a is None:
        return None
    sh, nd, r = list(a.t.shape), a.t.dim(), g.rng
    d = g.dim(a)
    choices = [f"{a.name}.transpose({d}, {g.dim(a)})", f"{a.name}.unsqueeze({r.randint(-nd - 1, nd)})",
               f"{a.name}.reshape(-1)", f"{a.name}.flatten({d})",
               f"{a.name}.permute({', '.join(map(str, r.sample(range(nd), nd)))})",
               f"{a.name}.view({', '.join(map(str, sh[:-1]))}{', ' if nd > 1 else ''}-1)",
               f"{a.name}.movedim({d}, {g.dim(a)})", f"{a.name}.contiguous()",
               f"{a.name}.view_as({a.name})"]
    if sh[d] > 1:
        lo = r.randrange(sh[d])
        hi = r.randint(lo + 1, sh[d])
        idx = ", ".join([":"] * d + [f"{lo}:{hi}:{r.choice([1, 1, 2])}"])
        choices += [f"{a.name}[{idx}]", f"{a.name}.narrow({d}, {lo}, {hi - lo})",
                    f"{a.name}.select({d}, {lo})", f"{a.name}[{', '.join([':'] * d + [str(lo)])}]"]
    if 1 in sh:
        i = sh.index(1)
        big = [s if j != i else r.randint(2, 4) for j, s in enumerate(sh)]
        choices += [f"{a.name}.expand({', '.join(map(str, big))})", f"{a.name}.squeeze({i})"]
    if nd == 2:
        choices += [f"{a.name}.t()", f"{a.name}.T"]
    return g.step(r.choice(choices), [a], exact=True)


@op("split", "view")
def _split(g):
    a = g.pick("any", min_ndim=1)
    if a is None:
        return None
    d = g.dim(a)
    n = a.t.shape[d]
    if n < 2:
        return None
    k = g.rng.randint(1, n - 1)
    kind = g.rng.choice(["split", "chunk", "unbind"]) if n <= 3 else g.rng.choice(["split", "chunk"])
    if kind == "split":
        return g.step(f"torch.split({a.name}, [{k}, {n - k}], {d})", [a], n_out=2, exact=True)
    if kind == "chunk":
        return g.step(f"{a.name}.chunk(2, {d})", [a], n_out=len(a.t.chunk(2, d)), exact=True)
    return g.step(f"{a.name}.unbind({d})", [a], n_out=n, exact=True)


# ---------------------------------------------------------------- data movement
@op("cat", "data", 1.5)
def _cat(g):
    a = g.pick("any", min_ndim=1)
    b = a and g.partner(a, "any", same_shape=True)
    if b is None:
        return None
    fn = g.rng.choice(["torch.cat", "torch.stack"])
    return g.step(f"{fn}([{a.name}, {b.name}], {g.dim(a)})", [a, b], exact=True)


@op("pad", "data")
def _pad(g):
    a = g.pick("num", min_ndim=1)
    return a and g.step(f"F.pad({a.name}, ({g.rng.randint(0, 2)}, {g.rng.randint(0, 2)}), "
                        f"value={g.rng.choice([0.0, 1.5])})", [a], exact=True)


@op("repeat", "data")
def _repeat(g):
    a = g.pick("any", min_ndim=1)
    return a and g.step(f"{a.name}.repeat({', '.join(str(g.rng.choice([1, 2])) for _ in a.t.shape)})",
                        [a], exact=True)


@op("index_select", "data")
def _index_select(g):
    a = g.pick("any", min_ndim=1)
    if a is None:
        return None
    d = g.dim(a)
    idx = [g.rng.randrange(a.t.shape[d]) for _ in range(g.rng.randint(1, 3))] if a.t.shape[d] else []
    if not idx:
        return None
    tmpl = g.rng.choice([f"{a.name}.index_select({d}, torch.tensor({idx}))",
                         f"{a.name}[{', '.join([':'] * d + [f'torch.tensor({idx})'])}]"])
    return g.step(tmpl, [a], exact=True)


@op("gather", "data", 0.5)
def _gather(g):
    a = g.pick("any", min_ndim=1)
    i = a and g.pick("int", ndims=(a.t.dim(),))
    if i is None:
        return None
    d = g.dim(a)
    return g.step(f"torch.gather({a.name}, {d}, {i.name}.remainder({a.t.shape[d]}))", [a, i], exact=True)


@op("tril", "data", 0.5)
def _tril(g):
    a = g.pick("any", min_ndim=2)
    return a and g.step(f"torch.{g.rng.choice(['tril', 'triu'])}({a.name}, {g.rng.randint(-1, 1)})",
                        [a], exact=True)


@op("cast", "data")
def _cast(g):
    a = g.pick("float")
    dt = g.rng.choice(["torch.float32", "torch.float16", "torch.bfloat16", "torch.float64"])
    return a and g.step(f"{a.name}.to({dt})", [a], exact=True)


@op("clone", "data", 0.5)
def _clone(g):
    a = g.pick("any")
    return a and g.step(f"{a.name}.clone()", [a], exact=True)


# ---------------------------------------------------------------- in-place
_INPLACE = ["{a}.add_({b})", "{a}.mul_({b})", "{a}.sub_({b})", "{a}.mul_(2.0)", "{a}.add_(1.5)",
            "{a}.relu_()", "{a}.clamp_(-1.0, 1.0)", "{a}.sigmoid_()", "{a}.zero_()", "{a}.fill_(0.5)",
            "{a}.copy_({b})", "{a}.masked_fill_({a} > 0, -2.0)", "{a}[0] = 3.0", "{a}[..., :1] = {b}[..., :1]",
            "{a}.div_(4.0)", "{a}.abs_()", "{a} += {b}", "{a}.neg_()"]


def _inplace(g, on_inputs: bool):
    a = g.pick("num", min_ndim=1, inplace_target=True, on_inputs=on_inputs)
    if a is None:
        return None
    tmpl = g.rng.choice(_INPLACE)
    b = g.partner(a, "num") if "{b}" in tmpl else None
    if "{b}" in tmpl and b is None:
        return None
    return g.step(tmpl.format(a=a.name, b=b.name if b else ""), [a] + ([b] if b else []),
                  inplace=a, exact=tmpl in ("{a}.zero_()", "{a}.fill_(0.5)", "{a}[0] = 3.0", "{a}.relu_()",
                                            "{a}.abs_()", "{a}.neg_()", "{a}.copy_({b})"))


@op("inplace", "inplace", 3.0)
def _inplace_mid(g):
    return _inplace(g, False)


@op("input_mut", "input_mut")
def _inplace_input(g):
    return _inplace(g, True)


# ---------------------------------------------------------------- random (checked through sinks)
# two draws must differ: drawn in float64, where a collision has probability ~2^-53 per
# element (in bf16 two uniform draws collide about once in 256)
_RANDOM = ["torch.rand_like({a}, dtype=torch.float64) != torch.rand_like({a}, dtype=torch.float64)",
           "(torch.rand_like({a}, dtype=torch.float64) - torch.rand_like({a}, dtype=torch.float64)).abs() > 0",
           "(torch.rand_like({a}) >= 0) & (torch.rand_like({a}) < 1)",
           "torch.randn_like({a}).isfinite()",
           "(F.dropout({a}.nan_to_num(1.0, 1.0, 1.0) + 1e4, 0.5, True) == 0).sum() < {a}.numel() + 1",
           "F.dropout({a}.nan_to_num(1.0, 1.0, 1.0).abs() + 1.0, 0.5, True) != "
           "F.dropout({a}.nan_to_num(1.0, 1.0, 1.0).abs() + 1.0, 0.5, True) * 0.0"]


@op("random", "random")
def _random(g):
    a = g.pick("float")
    return a and g.step(g.rng.choice(_RANDOM).format(a=a.name), [a], exact=True)


# ---------------------------------------------------------------- host fallbacks (no converter)
@op("fallback", "fallback", 2.0)
def _fallback(g):
    a = g.pick("float", min_ndim=1)
    if a is None:
        return None
    d = g.dim(a)
    nd = a.t.dim()
    choices = [(f"torch.flip({a.name}, [{d}])", True), (f"torch.roll({a.name}, 1, {d})", True),
               (f"torch.cumprod({a.name}, {d})", False), (f"torch.atan2({a.name}, {a.name} + 1)", False),
               (f"torch.log1p({a.name})", False), (f"torch.expm1({a.name})", False),
               (f"torch.isinf({a.name})", True), (f"F.elu({a.name})", False), (f"F.softplus({a.name})", False),
               (f"torch.sort({a.name}, {d})[0]", True), (f"torch.topk({a.name}, 1, {d})[0]", True),
               (f"{a.name}.prod({d})", False), (f"torch.linalg.vector_norm({a.name}, dim={d})", False)]
    if a.exact:
        choices += [(f"torch.round({a.name})", True), (f"torch.trunc({a.name} * 2)", True),
                    (f"torch.remainder({a.name}, 1.5)", True), (f"torch.sort({a.name}, {d})[1]", True),
                    (f"torch.min({a.name}, {d})[1]", True)]
    if nd >= 2:   # view-returning fallbacks
        choices += [(f"{a.name}.diagonal(0, {d}, {(d + 1) % nd})", True),
                    (f"{a.name}.unfold({d}, 1, 1)", True)]
    expr, exact = g.rng.choice(choices)
    return g.step(expr, [a], exact=exact)


# ---------------------------------------------------------------- duplicate expressions (CSE)
@op("dup", "dup", 1.5)
def _dup(g):
    return g.duplicate()


def op_table(ops: Optional[List[str]] = None, kinds: Optional[List[str]] = None) -> List[FuzzOp]:
    """The ops enabled by the ``--op`` names and ``--kinds`` groups (None: all). Raises
    ValueError naming an unknown op or group."""
    names = {o.name for o in OPS}
    groups = {o.group for o in OPS}
    for n in ops or []:
        if n not in names and n not in groups:
            raise ValueError(f"unknown fuzz op {n!r}; known: {sorted(names)}")
    for k in kinds or []:
        if k not in groups and k not in FEATURES:
            raise ValueError(f"unknown fuzz kind {k!r}; known: {sorted(groups | set(FEATURES))}")
    out = [o for o in OPS if (ops is None or o.name in ops or o.group in ops)
           and (kinds is None or o.group in kinds)]
    if not out:
        raise ValueError("no fuzz op left after the --op/--kinds filters")
    return out


# input features, selected by --kinds as well (a kinds list without any of them keeps all)
FEATURES: Dict[str, str] = {"special": "NaN/Inf/denormal/-0 input values",
                            "lowp": "float16/bfloat16 inputs",
                            "ints": "int64/int32/bool inputs",
                            "multi_out": "several outputs, aliasing each other or the inputs"}
