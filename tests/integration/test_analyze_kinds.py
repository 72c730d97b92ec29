"""`opencann analyze` reports each ConversionError by its kind (set where it is raised).

Before, every ConversionError became a "data-dependent shape" finding: a parameter
written in forward was reported with the wrong obstacle and no fix. Now the error's
``kind`` picks the finding (``data_dependent`` or ``conversion_error``), its title and its
fix; ``bad_argument`` (the call's own mistake) is still raised."""
import ast
import pathlib
import pickle

import pytest
import torch
from torch import nn

import opencann
from opencann.frontend.errors import KINDS, ConversionError
from opencann.tools.analyze import analyze, analyze_onnx


class _ParamWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, max_norm=1.0)    # renorms its weight in forward

    def forward(self, i):
        return self.emb(i) * 2


class _BufferWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n += 1
        return x * 2


class _Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x):
        return x + torch.rand(x.shape, generator=self.gen)


CASES = [(_ParamWrite, (torch.randint(0, 10, (3,)),), "parameter_written", "emb.weight"),
         (_BufferWrite, (torch.randn(2),), "buffer_written", "buffer n"),
         (_Generator, (torch.randn(2, 3),), "object_input", "torch.Generator")]


@pytest.mark.parametrize("cls,args,kind,needle", CASES, ids=[c[2] for c in CASES])
def test_each_conversion_error_is_its_own_finding_with_its_fix(cls, args, kind, needle):
    with pytest.raises(ConversionError) as e:
        opencann.compile(cls().eval(), args)
    assert e.value.kind == kind and needle in str(e.value)
    a = analyze(cls().eval(), args)
    (f,) = a.by_kind("conversion_error")
    title, fix = KINDS[kind]
    assert f.op == title and f.detail == f"fix: {fix}" and needle in f.message
    assert not a.by_kind("data_dependent")
    assert a.readiness == "not ready" and a.exit_code == 1
    d = a.to_dict()
    assert d["counts"]["conversion_error"] == 1 and d["counts"]["data_dependent"] == 0
    text = a.to_text()
    assert f"conversion error: {title} x1" in text and fix in text and needle in text


def test_data_dependent_conversion_errors_stay_data_dependent():
    class Half(nn.Module):
        def forward(self, x):
            return x * 2, x.shape[0] / 2
    cm = opencann.compile(Half(), (torch.randn(8, 5),), dynamic_shapes={"x": {0: "b"}})
    assert cm(torch.randn(6, 5))[1] == 3.0      # float size arithmetic compiles (bound per call)
    err = ConversionError("n0: data-dependent value", kind="data_dependent")
    a = analyze(nn.Linear(2, 2).eval(), (torch.randn(1, 2),))
    a.note_conversion_error(err)
    assert a.by_kind("data_dependent")[0].op == KINDS["data_dependent"][0]
    with pytest.raises(ConversionError, match="bad"):
        a.note_conversion_error(ConversionError("bad input_shapes", kind="bad_argument"))


def test_every_raise_site_names_a_kind_and_kinds_are_complete():
    root = pathlib.Path(opencann.__file__).parent
    missing = []
    for path in root.rglob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "ConversionError":
                kw = {k.arg: k.value for k in n.keywords}
                if "kind" not in kw or not (isinstance(kw["kind"], ast.Constant)
                                            and kw["kind"].value in KINDS):
                    missing.append(f"{path.name}:{n.lineno}")
    assert not missing, missing
    assert all(len(v) == 2 and all(v) for v in KINDS.values())
    with pytest.raises(ValueError, match="unknown ConversionError kind 'oops'"):
        ConversionError("x", kind="oops")
    e = pickle.loads(pickle.dumps(ConversionError("p written", kind="parameter_written")))
    assert e.kind == "parameter_written" and str(e) == "p written"


def test_onnx_conversion_errors_by_kind(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper
    g = helper.make_graph([helper.make_node("RandomUniformLike", ["x"], ["y"], name="r0")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    path = str(tmp_path / "r.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    a = analyze_onnx(path)
    (f,) = a.by_kind("conversion_error")
    assert f.op == KINDS["random_op"][0] and "r0" in f.message and a.exit_code == 1
    with pytest.raises(ConversionError) as e:
        analyze_onnx(path, input_shapes={"nope": (3,)})
    assert e.value.kind == "bad_argument"
