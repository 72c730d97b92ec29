"""`opencann.runtime.weight_watch`: writes torch does not count in ``_version`` are seen
(optimizer steps through the global post-hook, value probes for the rest), with no false
alarm on NaN/-0.0 values or unrelated optimizers, and nothing kept alive after the watched
tensors die. Per-call cost: bench/weight_watch.py."""
import gc

import torch
import torch.nn as nn

from opencann.runtime import weight_watch
from opencann.runtime.weight_watch import SAMPLE, SMALL_BYTES, WeightWatch


def _special(n):
    t = torch.randn(n)
    t[0], t[1], t[2] = float("nan"), -0.0, float("inf")
    return t


def test_unchanged_tensors_with_nan_and_signed_zeros_are_not_flagged():
    ts = [_special(10), _special(SMALL_BYTES), _special(7).to(torch.bfloat16),
          torch.tensor([True, False]), torch.arange(6).view(2, 3).t()]
    w = WeightWatch(ts, [f"t{i}" for i in range(len(ts))])
    assert not w.changed() and not w.changed() and w.changes() == {}


def test_small_tensor_compared_whole():
    ts = [torch.randn(SMALL_BYTES // 4), torch.randn(3, dtype=torch.float64)]
    w = WeightWatch(ts, ["a", "b"])
    ts[0].data[SMALL_BYTES // 8] += 1           # the middle of a tensor of SMALL_BYTES
    assert w.changed() and list(w.changes()) == [0]


def test_large_tensor_sampled_at_both_ends():
    big = torch.randn(SMALL_BYTES)              # 4x SMALL_BYTES bytes: sampled
    w = WeightWatch([big], ["big"])
    big.data[-1] = 7.0
    assert w.changed()
    w2 = WeightWatch([big], ["big"])            # a new snapshot
    big.data[SAMPLE + 5] += 1                   # the documented blind spot: not sampled
    assert not w2.changed()


def test_gapped_and_transposed_buffers():
    base = torch.randn(8, 8)
    gapped, trans = base[:, ::2], torch.randn(4, 6).t()
    w = WeightWatch([gapped, trans], ["gapped", "trans"])
    assert not w.changed()
    trans.data[5, 3] = 1e3
    gapped.data[0, 1] = 1e3
    assert set(w.changes()) == {0, 1}


def test_optimizer_hook_marks_only_stepped_parameters():
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    w = WeightWatch(list(a.parameters()), ["weight", "bias"])
    b(torch.randn(2, 3)).sum().backward()
    torch.optim.SGD(b.parameters(), lr=0.1, fused=True).step()
    torch.optim.SGD(a.parameters(), lr=0.1, fused=True).step()   # no grads: no write
    assert not w.changed()
    a(torch.randn(2, 3)).sum().backward()
    torch.optim.Adam(a.parameters(), lr=0.1, fused=True).step()
    assert w.changed()
    assert w.changes() == {0: "was modified in place by an optimizer step (Adam)",
                           1: "was modified in place by an optimizer step (Adam)"}


def test_watch_released_when_a_tensor_dies():
    t = torch.randn(100)
    w = WeightWatch([t], ["t"])
    assert w in weight_watch._WATCHES
    del t
    gc.collect()
    assert w not in weight_watch._WATCHES and not w.changed() and w._views == []


def test_a_replaced_parameter_with_no_other_reference_is_reported():
    """``m.w = nn.Parameter(t)`` frees the old Parameter inside the assignment when only the
    module held it: the watch reports the replacement (it is not released), by name."""
    m = nn.Sequential(nn.Linear(4, 4))
    w = WeightWatch(list(m.parameters()), ["0.weight", "0.bias"], module=m)
    assert not w.changed()
    m[0].weight = nn.Parameter(torch.randn(4, 4))   # the old weight dies here
    gc.collect()
    assert w in weight_watch._WATCHES and w.changed()
    assert w.changes() == {0: weight_watch.REPLACED}


def test_watch_released_when_its_module_dies():
    m = nn.Sequential(nn.Linear(4, 4))
    w = WeightWatch(list(m.parameters()), ["0.weight", "0.bias"], module=m)
    del m
    gc.collect()
    assert w not in weight_watch._WATCHES and not w.changed()


def test_channels_last_and_gapped_module_state_through_both_compilers():
    """Non-contiguous module state (a channels-last conv weight, a gapped buffer) is
    watched like any other: torch.compile re-freezes, opencann.compile refuses."""
    import pytest

    import opencann

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.register_buffer("g", torch.randn(4, 8)[:, ::2])

        def forward(self, x):
            return self.conv(x).mean((2, 3)) + self.g.sum(1)

    torch.manual_seed(0)
    m = M().to(memory_format=torch.channels_last).eval()
    x = torch.randn(2, 3, 6, 6)
    tm = torch.compile(m, backend="opencann")
    with torch.no_grad():
        cm = opencann.compile(m, (x,))
        torch.testing.assert_close(tm(x), m(x))
        torch.testing.assert_close(cm(x), m(x))
        m.conv.weight.data.mul_(-2)
        m.g.data[0, 0] = 5.0
        torch.testing.assert_close(tm(x), m(x))
        with pytest.raises(ValueError,
                           match="was modified in place after compiling \\(without a version bump"):
            cm(x)


def test_registration_traced_by_dynamo_while_a_watch_lives():
    """A live module watch installs the global registration hooks; a function traced by
    torch.compile that builds a ModuleList (``self.layers[:n]``, as transformers' decoders
    do) runs them under dynamo, which must neither fail nor mark the watched module."""
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    params = list(m.parameters())               # alive: a dead tensor releases its watch
    w = WeightWatch(params, [n for n, _ in m.named_parameters()], module=m)
    layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def run(x):
        for layer in layers[:2]:
            x = layer(x)
        return x

    x = torch.randn(2, 4)
    out = torch.compile(run, backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(out, layers[1](layers[0](x)))
    assert not w.changed() and not w.replaced
    m[0].weight = nn.Parameter(torch.randn(4, 4))   # a real replacement is still seen
    assert w.changed()
