"""Freezing on the torch.compile path (#11 item 6, `opencann.dynamo.freezing`): in
inference graphs the module's parameters and buffers are constants, so BatchNorm folds
and Conv+BN+ReLU fuses as in ``opencann.compile``; a frozen weight changed afterwards
(in place under no_grad, ``load_state_dict``, an optimizer step, a tied weight, a new
Parameter, ``p.data = t``) re-freezes the graph (counted in `opencann.dynamo.recompiles`)
and the next call matches eager's new value; training graphs and tensors the graph
writes are not frozen; symbolic graphs and graph breaks freeze too."""
import logging

import pytest
import torch

import opencann  # noqa: F401  (registers the backend)
from opencann.dynamo import COMPILED_GRAPHS, recompiles
from opencann.log import logger as opencann_logger


class ConvBnRelu(torch.nn.Module):
    def __init__(self, c=4):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, c, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(c)
        with torch.no_grad():   # non-trivial statistics: a fold that ignored them would show
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class Tied(torch.nn.Module):
    """An embedding whose table is also the output projection (tied weights)."""

    def __init__(self, v=11, d=8):
        super().__init__()
        self.emb = torch.nn.Embedding(v, d)
        self.proj = torch.nn.Linear(d, v, bias=False)
        self.proj.weight = self.emb.weight

    def forward(self, ids):
        return self.proj(torch.tanh(self.emb(ids)))


class Broken(torch.nn.Module):
    """Two Linear layers with a graph break between them (two dynamo graphs)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)

    def forward(self, x):
        y = self.a(x)
        torch._dynamo.graph_break()
        return self.b(torch.relu(y))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def logs():
    """The opencann logger's records at INFO and above (it does not propagate to root)."""
    h, old = _Records(), opencann_logger.level
    opencann_logger.addHandler(h)
    opencann_logger.setLevel(logging.INFO)
    yield h
    opencann_logger.removeHandler(h)
    opencann_logger.setLevel(old)


def _last(n0):
    return COMPILED_GRAPHS[n0:]


def _count(model):
    return recompiles(model)["compiles"]


def test_conv_bn_relu_folds_and_matches_eager():
    m = ConvBnRelu().eval()
    f = torch.compile(m, backend="opencann")
    x = torch.randn(2, 3, 8, 8)
    x[0, 1, 2, 3] = float("nan")
    n0 = len(COMPILED_GRAPHS)
    with torch.no_grad():
        want = m(x)
        got = f(x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, equal_nan=True)
        assert torch.equal(got.isnan(), want.isnan())
        got.fill_(7.0)                              # output independence
        again = f(x)                                # second call
    torch.testing.assert_close(again, want, atol=1e-5, rtol=1e-5, equal_nan=True)
    (rep,) = _last(n0)
    applied = {a["pass"] for a in rep.applied}
    assert {"fold_batchnorm", "fuse_conv_act"} <= applied, rep.summary()
    assert not any(s["pass"] == "fold_batchnorm" for s in rep.skipped)
    fr = rep.torch_compile["frozen"]
    assert fr["tensors"] == 6 and fr["bytes"] > 0 and fr["kept_as_inputs"] == {}
    assert "freezing: 6 module tensors" in rep.summary()


def test_option_off_keeps_weights_as_inputs():
    m = ConvBnRelu().eval()
    f = torch.compile(m, backend="opencann", options={"freezing": False})
    n0 = len(COMPILED_GRAPHS)
    x = torch.randn(1, 3, 6, 6)
    with torch.no_grad():
        torch.testing.assert_close(f(x), m(x), atol=1e-5, rtol=1e-5)
        m.conv.weight.data.mul_(3)                  # unfrozen: even .data writes are seen
        torch.testing.assert_close(f(x), m(x), atol=1e-5, rtol=1e-5)
    (rep,) = _last(n0)
    assert "frozen" not in rep.torch_compile
    assert any(s["pass"] == "fold_batchnorm" and "not constants" in s["reason"] for s in rep.skipped)


def test_bad_option_value():
    f = torch.compile(ConvBnRelu().eval(), backend="opencann", options={"freezing": "yes"})
    with torch.no_grad(), pytest.raises(Exception, match="option 'freezing' takes True or False"):
        f(torch.randn(1, 3, 6, 6))


def _change_in_place(m):
    with torch.no_grad():
        m.conv.weight.mul_(-2)
        m.bn.running_var.add_(0.5)


def _change_by_load_state_dict(m):
    sd = {k: (v * 1.5 if v.is_floating_point() else v) for k, v in m.state_dict().items()}
    m.load_state_dict(sd)


def _change_by_new_parameter(m):
    m.conv.weight = torch.nn.Parameter(torch.randn_like(m.conv.weight))


def _change_by_data_rebinding(m):
    m.conv.weight.data = torch.randn_like(m.conv.weight)


@pytest.mark.parametrize("change", [_change_in_place, _change_by_load_state_dict,
                                    _change_by_new_parameter, _change_by_data_rebinding])
def test_changed_weight_refreezes(change, logs):
    m = ConvBnRelu().eval()
    f = torch.compile(m, backend="opencann")
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(f(x), m(x), atol=1e-5, rtol=1e-5)
        before = _count(m)
        change(m)
        got = f(x)
        torch.testing.assert_close(got, m(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(f(x), m(x), atol=1e-5, rtol=1e-5)   # and stays frozen
    assert _count(m) == before + 1
    last = recompiles(m)["recompiles"][-1]
    assert "frozen conv.weight" in last["reason"] or "frozen bn." in last["reason"]
    assert any("re-frozen" in r.getMessage() for r in logs.records)


def test_optimizer_step_between_inference_calls():
    m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))
    f = torch.compile(m, backend="opencann")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(3, 5)
    c0 = _count(m)
    for _ in range(2):
        with torch.no_grad():
            torch.testing.assert_close(f(x), m(x), atol=1e-5, rtol=1e-5)
        m(torch.randn(4, 5)).square().sum().backward()   # an eager training step
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        torch.testing.assert_close(f(x), m(x), atol=1e-5, rtol=1e-5)
    assert _count(m) - c0 == 3      # the first compile and two re-freezes


def test_tied_weights():
    m = Tied().eval()
    f = torch.compile(m, backend="opencann")
    ids = torch.tensor([[1, 4, 9, 0]])
    n0, c0 = len(COMPILED_GRAPHS), _count(m)
    with torch.no_grad():
        torch.testing.assert_close(f(ids), m(ids), atol=1e-5, rtol=1e-5)
        assert _last(n0)[0].torch_compile["frozen"]["tensors"] == 1   # one tensor, two users
        m.proj.weight.mul_(0.5)                    # through the other module
        torch.testing.assert_close(f(ids), m(ids), atol=1e-5, rtol=1e-5)
    assert _count(m) - c0 == 2


def test_two_instances_of_one_class_switch_without_recompiling():
    a, b = ConvBnRelu().eval(), ConvBnRelu().eval()
    fa, fb = torch.compile(a, backend="opencann"), torch.compile(b, backend="opencann")
    x = torch.randn(1, 3, 6, 6)
    c0 = _count(a)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(fa(x), a(x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(fb(x), b(x), atol=1e-5, rtol=1e-5)
    assert _count(a) - c0 == 2      # b's weights frozen once, then both kept


def test_training_graph_not_frozen():
    m = ConvBnRelu().train()
    f = torch.compile(m, backend="opencann")
    x = torch.randn(2, 3, 6, 6)
    ref = ConvBnRelu().train()
    ref.load_state_dict(m.state_dict())
    n0 = len(COMPILED_GRAPHS)
    f(x).sum().backward()
    ref(x).sum().backward()
    assert all("frozen" not in r.torch_compile for r in _last(n0))
    torch.testing.assert_close(m.conv.weight.grad, ref.conv.weight.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(m.bn.running_mean, ref.bn.running_mean, atol=1e-6, rtol=1e-5)


def test_train_mode_under_no_grad_keeps_written_buffers():
    m = ConvBnRelu().train()
    ref = ConvBnRelu().train()
    ref.load_state_dict(m.state_dict())
    f = torch.compile(m, backend="opencann")
    x = torch.randn(2, 3, 6, 6)
    n0 = len(COMPILED_GRAPHS)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(f(x), ref(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m.bn.running_var, ref.bn.running_var, atol=1e-6, rtol=1e-5)
    kept = _last(n0)[0].torch_compile["frozen"]["kept_as_inputs"]
    assert {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"} <= set(kept)
    assert all("writes it" in why for why in kept.values())
    m.eval()                                    # dynamo recompiles; now all frozen
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(f(x), ref(x), atol=1e-5, rtol=1e-5)
    assert COMPILED_GRAPHS[-1].torch_compile["frozen"]["kept_as_inputs"] == {}


def test_grad_mode_without_trainable_tensors_is_frozen_and_inference_mode_works():
    m = ConvBnRelu().eval().requires_grad_(False)
    f = torch.compile(m, backend="opencann")
    x = torch.randn(1, 3, 6, 6)
    n0 = len(COMPILED_GRAPHS)
    torch.testing.assert_close(f(x), m(x), atol=1e-5, rtol=1e-5)
    assert _last(n0)[0].torch_compile["frozen"]["tensors"] == 6
    with torch.inference_mode():
        torch.testing.assert_close(f(x), m(x), atol=1e-5, rtol=1e-5)


def test_symbolic_graph_frozen_at_two_shapes():
    m = ConvBnRelu().eval()
    f = torch.compile(m, backend="opencann", dynamic=True)
    n0, c0 = len(COMPILED_GRAPHS), _count(m)
    with torch.no_grad():
        for b, hw in ((2, 8), (3, 5), (2, 8)):
            x = torch.randn(b, 3, hw, hw)
            torch.testing.assert_close(f(x), m(x), atol=1e-5, rtol=1e-5)
        m.conv.bias.add_(1.0)
        x = torch.randn(3, 3, 5, 5)
        torch.testing.assert_close(f(x), m(x), atol=1e-5, rtol=1e-5)
    reps = _last(n0)
    assert reps[0].dynamic and reps[0].torch_compile["frozen"]["tensors"] == 6
    assert any(a["pass"] == "fold_batchnorm" for a in reps[0].applied)
    assert _count(m) - c0 == 2


def test_graph_break_freezes_each_graph():
    m = Broken().eval()
    f = torch.compile(m, backend="opencann")
    x = torch.randn(4, 6)
    n0 = len(COMPILED_GRAPHS)
    with torch.no_grad():
        torch.testing.assert_close(f(x), m(x), atol=1e-5, rtol=1e-5)
        assert [r.torch_compile["frozen"]["tensors"] for r in _last(n0)] == [2, 2]
        m.b.weight.neg_()
        torch.testing.assert_close(f(x), m(x), atol=1e-5, rtol=1e-5)


@torch._dynamo.config.patch(recompile_limit=2)
def test_weight_changing_every_call_is_unfrozen_after_the_limit(logs):
    m = torch.nn.Linear(4, 4)
    f = torch.compile(m, backend="opencann")
    x = torch.randn(2, 4)
    c0 = _count(m)
    with torch.no_grad():
        for _ in range(5):
            torch.testing.assert_close(f(x), m(x), atol=1e-5, rtol=1e-5)
            m.bias.add_(1.0)
    rep = COMPILED_GRAPHS[-1]
    assert rep.torch_compile["frozen"]["kept_as_inputs"] == {"bias": "changed after 2 re-freezes"}
    assert _count(m) - c0 == 4      # the first compile, two re-freezes, then bias as an input
    assert any("kept as graph inputs" in r.getMessage() and r.levelno == logging.WARNING
               for r in logs.records)
