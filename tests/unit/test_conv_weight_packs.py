"""Conv weights are packed per intra-op thread count (ConvWeightPacks): a model compiled
at one thread count and run at another stays correct and never reorders its weights
on every call (oneDNN's blocking depends on the thread count)."""
import threading

import pytest
import torch

import opencann
from opencann.devices.cpu import mkldnn_available

pytestmark = [pytest.mark.serial,     # sets this process's intra-op thread count
              pytest.mark.skipif(not mkldnn_available(), reason="no oneDNN convolutions")]


class Bottleneck(torch.nn.Module):
    """ResNet-50's layer-3 expansion (256 → 1024, 1×1, 14×14) with a residual add: the
    shape whose weight blocking differs between 1 and 2 threads on AVX-512 hosts."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(1024, 256, 1)
        self.bn = torch.nn.BatchNorm2d(256)
        self.b = torch.nn.Conv2d(256, 256, 3, padding=1)
        self.c = torch.nn.Conv2d(256, 1024, 1)

    def forward(self, x):
        y = torch.relu(self.bn(self.a(x)))
        y = torch.relu(self.b(y))
        return torch.relu(self.c(y) + x)


def _model_and_input():
    torch.manual_seed(0)
    m = Bottleneck().eval()
    with torch.no_grad():
        m.bn.running_var.uniform_(0.5, 2.0)
        m.bn.running_mean.normal_()
    x = torch.randn(1, 1024, 14, 14)
    x[0, 3, 2, 2], x[0, 9, 0, 1], x[0, 11, 5, 5] = float("nan"), float("inf"), float("-inf")
    return m, x


def _with_threads(n, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("compile_threads,run_threads", [(2, 1), (1, 2)])
def test_other_thread_count_matches_eager(compile_threads, run_threads):
    m, x = _model_and_input()
    with torch.no_grad():
        ref = m(x)
    cm = _with_threads(compile_threads, lambda: opencann.compile(m, (x,)))
    outs = [_with_threads(run_threads, lambda: cm(x)) for _ in range(2)]
    got = []

    def in_thread():
        torch.set_num_threads(run_threads)
        got.append(cm(x))
    th = threading.Thread(target=in_thread)
    th.start()
    th.join()
    for y in outs + got:
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4, equal_nan=True)
        assert torch.equal(torch.isnan(y), torch.isnan(ref))
        assert torch.equal(torch.isinf(y), torch.isinf(ref))
    assert outs[0].data_ptr() != outs[1].data_ptr()


def test_packs_are_made_once_per_thread_count(capfd):
    from opencann.ops.kernels.cpu import ConvWeightPacks
    torch.manual_seed(0)
    w = torch.randn(1024, 256, 1, 1)
    x = torch.randn(1, 256, 14, 14).to(memory_format=torch.channels_last)

    class _N:  # the attributes ConvWeightPacks reads of a node and a tensor description
        attrs = dict(padding=[0, 0], stride=[1, 1], dilation=[1, 1], groups=1)

    class _D:
        shape = (1, 256, 14, 14)
    packs = _with_threads(2, lambda: ConvWeightPacks(_N(), _D(), w))
    conv = torch.ops.mkldnn._convolution_pointwise
    ref = torch.nn.functional.conv2d(x, w)
    for n in (1, 2, 1):
        def run():
            return conv(x, packs.get(), None, [0, 0], [1, 1], [1, 1], 1, "none", [], "")
        _with_threads(n, run)  # the primitive for this count is made (and cached) here
        capfd.readouterr()
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
            y = _with_threads(n, run)
        log = capfd.readouterr().out
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
        assert "convolution" in log and ",reorder," not in log, log
    assert packs.counts() == [1, 2]
