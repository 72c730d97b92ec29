"""Model files of earlier formats still load and run like eager.

``data/format1_mutating.ocm`` (format 1, static) and ``data/format2_dynamic.ocm``
(format 2, dynamic dims) were written by opencann at commit 7baf9be, before the calling
convention moved from ``graph.meta`` keys into `opencann.ir.CallSignature` (format 3):
the loader converts their meta keys (``input_mutations``, ``returns_input``,
``input_views``, ``output_literals``, ``n_outputs``, ``autocast``, ...) on load. The
models are defined here with deterministic weights (no RNG) so eager gives the
reference."""
from __future__ import annotations

import os

import torch
from torch import nn

HERE = os.path.join(os.path.dirname(__file__), "data")


def _weights(lin: nn.Linear) -> None:
    with torch.no_grad():
        lin.weight.copy_(torch.linspace(-1, 1, lin.weight.numel()).reshape(lin.weight.shape))
        lin.bias.copy_(torch.linspace(-0.5, 0.5, lin.bias.numel()))


class Mutating(nn.Module):
    """Writes into its input ``y``, returns it, a view of it, a literal int and a result."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        _weights(self.lin)

    def forward(self, x, y):
        y.mul_(2)
        return self.lin(x).relu(), y, x.shape[0], y[1:]


class Dyn(nn.Module):
    """A batch-dynamic MLP returning a size."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        _weights(self.lin)

    def forward(self, x):
        return torch.tanh(self.lin(x)), x.shape[0]


def inputs(gen=None):
    return (torch.randn(2, 4, generator=gen), torch.randn(3, 5, generator=gen))


def dyn_input(b, gen=None):
    return torch.randn(b, 4, generator=gen)


def _check_mutating(lm, gen):
    x, y = inputs(gen)
    ye = y.clone()
    want = Mutating()(x, ye)
    got = lm(x, y)
    assert len(got) == 4 and got[2] == want[2] == 2
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(y, ye)                # the caller's input was written
    assert got[1] is y                               # the mutated input itself, as in eager
    assert got[3].data_ptr() == y[1:].data_ptr()     # a view of it, as in eager
    return got


def test_format1_file_with_input_mutations_loads_and_runs_like_eager():
    import opencann
    lm = opencann.load(os.path.join(HERE, "format1_mutating.ocm"))
    gen = torch.Generator().manual_seed(1)
    first = _check_mutating(lm, gen)
    keep = first[0].clone()
    second = _check_mutating(lm, gen)                # a second call: own outputs
    torch.testing.assert_close(first[0], keep)
    assert second[0].data_ptr() != first[0].data_ptr()
    sig = lm.graph.signature
    assert sig.input_mutations == (1,) and sig.returns_input == {1: 1}
    assert sig.output_literals == {3: 2} and sig.n_outputs == 5 and sig.autocast is None
    assert not {"input_mutations", "output_literals", "n_outputs"} & set(lm.graph.meta)


def test_format1_file_checks_autocast_as_compiled_outside():
    import opencann
    lm = opencann.load(os.path.join(HERE, "format1_mutating.ocm"))
    x, y = inputs(torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        try:
            lm(x, y)
        except ValueError as e:
            assert "outside torch.autocast" in str(e)
        else:
            raise AssertionError("a call inside autocast was not refused")


def test_format2_dynamic_file_loads_and_runs_like_eager():
    import opencann
    lm = opencann.load(os.path.join(HERE, "format2_dynamic.ocm"))
    gen = torch.Generator().manual_seed(3)
    for b in (3, 9):
        x = dyn_input(b, gen)
        x[0, 0], x[1, 1] = float("nan"), float("inf")
        want = Dyn()(x)
        got = lm(x)
        assert got[1] == want[1] == b
        torch.testing.assert_close(got[0], want[0], equal_nan=True)
    assert lm.graph.signature.n_outputs == 2


def test_current_format_saves_the_signature_outside_meta(tmp_path):
    import dataclasses
    import json

    import opencann
    from opencann.runtime.model_file import read_sections
    with torch.no_grad():
        cm = opencann.compile(Mutating(), inputs(torch.Generator().manual_seed(4)))
    sig = cm.graph.signature
    assert sig.input_mutations == (1,) and sig.returns_input == {1: 1} and sig.writes_inputs
    try:
        sig.n_outputs = 1
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("CallSignature is not frozen")
    path = str(tmp_path / "m.ocm")
    opencann.save(cm, path)
    graph_j = json.loads(bytes(read_sections(path)[1]["graph"]))
    assert "signature" in graph_j and "input_mutations" not in json.dumps(graph_j["meta"])
    lm = opencann.load(path)
    assert lm.graph.signature == sig
    _check_mutating(lm, torch.Generator().manual_seed(5))
