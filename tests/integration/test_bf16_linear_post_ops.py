"""A bf16 LinearAct on oneDNN's prepacked inner product runs GELU (erf / tanh), tanh,
sigmoid and SiLU as oneDNN post-ops (`BF16_LINEAR_POST`, one pass over the output
instead of two), ReLU still as eager's in-place kernel after it (oneDNN's drops NaN).
Checked against eager: the same module under ``torch.autocast`` bf16 (the same GEMM and
activation, both rounded to bf16) and eager fp32 (cosine within bf16's rounding), NaN and
±inf at eager fp32's positions, a second call, and outputs that own their memory."""
import pytest
import torch

import opencann
from opencann.devices.cpu import onednn_bf16_available, onednn_linear_available
from opencann.ops.kernels.cpu import BF16_LINEAR_POST

pytestmark = pytest.mark.skipif(not onednn_linear_available(),
                                reason="no oneDNN inner product in this torch")
BF16 = {"precision_mode": "allow_mix_precision_bf16"}
ACTS = {"gelu": torch.nn.GELU(), "gelu_tanh": torch.nn.GELU(approximate="tanh"),
        "tanh": torch.nn.Tanh(), "sigmoid": torch.nn.Sigmoid(), "silu": torch.nn.SiLU(),
        "relu": torch.nn.ReLU()}


class Mlp(torch.nn.Module):
    """Linear(48 -> 96) + activation, Linear(96 -> 24): a transformer FFN in small."""

    def __init__(self, act: torch.nn.Module):
        super().__init__()
        self.up, self.act, self.down = torch.nn.Linear(48, 96), act, torch.nn.Linear(96, 24)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


def _cosine(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


def _case(act: str, seed: int = 0):
    torch.manual_seed(seed)
    return Mlp(ACTS[act]).eval(), torch.randn(16, 48) * 2


@pytest.mark.parametrize("act", sorted(ACTS))
def test_values_match_eager_bf16_and_fp32(act):
    m, x = _case(act)
    with torch.no_grad():
        ref = m(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_bf16 = m(x).float()
    cm = opencann.compile(m, (x,), options=BF16)
    assert [n.attrs["act"] for n in cm.graph.nodes if n.op == "LinearAct"] == [act, "none"]
    first, second = cm(x), cm(x)
    assert first.dtype == torch.float32 and first.shape == ref.shape
    assert torch.equal(first, second) and first.data_ptr() != second.data_ptr()
    assert _cosine(first, ref) >= 0.999
    # the same bf16 GEMMs as autocast's; the fused activation rounds once: within 2 bf16 ulps
    torch.testing.assert_close(first, ref_bf16, rtol=2 ** -7, atol=2e-2)
    first.add_(1)   # the caller owns the result: the next call is unchanged
    assert torch.equal(cm(x), second)


@pytest.mark.parametrize("act", sorted(ACTS))
def test_nan_and_inf_land_where_eager_fp32_puts_them(act):
    m, x = _case(act, seed=1)
    x[2, 5], x[7, 0], x[11, 30] = float("nan"), float("inf"), float("-inf")
    with torch.no_grad():
        ref = m(x)
    cm = opencann.compile(m, (x,), options=BF16)
    for _ in range(2):
        out = cm(x)
        for special in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(special(out), special(ref)), (act, special.__name__)
    fin = ref.isfinite()
    assert fin.float().mean() > 0.5 and _cosine(out[fin], ref[fin]) >= 0.999


@pytest.mark.skipif(not onednn_bf16_available(), reason="no oneDNN bf16 kernels on this CPU (AVX2 only): "
                    "bf16 linears run ATen's addmm, activations after it")
def test_the_activation_is_a_onednn_post_op_and_relu_is_not(capfd):
    """oneDNN's verbose log of a call: GELU on the first inner product as an eltwise
    post-op, no separate pass; ReLU (not in `BF16_LINEAR_POST`) has none."""
    assert "relu" not in BF16_LINEAR_POST and {"gelu", "gelu_tanh", "silu"} <= set(BF16_LINEAR_POST)
    logs = {}
    for act in ("gelu", "relu"):
        m, x = _case(act)
        cm = opencann.compile(m, (x,), options=BF16)
        cm(x)
        capfd.readouterr()
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
            cm(x)
        logs[act] = [ln for ln in capfd.readouterr().out.splitlines()
                     if ",exec," in ln and ",inner_product," in ln]
    assert len(logs["gelu"]) == 2 and "eltwise_gelu_erf" in logs["gelu"][0], logs["gelu"]
    assert not any("eltwise" in ln for ln in logs["relu"]), logs["relu"]
