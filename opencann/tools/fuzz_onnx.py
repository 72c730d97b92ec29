"""Differential fuzzing of the ONNX path: random small ONNX graphs, compiled by opencann,
checked against ONNX Runtime.

    from opencann.tools.fuzz_onnx import generate_onnx, check_onnx, run_onnx_fuzz
    model, feeds = generate_onnx(seed=3)     # an onnx.ModelProto and its numpy inputs
    print(check_onnx(model, feeds))          # [] or [(check, detail), ...]
    print(run_onnx_fuzz(cases=200, seed=0).summary())

A graph is a chain of 1-6 nodes over live float32 values of rank 1-4 (random sizes 1-6,
inputs drawn from a normal distribution with NaN, ±inf, ±0 and halves planted), each node
drawn from `OPS` with random attributes and constant operands (axes, pads, scales,
slice bounds, indices) and kept only when ONNX Runtime accepts the graph so far (so every
generated graph is valid by ONNX Runtime's reading). Shapes of intermediate values come
from ONNX Runtime itself. The checks (`ONNX_CHECKS`): compile/run errors, output shapes
(rank 0 included) and dtypes, NaN/±inf positions, values (relative to the output's
scale), a second call with other inputs, and the model saved and loaded back giving the
same bits. Graphs with an op whose NaN handling in ONNX Runtime differs from the
specification (MaxPool, ReduceMax/Min, ArgMax, ReduceLogSumExp, LRN; see
``opencann.frontend.onnx.nn``) get NaN-free inputs and no NaN-making op (Sqrt) before it. ONNX Runtime and onnx are
imported when used; a seed is a repro.
"""
from __future__ import annotations

import os
import random
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

ONNX_CHECKS = {
    "error": "compiling, saving, loading or calling raised (ONNX Runtime did not)",
    "meta": "an output's shape or dtype differs from ONNX Runtime's (rank 0 included)",
    "nan": "NaN / +inf / -inf positions differ from ONNX Runtime's",
    "values": "values differ from ONNX Runtime's beyond 1e-4 of the output's scale",
    "second-call": "a second call with other inputs differs from ONNX Runtime's",
    "saved": "the saved and loaded model does not give the live model's bits",
}
_SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 0.5, -2.5]
NAN_SENSITIVE = {"MaxPool", "ReduceMax", "ReduceMin", "ArgMax", "LRN", "Resize", "GridSample",
                 "ReduceLogSumExp"}
NAN_MAKERS = {"Sqrt"}      # NaN from ordinary inputs: no NaN-sensitive op may follow them


def _i64(name, vals):
    from onnx import numpy_helper
    return numpy_helper.from_array(np.array(vals, dtype=np.int64), name)


def _f32(name, vals):
    from onnx import numpy_helper
    return numpy_helper.from_array(np.array(vals, dtype=np.float32), name)


# each op: (rng, input shape, fresh-name fn) -> (op_type, extra input initializers, attrs) or None
def _unary(op, **attrs):
    return lambda r, s, nm: (op, [], dict(attrs))


def _reduce(op):
    def f(r, s, nm):
        axes = sorted(r.sample(range(len(s)), r.randint(1, len(s))))
        axes = [a - len(s) if r.random() < 0.3 else a for a in axes]
        return op, [_i64(nm(), axes)], {"keepdims": r.randint(0, 1)}
    return f


def _softmax(op):
    return lambda r, s, nm: (op, [], {"axis": r.randrange(-len(s), len(s))})


def _slice(r, s, nm):
    ax = r.randrange(len(s))
    step = r.choice([1, 1, 2, -1, -2])
    st, en = r.randint(-8, 8), r.choice([r.randint(-8, 8), 2 ** 62, -2 ** 62])
    return "Slice", [_i64(nm(), [st]), _i64(nm(), [en]), _i64(nm(), [ax]), _i64(nm(), [step])], {}


def _pad(r, s, nm):
    mode = r.choice(["constant", "reflect", "edge", "wrap"])
    pads = [r.randint(-1 if d > 1 else 0, min(2, d - 1) if mode == "reflect" else 2) for d in s] + \
           [r.randint(-1 if d > 2 else 0, min(2, d - 1) if mode == "reflect" else 2) for d in s]
    return "Pad", [_i64(nm(), pads)], {"mode": mode}


def _resize(r, s, nm):
    if len(s) != 4:
        return None
    mode = r.choice(["nearest", "linear", "cubic"])
    ctm = r.choice(["half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners",
                    "asymmetric", "tf_half_pixel_for_nn"])
    attrs = {"mode": mode, "coordinate_transformation_mode": ctm}
    if mode == "nearest":
        attrs["nearest_mode"] = r.choice(["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
    if mode == "cubic":
        attrs["cubic_coeff_a"] = r.choice([-0.75, -0.5])
        attrs["exclude_outside"] = r.randint(0, 1)
    if r.random() < 0.5:
        sc = [1.0, 1.0] + [r.choice([0.5, 0.75, 1.5, 2.0, 2.5, 3.0]) for _ in range(2)]
        return "Resize", [_f32(nm(), []), _f32(nm(), sc)], attrs
    sz = list(s[:2]) + [r.randint(1, 9) for _ in range(2)]
    return "Resize", [_f32(nm(), []), None, _i64(nm(), sz)], attrs


def _transpose(r, s, nm):
    p = list(range(len(s)))
    r.shuffle(p)
    return "Transpose", [], {"perm": p}


def _gather(r, s, nm):
    ax = r.randrange(len(s))
    idx = np.array([r.randint(-s[ax], s[ax] - 1) for _ in range(r.randint(1, 4))], np.int64)
    if r.random() < 0.3:
        idx = idx[:1].reshape(())
    from onnx import numpy_helper
    return "Gather", [numpy_helper.from_array(idx, nm())], {"axis": ax}


def _gather_nd(r, s, nm):
    b = r.randint(0, min(1, len(s) - 1))
    k = r.randint(1, len(s) - b)
    m = r.randint(1, 3)
    from onnx import numpy_helper
    idx = np.stack([np.array([[r.randint(-s[b + j], s[b + j] - 1) for _ in range(m)]
                              for _ in range(int(np.prod(s[:b])))]) for j in range(k)], -1)
    idx = idx.reshape(list(s[:b]) + [m, k]).astype(np.int64)
    return "GatherND", [numpy_helper.from_array(idx, nm())], {"batch_dims": b}


def _pool(op):
    def f(r, s, nm):
        if len(s) not in (3, 4) or min(s[2:]) < 2:
            return None
        k = [r.randint(1, min(3, d)) for d in s[2:]]
        attrs = {"kernel_shape": k, "strides": [r.randint(1, 2) for _ in k]}
        if r.random() < 0.5:
            attrs["pads"] = [r.randint(0, kk // 2) for kk in k] * 2
        if op == "AveragePool":
            attrs["count_include_pad"] = r.randint(0, 1)
        return op, [], attrs
    return f


def _lrn(r, s, nm):
    if len(s) < 3:
        return None
    return "LRN", [], {"size": r.choice([1, 3, 5]), "alpha": 0.3, "beta": 0.6, "bias": 1.5}


def _grid(r, s, nm):
    if len(s) != 4:
        return None
    g = (np.random.default_rng(r.randrange(2 ** 31)).random((s[0], 3, 4, 2)) * 2.4 - 1.2)
    from onnx import numpy_helper
    return "GridSample", [numpy_helper.from_array(g.astype(np.float32), nm())], {
        "mode": r.choice(["bilinear", "nearest", "bicubic"]),
        "padding_mode": r.choice(["zeros", "border", "reflection"]),
        "align_corners": r.randint(0, 1)}


def _binary(op):
    def f(r, s, nm):
        c = np.random.default_rng(r.randrange(2 ** 31)).standard_normal(
            s[-r.randint(0, len(s)):] if r.random() < 0.5 else s).astype(np.float32)
        if op in ("Div", "Pow"):
            c = np.abs(c) + 0.5
        from onnx import numpy_helper
        return op, [numpy_helper.from_array(c, nm())], {}
    return f


def _einsum(r, s, nm):
    letters = "abcd"[:len(s)]
    return "Einsum", [], {"equation": f"{letters}->"}


OPS: Dict[str, Callable] = {
    "Relu": _unary("Relu"), "Abs": _unary("Abs"), "Neg": _unary("Neg"), "Exp": _unary("Exp"),
    "Sigmoid": _unary("Sigmoid"), "Tanh": _unary("Tanh"), "Floor": _unary("Floor"),
    "Round": _unary("Round"), "Sign": _unary("Sign"), "Erf": _unary("Erf"),
    "Softplus": _unary("Softplus"), "LeakyRelu": _unary("LeakyRelu", alpha=0.2),
    "Elu": _unary("Elu", alpha=0.7), "HardSwish": _unary("HardSwish"), "Sqrt": _unary("Sqrt"),
    "Add": _binary("Add"), "Mul": _binary("Mul"), "Sub": _binary("Sub"), "Div": _binary("Div"),
    "Max": _binary("Max"), "Min": _binary("Min"),
    "ReduceSum": _reduce("ReduceSum"), "ReduceMean": _reduce("ReduceMean"),
    "ReduceMax": _reduce("ReduceMax"), "ReduceProd": _reduce("ReduceProd"),
    "ReduceL2": _reduce("ReduceL2"), "ReduceLogSumExp": _reduce("ReduceLogSumExp"),
    "Softmax": _softmax("Softmax"), "LogSoftmax": _softmax("LogSoftmax"),
    "Slice": _slice, "Pad": _pad, "Resize": _resize, "Transpose": _transpose,
    "Gather": _gather, "GatherND": _gather_nd, "MaxPool": _pool("MaxPool"),
    "AveragePool": _pool("AveragePool"), "LRN": _lrn, "GridSample": _grid, "Einsum": _einsum,
}


_ANY_RANK = {"Relu", "Abs", "Neg", "Exp", "Sigmoid", "Tanh", "Floor", "Round", "Sign", "Erf",
             "Softplus", "LeakyRelu", "Elu", "HardSwish", "Sqrt"}


@dataclass
class OnnxFuzzResult:
    """Outcome of a campaign: cases run, and failing seeds with their checks and details."""

    cases: int = 0
    skipped: int = 0
    failures: List[Tuple[int, List[Tuple[str, str]]]] = field(default_factory=list)

    def summary(self) -> str:
        """One line of totals, then one line per failing seed (checks and first detail)."""
        lines = [f"onnx fuzz: {self.cases} graphs vs ONNX Runtime, {len(self.failures)} failing, "
                 f"{self.skipped} not generated"]
        for seed, fails in self.failures:
            lines.append(f"  seed {seed}: {', '.join(sorted({c for c, _ in fails}))}: {fails[0][1]}")
        return "\n".join(lines)


def _ort(model, feeds):
    import onnxruntime as ort
    ort.set_default_logger_severity(3)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def _make(nodes, inits, in_shape, out_name, out_shape, out_elem=1):
    import onnx
    from onnx import helper
    g = helper.make_graph(nodes, "fuzz", [helper.make_tensor_value_info("x", 1, list(in_shape))],
                          [helper.make_tensor_value_info(out_name, out_elem, list(out_shape))],
                          initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = min(onnx.IR_VERSION, 9)
    return m


def _inputs(rng: random.Random, shape, nan: bool) -> np.ndarray:
    x = np.random.default_rng(rng.randrange(2 ** 31)).standard_normal(shape).astype(np.float32)
    if nan:
        flat = x.reshape(-1)
        for i in rng.sample(range(flat.size), min(flat.size // 4, 3)):
            flat[i] = rng.choice(_SPECIAL)
    return x


def generate_onnx(seed: int, ops: Optional[List[str]] = None):
    """``(model, feeds, nan_free)`` from ``seed``: a random valid ONNX graph (opset 18) with
    one float32 input ``x`` and one output, and its inputs. Returns None when no valid
    graph was drawn. Raises ValueError for an unknown op name in ``ops``."""
    from onnx import helper
    table = OPS if not ops else {k: OPS[k] for k in ops if k in OPS}
    if ops and len(table) != len(ops):
        raise ValueError(f"unknown ONNX fuzz op(s) {sorted(set(ops) - set(OPS))}; known: {sorted(OPS)}")
    rng = random.Random(seed)
    shape = [rng.randint(1, 6) for _ in range(rng.randint(1, 4))]
    counter = iter(range(10 ** 6))

    def nm():
        return f"c{next(counter)}"
    nodes, inits = [], []
    cur, cur_shape, cur_elem = "x", list(shape), 1
    nan_free = may_nan = False
    feeds0 = {"x": _inputs(rng, shape, False)}
    for k in range(rng.randint(1, 6)):
        for _ in range(8):
            op = rng.choice(sorted(table))
            try:
                made = table[op](rng, cur_shape, nm) if cur_shape or op in _ANY_RANK else None
            except (ValueError, IndexError):   # no valid attributes for this shape
                made = None
            if made is None or cur_elem != 1 or (op in NAN_SENSITIVE and may_nan):
                continue
            op_type, extra, attrs = made
            names = [cur] + [("" if t is None else t.name) for t in extra]
            out = f"v{k}"
            node = helper.make_node(op_type, names, [out], **attrs)
            trial = _make(nodes + [node], inits + [t for t in extra if t is not None], shape, out, [])
            try:
                del trial.graph.output[0].type.tensor_type.shape.dim[:]
                trial.graph.output[0].type.tensor_type.ClearField("shape")
                res = _ort(trial, feeds0)[0]
            except Exception:  # noqa: BLE001 - ONNX Runtime refuses: draw another node
                continue
            if res.size == 0 or res.size > 4096 or res.dtype != np.float32:
                continue
            nodes.append(node)
            inits += [t for t in extra if t is not None]
            cur, cur_shape = out, list(res.shape)
            nan_free |= op_type in NAN_SENSITIVE
            may_nan |= op_type in NAN_MAKERS
            break
    if not nodes:
        return None
    model = _make(nodes, inits, shape, cur, cur_shape)
    feeds = {"x": _inputs(rng, shape, not nan_free)}
    return model, feeds, nan_free


def _compare(got, ref, tag: str) -> List[Tuple[str, str]]:
    got = np.asarray(got)
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return [("meta", f"{tag}: {got.dtype}{got.shape} vs ONNX Runtime {ref.dtype}{ref.shape}")]
    for what, f in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        if not np.array_equal(f(got), f(ref)):
            return [("nan", f"{tag}: {what} positions differ")]
    fin = np.isfinite(ref)
    if fin.any():
        scale = max(1.0, float(np.abs(ref[fin]).max()))
        err = float(np.abs(got[fin].astype(np.float64) - ref[fin]).max())
        if err > 1e-4 * scale:
            return [("values", f"{tag}: max error {err:.3g} (scale {scale:.3g})")]
    return []


def check_onnx(model, feeds) -> List[Tuple[str, str]]:
    """The failed checks (`ONNX_CHECKS`) of ``model`` compiled by opencann against ONNX
    Runtime on ``feeds`` and on a second input, and of its saved + loaded copy."""
    import torch

    import opencann
    ref = _ort(model, feeds)[0]
    x = torch.from_numpy(feeds["x"].copy())
    x2 = np.random.default_rng(1).standard_normal(feeds["x"].shape).astype(np.float32)
    ref2 = _ort(model, {"x": x2})[0]
    try:
        cm = opencann.compile(model)
        y = cm(x)[0].numpy().copy()
    except Exception as e:  # noqa: BLE001 - reported as a failed check
        return [("error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])]
    fails = _compare(y, ref, "first call")
    try:
        y2 = cm(torch.from_numpy(x2))[0].numpy()
        fails += [("second-call", d) for _, d in _compare(y2, ref2, "second call")]
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "m.ocm")
            opencann.save(cm, p)
            y3 = opencann.load(p)(x)[0].numpy()
        if y3.shape != y.shape or not np.array_equal(y3.view(np.uint32), y.view(np.uint32)):
            fails.append(("saved", "the loaded model's bits differ from the live model's"))
    except Exception as e:  # noqa: BLE001
        fails.append(("error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]))
    return fails


def run_onnx_fuzz(cases: int = 100, seed: int = 0, ops: Optional[List[str]] = None,
                  progress: Optional[Callable[[int, int], None]] = None) -> OnnxFuzzResult:
    """Generate and check ``cases`` graphs from seeds ``seed .. seed + cases - 1``."""
    import logging
    import warnings
    res = OnnxFuzzResult()
    logger = logging.getLogger("opencann")
    old = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for s in range(seed, seed + cases):
                g = generate_onnx(s, ops)
                if g is None:
                    res.skipped += 1
                    continue
                res.cases += 1
                fails = check_onnx(g[0], g[1])
                if fails:
                    res.failures.append((s, fails))
                if progress:
                    progress(s - seed + 1, cases)
    finally:
        logger.setLevel(old)
    return res
