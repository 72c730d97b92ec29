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


def assert_close(a, b, rtol=1e-5, atol=1e-5, msg=""):
    assert a.shape == b.shape, f"{msg}: shape {a.shape} vs {b.shape}"
    assert a.dtype == b.dtype, f"{msg}: dtype {a.dtype} vs {b.dtype}"
    if a.dtype.is_floating_point:
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=msg or None)
    else:
        assert torch.equal(a, b), msg


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
