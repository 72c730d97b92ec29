"""Shared test helpers: run a function through opencann's graph engine via make_fx."""
from __future__ import annotations

import pathlib

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from opencann.engine import compile_graph
from opencann.frontend.torch import decomposition_table, from_fx_graph
from opencann.runtime import Executor

# the repository's root (this file is tests/helpers.py): examples/, docs/, bench/ hang off it
REPO = pathlib.Path(__file__).resolve().parent.parent


def check_linear(out, x, w, b):
    """Assert ``out`` is ``F.linear(x, w, b)`` as a numba GEMM computes it (fp32 sums of K
    products in another order than MKL's): NaN/Inf positions and Inf signs are eager's
    (fp32 F.linear), finite outputs within 1e-5 * (|x| @ |W|^T + |b|) of float64 elementwise
    (the worst-case bound of a K-term fp32 sum is K * 2^-24 relative to that magnitude;
    typical errors are ~sqrt(K) * 2^-24), and at least one output is finite."""
    ref = torch.nn.functional.linear(x, w, b)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    assert torch.equal(out[torch.isinf(ref)], ref[torch.isinf(ref)])  # same sign of Inf
    fin = torch.isfinite(ref)
    assert fin.any()
    ref64 = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    mag = torch.nn.functional.linear(x.abs().nan_to_num(0, 0, 0).double(),
                                     w.abs().nan_to_num(0, 0, 0).double(),
                                     None if b is None else b.abs().double())
    assert ((out.double() - ref64).abs()[fin] <= 1e-5 * mag[fin] + 1e-30).all()


def run_compiled(fn, *inputs, options=None):
    """Trace ``fn`` to ATen with make_fx, compile it and run it; returns (outputs, graph,
    plan, report). Outputs are a list."""
    gm = make_fx(lambda *a: fn(*a), decomposition_table=decomposition_table(),
                 tracing_mode="fake")(*inputs)
    graph = from_fx_graph(gm, inputs)
    graph, plan, report = compile_graph(graph, "cpu", options or {"verify": True})
    ex = Executor(graph, plan)
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    outs = ex.run(tensors)
    lits = graph.signature.output_literals
    n = graph.signature.n_flat(len(outs))
    it = iter(outs)
    return [lits[i] if i in lits else next(it) for i in range(n)], graph, plan, report


def _leaves(o) -> list:
    """The leaves of nested tuples / lists / dict values, in order."""
    if isinstance(o, (tuple, list)):
        return [t for x in o for t in _leaves(x)]
    if isinstance(o, dict):
        return [t for x in o.values() for t in _leaves(x)]
    return [o]


def assert_close(got, ref, rtol=1e-5, atol=1e-5, msg="", *, strides=False, signed_zeros=False):
    """``got`` is eager's ``ref``: the same structure (tensors inside nested tuples, lists
    and dict values; other leaves equal), and per tensor the same dtype and shape, values
    within ``rtol``/``atol`` with NaN exactly where eager has NaN (integers and bools equal).
    ``signed_zeros``: zeros carry eager's sign. ``strides``: eager's strides on every dim of
    size > 1 (a size-1 dim's stride addresses nothing; equal strides there also mean
    ``.view(-1)`` works exactly where eager's does). Raises AssertionError naming ``msg``."""
    got, ref = _leaves(got), _leaves(ref)
    assert len(got) == len(ref), f"{msg}: {len(got)} outputs, eager has {len(ref)}"
    for i, (g, r) in enumerate(zip(got, ref)):
        where = f"{msg} output {i}"
        if not isinstance(r, torch.Tensor):
            assert g == r and type(g) is type(r), f"{where}: {g!r}, eager {r!r}"
            continue
        assert g.shape == r.shape, f"{where}: shape {g.shape} vs eager {r.shape}"
        assert g.dtype == r.dtype, f"{where}: dtype {g.dtype} vs eager {r.dtype}"
        if strides:
            layout = [(st, n) for st, n in zip(r.stride(), r.shape) if n != 1]
            assert [(st, n) for st, n in zip(g.stride(), g.shape) if n != 1] == layout, \
                f"{where}: strides {g.stride()} vs eager {r.stride()}"
        if not r.dtype.is_floating_point and not r.dtype.is_complex:
            assert torch.equal(g, r), where
            continue
        torch.testing.assert_close(g, r, rtol=rtol, atol=atol, equal_nan=True, msg=where or None)
        if signed_zeros:
            zero = r == 0
            assert torch.equal(torch.signbit(g[zero]), torch.signbit(r[zero])), \
                f"{where}: zeros of another sign than eager's"


def assert_calls_like_eager(compiled, model, inputs_for, keys=(3, 5, 3), **kw):
    """Calls ``compiled`` and the eager ``model`` on ``inputs_for(k)`` (a tuple of
    arguments) for each ``k`` in ``keys`` (sizes, seeds), compares every result with
    eager's (`assert_close`, keywords ``kw``), then compares every result again: later
    calls left earlier outputs alone."""
    kept = []
    for k in keys:
        args = inputs_for(k)
        ref, got = model(*args), compiled(*args)
        assert_close(got, ref, msg=f"call {k}", **kw)
        kept.append((got, ref))
    for k, (got, ref) in zip(keys, kept):
        assert_close(got, ref, msg=f"call {k} after later calls", **kw)


def run_op_direct(op_name, *args):
    """Build a one-node IR graph for ``op_name`` with ATen-style ``args`` (tensors become
    graph inputs), compile and run it; returns (outputs, eager reference outputs)."""
    from opencann.ir import Graph, TensorDesc, TensorRef
    from opencann.ops import get_op, infer

    op = get_op(op_name)
    graph = Graph(op_name)
    inputs, attrs, tensors = [], {}, []
    for a, val in zip(op.aten._schema.arguments, args):
        if isinstance(val, torch.Tensor):
            v = graph.add_input(TensorDesc.of(val))
            inputs.append(v)
            tensors.append(val)
            attrs[a.name] = TensorRef(len(inputs) - 1)
        else:
            attrs[a.name] = val
    node = graph.create_node(op_name, inputs, attrs, [])
    descs = infer(node)
    node.outputs = [graph._value(d, producer=node) for d in descs]
    graph.outputs = list(node.outputs)
    graph, plan, report = compile_graph(graph, "cpu", {"verify": True})
    outs = Executor(graph, plan).run(tensors)
    schema = op.aten._schema.arguments
    pos_args = [v for a, v in zip(schema, args) if not a.kwarg_only]
    kw = {a.name: v for a, v in zip(schema, args) if a.kwarg_only}
    ref = op.aten(*pos_args, **kw)
    refs = list(ref) if isinstance(ref, (tuple, list)) else [ref]
    return list(outs), refs


def seeded(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """``model`` in eval mode with its parameters moved by seeded noise (std 0.05), so
    no weight is a round initial value (a test then compares non-trivial numbers)."""
    torch.manual_seed(seed)
    m = model.eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


def save_and_load(cm, tmp_path, name: str = "model.ocm"):
    """``opencann.save`` the compiled model ``cm`` under pytest's ``tmp_path`` and load it
    back; returns (the loaded model, the file's path as a str)."""
    import opencann
    path = str(tmp_path / name)
    opencann.save(cm, path)
    return opencann.load(path), path


class ForcedGemmChoice(dict):
    """A stand-in for ``opencann.ops.kernels.cpu.LINEAR_CHOICES`` that answers ``kernel``
    for every GEMM shape (monkeypatch it in to bind that kernel where it exists)."""

    def __init__(self, kernel):
        super().__init__()
        self.kernel = kernel

    def get(self, key, default=None):
        return self.kernel


def count_in_new_thread() -> int:
    """``torch.get_num_threads()`` as seen by a thread started now: the intra-op count a
    fresh thread inherits from ATen's process default."""
    import threading
    got = []
    t = threading.Thread(target=lambda: got.append(torch.get_num_threads()))
    t.start()
    t.join()
    return got[0]


def run_cli(argv, capsys):
    """(exit code, stdout, the non-empty stderr lines) of ``opencann argv`` run in-process
    (argparse's own errors as their exit code)."""
    from opencann import cli
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out, [ln for ln in cap.err.splitlines() if ln.strip()]


def run_pass(p, g, device="cpu"):
    """Run the one pass ``p`` over graph ``g`` (verifying it) on ``device``; returns
    (the graph's text dump, the compile report)."""
    from opencann.engine.options import complete
    from opencann.ir import verify
    from opencann.ir.dump import to_text
    from opencann.passes import PassContext, PassManager
    from opencann.report import CompileReport
    ctx = PassContext(options=complete({"verify": True}), report=CompileReport(), device=device)
    PassManager([p]).run(g, ctx)
    verify(g)
    return to_text(g), ctx.report


def skipped(report):
    """(pass, reason) of every near miss a compile report recorded."""
    return [(s["pass"], s["reason"]) for s in report.skipped]



def run_threads(targets, switch_interval: float = 1e-6) -> None:
    """Run the callables ``targets`` (each ``(fn, args)``) on threads of their own, all
    started before any is joined, with the interpreter switching threads every
    ``switch_interval`` seconds (often: the window a race needs), restored after."""
    import sys
    import threading
    old = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval)
    try:
        ts = [threading.Thread(target=fn, args=args) for fn, args in targets]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        sys.setswitchinterval(old)


def fresh_acl_session(monkeypatch):
    """The body of an ACL test file's autouse fixture (``yield from``): no device list
    from the environment, acl initialized with device 0 set for the test, finalized after
    it, and the process left as if never finalized."""
    import opencann.acl as acl
    from opencann.acl import _state
    monkeypatch.delenv("OPENCANN_ACL_DEVICES", raising=False)
    if _state.initialized:
        acl.finalize()
    assert acl.init() == 0 and acl.rt.set_device(0) == 0
    yield
    if _state.initialized:
        acl.finalize()
    _state.finalized_once = False


def tiny_llm_config(name: str):
    """A tiny transformers causal-LM config (vocab 97, 2 layers, no eos) for the LLM tests:
    ``"llama"`` (GQA 4/2 heads), ``"gpt2"`` (learned positions, 64 of them) or ``"qwen2"``
    (Q/K/V biases). Raises KeyError for another name."""
    import transformers as T
    return {
        "llama": lambda: T.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, eos_token_id=None),
        "gpt2": lambda: T.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=2,
                                     n_positions=64, bos_token_id=1, eos_token_id=None),
        "qwen2": lambda: T.Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, eos_token_id=None),
    }[name]()
