"""A hand-written int8 ``quant_config`` is checked as a whole kind, never half applied:
``skip_layers`` of a wrong type (an int, a dict, bytes, a str, None or "" inside) is one
ValueError line at every entry that takes it (the compile option, ``create_quant_config``,
``opencann.quantize``'s config: one shared check, `check_skip_layers`); a ``layers`` key
or a ``skip_layers`` name of no layer of the graph (a typo, a module or pre-fusion name as
a record's key, a ReLU's name) is one line from the int8 pass naming it, why and the
graph's names (`check_layer_names`), on the CPU and the vnpu, static, dynamic and ONNX
alike; ``check_names: False`` ignores them (a whole model's config applied to a part, as
``opencann.tune`` does). After each error the corrected config compiles and gives the
output of ``opencann.quantize``'s own config."""
import warnings

import pytest
import torch
from torch import nn

import opencann
from opencann.engine.options import complete
from opencann.engine.quantize import calibrate, quant_report
from opencann.devices import parse_device
from opencann.ir import DataType, Graph, TensorDesc, TensorRef
from opencann.ops.kernels.int8_quantize import check_skip_layers
from opencann.passes import PassContext, PassManager, VnpuQuantizeInt8
from opencann.report import CompileReport
from opencann.tools.quantize import create_quant_config

G = torch.Generator().manual_seed(7)


class Net(nn.Module):
    """conv → BN → relu, a residual conv, flatten, a linear: every CPU int8 layer kind."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 6 * 6, 10)

    def forward(self, x):
        y = self.stem(x)
        return self.fc(torch.relu(self.conv2(y) + y).flatten(1))


def _x(n=2):
    return torch.randn(n, 3, 6, 6, generator=G)


@pytest.fixture(scope="module")
def setup():
    """(model, calibration batches, the records opencann.quantize's calibration gives, the
    int8 model opencann.quantize makes from them)."""
    torch.manual_seed(0)
    m = Net().eval()
    cal = [(_x(),) for _ in range(3)]
    records = calibrate(opencann.compile(m, cal[0]), cal)
    return m, cal, records, opencann.quantize(m, cal)


def _layers(records, **renamed):
    """The ``layers`` dict of ``records`` (scale_d / offset_d, accum / out kept), keys renamed."""
    out = {}
    for k, r in records.items():
        out[renamed.get(k, k)] = {f: r[f] for f in ("scale_d", "offset_d", "accum", "out") if f in r}
    return out


def _one_line_error(call, *patterns):
    with pytest.raises(ValueError) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for p in patterns:
        assert p in msg, (p, msg)
    return msg


# -- skip_layers of a wrong type: one rule at every entry --------------------------------

BAD_SKIPS = [(3, "got 3 (int)"), ({"fc": 1}, "got {'fc': 1} (dict)"), (b"fc", "got b'fc' (bytes)"),
             (["fc", None], "holding None (NoneType)"), (["fc", 3], "holding 3 (int)"),
             ([""], "holding '' (str)"), ("fc", "got the str 'fc'")]


@pytest.mark.parametrize("bad,shown", BAD_SKIPS)
def test_skip_layers_of_a_wrong_type_is_one_line_at_every_entry(setup, bad, shown):
    m, cal, records, q = setup
    fix = "e.g. ['fc']"
    _one_line_error(lambda: opencann.compile(m, cal[0], options={"quant_config": {"layers": {}, "skip_layers": bad}}),
                    "option 'quant_config': 'skip_layers' takes a list of", shown, fix)
    _one_line_error(lambda: create_quant_config(bad), "skip_layers takes a list of", shown, fix)
    _one_line_error(lambda: opencann.quantize(m, cal, config={"skip_layers": bad}),
                    "config['skip_layers'] takes a list of", shown, fix)


def test_check_skip_layers_takes_none_lists_tuples_and_sets():
    assert check_skip_layers(None) == [] and check_skip_layers(()) == []
    assert check_skip_layers(("fc", "stem.0")) == ["fc", "stem.0"]
    assert check_skip_layers({"stem.0", "fc"}) == ["fc", "stem.0"]
    assert create_quant_config(skip_layers=frozenset({"fc"}))["skip_layers"] == ["fc"]


def test_after_a_bad_skip_layers_the_corrected_config_compiles(setup):
    m, cal, records, _ = setup
    cfg = {"layers": _layers(records), "skip_layers": 3}
    with pytest.raises(ValueError, match="'skip_layers' takes a list"):
        opencann.compile(m, cal[0], options={"quant_config": cfg})
    cfg["skip_layers"] = ["fc"]
    got = opencann.compile(m, cal[0], options={"quant_config": cfg})
    ref = opencann.quantize(m, cal, config=create_quant_config(["fc"]))
    rows = {r["where"].split(" ")[0]: r for r in quant_report(got)}
    assert not rows["fc"]["int8"] and "skip_layers" in rows["fc"]["reason"] and rows["conv2"]["int8"]
    x = _x()
    torch.testing.assert_close(got(x), ref(x), rtol=0, atol=0)


# -- layers / skip_layers names of no layer: one line from the pass ----------------------

KINDS = "'layers' names no ConvBiasAct / ConvAddAct / LinearAct node of this graph"


def test_a_record_of_no_node_is_one_line_listing_the_graph_names(setup):
    m, cal, records, q = setup
    assert sorted(records) == ["addmm_none", "convolution_1_1_add_relu", "convolution_relu"]
    rec = {"scale_d": 0.1, "offset_d": 3}
    msg = _one_line_error(lambda: opencann.compile(m, cal[0], options={"quant_config": {"layers": {"nosuch": rec}}}),
                          KINDS, "'nosuch' is no node", "key each record by the node's name as quant_report shows it")
    assert "addmm_none, convolution_1_1_add_relu, convolution_relu" in msg
    for key, why in (("fc", "'fc' is the module or pre-fusion name of node 'addmm_none'"),
                     ("addmm", "'addmm' is the module or pre-fusion name of node 'addmm_none'"),
                     ("convolution", "of node 'convolution_relu'"),
                     ("view", "'view' is a Reshape node (int8 quantizes ConvBiasAct / ConvAddAct / LinearAct"),
                     ("convolution_rel", "'convolution_rel' is no node (near matches: convolution_relu")):
        layers = _layers(records)
        layers[key] = rec
        _one_line_error(lambda: opencann.compile(m, cal[0], options={"quant_config": {"layers": layers}}),
                        KINDS, why)
    many = {k: rec for k in ("a", "b", "c", "d", "e")}
    _one_line_error(lambda: opencann.compile(m, cal[0], options={"quant_config": {"layers": many}}),
                    "'a' is no node; 'b' is no node; 'c' is no node; and 2 more")


def test_a_misnamed_record_corrected_gives_quantizes_output(setup):
    """The record keyed by the module name ('fc') is refused; keyed by its node's name the
    config is opencann.quantize's own and the outputs are the same, close to eager."""
    m, cal, records, q = setup
    bad = _layers(records, addmm_none="fc")
    _one_line_error(lambda: opencann.compile(m, cal[0], options={"quant_config": {"layers": bad}}),
                    "'fc' is the module or pre-fusion name of node 'addmm_none'")
    good = opencann.compile(m, cal[0], options={"quant_config": {"layers": _layers(records)}})
    assert all(r["int8"] for r in quant_report(good)) and len(quant_report(good)) == 3
    x = _x()
    torch.testing.assert_close(good(x), q(x), rtol=0, atol=0)
    with torch.no_grad():
        ref = m(x)
    assert float(torch.nn.functional.cosine_similarity(good(x).flatten(), ref.flatten(), 0)) > 0.99


def test_a_transposed_convolutions_record_says_why_it_is_not_quantized():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ConvTranspose2d(4, 4, 2)).eval()
    x = _x()
    conv = next(n.name for n in opencann.compile(m, x).graph.nodes if n.op == "Conv2D")
    _one_line_error(lambda: opencann.compile(m, x, options={"quant_config": {"layers": {conv: {"scale_d": 0.1,
                                                                                               "offset_d": 0}}}}),
                    f"{conv!r} is a Conv2D node (a transposed convolution: the int8 kernels take 2-D forward")


def test_a_skip_layers_name_of_no_layer_is_one_line_in_compile(setup):
    """opencann.compile checks skip_layers names as opencann.quantize does (it ignored them)."""
    m, cal, records, q = setup
    layers = _layers(records)
    _one_line_error(lambda: opencann.compile(m, cal[0], options={"quant_config": {"layers": layers,
                                                                                   "skip_layers": ["fc_1"]}}),
                    "skip_layers names no layer of the model: 'fc_1'", "near matches: fc")
    _one_line_error(lambda: opencann.compile(m, cal[0], options={"quant_config": {"layers": layers,
                                                                                   "skip_layers": ["convolution"]}}),
                    "'convolution' was fused into 'convolution_relu'")
    _one_line_error(lambda: opencann.quantize(m, cal, config=create_quant_config(["layer9"])),
                    "skip_layers names no layer of the model: 'layer9'", "layers: ")
    for name in ("stem.0", "convolution_relu", "relu"):   # module, node and traced names all label it
        got = opencann.compile(m, cal[0], options={"quant_config": {"layers": layers, "skip_layers": [name]}})
        row = next(r for r in quant_report(got) if r["layer"] == "convolution_relu")
        assert not row["int8"] and "skip_layers" in row["reason"], name


def test_check_names_false_ignores_names_of_no_layer(setup):
    """A whole model's config applied to a part (opencann.tune's int8 candidate): names of
    no node are ignored, the layers it does name run int8, the rest stay fp32 with a reason."""
    m, cal, records, q = setup
    layers = _layers(records, addmm_none="addmm_none_qkv")
    got = opencann.compile(m, cal[0], options={"quant_config": {"layers": layers, "skip_layers": ["gone"],
                                                                "check_names": False}})
    rows = {r["layer"]: r for r in quant_report(got)}
    assert rows["convolution_relu"]["int8"] and not rows["addmm_none"]["int8"]
    assert "no calibration record" in rows["addmm_none"]["reason"]
    with pytest.raises(ValueError, match="'check_names' takes True or False, got 'no'"):
        opencann.compile(m, cal[0], options={"quant_config": {"layers": layers, "check_names": "no"}})


def test_layers_of_a_wrong_type_is_one_line(setup):
    m, cal, _, _ = setup
    for bad in ([], 0, "convolution_relu"):
        _one_line_error(lambda: opencann.compile(m, cal[0], options={"quant_config": {"layers": bad}}),
                        "option 'quant_config': 'layers' must map node names to")


def test_names_are_checked_under_dynamic_shapes_and_a_good_config_runs_every_size(setup):
    m, cal, records, q = setup
    dyn = {"x": {0: "batch"}}
    bad = {"layers": _layers(records, convolution_relu="conv1")}
    _one_line_error(lambda: opencann.compile(m, _x(4), options={"quant_config": bad}, dynamic_shapes=dyn),
                    KINDS, "'conv1' is no node")
    got = opencann.compile(m, _x(4), options={"quant_config": {"layers": _layers(records)}}, dynamic_shapes=dyn)
    for n in (1, 3, 4):   # per sample as the static int8 model (batch 2) computes it
        x = _x(n)
        ref = torch.cat([q(x[i:i + 1].repeat(2, 1, 1, 1))[:1] for i in range(n)])
        torch.testing.assert_close(got(x), ref, rtol=0, atol=1e-5)


def test_an_onnx_models_records_are_checked_as_well(setup, tmp_path):
    pytest.importorskip("onnx")
    m, cal, _, _ = setup
    path = str(tmp_path / "net.onnx")
    with warnings.catch_warnings():     # the TorchScript exporter's deprecation notes
        warnings.simplefilter("ignore")
        torch.onnx.export(m, cal[0], path, dynamo=False, opset_version=17)
    records = calibrate(opencann.compile(path), cal)
    assert records
    name = sorted(records)[0]
    _one_line_error(lambda: opencann.compile(path, options={"quant_config": {"layers": _layers(records, **{name: name + "x"})}}),
                    KINDS, f"{name + 'x'!r} is no node (near matches: {name}")
    got = opencann.compile(path, options={"quant_config": {"layers": _layers(records)}})
    assert all(r["int8"] for r in quant_report(got))
    x = _x()
    with torch.no_grad():
        ref = m(x)
    out = got(x)
    out = out[0] if isinstance(out, (tuple, list)) else out     # an ONNX model returns its outputs' tuple
    assert float(torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), 0)) > 0.99


# -- the vnpu pass: the same rule on its unfused Cube ops ---------------------------------

def _vnpu_run(layers, skip=()):
    """``vnpu_quantize_int8`` on a Conv2D → Relu graph with ``layers`` / ``skip``; the report."""
    g = Graph("g")
    f = DataType.FLOAT
    x = g.add_input(TensorDesc((1, 4, 6, 6), f), "x")
    w = g.add_const(torch.randn(8, 4, 3, 3, generator=G), "w")
    b = g.add_const(torch.randn(8, generator=G), "b")
    attrs = {"input": TensorRef(0), "weight": TensorRef(1), "bias": TensorRef(2), "stride": [1, 1],
             "padding": [1, 1], "dilation": [1, 1], "transposed": False, "output_padding": [0, 0], "groups": 1}
    c = g.create_node("Conv2D", [x, w, b], attrs, [TensorDesc((1, 8, 6, 6), f)], "conv", scope="c1")
    r = g.create_node("Relu", [c.output], {"self": TensorRef(0)}, [TensorDesc((1, 8, 6, 6), f)], "relu")
    g.outputs = [r.output]
    ctx = PassContext(options=complete({"quant_config": {"layers": layers, "skip_layers": list(skip)}}),
                      report=CompileReport(), device=parse_device("vnpu:ascend910b"))
    PassManager([VnpuQuantizeInt8()]).run(g, ctx)
    return ctx.report


def test_the_vnpu_pass_refuses_names_of_no_cube_op():
    rec = {"scale_d": 0.05, "offset_d": 100}
    _one_line_error(lambda: _vnpu_run({"convolution_relu": rec}),
                    "'layers' names no Conv2D / MatMulV2 / MatMul node of this graph: 'convolution_relu' is no node",
                    "as quant_report shows it (opencann.quantize writes them): conv")
    _one_line_error(lambda: _vnpu_run({"relu": rec}), "'relu' is a Relu node (int8 quantizes Conv2D / MatMulV2")
    _one_line_error(lambda: _vnpu_run({"c1": rec}), "'c1' is the module or pre-fusion name of node 'conv'")
    _one_line_error(lambda: _vnpu_run({"conv": rec}, skip=["c2"]), "skip_layers names no layer of the model: 'c2'")
    assert [e["nodes"] for e in _vnpu_run({"conv": rec}).applied] == ["conv"]
    assert "skip_layers" in _vnpu_run({"conv": rec}, skip=["c1"]).skipped[0]["reason"]
