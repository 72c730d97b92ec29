"""Activations lowered to bf16 / fp16 keep NaN and ±inf where eager fp32 puts them: ATen's
fp16 GELU returns +inf for +inf where its fp32 one (oneDNN's on AVX-512) returns NaN, so a
Linear → GELU lowered to fp16 returned +inf where eager returned NaN. The precision pass
asks `parity.activation_low_precision_differs` (every kernel the lowered node may bind, in
each low dtype) and keeps the activation fp32 where it differs, naming it in its note."""
import pytest
import torch
import torch.nn.functional as F

import opencann
from opencann.ops.parity import activation_low_precision_differs
from opencann.ops.parity.activation_low import LOW_ACTS, low_kernels

MODES = ["allow_mix_precision", "force_fp16", "allow_mix_precision_bf16"]
ACTS = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu,
        "tanh": torch.tanh, "sigmoid": torch.sigmoid}


class LinearAct(torch.nn.Module):
    def __init__(self, act: str):
        super().__init__()
        self.lin, self.act = torch.nn.Linear(4, 8), ACTS[act]

    def forward(self, x):
        return self.act(self.lin(x))


def _specials(x: torch.Tensor) -> torch.Tensor:
    """+inf, -inf and NaN in separate rows of a randn input (a Linear then gives ±inf
    across the row, with the weights' signs)."""
    x[1, 2] = float("inf")
    x[3, 0] = float("-inf")
    x[4, 1] = float("nan")
    return x


def _same_specials(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(out.isinf(), ref.isinf())
    assert torch.equal(out[ref.isinf()], ref[ref.isinf()])
    fin = torch.isfinite(ref)
    assert (out[fin] - ref[fin]).abs().max().item() < tol


def _low(mode: str) -> torch.dtype:
    return torch.bfloat16 if mode.endswith("bf16") else torch.float16


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("act", sorted(ACTS))
def test_linear_then_activation_keeps_eagers_nan_and_inf(mode, act):
    torch.manual_seed(0)
    m = LinearAct(act).eval()
    cm = opencann.compile(m, (torch.randn(6, 4),), options={"precision_mode": mode})
    for _ in range(2):
        x = _specials(torch.randn(6, 4))
        with torch.no_grad():
            ref = m(x)
        _same_specials(cm(x), ref, 0.05)


@pytest.mark.parametrize("act", sorted(ACTS))
def test_force_fp16_activation_of_an_input_keeps_eagers_nan_and_inf(act):
    """Under force_fp16 the activation reads the input's fp16 cast directly."""
    class Act(torch.nn.Module):
        def forward(self, x):
            return ACTS[act](x * 2.0)
    m = Act()
    cm = opencann.compile(m, (torch.randn(3, 40),), options={"precision_mode": "force_fp16"})
    for _ in range(2):
        x = torch.randn(3, 40)
        x[0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
        x[2, -3:] = torch.tensor([float("inf"), 3e4, -3e4])
        _same_specials(cm(x), m(x), 0.02)


@pytest.mark.parametrize("mode", MODES)
def test_an_activation_the_probe_flags_stays_fp32_and_is_named(mode):
    """Where `activation_low_precision_differs` finds a difference (fp16 GELU on an
    AVX-512 CPU) the Gelu node computes in fp32 and the precision note gives the probe's
    line; elsewhere it is lowered."""
    cm = opencann.compile(LinearAct("gelu").eval(), (torch.randn(6, 4),),
                          options={"precision_mode": mode, "disable": ["fuse_linear_act"]})
    why = activation_low_precision_differs("gelu", _low(mode))
    (gelu,) = [n for n in cm.graph.nodes if n.op == "Gelu"]
    note = next(p.note for p in cm.report.passes if p.name == "precision")
    if why:
        assert gelu.outputs[0].desc.dtype.torch == torch.float32
        assert "kept in fp32" in note and why in note, note
    else:
        assert gelu.outputs[0].desc.dtype.torch == _low(mode)


def test_the_probe_covers_each_activation_in_each_low_dtype():
    """Every activation of `LOW_ACTS` is probed in bf16 and fp16 through ATen's
    functional, .out, in-place, strided and channels-last kernels (and in bf16 oneDNN's
    inner product post-op where LinearAct binds it); each answer is a line or None."""
    from opencann.devices.cpu import onednn_bf16_available, onednn_linear_available
    from opencann.ops.kernels.cpu import BF16_LINEAR_POST
    for act in LOW_ACTS:
        for dt in (torch.bfloat16, torch.float16):
            names = [n for n, _, _ in low_kernels(act, dt)]
            extra = dt == torch.bfloat16 and act in BF16_LINEAR_POST and onednn_linear_available() \
                and onednn_bf16_available()
            assert len(names) == 5 + extra, names
            why = activation_low_precision_differs(act, dt)
            assert why is None or (isinstance(why, str) and "\n" not in why)
    with pytest.raises(KeyError):
        list(low_kernels("relu", torch.float16))
