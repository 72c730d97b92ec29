"""`fold_batchnorm` near the dtype's limit (`opencann.ops.parity.batchnorm_fold`).

Folding BatchNorm into the conv's weights moves where values overflow: eager's conv output
overflows before a scale < 1 would bring it back, a float64 γ/√(var+eps) stays finite where
eager's float32 one is inf, W·scale flushes to 0 where eager keeps inf·tiny = inf. Each
case below but `_huge_gamma` (refused by the bound alone) gave other inf/NaN positions than
eager before; now the BatchNorm is kept with the reason in the report, and a normal model
still folds. Every compiled result is checked
against eager with NaN/Inf inputs, on two calls, with independent outputs."""
import pytest
import torch

import opencann
from opencann.ops.parity.batchnorm_fold import fold_values, input_bound


class ConvBN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x))


def _model(setup):
    m = ConvBN().eval()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-1, 1)
        m.bn.running_var.uniform_(0.5, 2)
        setup(m)
    return m


def _inputs(seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(2, 3, 6, 6, generator=g) + 0.1) * scale   # non-zero, positive
    x[0, 0, 1, 1] = float("nan")
    x[1, 1, 2, 3] = float("inf")
    x[1, 2, 4, 4] = -float("inf")
    return x


def _big_weights(m):      # eager's conv output overflows; scale 0.01 would bring it back
    m.conv.weight[0].fill_(2e38)
    m.bn.weight.fill_(0.01)


def _inf_scale(m):        # float32 γ/√(0 + eps) is inf; float64's is 9.5e38, finite
    m.bn.running_var[1] = 0.0
    m.bn.weight[1] = 3e36


def _flushed_weights(m):  # W·scale = 1e-47 flushes to 0: inf·0 = NaN, eager's inf·tiny = inf
    m.conv.weight[2].fill_(1e-17)
    m.bn.weight[2] = 1e-30


def _huge_gamma(m):       # folded weights of 1e29: 27 taps × large inputs pass float32's max
    m.bn.weight.fill_(1e30)


CASES = [(_big_weights, "eager's conv output in channel 0", 0.5),
         (_inf_scale, "BatchNorm's scale γ/√(var+eps) is infinite in channel 1", 1.0),
         (_flushed_weights, "the folded weight underflows float32's smallest normal", 1.0),
         (_huge_gamma, "eager's BatchNorm output in channel 0 could reach", 1.0)]


def _check(cm, m, scale):
    kept = []
    for seed in (1, 2):
        x = _inputs(seed, scale)
        with torch.no_grad():
            want = m(x)
        got = cm(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        kept.append((got, got.clone(), x))
    got, copy, x = kept[0]
    torch.testing.assert_close(got, copy, rtol=0, atol=0, equal_nan=True)  # untouched by call 2
    assert got.untyped_storage().data_ptr() != kept[1][0].untyped_storage().data_ptr()
    assert got.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


@pytest.mark.parametrize("setup,reason,scale", CASES, ids=[c[0].__name__ for c in CASES])
def test_extreme_constants_keep_batchnorm_and_eager_values(setup, reason, scale):
    m = _model(setup)
    cm = opencann.compile(m, (_inputs(0, scale),))
    assert cm.graph.op_counts().get("BatchNorm") == 1
    skips = [s["reason"] for s in cm.report.skipped if s["pass"] == "fold_batchnorm"]
    assert len(skips) == 1 and reason in skips[0] and "BatchNorm kept unfused" in skips[0]
    _check(cm, m, scale)


def test_ordinary_statistics_still_fold_and_match_eager():
    m = _model(lambda m: (m.bn.weight.uniform_(0.5, 2), m.bn.running_var.__setitem__(0, 0.0)))
    cm = opencann.compile(m, (_inputs(0),))
    assert "BatchNorm" not in cm.graph.op_counts()
    assert not [s for s in cm.report.skipped if s["pass"] == "fold_batchnorm"]
    _check(cm, m, 1.0)


def test_nan_statistics_still_fold_and_give_eager_nan_channels():
    m = _model(lambda m: (m.bn.running_var.__setitem__(0, float("nan")),
                          m.bn.weight.__setitem__(1, float("nan")),
                          m.bn.running_mean.__setitem__(2, float("nan"))))
    cm = opencann.compile(m, (_inputs(0),))
    assert "BatchNorm" not in cm.graph.op_counts()
    _check(cm, m, 1.0)


def test_fold_values_uses_eagers_float32_scale():
    """Eager's α = (1/√(var+eps))·γ in float32: the folded weight is W·α rounded once."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(4, 2, 3, 3, generator=g), torch.randn(4, generator=g)
    gamma, beta = torch.randn(4, generator=g), torch.randn(4, generator=g)
    mean, var = torch.randn(4, generator=g), torch.rand(4, generator=g) + 0.1
    wf, bf = fold_values(w, b, gamma, beta, mean, var, 1e-5)
    alpha = (1 / torch.sqrt(var + torch.tensor(1e-5))) * gamma
    torch.testing.assert_close(wf, (w.double() * alpha.double().view(-1, 1, 1, 1)).float(),
                               rtol=0, atol=0)
    torch.testing.assert_close(bf, (b.double() * alpha.double()
                                    + (beta - mean * alpha).double()).float(), rtol=0, atol=0)
    assert input_bound(torch.float32) == pytest.approx(1.8446744e19, rel=1e-6)
    assert input_bound(torch.float16) == pytest.approx(255.94, rel=1e-4)
    reason = fold_values(w, b, gamma, beta, mean, var * 0, 1e-30)  # α = γ·1e15: fine
    assert not isinstance(reason, str)
    reason = fold_values((w * 20).half(), b.half(), gamma, beta, mean, var, 1e-5)
    assert isinstance(reason, str) and "float16's max" in reason
