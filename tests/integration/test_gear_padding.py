"""Gear padding with ATC's semantics (issue #12): a call is served by the smallest gear
that holds it, padded only where `OpDef.per_index` proves padding cannot change the
results; otherwise exact gears only, with the op that prevents padding named."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import opencann
from opencann import zoo

from helpers import seeded as _seeded


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock (conv-bn-relu ×2, identity or 1×1 downsample)."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class TinyResNet(nn.Module):
    """A ResNet-18-shaped CNN, small: stem, max pool, two stages, global pool, fc."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        self.layers = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 16, 2))
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


@pytest.fixture(scope="module")
def resnet():
    m = _seeded(TinyResNet())
    cm = opencann.compile(m, (torch.randn(2, 3, 32, 32),),
                          options={"dynamic_batch_size": [1, 2, 4, 8]})
    return m, cm


@pytest.mark.parametrize("batch,gear", [(3, 4), (5, 8), (7, 8)])
def test_resnet_batch_padded_to_the_smallest_gear(resnet, batch, gear):
    m, cm = resnet
    built = cm.plans.misses
    x = torch.randn(batch, 3, 32, 32)
    x[0, 1, 5, 7] = float("nan")                 # NaN stays in its own sample
    with torch.no_grad():
        ref = m(x)
    out = cm(x)
    assert out.shape == ref.shape
    assert torch.equal(out.isnan(), ref.isnan())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert cm.plans.misses == built              # served by a gear planned at compile time
    assert (gear,) in cm.plans.keys()
    again = cm(x)                                # a second call: same values, own memory
    torch.testing.assert_close(again, ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert again.data_ptr() != out.data_ptr()
    out.fill_(0)
    torch.testing.assert_close(cm(x), ref, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_resnet_report_lists_gears_and_padding(resnet):
    _, cm = resnet
    d = cm.report.dynamic
    assert d["gears"] == {"option": "dynamic_batch_size", "dims": ["batch"],
                          "values": [[1], [2], [4], [8]]}
    assert d["padding"]["applies"] and d["padding"]["dims"]["batch"] == {
        "padded": True, "blocked_by": None}
    assert "replicate" in d["padding"]["fill"]
    assert any("batch padded to the smallest gear" in n for n in cm.report.notes)
    with pytest.raises(ValueError, match=r"batch=9 is not one of the gears .*\[1, 2, 4, 8\]"):
        cm(torch.randn(9, 3, 32, 32))


class MinusBatchMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        return self.fc(x - x.mean(0))


class BatchSum(nn.Module):
    def forward(self, x):
        return torch.relu(x) + x.sum(0, keepdim=True)


class TrainBN(nn.Module):
    """BatchNorm normalising with the batch's statistics (no running statistics)."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(6, track_running_stats=False)

    def forward(self, x):
        return self.bn(x) * 2


@pytest.mark.parametrize("model,op", [(MinusBatchMean, "ReduceMean"), (BatchSum, "ReduceSum"),
                                      (TrainBN, "BNTrainingUpdateNoStats")])
def test_a_batch_mixing_op_means_exact_gears_only_and_is_named(model, op):
    m = model().eval()
    cm = opencann.compile(m, (torch.randn(2, 6),), options={"dynamic_batch_size": [2, 4]})
    row = cm.report.dynamic["padding"]["dims"]["batch"]
    assert not cm.report.dynamic["padding"]["applies"] and not row["padded"]
    b = row["blocked_by"]
    assert b["op"] == op and b["node"] and "test_gear_padding.py:" in b["source"], b
    assert any(f"({op})" in n and "exact gears only" in n for n in cm.report.notes)
    x = torch.randn(4, 6)
    with torch.no_grad():
        ref = m(x)
    torch.testing.assert_close(cm(x), ref, rtol=1e-5, atol=1e-5)   # an exact gear runs
    with pytest.raises(ValueError, match=r"not one of the gears .*\[2, 4\].*only exact gears"):
        cm(torch.randn(3, 6))


class NeedsFallback(nn.Module):
    def forward(self, x):
        return torch.special.bessel_j0(x) + 1


def test_an_op_without_a_per_index_fact_blocks_padding():
    cm = opencann.compile(NeedsFallback(), (torch.randn(2, 5),),
                          options={"dynamic_batch_size": [2, 4]})
    b = cm.report.dynamic["padding"]["dims"]["batch"]["blocked_by"]
    assert b["op"] == "HostFallback" and "per-index" in b["reason"], b


class PerRowScaled(nn.Module):
    """Everything per row: LayerNorm, softmax over features, a reshape round trip."""

    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        b, t, d = x.shape
        y = self.fc(self.ln(x)).reshape(b * t, d).softmax(-1)
        return y.view(b, t, d).permute(1, 0, 2), x.amax(-1)


def test_per_row_ops_and_a_permuted_output_are_sliced_back():
    m = _seeded(PerRowScaled())
    cm = opencann.compile(m, (torch.randn(2, 3, 8),), options={"dynamic_batch_size": [2, 4, 8]})
    assert cm.report.dynamic["padding"]["applies"]
    for b in (1, 3, 6):
        x = torch.randn(b, 3, 8)
        x[-1, 0, 0] = float("inf")
        got, want = cm(x), m(x)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_per_index_is_an_opdef_column_for_the_library():
    """Every library op of the elementwise kind states its rule; checked in a fresh
    interpreter, so ops other tests register (user ops: unknown, hence None) stay out."""
    import subprocess
    import sys
    code = """
from opencann.ops import OpKind, all_ops, get_op
for op in all_ops():
    if op.kind == OpKind.ELEMENTWISE and not op.random and not op.name.endswith("Grad"):
        assert op.per_index is not None, op.name
for name in ("Conv2D", "ConvBiasAct", "MatMulV2", "LinearAct", "LayerNorm", "SoftmaxV2",
             "BatchNorm", "MaxPool", "Reshape", "ScaledDotProductAttention", "FlashAttention"):
    assert get_op(name).per_index is not None, name
for name in ("HostFallback", "OnnxHostFallback", "AsStrided"):
    assert get_op(name).per_index is None, name
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


# -- MiniLM with its real weights --------------------------------------------------------
def _text(batch, seq, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 20000, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[0, seq - seq // 4:] = 0
    return ids, mask


@pytest.mark.heavy
def test_minilm_sequence_gears_are_exact_and_say_why():
    zm = zoo.minilm(batch=1, seq=16)
    cm = opencann.compile(zm.model, zm.example_inputs,
                          dynamic_shapes={"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}},
                          options={"dynamic_dims": [[16], [32]]})
    b = cm.report.dynamic["padding"]["dims"]["seq"]["blocked_by"]
    assert b is not None and "modeling_bert.py:" in b["source"] and "padded indices" in b["reason"]
    ids, mask = _text(1, 32, 1)
    with torch.no_grad():
        ref = zm.model(ids, mask)
    torch.testing.assert_close(cm(ids, mask).last_hidden_state, ref.last_hidden_state,
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"seq=20 is not one of the gears .*\[16, 32\]"):
        cm(*_text(1, 20, 2))


@pytest.mark.heavy
@pytest.mark.full   # make test: the MiniLM sequence gears and the ResNet gear report
def test_minilm_batch_gears_pad_the_batch():
    zm = zoo.minilm(batch=2, seq=16)
    cm = opencann.compile(zm.model, zm.example_inputs, options={"dynamic_batch_size": [1, 2, 4]})
    assert cm.report.dynamic["padding"]["dims"]["batch"]["padded"]
    ids, mask = _text(3, 16, 3)
    with torch.no_grad():
        ref = zm.model(ids, mask)
    out = cm(ids, mask)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.pooler_output, ref.pooler_output, rtol=1e-5, atol=1e-5)


@pytest.mark.heavy
@pytest.mark.full   # make test: test_resnet_report_lists_gears_and_padding, the MiniLM batch gears
def test_resnet50_batch_gears_pad():
    zm = zoo.resnet50(batch=2, size=64)
    cm = opencann.compile(zm.model, zm.example_inputs, options={"dynamic_batch_size": [1, 2, 4]})
    assert cm.report.dynamic["padding"]["applies"]
    x = torch.randn(3, 3, 64, 64)
    with torch.no_grad():
        ref = zm.model(x).last_hidden_state
    out = cm(x).last_hidden_state
    # the padded call is the batch-4 gear on the padded input, bit for bit ...
    gear = cm(torch.cat([x, x[-1:]])).last_hidden_state
    assert torch.equal(out, gear[:3])
    # ... and eager's value within the fused convolutions' rounding (BN folded, oneDNN)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-4


def test_vnpu_gears_compile_each_gear_and_pad(device="vnpu"):
    m = _seeded(TinyResNet())
    cm = opencann.compile(m, (torch.randn(2, 3, 32, 32),), device=device,
                          options={"dynamic_batch_size": [1, 2, 4]})
    assert cm.report.op_counts_after.get("TransData")          # the vnpu's formats, per gear
    assert cm.report.dynamic["padding"]["applies"]
    assert sorted(cm.plans.keys()) == [(1,), (2,), (4,)]
    assert any("compiled whole" in n for n in cm.report.notes)
    built = cm.plans.misses
    for n in (1, 3, 4):
        x = torch.randn(n, 3, 32, 32)
        out = cm(x)
        # the padded call is the gear's plan on the padded input, bit for bit
        g = min(k for k in (1, 2, 4) if k >= n)
        assert torch.equal(out, cm(torch.cat([x, x[-1:].expand(g - n, -1, -1, -1)]))[:n])
        with torch.no_grad():
            torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)
    assert cm.plans.misses == built
    with pytest.raises(ValueError, match="not one of the gears"):
        cm(torch.randn(5, 3, 32, 32))


def test_vnpu_dynamic_dims_compile_each_shape_on_first_use():
    m = _seeded(TinyResNet())
    cm = opencann.compile(m, (torch.randn(2, 3, 32, 32),), device="vnpu",
                          dynamic_shapes={"x": {0: "batch"}}, dim_ranges={"batch": (1, 8)})
    for n in (2, 5, 1, 5):
        x = torch.randn(n, 3, 32, 32)
        with torch.no_grad():
            torch.testing.assert_close(cm(x), m(x), rtol=1e-5, atol=1e-5)
    assert sorted(cm.plans.keys()) == [(1,), (2,), (5,)]
    assert [p["dims"]["batch"] for p in cm.report.dynamic["plans"]] == [2, 5, 1]
    with pytest.raises(ValueError, match=r"outside the compiled range \[1, 8\]"):
        cm(torch.randn(9, 3, 32, 32))


class Flat(nn.Module):
    def forward(self, x):
        return torch.tanh(x).reshape(-1), (x * 2).transpose(0, 1)


class FlatAcross(nn.Module):
    def forward(self, x):
        return x.transpose(0, 1).reshape(-1)


class Gram(nn.Module):
    def forward(self, x):
        return x @ x.T


class BySize(nn.Module):
    def forward(self, x):
        return x / x.shape[0]


class Noisy(nn.Module):
    def forward(self, x):
        return x + torch.rand_like(x)


@pytest.mark.parametrize("model,reason", [
    (FlatAcross, "merged with other dims"), (Gram, "both operands carry the padded dim"),
    (BySize, "size as a value"), (Noisy, "random")])
def test_what_stops_padding_is_named(model, reason):
    cm = opencann.compile(model(), (torch.randn(2, 4),), options={"dynamic_batch_size": [2, 4]})
    b = cm.report.dynamic["padding"]["dims"]["batch"]["blocked_by"]
    assert b is not None and reason in b["reason"], b


def test_flattened_and_transposed_outputs_are_sliced_back():
    m = Flat()
    cm = opencann.compile(m, (torch.randn(2, 4),), options={"dynamic_batch_size": [2, 4, 8]})
    assert cm.report.dynamic["padding"]["applies"]
    for b in (1, 3, 5):
        x = torch.randn(b, 4)
        for g, w in zip(cm(x), m(x)):
            assert g.shape == w.shape and torch.equal(g, w)


class AttentionBT(nn.Module):
    """Projection → per-head SDPA; batch and sequence merged for the Linear layers."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.heads, self.qkv, self.o = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(a.transpose(1, 2).reshape(b, t, d)) + x


def test_batch_pads_through_merged_views_and_the_sequence_stops_at_attention():
    m = _seeded(AttentionBT())
    cm = opencann.compile(m, (torch.randn(2, 8, 16),), dynamic_shapes={"x": {0: "b", 1: "t"}},
                          options={"dynamic_dims": [[1, 16], [2, 40], [4, 40]]})
    dims = cm.report.dynamic["padding"]["dims"]
    assert dims["b"]["padded"] and not dims["t"]["padded"]
    assert dims["t"]["blocked_by"]["op"] == "ScaledDotProductAttention"
    assert "attended" in dims["t"]["blocked_by"]["reason"]
    text = cm.report.to_text()
    assert "b: padded to the smallest gear" in text
    assert "t: exact gears only, padding stopped by scaled_dot_product_attention " \
           "(ScaledDotProductAttention) at (test_gear_padding.py:" in text
    x = torch.randn(3, 40, 16)                      # b padded to 4, t exact
    with torch.no_grad():
        torch.testing.assert_close(cm(x), m(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"t=30, b=3 is not one of the gears"):
        cm(torch.randn(3, 30, 16))


@torch.library.custom_op("gearpad::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@torch.library.custom_op("gearpad::thrice", mutates_args=())
def _thrice(x: torch.Tensor) -> torch.Tensor:
    return x * 3


for _op in (_twice, _thrice):
    _op.register_fake(lambda x: torch.empty_like(x))


class CustomOps(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x):
        return self.op(x) + 1


def test_a_custom_op_declares_its_per_index_fact():
    from opencann.extend import register_op
    from opencann.ops import per_index
    register_op("GearPadTwice", _twice, per_index=per_index.ALL)
    register_op("GearPadThrice", _thrice)                       # unknown
    cm = opencann.compile(CustomOps(_twice), (torch.randn(2, 3),),
                          options={"dynamic_batch_size": [2, 4]})
    assert cm.report.dynamic["padding"]["applies"]
    x = torch.randn(3, 3)
    assert torch.equal(cm(x), x * 2 + 1)
    cm = opencann.compile(CustomOps(_thrice), (torch.randn(2, 3),),
                          options={"dynamic_batch_size": [2, 4]})
    b = cm.report.dynamic["padding"]["dims"]["batch"]["blocked_by"]
    assert b["op"] == "GearPadThrice" and "per-index" in b["reason"]


class EwChain(nn.Module):
    """An elementwise chain with a last-dim reduction: one FusedElementwise node (with
    fuse_elementwise, off on cpu by default)."""

    def forward(self, x):
        y = torch.sigmoid(x) * x + 1.5
        return y, (y * y).amax(-1)   # a float sum is not fused (eager's cascade rounding)


class ResidualNorm(nn.Module):
    """LayerNorm(fc(x) + x): one AddLayerNorm node with fuse_add_layer_norm."""

    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        return self.ln(self.fc(x) + x)


def _padded_like_eager(m, cm, batches, shape=(3, 8)):
    """Each batch (a NaN in the last real row): eager's values, twice."""
    for b in batches:
        x = torch.randn(b, *shape)
        x[b - 1, 1, 2] = float("nan")
        with torch.no_grad():
            want = m(x)
        want = (want,) if isinstance(want, torch.Tensor) else want
        for _ in range(2):                                  # a second call too
            got = cm(x)
            got = (got,) if isinstance(got, torch.Tensor) else got
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert g.shape == w.shape
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("model,op,options", [
    (EwChain, "FusedElementwise", {"enable": ["fuse_elementwise"]}),
    (ResidualNorm, "AddLayerNorm", {"enable": ["fuse_add_layer_norm"]}),
])
def test_fused_ops_pad_the_batch_with_eager_values(model, op, options):
    m = _seeded(model())
    cm = opencann.compile(m, (torch.randn(2, 3, 8),),
                          options={"dynamic_batch_size": [2, 4, 8], **options})
    assert op in cm.graph.op_counts()
    assert cm.report.dynamic["padding"]["applies"], cm.report.dynamic["padding"]
    built = cm.plans.misses
    _padded_like_eager(m, cm, (1, 3, 5, 8))
    assert cm.plans.misses == built                         # served by the gears' plans


def _fused_node(model, shape, options=None):
    cm = opencann.compile(model, (torch.randn(*shape),), dynamic_shapes={"x": {0: "b", 1: "t"}},
                          options=options)
    return next(n for n in cm.graph.nodes if n.op in ("FusedElementwise", "AddLayerNorm"))


def test_fused_rules_refuse_the_normalized_and_reduced_dim():
    from opencann.ops import get_op
    n = _fused_node(EwChain(), (2, 3, 8), {"enable": ["fuse_elementwise"]})
    rule = get_op(n.op).per_index
    assert rule(n, {0: 0}, "b") == {k: 0 for k in range(len(n.outputs))}
    assert "reduces over the padded dim" in rule(n, {0: 2}, "b")
    ln = _fused_node(_seeded(ResidualNorm()), (2, 3, 8), {"enable": ["fuse_add_layer_norm"]})
    rule = get_op(ln.op).per_index
    a, w = ln.attrs["self"].index, ln.attrs["weight"].index
    assert rule(ln, {a: 1}, "t") == {0: 1}
    assert "mixes entries" in rule(ln, {a: 2}, "t")
    assert "weight" in rule(ln, {w: 0}, "t")
