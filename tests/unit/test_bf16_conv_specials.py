"""bf16 mixed precision keeps NaN and ±inf where eager fp32 puts them in convolutions (1-,
2-, 3-D, transposed) with an odd number of input channels per group: oneDNN's bf16 convolution sums two input
channels at a time, and the pad of an odd count reads the next pixel's first channel
against a zero weight, so a NaN or inf there turned a neighbouring output NaN (Conv2d(3,
5, 1): the pixel before a NaN pixel all NaN). Such a convolution stays fp32
(`parity.conv_low_precision_differs`, probed per configuration, through every kernel the
bound node may run: Conv2d(1, 8, 1) differs only on the weight reordered to oneDNN's
blocked layout, which a constant weight binds); an even count stays bf16. In fp16 a
convolution runs ATen's kernel (oneDNN's fused one is fp32 / bf16 only) and keeps eager's
positions there too."""
import pytest
import torch

import opencann

BF16 = {"precision_mode": "allow_mix_precision_bf16"}


def _specials(x: torch.Tensor) -> torch.Tensor:
    """NaN, +inf and -inf in a few pixels' first, middle and last channels."""
    c = x.shape[1]
    x[0, 0, 2, 1] = float("nan")
    x[0, c - 1, 4, 4] = float("inf")
    x[-1, c // 2, 0, 0] = float("-inf")
    x[-1, 0, 5, 3] = float("inf")
    return x


def _same_specials(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(out.isinf(), ref.isinf())
    assert torch.equal(out[ref.isinf()], ref[ref.isinf()])
    fin = torch.isfinite(ref)
    assert fin.any()
    assert (out[fin] - ref[fin]).abs().max().item() < 0.05 * ref[fin].abs().max().item()


@pytest.mark.parametrize("cin,cout,k,stride,groups,relu", [
    (3, 5, 1, 1, 1, False), (3, 5, 3, 1, 1, True), (1, 4, 3, 1, 1, False),
    (17, 8, 1, 2, 1, False), (3, 16, 7, 2, 1, True), (6, 4, 3, 1, 2, False),
    (1, 8, 1, 1, 1, False), (1, 8, 1, 1, 1, True)])
def test_odd_channel_convolutions_keep_eagers_nan_and_inf(cin, cout, k, stride, groups, relu):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, groups=groups)
    m = torch.nn.Sequential(conv, torch.nn.ReLU()) if relu else conv
    m = m.eval()
    x = torch.randn(2, cin, 7, 8)
    cm = opencann.compile(m, (x,), options=BF16)
    for _ in range(2):
        x = _specials(torch.randn(2, cin, 7, 8))
        with torch.no_grad():
            ref = m(x)
        _same_specials(cm(x), ref)


@pytest.mark.parametrize("make,shape", [
    (lambda: torch.nn.Conv1d(3, 5, 3, padding=1), (2, 3, 9)),
    (lambda: torch.nn.Conv3d(3, 4, 3, padding=1), (2, 3, 5, 6, 4)),
    (lambda: torch.nn.ConvTranspose2d(3, 5, 2, stride=2), (2, 3, 5, 6)),
    (lambda: torch.nn.ConvTranspose1d(5, 4, 3), (2, 5, 7))])
def test_other_convolutions_with_odd_channels_keep_eagers_nan_and_inf(make, shape):
    """The same fault in 1-D, 3-D and transposed convolutions: each configuration is
    probed as the 2-D one is."""
    torch.manual_seed(0)
    m = make().eval()
    cm = opencann.compile(m, (torch.randn(*shape),), options=BF16)
    x = torch.randn(*shape)
    c = shape[1]
    x[(0, 0) + tuple(s // 2 for s in shape[2:])] = float("nan")
    x[(1, c - 1) + tuple(1 for _ in shape[2:])] = float("inf")
    x[(1, c // 2) + tuple(s - 1 for s in shape[2:])] = float("-inf")
    with torch.no_grad():
        ref = m(x)
    _same_specials(cm(x), ref)


def test_even_channel_convolutions_stay_bf16():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3, padding=1)).eval()
    cm = opencann.compile(m, (torch.randn(1, 3, 8, 8),), options=BF16)
    from opencann.devices.cpu import onednn_bf16_available
    dtypes = [n.outputs[0].desc.dtype.torch for n in cm.graph.nodes if n.op.startswith("Conv")]
    # the 3-channel one kept in fp32 where oneDNN's bf16 kernel would bind it (ATen's keeps
    # eager's NaN positions: bf16 where oneDNN has no bf16 kernels)
    first = torch.float32 if onednn_bf16_available() else torch.bfloat16
    assert dtypes == [first, torch.bfloat16]
    x = _specials(torch.randn(1, 3, 8, 8))
    with torch.no_grad():
        ref = m(x)
    _same_specials(cm(x), ref)


def test_odd_channel_convolution_with_a_residual_keeps_eagers_nan_and_inf():
    """Conv2d(1, 8, 1) + a residual (ConvAddAct in bf16: oneDNN's sum post-op on the
    reordered weight) puts NaN where eager fp32 does, call after call."""
    torch.manual_seed(0)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 8, 1)

        def forward(self, x, r):
            return torch.relu(self.conv(x) + r)
    m = M().eval()
    cm = opencann.compile(m, (torch.randn(2, 1, 7, 8), torch.randn(2, 8, 7, 8)), options=BF16)
    for _ in range(2):
        x, r = _specials(torch.randn(2, 1, 7, 8)), torch.randn(2, 8, 7, 8)
        with torch.no_grad():
            ref = m(x, r)
        out = cm(x, r)
        assert out.dtype == ref.dtype
        _same_specials(out, ref)


@pytest.mark.parametrize("mode", ["allow_mix_precision", "force_fp16"])
@pytest.mark.parametrize("make,shape", [
    (lambda: torch.nn.Conv2d(1, 8, 1), (2, 1, 7, 8)), (lambda: torch.nn.Conv2d(3, 5, 3, padding=1), (2, 3, 7, 8)),
    (lambda: torch.nn.Conv1d(3, 5, 3, padding=1), (2, 3, 9)),
    (lambda: torch.nn.ConvTranspose2d(3, 5, 2, stride=2), (2, 3, 7, 8))])
def test_fp16_odd_channel_convolutions_keep_eagers_nan_and_inf(mode, make, shape):
    """fp16 convolutions run ATen's kernel, which the probe runs for fp16 (and not
    oneDNN's fused one, which fp16 never binds): NaN and ±inf where eager fp32 puts
    them, whichever precision the probe leaves the node in."""
    torch.manual_seed(0)
    m = make().eval()
    cm = opencann.compile(m, (torch.randn(*shape),), options={"precision_mode": mode})
    for _ in range(2):
        x = _specials(torch.randn(*shape)) if len(shape) == 4 else torch.randn(*shape)
        x[(0, 0) + (1,) * (len(shape) - 2)] = float("nan")
        x[(1, shape[1] - 1) + (2,) * (len(shape) - 2)] = float("inf")
        with torch.no_grad():
            ref = m(x)
        out = cm(x)
        assert out.dtype == ref.dtype
        assert torch.equal(torch.isnan(out), torch.isnan(ref))
        assert torch.equal(out.isinf(), ref.isinf())
        assert torch.equal(out[ref.isinf()], ref[ref.isinf()])


def test_the_probe_runs_every_kernel_a_bound_convolution_may_run():
    """bf16 2-D: ATen's at both layouts and oneDNN's on the plain and the reordered
    weight, alone and with the sum post-op (ConvBiasAct / ConvAddAct); fp16 and 1-D /
    transposed ones: ATen's only (they stay Conv2D nodes)."""
    from opencann.devices.cpu import mkldnn_available, onednn_bf16_available
    from opencann.ops.parity.conv_probes import _low_conv_runs
    conv = ([0, 0], [1, 1], [1, 1], 1)
    names = [n for n, _, _ in _low_conv_runs(2, False, torch.bfloat16, conv, [2, 1, 7, 8])]
    assert names[:2] == ["ATen's convolution at the contiguous layout",
                         "ATen's convolution at channels-last"]
    if mkldnn_available() and onednn_bf16_available():
        assert len(names) == 8
        assert sum("reordered" in n for n in names) == 3 and sum("sum post-op" in n for n in names) == 4
    else:   # no oneDNN bf16 convolution binds here: ATen's only
        assert len(names) == 2
    assert len(_low_conv_runs(2, False, torch.float16, conv, [2, 1, 7, 8])) == 2
    assert len(_low_conv_runs(2, True, torch.bfloat16, conv, [2, 1, 7, 8])) == 2
    assert len(_low_conv_runs(1, False, torch.bfloat16, ([0], [1], [1], 1), [2, 1, 7])) == 1
