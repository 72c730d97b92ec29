"""IR, passes (with their skip reasons), memory planner, host fallback, backend, errors."""
import json

import pytest
import torch
import torch.nn as nn

import opencann
from helpers import run_compiled
from opencann.ir import DataType, Format, Graph, GraphError, TensorDesc, to_dot, verify
from opencann.passes import plan_memory

g = torch.Generator().manual_seed(0)


def test_ir_print_verify_dot():
    gr = Graph("t")
    x = gr.add_input(TensorDesc((2, "seq"), DataType.FLOAT), "x")
    assert not x.desc.is_static and str(x.desc) == "float32[2,seq]"
    _, graph, _, _ = run_compiled(lambda a: torch.relu(a) + 1, torch.randn(3, 4, generator=g))
    text = str(graph)
    assert "Relu" in text and "return" in text
    verify(graph)
    assert "digraph" in to_dot(graph)
    node = graph.nodes[0]
    node.add_input(graph.outputs[0])  # use before definition
    with pytest.raises(GraphError, match="before it is defined"):
        verify(graph)
    with pytest.raises(ValueError, match="unsupported dtype"):
        DataType.from_torch(torch.complex128)
    assert TensorDesc((1, 16, 4, 4), DataType.FLOAT16, Format.NC1HWC0).format.value == "NC1HWC0"


def test_cse_dce_and_inplace():
    def f(a):
        u = torch.exp(a)
        v = torch.exp(a)          # CSE merges with u
        torch.sin(a)              # dead
        w = (u + v) * 2           # in place into u+v's buffer
        return torch.tanh(w) + 1
    x = torch.randn(64, 64, generator=g)
    outs, graph, plan, report = run_compiled(f, x)
    torch.testing.assert_close(outs[0], f(x))
    by = {p.name: p for p in report.passes}
    assert by["cse"].changed >= 1
    assert plan.inplace, "expected in-place reuse of dying elementwise inputs"
    assert plan.arena_bytes <= plan.naive_bytes


def test_memory_plan_bound_and_views():
    def f(a):
        h = a
        for _ in range(6):
            h = torch.relu(h @ a).reshape(32, 32).t() * 0.5
        return h.sum()
    x = torch.randn(32, 32, generator=g)
    outs, graph, plan, _ = run_compiled(f, x, options={"inplace": False})
    torch.testing.assert_close(outs[0], f(x), rtol=1e-4, atol=1e-4)
    assert plan.lower_bound <= plan.arena_bytes <= 1.02 * plan.lower_bound
    for b in plan.buffers.values():
        assert b.offset % plan.alignment == 0
    # no two buffers that are live at once overlap
    bs = list(plan.buffers.values())
    for i, a in enumerate(bs):
        for b in bs[i + 1:]:
            if a.start <= b.end and b.start <= a.end:
                assert a.offset + a.size <= b.offset or b.offset + b.size <= a.offset
    with pytest.raises(ValueError, match="alignment"):
        plan_memory(graph, alignment=3)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.c3 = nn.Conv2d(8, 8, 1)

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        z = self.b2(self.c2(y))
        a = torch.relu(z + y)                   # Conv+Add+Relu, addend y dies here
        b = self.c3(a)
        return torch.sigmoid(b) + a + b.mean((2, 3), keepdim=True)  # broadcast addend


def _randomize_bn(m):
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.normal_(generator=g)
            mod.running_var.uniform_(0.5, 2.0, generator=g)
            mod.weight.data.normal_(generator=g)
    return m.eval()


def test_conv_fusions_and_reasons():
    m = _randomize_bn(ConvNet())
    x = torch.randn(2, 3, 16, 16, generator=g)
    cm = opencann.compile(m, (x,))
    with torch.no_grad():
        ref = m(x)
    torch.testing.assert_close(cm(x), ref, rtol=1e-4, atol=1e-5)
    kinds = [a["pass"] for a in cm.report.applied]
    details = [a["detail"] for a in cm.report.applied]
    assert kinds.count("fold_batchnorm") == 2 and "Conv+Relu" in details and "Conv+Add+Relu" in details
    reasons = " ".join(s["reason"] for s in cm.report.skipped)
    assert "several users" in reasons  # c3's output feeds sigmoid, add and mean
    assert "also the convolution's input" in reasons  # y feeds c2 and the residual add
    text = cm.report.to_text()
    assert "optimizations not applied" in text and "test_engine.py:" in text  # source location
    d = json.loads(cm.report.to_json())
    assert d["memory"]["arena_bytes"] > 0 and d["cost_after"]["bytes"] < d["cost_before"]["bytes"]


def test_training_mode_batchnorm_is_explained():
    m = ConvNet().train()
    with pytest.raises(ValueError, match="model.eval"):
        opencann.compile(m, (torch.randn(1, 3, 8, 8),))


class Custom(nn.Module):
    def forward(self, x):
        return torch.special.bessel_j0(x) * 2 + torch.special.bessel_j0(x + 1)


def test_host_fallback_runs_and_is_reported():
    x = torch.randn(5, 7, generator=g)
    cm = opencann.compile(Custom(), (x,))
    torch.testing.assert_close(cm(x), Custom()(x))
    fb = cm.report.host_fallbacks
    assert list(fb) == ["aten.special_bessel_j0.default"] and fb["aten.special_bessel_j0.default"]["count"] == 2
    assert "test_engine.py" in fb["aten.special_bessel_j0.default"]["where"][0]
    assert "host fallbacks" in cm.report.summary()
    # CANN GE's behaviour on request: fail the whole compile, naming the op and its line
    with pytest.raises(ValueError, match="special_bessel_j0.*test_engine.py"):
        opencann.compile(Custom(), (x,), options={"host_fallback": False})


def test_bad_inputs_have_clear_errors():
    m = nn.Linear(4, 3).eval()
    cm = opencann.compile(m, (torch.randn(2, 4),))
    with pytest.raises(ValueError, match="compiled for float32\\[2,4\\]"):
        cm(torch.randn(3, 4))
    with pytest.raises(ValueError, match="unknown compile option"):
        opencann.compile(m, (torch.randn(2, 4),), options={"fuse": True})
    with pytest.raises(ValueError, match="unknown pass name"):
        opencann.compile(m, (torch.randn(2, 4),), options={"disable": ["nope"]})
    with pytest.raises(ValueError, match="not supported"):
        opencann.compile(m, (torch.randn(2, 4),), device="tpu")
    with pytest.raises(TypeError, match="nn.Module"):
        opencann.compile(lambda x: x, (torch.randn(2),))


def test_compile_options_are_checked_without_a_model():
    """`check_compile_options`: what opencann.compile refuses in its options, before a
    capture (an application that compiles later checks its options at its own compile)."""
    from opencann.engine import check_compile_options
    assert check_compile_options({"disable": ["fuse_qkv_linear"]}) == {"disable": ["fuse_qkv_linear"]}
    for bad, match in (({"disable": ["nope"]}, "unknown pass name"), ({"fuse": True}, "unknown compile option"),
                       ({"disable": ["memory_plan"]}, "cannot be disabled"),
                       ({"disable_rewrites": ["dce@x"]}, "switches only whole")):
        with pytest.raises(ValueError, match=match):
            check_compile_options(bad)


def test_pass_switch_and_trace(tmp_path):
    m = _randomize_bn(ConvNet())
    x = torch.randn(1, 3, 8, 8, generator=g)
    cm = opencann.compile(m, (x,), options={"disable": ["fold_batchnorm"], "verify": True})
    assert not any(a["pass"] == "fold_batchnorm" for a in cm.report.applied)
    with torch.no_grad():
        torch.testing.assert_close(cm(x), m(x), rtol=1e-4, atol=1e-5)
    path = tmp_path / "trace.json"
    ev = cm.profile(x, path=str(path))
    assert len(ev) == len(cm.graph.nodes) and all(e["dur"] >= 0 for e in ev)
    assert json.loads(path.read_text())["traceEvents"]


def test_torch_compile_backend_with_graph_break():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(8, 8)

        def forward(self, x):
            y = torch.relu(self.l(x))
            if y.sum() > 0:  # data-dependent: a graph break
                y = y * 2
            return {"out": y, "aux": (y.mean(),)}
    from opencann.dynamo import COMPILED_GRAPHS
    n0 = len(COMPILED_GRAPHS)
    m = M().eval()
    x = torch.randn(4, 8, generator=g)
    torch._dynamo.reset()
    c = torch.compile(m, backend="opencann")
    with torch.no_grad():
        r, e = c(x), m(x)
    torch.testing.assert_close(r["out"], e["out"])
    torch.testing.assert_close(r["aux"][0], e["aux"][0])
    assert len(COMPILED_GRAPHS) - n0 >= 2


class Acts(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.c2, self.c3 = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 1, bias=False)
        self.l, self.l2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        y = torch.nn.functional.gelu(self.c(x))
        y = torch.sigmoid(self.c2(y))
        y = torch.tanh(y * 2)
        y = self.c3(y) + torch.cos(y)         # bias-less conv + add, not in place
        z = torch.nn.functional.gelu(self.l(y.mean((2, 3))), approximate="tanh")
        return torch.tanh(self.l2(z))


def test_activation_fusions():
    m = Acts().eval()
    x = torch.randn(2, 3, 12, 12, generator=g)
    cm = opencann.compile(m, (x,))
    kinds = {a["detail"] for a in cm.report.applied}
    assert {"Conv+Gelu", "Conv+Sigmoid", "Conv+Add", "Linear+bias+gelu_tanh", "Linear+bias+tanh"} <= kinds
    with torch.no_grad():
        torch.testing.assert_close(cm(x), m(x), rtol=1e-5, atol=1e-6)


def test_inference_disagreement_names_node(monkeypatch):
    """Our shape inference is checked against FX's meta values at conversion."""
    from opencann.frontend.torch import convert
    from opencann.ir import TensorDesc as TD

    def wrong(node):
        return [TD((7, 7), o.desc.dtype) for o in node.outputs]
    monkeypatch.setattr(convert, "infer", wrong)
    with pytest.raises(convert.ConversionError, match=r"shape inference disagrees with FX for .*test_engine.py:\d+"):
        opencann.compile(Custom(), (torch.randn(3, 4),))
