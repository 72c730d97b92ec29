"""Static views hoisted out of the generated code (runtime/codegen.py): a view of a
constant or a planned buffer is made once at binding, remade per arena by clones, and
gives eager's values; views of inputs, graph outputs and copying reshapes still run per
call."""
import threading

import torch
from torch import nn

import opencann


class Heads(nn.Module):
    """Attention-style reshapes and transposes of planned buffers and of a constant."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.register_buffer("table", torch.randn(4, 8))

    def forward(self, x):
        h = self.proj(x).view(2, 3, 4, 4).transpose(1, 2)      # views of a planned buffer
        t = self.table.t()[:4]                                 # views of a constant
        y = torch.relu(h) @ t                                  # [2, 4, 3, 4]
        return y.reshape(2, 12, 4).sum(-1), x.view(6, 16)      # a view of the input is returned


def _executor(cm):
    return cm.executor


def test_static_views_are_bound_once_and_match_eager():
    torch.manual_seed(0)
    m = Heads().eval()
    x = torch.randn(6, 16)
    cm = opencann.compile(m, (x,))
    src = _executor(cm)._src
    assert "H" in src and _executor(cm)._hoisted, src
    for _ in range(2):   # a second call reuses the bound views
        x = torch.randn(6, 16)
        x[0, 0] = float("nan")
        got, want = cm(x), m(x)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, equal_nan=True)
    out = cm(x)[1]
    assert out.data_ptr() == x.data_ptr()   # the input's view is made per call, on this x


def test_clones_bind_views_of_their_own_arena():
    torch.manual_seed(1)
    m = Heads().eval()
    cm = opencann.compile(m, (torch.randn(6, 16),), options={"concurrent_calls": 3})
    xs = [torch.randn(6, 16) for _ in range(6)]
    want = [m(x)[0] for x in xs]
    got = [None] * len(xs)

    def work(i):
        for _ in range(20):
            got[i] = cm(xs[i])[0].clone()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_a_reshape_that_must_copy_keeps_its_copy_per_call():
    """reshape of a transposed buffer is captured as clone + view: the clone runs every
    call (it reads this call's data), only the views are bound once."""
    class M(nn.Module):
        def forward(self, x):
            y = torch.relu(x).t()           # a transposed view of a planned buffer
            return y.reshape(-1) * 2        # cannot be a view: a copy every call

    m = M().eval()
    cm = opencann.compile(m, (torch.randn(3, 5),))
    ops = {n.name: n.op for n in cm.graph.nodes}
    copies = [n for n, op in ops.items() if op in ("Identity", "ReshapeCopy")]
    hoisted = {name for name, _, _ in _executor(cm)._hoisted}
    assert copies and len(hoisted) == sum(op in ("Transpose", "Reshape") for op in ops.values())
    for _ in range(2):
        x = torch.randn(3, 5)
        torch.testing.assert_close(cm(x), m(x))
