"""Differential fuzzing: random small programs, compiled, checked against eager PyTorch.

    from opencann.tools.fuzz import generate, run_fuzz
    prog = generate(seed=3)            # a random torch.nn.Module program, as Python source
    print(prog.source())               # standalone: class M, make_inputs(seed)
    res = run_fuzz(cases=200, seed=0, backends=["opencann"])
    print(res.summary())               # failures grouped by backend and check, minimal repros

A program is a list of steps over live values (``v7 = torch.relu(v3)``, ``v3.add_(v1)``,
``v8, v9 = v2.chunk(2, 1)``), drawn from the op table in `opencann.tools.fuzz_ops` with a
seeded ``random.Random`` (a seed is a repro; hypothesis was not used because its shrinker
does not know that removing a step removes the steps that read its values). Each step is
run eagerly while generating and kept only if eager PyTorch accepts it.

Each program runs through a backend (``opencann`` = ``opencann.compile``, ``vnpu`` =
``opencann.compile(device="vnpu:ascend910b")``, ``dynamo`` = ``torch.compile(backend=
"opencann", dynamic=False)``, ``flash`` = opencann with ``fuse_flash_attention``, only for
programs with attention) and is compared with a fresh eager run per call; the checks
(`CHECKS`) are listed there. A failing program is shrunk (delta debugging over its steps,
outputs, special input values and unused inputs) to a minimal standalone repro.
Errors: ValueError for an unknown backend, check, op or kind.
"""
from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .fuzz_ops import FEATURES, FuzzOp, op_table

BACKENDS = ("opencann", "vnpu", "dynamo", "flash")
VNPU = "vnpu:ascend910b"
CHECKS = {
    "error": "compiling or calling raised (eager did not)",
    "meta": "an output's shape, dtype or strides differ from eager's",
    "values": "values differ beyond the dtype's tolerance (relative to the output's scale)",
    "nan": "NaN/+Inf/-Inf positions differ",
    "input-mutation": "the inputs after the call differ from eager's inputs after the call",
    "second-call": "a second call (other inputs) changed the first call's outputs",
    "alias": "writing into one output changes other outputs/inputs differently than in eager",
    "threads": "calls from two threads at once give wrong values",
    "weights": "weights changed through .data after compiling: neither an error, the old (snapshot) nor the new result",
}
TOL = {torch.float32: 1e-4, torch.float64: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
MAX_NUMEL = 2048


# ------------------------------------------------------------------ programs
@dataclass
class InputSpec:
    """One input of a fuzz program: its variable name, shape, dtype name ('float32', 'int64',
    'bool', ...) and special values (flat index, Python literal source such as 'nan') written
    into it."""
    name: str
    shape: Tuple[int, ...]
    dtype: str                                   # "float32", "int64", "bool"...
    specials: List[Tuple[int, str]] = field(default_factory=list)  # (flat index, value source)

    def source(self) -> str:
        """The lines of ``make_inputs`` that create this input from generator ``g``: ``randn`` for
        floats (cast to the dtype), ``randint(-8, 9)`` for ints, ``rand > 0.5`` for bool, then
        the special values."""
        shape = ", ".join(map(str, self.shape)) + ("," if len(self.shape) == 1 else "")
        if self.dtype == "bool":
            s = f"    {self.name} = torch.rand(({shape}), generator=g) > 0.5"
        elif self.dtype.startswith("int"):
            s = f"    {self.name} = torch.randint(-8, 9, ({shape}), generator=g).to(torch.{self.dtype})"
        else:
            cast = "" if self.dtype == "float32" else f".to(torch.{self.dtype})"
            s = f"    {self.name} = torch.randn(({shape}), generator=g){cast}"
        if self.specials:
            idx = [i for i, _ in self.specials]
            vals = ", ".join(v for _, v in self.specials)
            s += (f"\n    {self.name}.view(-1)[{idx}] = torch.tensor([{vals}], "
                  f"dtype={self.name}.dtype)")
        return s


@dataclass
class Step:
    """One step of a fuzz program: a Python expression over earlier values (``uses``) assigned to
    ``outs`` (none for an in-place step on ``inplace``), its op name and group, the module
    ``__init__`` lines it needs, and whether its result is exact (bit-identical across
    backends)."""
    expr: str
    uses: List[str]
    outs: List[str]
    op: str
    group: str
    inits: List[str] = field(default_factory=list)  # module __init__ lines
    inplace: Optional[str] = None
    exact: bool = False

    def line(self) -> str:
        """The step as one line of ``forward``: ``outs = expr``, or ``expr`` alone for an in-place
        step."""
        return f"{', '.join(self.outs)} = {self.expr}" if self.outs else self.expr


@dataclass
class Program:
    """A generated fuzz program: its seed, inputs, steps and returned value names; `source` writes
    it as standalone Python."""
    seed: int
    inputs: List[InputSpec]
    steps: List[Step]
    outputs: List[str]

    @property
    def tol(self) -> float:
        """Relative and absolute tolerance of value checks: 5e-2 with bfloat16 in the program, 1e-2
        with float16, else 1e-4."""
        src = self.source()
        return 5e-2 if "bfloat16" in src else 1e-2 if "float16" in src else 1e-4

    @property
    def has_attention(self) -> bool:
        """Whether a step is of the 'attention' group (scaled_dot_product_attention)."""
        return any(s.group == "attention" for s in self.steps)

    def ops(self) -> List[str]:
        """The op names the steps use, sorted, without repeats."""
        return sorted({s.op for s in self.steps})

    def source(self) -> str:
        """The program as standalone Python: ``class M`` and ``make_inputs(seed)``."""
        inits = [i for s in self.steps for i in s.inits]
        lines = ["import torch", "import torch.nn.functional as F", "",
                 'nan, inf = float("nan"), float("inf")', "", "",
                 "class M(torch.nn.Module):", "    def __init__(self):",
                 "        super().__init__()", "        torch.manual_seed(0)"]
        lines += ["        " + i for i in inits]
        names = ", ".join(["self"] + [i.name for i in self.inputs])
        lines += ["", f"    def forward({names}):"]
        lines += ["        " + s.line() for s in self.steps]
        lines += [f"        return ({', '.join(self.outputs)},)" if self.outputs else "        return ()", "", "",
                  "def make_inputs(seed=0):", "    g = torch.Generator().manual_seed(seed)"]
        lines += [i.source() for i in self.inputs]
        lines += [f"    return ({', '.join(i.name for i in self.inputs)},)", ""]
        return "\n".join(lines)

    def namespace(self) -> dict:
        """The globals of `source` after running it (``M``, ``make_inputs``). Raises what the
        program raises at definition (a generator bug)."""
        ns: dict = {}
        exec(compile(self.source(), f"<fuzz program {self.seed}>", "exec"), ns)  # noqa: S102
        return ns


@dataclass
class Val:
    """A value of a program being generated: its variable name, a sample tensor (computed eagerly
    as it grows), whether it is exact, and whether it is a program input."""
    name: str
    t: torch.Tensor
    exact: bool
    is_input: bool = False


def _kind_ok(t: torch.Tensor, kind: str) -> bool:
    if kind == "any":
        return True
    if kind == "bool":
        return t.dtype == torch.bool
    if kind == "float":
        return t.dtype.is_floating_point
    if kind == "int":
        return not t.dtype.is_floating_point and t.dtype != torch.bool
    return t.dtype != torch.bool  # num


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class Gen:
    """Generation state handed to the op builders of `opencann.tools.fuzz_ops`."""

    def __init__(self, rng: random.Random, vals: List[Val]):
        self.rng, self.vals = rng, vals
        self.steps: List[Step] = []
        self.pending: List[str] = []
        self.n_modules = 0

    def _recent(self, cands: List[Val]) -> Optional[Val]:
        if not cands:
            return None
        if self.rng.random() < 0.6:
            cands = cands[-4:]
        return self.rng.choice(cands)

    def pick(self, kind: str, exact: bool = False, min_ndim: int = 0, ndims=None, dtypes=None,
             inplace_target: bool = False, on_inputs: bool = False) -> Optional[Val]:
        """A random earlier value of ``kind`` ('any', 'bool', 'float', 'int', 'num') meeting the
        filters (exact, rank, dtypes; for in-place targets: on a program input or not, never
        expanded), preferring recent ones; None if there is none."""
        inputs = {_storage(v.t) for v in self.vals if v.is_input}
        out = []
        for v in self.vals:
            t = v.t
            if not _kind_ok(t, kind) or (exact and not v.exact) or t.dim() < min_ndim:
                continue
            if ndims is not None and t.dim() not in ndims:
                continue
            if dtypes is not None and str(t.dtype) not in dtypes:
                continue
            if inplace_target and ((_storage(t) in inputs) != on_inputs or 0 in t.stride()):
                continue
            out.append(v)
        return self._recent(out)

    def partner(self, a: Val, kind: str, same_shape: bool = False, exact: bool = False) -> Optional[Val]:
        """A second operand for ``a``: a value of ``kind`` with ``a``'s shape or (unless
        ``same_shape``) one that broadcasts with it; None if there is none."""
        same, bcast = [], []
        for v in self.vals:
            if not _kind_ok(v.t, kind) or (exact and not v.exact):
                continue
            if v.t.shape == a.t.shape:
                same.append(v)
            elif not same_shape:
                try:
                    if torch.broadcast_shapes(v.t.shape, a.t.shape) == a.t.shape or self.rng.random() < 0.3:
                        bcast.append(v)
                except RuntimeError:
                    pass
        if same and (not bcast or self.rng.random() < 0.6):
            return self.rng.choice(same)
        return self._recent(bcast)

    def dim(self, a: Val) -> int:
        """A random dim of ``a``, negative (counted from the end) one time in four."""
        d = self.rng.randrange(a.t.dim())
        return d - a.t.dim() if self.rng.random() < 0.25 else d

    def module(self, ctor: str, inits: Sequence[str] = ()) -> str:
        """Register a submodule ``self.m<k> = ctor`` (plus ``inits``, formatted with ``m``) for the
        next step; returns its attribute name."""
        name = f"self.m{self.n_modules}"
        self.n_modules += 1
        self.pending += [f"{name} = {ctor}"] + [i.format(m=name) for i in inits]
        return name

    def step(self, expr: str, uses: List[Val], n_out: int = 1, exact: bool = False,
             inplace: Optional[Val] = None) -> "Step":
        """A `Step` for ``expr`` over ``uses`` with ``n_out`` outputs (names filled in by the
        caller), the pending module lines, in place on ``inplace`` when given; exact only if
        every input is."""
        return Step(expr, sorted({u.name for u in uses}), [] if inplace else [""] * n_out, "", "",
                    list(self.pending), inplace.name if inplace else None,
                    exact and all(u.exact for u in uses))

    def duplicate(self) -> Optional[Step]:
        """A repeat of one of the last five value-producing steps (exercises CSE and output
        aliasing), or None."""
        cands = [s for s in self.steps if s.outs and s.group not in ("random", "dup")]
        if not cands:
            return None
        s = self.rng.choice(cands[-5:])
        return Step(s.expr, list(s.uses), [""] * len(s.outs), "", "", [], None, s.exact)


_SPECIALS = {"float32": ["nan", "inf", "-inf", "1e-40", "-0.0", "1e30"],
             "float16": ["nan", "inf", "-inf", "1e-6", "-0.0", "30000.0"],
             "bfloat16": ["nan", "inf", "-inf", "1e-39", "-0.0", "1e30"]}


def _input_specs(rng: random.Random, features: set, table: List[FuzzOp]) -> List[InputSpec]:
    groups = {o.group for o in table}
    want4d = bool(groups & {"conv", "attention"}) and rng.random() < 0.5
    if want4d:
        base = [rng.randint(1, 2), rng.randint(1, 4), rng.randint(2, 5), rng.randint(2, 5)]
    else:
        base = [rng.randint(1, 5) for _ in range(rng.randint(1, 3))]
    fdt = "float32"
    if "lowp" in features and rng.random() < 0.2:
        fdt = rng.choice(["float16", "bfloat16"])
    specs = []
    for i in range(rng.choice([1, 2, 2, 3])):
        shape = list(base)
        r = rng.random()
        if i and r < 0.25:
            shape = shape[rng.randrange(len(shape)):]               # trailing dims (broadcast)
        elif i and r < 0.45:
            shape[rng.randrange(len(shape))] = 1                      # a broadcast dim
        elif i and r < 0.55:
            shape[-1] = rng.randint(1, 5)                              # matmul partner
        dt = fdt
        if "ints" in features and rng.random() < 0.2:
            dt = rng.choice(["int64", "int32", "bool"])
        elif "lowp" in features and rng.random() < 0.05:
            dt = rng.choice(["float16", "bfloat16"])
        spec = InputSpec(f"x{i}", tuple(shape), dt)
        n = 1
        for s in shape:
            n *= s
        if "special" in features and dt in _SPECIALS and rng.random() < 0.35:
            idx = sorted(rng.sample(range(n), min(n, rng.randint(1, 3))))
            spec.specials = [(j, rng.choice(_SPECIALS[dt])) for j in idx]
        specs.append(spec)
    return specs


def generate(seed: int, ops: Optional[List[str]] = None, kinds: Optional[List[str]] = None,
             max_steps: int = 10) -> Program:
    """A random program from ``seed`` (same seed, same program). ``ops``/``kinds`` filter
    the op table (`opencann.tools.fuzz_ops.op_table`); feature names in ``kinds``
    (special, lowp, ints, multi_out) switch input features on, all on when none is named."""
    table = op_table(ops, [k for k in kinds if k not in FEATURES] or None if kinds else None)
    features = set(FEATURES) if not kinds or not set(kinds) & set(FEATURES) else set(kinds) & set(FEATURES)
    rng = random.Random(seed)
    specs = _input_specs(rng, features, table)
    prog = Program(seed, specs, [], [])
    env = prog.namespace()
    holder = torch.nn.Module()
    env["self"] = holder
    tensors = env["make_inputs"](0)
    g = Gen(rng, [Val(s.name, t, True, True) for s, t in zip(specs, tensors)])
    env.update({s.name: t for s, t in zip(specs, tensors)})
    weights = [o.weight for o in table]
    n_steps, tries = rng.randint(2, max_steps), 0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while len(g.steps) < n_steps and tries < 12 * n_steps:
            tries += 1
            fop = rng.choices(table, weights)[0]
            g.pending = []
            try:
                st = fop.build(g)
            except (IndexError, ValueError):
                continue
            if st is None:
                continue
            st.op, st.group = (st.op or fop.name), ("dup" if fop.group == "dup" else fop.group)
            base = len(g.vals)
            st.outs = [f"v{base + k}" for k in range(len(st.outs))]
            try:
                for line in st.inits:
                    exec(line, env)  # noqa: S102
                exec(st.line(), env)  # noqa: S102
            except Exception:  # noqa: BLE001 - eager refused: propose another step
                continue
            new = [env[o] for o in st.outs]
            if not all(isinstance(t, torch.Tensor) and 0 < t.numel() <= MAX_NUMEL and t.dim() <= 5
                       for t in new):
                continue
            if st.inplace:
                tgt = _storage(env[st.inplace])
                for v in g.vals:
                    if _storage(v.t) == tgt:
                        v.exact = v.exact and st.exact
            g.vals += [Val(o, t, st.exact) for o, t in zip(st.outs, new)]
            g.steps.append(st)
    prog.steps = g.steps
    prog.outputs = _pick_outputs(rng, g, "multi_out" in features)
    return prog


def _pick_outputs(rng: random.Random, g: Gen, multi: bool) -> List[str]:
    used = {u for s in g.steps for u in s.uses}
    made = [v.name for v in g.vals if not v.is_input]
    leaves = [n for n in made if n not in used] or made or [g.vals[0].name]
    n = rng.choice([1, 1, 2, 2, 3, 4]) if multi else 1
    outs = [leaves[-1]]
    for _ in range(n - 1):
        r = rng.random()
        pool = leaves if r < 0.5 else [v.name for v in g.vals]
        outs.append(rng.choice(pool))                     # duplicates and inputs allowed
    return outs


# ------------------------------------------------------------------ checking
@dataclass
class Failure:
    """One failed check: the backend ('opencann', 'vnpu', 'dynamo', 'flash'), the check ('error',
    'values', 'nan', 'alias', ...) and what went wrong."""
    backend: str
    check: str
    detail: str

    def key(self) -> Tuple[str, str, str]:
        """What makes two failures the same bug when shrinking: backend, check and, for errors, the
        message up to its first ':'."""
        return (self.backend, self.check, self.detail.split(":")[0] if self.check == "error" else "")

    def __str__(self) -> str:
        return f"[{self.backend}] {self.check}: {self.detail}"


def _clone(ts):
    return [t.clone() for t in ts]


def _tuple(o) -> list:
    return list(o) if isinstance(o, (tuple, list)) else [o]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality with NaN equal to NaN (a write into one shows up here)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _compare(got, ref: torch.Tensor, tol: float, what: str) -> Optional[Tuple[str, str]]:
    if not isinstance(got, torch.Tensor):
        return "meta", f"{what} is {type(got).__name__}, eager gives a tensor"
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return "meta", (f"{what} is {str(got.dtype)[6:]}{list(got.shape)}, eager "
                        f"{str(ref.dtype)[6:]}{list(ref.shape)}")
    if not ref.dtype.is_floating_point:
        if not torch.equal(got, ref):
            n = int((got != ref).sum())
            return "values", f"{what}: {n} of {ref.numel()} elements differ (exact dtype {str(ref.dtype)[6:]})"
        return None
    g, r = got.double(), ref.double()
    for name, fn in (("NaN", torch.isnan), ("+Inf", lambda t: t == float("inf")),
                     ("-Inf", lambda t: t == -float("inf"))):
        if not torch.equal(fn(g), fn(r)):
            return "nan", (f"{what}: {name} at {int(fn(g).sum())} positions, eager at "
                           f"{int(fn(r).sum())} ({int((fn(g) != fn(r)).sum())} differ)")
    fin = torch.isfinite(r)
    if fin.any():
        tol = max(tol, TOL.get(ref.dtype, 1e-4))
        scale = float(r[fin].abs().max())
        err = (g[fin] - r[fin]).abs()
        bad = err > tol * scale + tol * r[fin].abs() + 1e-30
        if bad.any():
            return "values", (f"{what}: max |diff| {float(err.max()):.3g} at scale {scale:.3g} "
                              f"({int(bad.sum())} of {ref.numel()} beyond tol {tol:g})")
    return None


def _strides_differ(got: torch.Tensor, ref: torch.Tensor) -> bool:
    return any(gs != rs for gs, rs, n in zip(got.stride(), ref.stride(), ref.shape) if n > 1)


def _check_call(fails, backend, outs, ref_outs, ins, ref_ins, tol, nondet, tag):
    if len(outs) != len(ref_outs):
        fails.append(Failure(backend, "meta", f"{len(outs)} outputs, eager {len(ref_outs)}"))
        return
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        if i in nondet:
            continue
        bad = _compare(o, r, tol, f"{tag} output {i}")
        if bad:
            fails.append(Failure(backend, *bad))
        elif _strides_differ(o, r):
            fails.append(Failure(backend, "meta", f"{tag} output {i} strides {o.stride()}, "
                                 f"eager {r.stride()} (shape {list(r.shape)})"))
    for k, (a, b) in enumerate(zip(ins, ref_ins)):
        bad = _compare(a, b, tol, f"{tag} input {k} after the call")
        if bad:
            fails.append(Failure(backend, "input-mutation", bad[1]))


_FILL = {torch.bool: None, torch.float16: 1234.0, torch.bfloat16: 1234.0}


def _write_effects(call, inputs, i) -> Optional[frozenset]:
    """Call, write into output ``i``; which other outputs ('o<j>') and inputs ('x<k>')
    changed. None when the write itself raises (e.g. an expanded output)."""
    ins = _clone(inputs)
    outs = _tuple(call(ins))
    if i >= len(outs):
        return None
    before = [_clone(outs), _clone(ins)]
    try:
        o = outs[i]
        if o.dtype == torch.bool:
            o.logical_not_()
        else:
            o.fill_(123 if not o.dtype.is_floating_point else 1234.0)
    except RuntimeError:
        return None
    changed = {f"o{j}" for j, (a, b) in enumerate(zip(outs, before[0])) if j != i and not _same_bits(a, b)}
    changed |= {f"x{k}" for k, (a, b) in enumerate(zip(ins, before[1])) if not _same_bits(a, b)}
    return frozenset(changed)


@contextlib.contextmanager
def _quiet():
    lg = logging.getLogger("opencann")
    level = lg.level
    lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        lg.setLevel(level)


def _build(backend: str, m: torch.nn.Module, example: list):
    import opencann
    if backend == "opencann":
        return opencann.compile(m, tuple(_clone(example)))
    if backend == "vnpu":
        return opencann.compile(m, tuple(_clone(example)), device=VNPU)
    if backend == "flash":
        return opencann.compile(m, tuple(_clone(example)), options={"enable": ["fuse_flash_attention"]})
    if backend == "dynamo":
        torch._dynamo.reset()
        return torch.compile(m, backend="opencann", dynamic=False)
    raise ValueError(f"unknown fuzz backend {backend!r}; known: {list(BACKENDS)}")


def check_module(make_model: Callable[[], torch.nn.Module], make_inputs: Callable[[int], tuple],
                 backend: str = "opencann", tol: float = 1e-4,
                 checks: Optional[Sequence[str]] = None) -> Optional[List[Failure]]:
    """Compile ``make_model()`` (a fresh module) with ``backend`` on ``make_inputs(0)`` and
    compare with eager on ``make_inputs(0)`` and ``make_inputs(1)``; returns the failures
    (`Failure`: backend, check from `CHECKS`, detail), [] when all pass, or None when eager
    itself raises (an invalid program)."""
    checks = set(checks or CHECKS)
    fails: List[Failure] = []
    inA, inB = list(make_inputs(0)), list(make_inputs(1))
    m = make_model().eval().requires_grad_(False)

    def eager(ins):
        ins = _clone(ins)
        outs = _tuple(m(*ins))
        return outs, ins

    with _quiet(), _reference_attention(backend):
        try:
            refA, refA_in = eager(inA)
            refB, refB_in = eager(inB)
            refB2, _ = eager(inB)
        except Exception:  # noqa: BLE001 - not a valid program
            return None
        nondet = {i for i, (a, b) in enumerate(zip(refB, refB2)) if not _same_bits(a, b)}
        try:
            cm = _build(backend, m, inA)
            a_in = _clone(inA)
            outsA = _tuple(cm(*a_in))
            snap = _clone([o for o in outsA if isinstance(o, torch.Tensor)])
            _check_call(fails, backend, outsA, refA, a_in, refA_in, tol, nondet, "call 1")
            b_in = _clone(inB)
            outsB = _tuple(cm(*b_in))
            _check_call(fails, backend, outsB, refB, b_in, refB_in, tol, nondet, "call 2")
            if "second-call" in checks:
                for i, (o, s) in enumerate(zip([o for o in outsA if isinstance(o, torch.Tensor)], snap)):
                    if i not in nondet and not _same_bits(o, s):
                        fails.append(Failure(backend, "second-call",
                                             f"call 1 output {i} changed by call 2"))
            if "alias" in checks:
                _check_alias(fails, backend, cm, m, inB, len(refB))
            if "threads" in checks and backend != "dynamo":
                _check_threads(fails, backend, cm, inA, inB, refA, refB, tol, nondet)
            if "weights" in checks and any(True for _ in m.parameters()):
                _check_weights(fails, backend, cm, m, inA, tol, nondet)
        except Exception as e:  # noqa: BLE001 - the backend raised: that is the finding
            msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            fails.append(Failure(backend, "error", f"{type(e).__name__}: {msg}"))
    # one record per check: the first finding, with how many more there were
    out: Dict[str, Failure] = {}
    more: Dict[str, int] = {}
    for f in fails:
        if f.check in checks:
            more[f.check] = more.get(f.check, -1) + 1
            out.setdefault(f.check, f)
    return [replace(f, detail=f.detail + (f" (+{more[c]} more)" if more[c] else ""))
            for c, f in out.items()]


def _reference_attention(backend: str):
    """For the ``flash`` backend, eager's SDPA runs its math backend (the definition):
    torch's CPU flash kernel drops a NaN query's NaN from the row max when the key length
    is not a multiple of its vector width (0 where the math backend gives NaN), and
    opencann's FlashAttention follows the math backend (docs/guide/flash_attention.md)."""
    if backend != "flash":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.MATH)


def _check_alias(fails, backend, cm, m, inputs, n_out):
    for i in range(n_out):
        want = _write_effects(lambda ins: m(*ins), inputs, i)
        if want is None:
            continue
        got = _write_effects(lambda ins: cm(*ins), inputs, i)
        if got is not None and got != want:
            fails.append(Failure(backend, "alias", f"writing output {i} changed "
                                 f"{sorted(got) or 'nothing'}; in eager {sorted(want) or 'nothing'}"))


def _check_threads(fails, backend, cm, inA, inB, refA, refB, tol, nondet):
    bad: List[str] = []

    def work(ins, ref):
        for _ in range(3):
            try:
                outs = _tuple(cm(*_clone(ins)))
            except Exception as e:  # noqa: BLE001
                bad.append(f"{type(e).__name__}: {e}"[:200])
                return
            for i, (o, r) in enumerate(zip(outs, ref)):
                if i not in nondet and _compare(o, r, tol, f"output {i}"):
                    bad.append(f"output {i} wrong")
    ts = [threading.Thread(target=work, args=a) for a in ((inA, refA), (inB, refB))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if bad:
        fails.append(Failure(backend, "threads", f"two threads calling at once: {bad[0]}"))


def _check_weights(fails, backend, cm, m, inA, tol, nondet):
    """Weights changed through ``.data`` after compiling: the compiled model must give
    the old weights' result (a snapshot, `opencann.compile`) or the new weights' result
    (live parameters, ``torch.compile``) for every output, or refuse with ValueError;
    never a mix of the two."""
    old = _tuple(m(*_clone(inA)))
    for p in m.parameters():
        p.data.mul_(-0.5).add_(0.25)
    new = _tuple(m(*_clone(inA)))
    try:
        outs = _tuple(cm(*_clone(inA)))
    except ValueError:
        return  # refused with an error: the documented contract
    for ref in (old, new):
        if not any(i not in nondet and _compare(o, r, tol, f"output {i}")
                   for i, (o, r) in enumerate(zip(outs, ref))):
            return
    fails.append(Failure(backend, "weights", "after changing weights through .data the "
                         "outputs are neither the old weights' (snapshot) nor the new weights' "
                         "result"))


def check_program(prog: Program, backend: str, checks=None) -> Optional[List[Failure]]:
    """`check_module` on a `Program` (None: eager rejects the program)."""
    if backend == "flash" and not prog.has_attention:
        return []
    try:
        ns = prog.namespace()
    except Exception:  # noqa: BLE001
        return None
    return check_module(ns["M"], ns["make_inputs"], backend, prog.tol, checks)


# ------------------------------------------------------------------ shrinking
def _without(prog: Program, drop: set) -> Optional[Program]:
    gone: set = set()
    steps = []
    for i, s in enumerate(prog.steps):
        if i in drop or any(u in gone for u in s.uses):
            gone |= set(s.outs)
            continue
        steps.append(s)
    outs = [o for o in prog.outputs if o not in gone]
    return replace(prog, steps=steps, outputs=outs) if outs else None


def shrink(prog: Program, failure: Failure, checks=None, budget: int = 80) -> Program:
    """The smallest program found (within ``budget`` compiles) that still fails with
    ``failure``'s backend and check: delta debugging over steps, then outputs, special
    input values and unused inputs."""
    key = failure.key()
    calls = [0]

    def fails(p: Optional[Program]) -> bool:
        if p is None or calls[0] >= budget:
            return False
        calls[0] += 1
        got = check_program(p, failure.backend, checks)
        return bool(got) and any(f.key() == key for f in got)

    prog = _ddmin(prog, fails, calls, budget)
    # an output made by a step: try returning one of the step's operands instead
    producers = {o: s for s in prog.steps for o in s.outs}
    for k, o in enumerate(list(prog.outputs)):
        for u in producers[o].uses if o in producers else []:
            cand = replace(prog, outputs=prog.outputs[:k] + [u] + prog.outputs[k + 1:])
            if fails(cand):
                prog = _ddmin(cand, fails, calls, budget)
                break
    for o in list(prog.outputs):
        if len(prog.outputs) > 1:
            cand = replace(prog, outputs=[x for x in prog.outputs if x != o])
            if fails(cand):
                prog = cand
    prog = _ddmin(prog, fails, calls, budget)
    for k, spec in enumerate(prog.inputs):
        if spec.specials:
            ins = list(prog.inputs)
            ins[k] = replace(spec, specials=[])
            if fails(replace(prog, inputs=ins)):
                prog = replace(prog, inputs=ins)
    used = {u for s in prog.steps for u in s.uses} | set(prog.outputs)
    unused = [s for s in prog.inputs if s.name not in used]
    if unused and fails(replace(prog, inputs=[s for s in prog.inputs if s.name in used])):
        prog = replace(prog, inputs=[s for s in prog.inputs if s.name in used])
    return prog


def _ddmin(prog: Program, fails, calls, budget) -> Program:
    """Delta debugging over the steps (dropping a step drops the steps reading it)."""
    n = 2
    while len(prog.steps) >= 1 and calls[0] < budget:
        size = max(1, len(prog.steps) // n)
        progress = False
        for start in range(0, len(prog.steps), size):
            cand = _without(prog, set(range(start, start + size)))
            if fails(cand):
                prog, progress = cand, True
                break
        if not progress:
            if size == 1:
                break
            n = min(len(prog.steps), n * 2)
    return prog


def repro_source(prog: Program, failure: Failure) -> str:
    """A standalone script: the program, then a call of `check_module` printing failures."""
    return (f"# opencann fuzz repro (seed {prog.seed}): {failure}\n"
            f"# ops: {', '.join(prog.ops())}\n" + prog.source() +
            "\n\nif __name__ == \"__main__\":\n"
            "    from opencann.tools.fuzz import check_module\n"
            f"    for f in check_module(M, make_inputs, {failure.backend!r}, tol={prog.tol!r}):\n"
            "        print(f)\n")


# ------------------------------------------------------------------ driver
@dataclass
class FuzzResult:
    """The outcome of `run_fuzz`: cases generated, runs per backend, invalid programs (eager itself
    failed), failures as (failure, minimal program, repro path) and wall time in seconds."""
    cases: int = 0
    runs: Dict[str, int] = field(default_factory=dict)
    invalid: int = 0
    failures: List[Tuple[Failure, Program, str]] = field(default_factory=list)  # (failure, minimal, path)
    seconds: float = 0.0

    def summary(self) -> str:
        """A text summary: counts, then failures grouped by backend and check (up to 8 each, with
        seed, detail and ops)."""
        lines = [f"{self.cases} programs, runs per backend {self.runs}, {len(self.failures)} "
                 f"failures, {self.seconds:.0f} s" + (f", {self.invalid} invalid" if self.invalid else "")]
        groups: Dict[Tuple[str, str], list] = {}
        for f, p, path in self.failures:
            groups.setdefault((f.backend, f.check), []).append((f, p, path))
        for (b, c), items in sorted(groups.items()):
            lines.append(f"  {b:9s} {c:15s} x{len(items)}")
            for f, p, path in items[:8]:
                lines.append(f"      seed {p.seed}: {f.detail[:110]}  [{', '.join(p.ops())}]"
                             + (f" -> {path}" if path else ""))
        return "\n".join(lines)


def run_fuzz(cases: int = 100, seed: int = 0, backends: Sequence[str] = ("opencann",),
             ops: Optional[List[str]] = None, kinds: Optional[List[str]] = None,
             checks: Optional[List[str]] = None, out_dir: Optional[str] = None,
             max_steps: int = 10, shrink_budget: int = 60, max_shrinks: int = 20,
             every: Optional[Dict[str, int]] = None,
             progress: Optional[Callable[[str], None]] = None) -> FuzzResult:
    """Generate ``cases`` programs from seeds ``seed..seed+cases-1`` and check each with
    ``backends``; failures are shrunk (the first ``max_shrinks``) and, with ``out_dir``,
    written there as standalone repro scripts. ``every[b] = k`` runs backend b on every
    k-th case only (torch.compile is slower)."""
    for b in backends:
        if b not in BACKENDS:
            raise ValueError(f"unknown fuzz backend {b!r}; known: {list(BACKENDS)} or 'all'")
    for c in checks or []:
        if c not in CHECKS:
            raise ValueError(f"unknown fuzz check {c!r}; known: {sorted(CHECKS)}")
    op_table(ops, [k for k in kinds if k not in FEATURES] or None if kinds else None)  # validate
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    res = FuzzResult()
    t0 = time.perf_counter()
    seen_keys: set = set()
    for case in range(seed, seed + cases):
        prog = generate(case, ops, kinds, max_steps)
        res.cases += 1
        for b in backends:
            if every and case % every.get(b, 1):
                continue
            got = check_program(prog, b, checks)
            res.runs[b] = res.runs.get(b, 0) + 1
            if got is None:
                res.invalid += 1
                continue
            for f in got:
                small = prog
                if len(res.failures) < max_shrinks and shrink_budget:
                    small = shrink(prog, f, checks, shrink_budget)
                path = ""
                if out_dir:
                    path = os.path.join(out_dir, f"seed{case}_{b}_{f.check}.py")
                    with open(path, "w") as fh:
                        fh.write(repro_source(small, f))
                res.failures.append((f, small, path))
                if progress and f.key() not in seen_keys:
                    progress(f"seed {case}: {f}")
                seen_keys.add(f.key())
        if progress and (case - seed + 1) % 50 == 0:
            progress(f"{case - seed + 1}/{cases} programs, {len(res.failures)} failures, "
                     f"{time.perf_counter() - t0:.0f} s")
    res.seconds = time.perf_counter() - t0
    return res
