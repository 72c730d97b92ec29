"""`opencann.quantize` with dynamic dims and gears (docs/guide/quantization.md): the int8
kernels run at every shape, equal to the static quantization at the calibrated shape,
close to eager fp32 at other shapes, through save/load; calibration batches of several
sizes under dynamic_shapes; one-line errors for what stays refused."""
import pytest
import torch

import opencann
from opencann.devices.cpu import mkldnn_available
from opencann.tools.quantize import quant_report

pytestmark = pytest.mark.skipif(not (mkldnn_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")),
                                reason="no oneDNN int8 kernels in this torch")


class Net(torch.nn.Module):
    """Conv-ReLU, global mean, Linear-ReLU-Linear: QuantConvBiasAct and QuantLinearAct."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.fc1, self.fc2 = torch.nn.Linear(8, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        y = torch.relu(self.conv(x)).mean((2, 3))
        return self.fc2(torch.relu(self.fc1(y)))


def _model():
    torch.manual_seed(0)
    return Net().eval()


def _cal(shapes):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*s, generator=g) for s in shapes]


def _close(cm, m, x):
    got, want = cm(x), m(x)
    assert got.shape == want.shape
    cos = torch.nn.functional.cosine_similarity(got.flatten().double(), want.flatten().double(), 0)
    assert cos > 0.999 and (got - want).abs().max() < 0.05


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("how", ["dynamic_shapes", "gears"])
def test_quantized_model_serves_other_shapes(how, tmp_path):
    m, cal = _model(), _cal([(4, 3, 8, 8)] * 3)
    static = opencann.quantize(m, cal)
    if how == "gears":
        q = opencann.quantize(m, cal, options={"dynamic_batch_size": [1, 2, 4, 8]})
    else:
        q = opencann.quantize(m, cal, dynamic_shapes={"x": {0: "batch", 2: "h", 3: "w"}})
    assert [r["int8"] for r in quant_report(q)] == [True, True, True]
    x = cal[0].clone()
    assert torch.equal(q(x), static(x))            # the calibrated shape: the same kernels and scales
    shapes = [(1, 3, 8, 8), (3, 3, 8, 8), (8, 3, 8, 8)] + ([(2, 3, 5, 11)] if how == "dynamic_shapes" else [])
    g = torch.Generator().manual_seed(2)
    for s in shapes:
        xs = torch.randn(*s, generator=g)
        first = q(xs)
        _close(q, m, xs)
        assert torch.equal(q(xs), first)
    path = str(tmp_path / "q.ocm")
    opencann.save(q, path)
    back = opencann.load(path)
    for s in shapes:
        xs = torch.randn(*s, generator=g)
        assert torch.equal(back(xs), q(xs))


def test_dynamic_calibration_takes_batches_of_several_sizes():
    m = _model()
    cal = _cal([(1, 3, 8, 8), (4, 3, 8, 8), (2, 3, 6, 10)])
    q = opencann.quantize(m, cal, dynamic_shapes={"x": {0: "batch", 2: "h", 3: "w"}})
    assert all(r["int8"] for r in quant_report(q))
    for x in cal:
        _close(q, m, x)


def test_shape_errors_stay_one_line():
    m = _model()
    with pytest.raises(ValueError, match="give dynamic_shapes for the dims that differ"):
        opencann.quantize(m, _cal([(1, 3, 8, 8), (4, 3, 8, 8)]))
    with pytest.raises(ValueError, match="ranks and dtypes"):
        opencann.quantize(m, [torch.randn(1, 3, 8, 8), torch.randn(3, 8, 8)],
                          dynamic_shapes={"x": {0: "batch"}})
    q = opencann.quantize(m, _cal([(2, 3, 8, 8)]), options={"dynamic_batch_size": [1, 2]})
    with pytest.raises(ValueError) as e:
        q(torch.randn(3, 3, 8, 8))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="dim_ranges"):
        opencann.quantize(m, _cal([(2, 3, 8, 8)]), dim_ranges={"batch": (1, 4)})


@pytest.mark.parametrize("how", ["dynamic_shapes", "gears"])
def test_observed_run_uses_the_plan_of_the_call_shape(how, recwarn):
    """Calibration (`CompiledModel.run_observed`) at a shape other than the example's
    observes that shape's tensors: the records equal a static model's at that shape, and
    no kernel writes into a buffer planned for another shape (torch's resize warning)."""
    from opencann.engine.quantize import _batches, calibrate
    m = _model()
    x4, x2 = _cal([(4, 3, 8, 8), (2, 3, 8, 8)])
    if how == "gears":
        cm = opencann.compile(m, x4, options={"dynamic_batch_size": [2, 4]})
    else:
        cm = opencann.compile(m, x4, dynamic_shapes={"x": {0: "batch"}})
    seen = []
    outs = cm.run_observed(lambda node, ts: seen.extend(t.shape[0] for t in ts if isinstance(t, torch.Tensor)
                                                         and t.dim() > 1), x2)
    assert set(seen) == {2}
    torch.testing.assert_close(outs[0], m(x2), rtol=1e-5, atol=1e-5)
    # the two compiles may bind different fp32 kernels (the bind-time race): records equal
    # to float32 rounding of the layers' inputs, not bit for bit
    got, want = calibrate(cm, _batches([x2])), calibrate(opencann.compile(m, x2), _batches([x2]))
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].keys() == want[k].keys()
        for f, v in want[k].items():
            assert got[k][f] == pytest.approx(v, rel=1e-5, abs=1e-6), (k, f)
    assert not [w for w in recwarn if "resized" in str(w.message)]
