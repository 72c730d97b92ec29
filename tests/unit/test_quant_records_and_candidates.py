"""Hand-written int8 records and tune's candidate names: one rule each.

Records (``quant_config['layers']``, AMCT's scale_d / offset_d): a record outside
``scale_d`` finite >= 2**-126 and ``offset_d`` an int in [0, 255] (its ``"accum"`` /
``"out"`` too) is one ValueError line naming the layer, the field, the value and what it
takes, on every path that reads it (the option check, the CPU pass, the vnpu pass); before,
inf / 300 / a denormal step kept the layer fp32 silently while NaN raised. A valid record is
used (the layer runs int8, close to eager).

Candidates (``opencann.tune(candidates=...)``, ``opencann tune --candidates``): an empty,
unknown or repeated name is one error line naming it and listing the valid ones (CLI: exit
2, one stderr line, before the model loads); before, ``fp32,,int8`` dropped the empty name."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import opencann
from helpers import run_cli
from opencann.devices import parse_device
from opencann.engine.options import complete
from opencann.ir import DataType, Graph, TensorDesc, TensorRef
from opencann.passes import PassContext, PassManager, VnpuQuantizeInt8
from opencann.passes.fusion.quantize_int8 import QuantizeInt8
from opencann.report import CompileReport
from opencann.tools import tune as tune_mod
from opencann.engine.quantize import calibrate
from opencann.tools.quantize import quant_report
from opencann.tools.tune import CANDIDATES, check_candidates, tune

LAYER = "addmm_none"      # the fused node of a lone nn.Linear
VALID = {"scale_d": 0.02, "offset_d": 128}
STEP_RULE = r"give a finite float >= 2\*\*-126"
OFFSET_RULE = r"give an int in \[0, 255\]"

BAD_SCALE = [math.inf, -math.inf, math.nan, 0, 0.0, -0.0, -1, -0.02, 1e-45, 2.0 ** -127,
             "0.02", None, True, [0.02]]
BAD_OFFSET = [300, 256, -1, -128, math.inf, -math.inf, math.nan, 1.5, 128.0, "128", None, True]


def _linear():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4).eval(), torch.randn(2, 8)


def _compile(rec, lin=None, x=None, layer=LAYER):
    if lin is None:
        lin, x = _linear()
    return opencann.compile(lin, x, options={"quant_config": {"layers": {layer: rec}}})


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("value", BAD_SCALE, ids=repr)
def test_a_bad_scale_d_is_one_error_line_naming_layer_field_and_value(value):
    """Issue: scale_d = inf kept the layer fp32 silently, NaN raised; now each raises alike."""
    with pytest.raises(ValueError, match=rf"^option 'quant_config': layer '{LAYER}': scale_d = .*; {STEP_RULE}") as e:
        _compile({"scale_d": value, "offset_d": 0})
    msg = _one_line(e)
    shown = repr(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else f"{value!r}"
    assert f"scale_d = {shown}" in msg, msg


@pytest.mark.parametrize("value", BAD_OFFSET, ids=repr)
def test_a_bad_offset_d_is_one_error_line_naming_layer_field_and_value(value):
    """Issue: offset_d = 300 (outside uint8) kept the layer fp32 silently; now it raises."""
    with pytest.raises(ValueError, match=rf"^option 'quant_config': layer '{LAYER}': offset_d = .*; {OFFSET_RULE}") as e:
        _compile({"scale_d": 0.02, "offset_d": value})
    assert f"offset_d = {value!r}" in _one_line(e)


@pytest.mark.parametrize("key", ["accum", "out"])
@pytest.mark.parametrize("field, value", [("scale_d", math.inf), ("scale_d", math.nan), ("scale_d", 0),
                                          ("scale_d", -1), ("offset_d", 300), ("offset_d", -1),
                                          ("offset_d", "x")])
def test_a_bad_accum_or_out_record_names_its_key(key, field, value):
    """A ConvAddAct's addend / result record went into the node unchecked (fuse_requant
    then quantized at inf); it follows the same rule."""
    sub = dict(VALID, **{field: value})
    with pytest.raises(ValueError, match=rf"^option 'quant_config': layer '{LAYER}' record '{key}': {field} = "):
        _compile(dict(VALID, **{key: sub}))


@pytest.mark.parametrize("rec, msg", [
    ({"offset_d": 0}, "has no 'scale_d'"),
    ({"scale_d": 0.02}, "has no 'offset_d'"),
    (3, "is 3 (int); give a dict"),
    (None, "is None (NoneType); give a dict"),
    (dict(VALID, accum=0.5), "record 'accum' is 0.5 (float); give a dict"),
])
def test_a_malformed_record_is_one_line(rec, msg):
    with pytest.raises(ValueError, match=f"^option 'quant_config': layer '{LAYER}'") as e:
        _compile(rec)
    assert msg in _one_line(e)


def test_a_layer_key_that_is_no_name_is_one_line():
    with pytest.raises(ValueError, match=r"^option 'quant_config': 'layers' takes node names \(str\)"):
        _compile(VALID, layer=0)


def test_a_non_bool_dynamic_linear_is_refused():
    lin, x = _linear()
    with pytest.raises(ValueError, match="'dynamic_linear' takes True or False, got 'yes'"):
        opencann.compile(lin, x, options={"quant_config": {"layers": {}, "dynamic_linear": "yes"}})


@pytest.mark.parametrize("rec, x_fn", [
    ({"scale_d": 5.0 / 255, "offset_d": 128}, lambda x: x.clamp(-2.5, 2.5)),
    ({"scale_d": 3.0 / 255, "offset_d": 0}, lambda x: x.abs().clamp(max=3.0)),        # bottom offset
    ({"scale_d": 1.0, "offset_d": 0}, lambda x: torch.zeros_like(x)),               # an all-zero calibration
    ({"scale_d": 3.0 / 255, "offset_d": 255}, lambda x: -x.abs().clamp(max=3.0)),     # top offset
    ({"scale_d": 1, "offset_d": 128}, lambda x: (x * 50).clamp(-120, 120)),                             # an int step
    ({"scale_d": 2.0 ** -126, "offset_d": 0}, lambda x: x.abs() * 1e-40),            # the floor itself
    ({"scale_d": np.float32(5.0 / 255), "offset_d": np.int64(128)}, lambda x: x.clamp(-2.5, 2.5)),  # NumPy scalars
])
def test_a_valid_hand_written_record_is_used(rec, x_fn):
    """Valid records, boundaries included, run the layer in int8 at that step: the result is
    eager's up to the quantization error (half a step times sum |w|, plus the weights')."""
    lin, x = _linear()
    x = x_fn(x)
    cm = _compile(rec, lin, x)
    row = quant_report(cm)[0]
    assert row["int8"] and f"offset_d={rec['offset_d']}" in row["detail"], row
    with torch.no_grad():
        want, got = lin(x), cm(x)
    w = lin.weight.abs()
    bound = rec["scale_d"] * w.sum(1).max() + x.abs().max() * w.max() * w.shape[1] / 100
    assert (got - want).abs().max() <= bound + 1e-6, ((got - want).abs().max(), bound)


def test_calibration_records_still_compile_and_round_trip_as_hand_written():
    """Calibration's records always hold (an all-zero range's scale_d 1, offset_d 0: the
    valid-record cases); written back by hand (with a residual block's accum / out and the
    min / max calibration adds) they give opencann.quantize's model, bit for bit."""
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            h = torch.relu(self.a(x))     # the addend a conv's output (a model input as the
            return torch.relu(self.b(h) + h).mean((2, 3))   # addend fails at run time: report)

    m, x = Block().eval(), torch.randn(1, 4, 6, 6)
    batches = [x, torch.randn(1, 4, 6, 6)]
    q = opencann.quantize(m, batches)
    rows = quant_report(q)
    assert rows and all(r["int8"] for r in rows), rows
    records = calibrate(opencann.compile(m, x), [(b,) for b in batches])
    assert any("accum" in r for r in records.values()), records
    again = opencann.compile(m, x, options={"quant_config": {"layers": records}})
    assert all(r["int8"] for r in quant_report(again)), quant_report(again)
    with torch.no_grad():
        assert torch.equal(again(x), q(x))
        torch.testing.assert_close(q(x), m(x), atol=0.1, rtol=0.05)


def _conv_graph(rec):
    g = Graph("g")
    x = g.add_input(TensorDesc((1, 4, 6, 6), DataType.FLOAT), "x")
    w = g.add_const(torch.randn(8, 4, 3, 3), "w")
    b = g.add_const(torch.randn(8), "b")
    attrs = {"input": TensorRef(0), "weight": TensorRef(1), "bias": TensorRef(2), "stride": [1, 1],
             "padding": [1, 1], "dilation": [1, 1], "transposed": False, "output_padding": [0, 0], "groups": 1}
    c = g.create_node("Conv2D", [x, w, b], attrs, [TensorDesc((1, 8, 6, 6), DataType.FLOAT)], "conv")
    g.outputs = [c.output]
    return g, {"layers": {"conv": rec}, "skip_layers": []}


@pytest.mark.parametrize("rec, field", [({"scale_d": 1e-45, "offset_d": 0}, "scale_d"),
                                        ({"scale_d": math.inf, "offset_d": 0}, "scale_d"),
                                        ({"scale_d": 0.05, "offset_d": 300}, "offset_d"),
                                        ({"scale_d": 0.05, "offset_d": -1}, "offset_d")])
def test_the_vnpu_pass_reading_a_record_directly_follows_the_rule(rec, field):
    """The vnpu pass skipped a bad record (and took a denormal step the CPU pass refused);
    it raises the same line when it reads options the option check never saw."""
    g, cfg = _conv_graph(rec)
    opts = complete({})
    opts["quant_config"] = cfg          # past the option check, as a pass sees a bad record
    ctx = PassContext(options=opts, report=CompileReport(), device=parse_device("vnpu:ascend910b"))
    with pytest.raises(ValueError, match=rf"layer 'conv': {field} = "):
        PassManager([VnpuQuantizeInt8()]).run(g, ctx)


def test_the_cpu_pass_reading_a_record_directly_follows_the_rule():
    lin, x = _linear()
    fp32 = opencann.compile(lin, x, options={"disable": ["quantize_int8"]})
    assert any(n.name == LAYER for n in fp32.graph.nodes)
    g = fp32.graph
    opts = complete({})
    opts["quant_config"] = {"layers": {LAYER: {"scale_d": math.inf, "offset_d": 0}}}
    ctx = PassContext(options=opts, report=CompileReport(), device=parse_device("cpu"))
    with pytest.raises(ValueError, match=rf"layer '{LAYER}': scale_d = inf"):
        PassManager([QuantizeInt8()]).run(g, ctx)


# -- tune's candidates ---------------------------------------------------------------------

VALID_NAMES = ", ".join(sorted(CANDIDATES))


@pytest.mark.parametrize("cands, msg", [
    (("fp32", "", "int8"), "candidates: an empty candidate name at position 2; valid: " + VALID_NAMES),
    (("", "fp32"), "an empty candidate name at position 1"),
    (("fp32", "bf16", ""), "an empty candidate name at position 3"),
    (("fp32", "int4"), "unknown candidate precision 'int4' at position 2; valid: " + VALID_NAMES),
    (("fp32", " bf16"), "unknown candidate precision ' bf16'"),
    (("fp32", None), "unknown candidate precision None"),
    (("fp32", ["bf16"]), "unknown candidate precision ['bf16']"),
    (("fp32", "fp32"), "'fp32' given twice in ['fp32', 'fp32']"),
    (("fp32", "bf16", "bf16"), "'bf16' given twice"),
    (("fp32", "bf16", CANDIDATES["bf16"]), "'bf16' given twice"),
    ("fp32,bf16", "takes a list of precisions"),
    ((), "takes a list of precisions"),
])
def test_bad_candidates_are_one_line(cands, msg):
    with pytest.raises(ValueError) as e:
        check_candidates(cands)
    assert msg in _one_line(e)
    lin, x = _linear()
    with pytest.raises(ValueError) as e:      # tune checks them before any compile
        tune(lin, (x,), candidates=cands, timing=False)
    assert msg in _one_line(e)


def test_good_candidates_keep_their_order():
    assert [c.name for c in check_candidates(("fp32", "bf16", "int8"))] == ["fp32", "bf16", "int8"]
    assert [c.name for c in check_candidates(iter(["fp32", "fp16"]))] == ["fp32", "fp16"]


FACTORY = '''
import torch
def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval(), (torch.randn(2, 8),)
'''


@pytest.fixture
def factory(tmp_path):
    p = tmp_path / "m.py"
    p.write_text(FACTORY)
    return f"{p}:make"


@pytest.mark.parametrize("arg, msg", [
    ("fp32,,int8", "an empty candidate name at position 2; valid: " + VALID_NAMES),
    (",fp32,bf16", "an empty candidate name at position 1"),
    ("fp32,bf16,", "an empty candidate name at position 3"),
    ("", "an empty candidate name at position 1"),
    (" ", "an empty candidate name at position 1"),
    ("fp32,int4", "unknown candidate precision 'int4' at position 2; valid: " + VALID_NAMES),
    ("fp32,fp32", "'fp32' given twice"),
    ("fp32,bf16,bf16", "'bf16' given twice"),
    ("bf16,fp32", "must start with 'fp32'"),
    ("fp32", "needs a lower precision after 'fp32'"),
])
def test_cli_bad_candidates_exit_2_with_one_line(arg, msg, factory, capsys):
    rc, out, err = run_cli(["tune", factory, "--no-timing", "--candidates", arg], capsys)
    assert rc == 2 and len(err) == 1, (rc, err)
    assert err[0].startswith(f"error: --candidates {arg}") and msg in err[0], err


def test_cli_candidates_are_stripped_and_passed_in_order(factory, capsys, monkeypatch):
    """'fp32, bf16' (a space after the comma) is fine; the names reach tune in order."""
    seen = {}

    def fake_tune(model, inputs, candidates, **kw):
        seen["c"] = candidates
        raise ValueError("stub")

    monkeypatch.setattr(tune_mod, "tune", fake_tune)
    rc, _, err = run_cli(["tune", factory, "--no-timing", "--candidates", "fp32, bf16 ,int8"], capsys)
    assert rc == 2 and err == ["error: stub"], err
    assert seen["c"] == ("fp32", "bf16", "int8")
