"""Bias-free Linears (``F.linear(x, W)`` without a bias: Llama's, Mistral's and Qwen2's
projections, LM heads) captured as MatMul ``mm(x, Wᵀ)`` with a constant weight take the
GEMM choice of LinearAct (`opencann.ops.kernels.cpu.gemm_kernel`): `FuseLinearAct` makes
them LinearAct nodes with no bias input, whose kernel (eager's ``mm``, oneDNN's or MKL's
prepacked GEMM, the decode GEMV) is chosen per shape and recorded in
``node.meta["kernel"]``; GatedMLP's two products take the same choice. Each kernel
matches eager (values, NaN/Inf rows, a second call, output independence; ``mm`` bit for
bit), from several threads at once too. A weight transpose larger than constant
folding's size limit is still folded (a view), so an LM head's weight is a constant.
The passes' before/expected graphs: tests/unit/test_pass_golden.py."""
import threading

import pytest
import torch
from torch import nn

import opencann
from opencann.devices import cpu as cpu_device
from opencann.ops.kernels import cpu as cpu_kernels
from helpers import ForcedGemmChoice

KERNELS = ("addmm", "mkl_packed", "onednn_packed", "onednn_plain", "gemv")


class Decoderish(nn.Module):
    """Bias-free projections as in a Llama block, a gated MLP and an LM head."""

    def __init__(self, d=48, h=80, vocab=120):
        super().__init__()
        self.q, self.k = nn.Linear(d, d, bias=False), nn.Linear(d, 16, bias=False)
        self.o = nn.Linear(d + 16, d, bias=False)
        self.gate, self.up = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        a = self.o(torch.cat([self.q(x), self.k(x)], -1)) + x
        a = self.down(nn.functional.silu(self.gate(a)) * self.up(a)) + a
        return self.head(a)


def _available(kernel):
    if kernel == "mkl_packed" and not cpu_device.mkl_packed_available():
        pytest.skip("MKL packed GEMM not in this torch build")
    if kernel.startswith("onednn") and not cpu_device.onednn_linear_available():
        pytest.skip("oneDNN inner product not in this torch build")


def _gemms(cm):
    return [n for n in cm.graph.nodes if n.op in ("LinearAct", "GatedMLP", "MatMul")]


def _close(out, ref, tol=1e-5):
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    assert torch.equal(out[torch.isinf(ref)], ref[torch.isinf(ref)])
    fin = torch.isfinite(ref)
    assert fin.any()
    assert ((out[fin] - ref[fin]).abs().max() / ref[fin].abs().max()).item() < tol


@pytest.mark.parametrize("kernel,rows", [(k, r) for k in KERNELS for r in (1, 4)]
                         + [("addmm", 9), ("onednn_packed", 9), ("onednn_plain", 9)])
def test_each_kernel_matches_eager_with_nan_and_inf_rows(kernel, rows, monkeypatch):
    _available(kernel)
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", ForcedGemmChoice(kernel))
    torch.manual_seed(0)
    m = Decoderish().eval()
    cm = opencann.compile(m, (torch.randn(rows, 48),), options={"disable": ["fuse_qkv_linear"]})
    gemms = _gemms(cm)
    # every bias-free GEMM is a LinearAct without a bias input, or a GatedMLP; the choice is recorded
    assert {n.op for n in gemms} == {"LinearAct", "GatedMLP"}
    assert all(len(n.inputs) == 2 and "self" not in n.attrs for n in gemms if n.op == "LinearAct")
    assert {n.meta["kernel"] for n in gemms} == {kernel}
    for k in range(2):
        x = torch.randn(rows, 48)
        if rows > 1:                    # a NaN row and an inf row beside finite ones
            x[0, 3] = float("nan")
            x[rows - 1, 5] = float("inf")
        with torch.no_grad():
            ref = m(x)
        out = cm(x)
        if kernel == "addmm":           # eager's mm: the same bits
            assert torch.equal(out.nan_to_num(), ref.nan_to_num())
            assert torch.equal(out.isnan(), ref.isnan())
        _close(out, ref)
        again = cm(x)
        assert torch.equal(again.isnan(), out.isnan())
        assert torch.equal(again.nan_to_num(), out.nan_to_num())   # same bits on a second call
        out.add_(1)                                                  # outputs are the caller's
        assert not torch.equal(again.nan_to_num(), out.nan_to_num())


def test_the_choice_is_raced_with_the_gemv_for_decode_rows_and_a_file_keeps_it(tmp_path, monkeypatch):
    """Without a forced choice the race runs on the bias-free shapes (the GEMV among the
    candidates for <= 8 rows, keyed apart from biased GEMMs), and a model file keeps the
    recorded choice."""
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", {})
    torch.manual_seed(1)
    m = Decoderish().eval()
    x = torch.randn(2, 48)
    cm = opencann.compile(m, (x,))
    keys = [k for k in cpu_kernels.LINEAR_CHOICES if k[0] == 2]
    assert keys and all(k[4] == "no bias" and "gemv" in k[-1] for k in keys)
    chosen = {n.name: n.meta["kernel"] for n in _gemms(cm)}
    assert set(chosen.values()) <= set(cpu_kernels.GEMM_KERNELS)
    with torch.no_grad():
        _close(cm(x), m(x))
    path = str(tmp_path / "m.ocm")
    opencann.save(cm, path)
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", ForcedGemmChoice("addmm"))
    loaded = opencann.load(path)
    assert {n.name: n.meta["kernel"] for n in _gemms(loaded)} == chosen
    assert torch.equal(loaded(x), cm(x))


def test_bias_free_linear_then_activation_fuses_into_one_kernel(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", ForcedGemmChoice("gemv"))
    torch.manual_seed(2)
    m = nn.Sequential(nn.Linear(24, 40, bias=False), nn.GELU(), nn.Linear(40, 8, bias=False)).eval()
    x = torch.randn(3, 24)
    x[1, 2] = float("-inf")
    cm = opencann.compile(m, (x,))
    acts = sorted(n.attrs["act"] for n in cm.graph.nodes if n.op == "LinearAct")
    assert acts == ["gelu", "none"]
    assert "Linear+gelu" in cm.report.summary()
    with torch.no_grad():
        _close(cm(x), m(x))


def test_concurrent_calls_agree_with_eager(monkeypatch):
    """One compiled model with GEMV-bound bias-free GEMMs called from 4 threads at once
    (the executor pool): every result equals a single-threaded call's bits."""
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", ForcedGemmChoice("gemv"))
    torch.manual_seed(3)
    m = Decoderish().eval()
    cm = opencann.compile(m, (torch.randn(1, 48),))
    xs = [torch.randn(1, 48) for _ in range(8)]
    xs[3][0, 7] = float("nan")
    want = [cm(x).clone() for x in xs]
    got, errors = {}, []
    start = threading.Barrier(4)

    def work(t):
        try:
            start.wait()
            for i in range(len(xs)):
                j = (i + t) % len(xs)
                got[(t, j)] = cm(xs[j])
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
    ts = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not errors and len(got) == 32
    for (t, j), out in got.items():
        assert torch.equal(out.isnan(), want[j].isnan())
        assert torch.equal(out.nan_to_num(), want[j].nan_to_num())
    with torch.no_grad():
        _close(want[0], m(xs[0]))


def test_qkv_merged_bias_free_graph_matches_eager():
    torch.manual_seed(5)
    m = Decoderish().eval()
    x = torch.randn(5, 48)
    x[2, 1] = float("nan")
    cm = opencann.compile(m, (x,))
    merged = [n for n in cm.graph.nodes if n.op == "LinearAct" and len(n.inputs) == 2
              and tuple(n.outputs[0].desc.shape) == (5, 64)]      # q [48] and k [16] as one GEMM
    assert len(merged) == 1
    with torch.no_grad():
        _close(cm(x), m(x))


def test_a_large_weight_transpose_is_folded_as_a_view(monkeypatch):
    """Constant folding's size limit holds for results that allocate; a transpose (a view of
    the weight) is folded at any size, so the LM head's GEMM sees a constant weight."""
    from opencann.passes.prepare import constant_folding
    monkeypatch.setattr(constant_folding, "FOLD_LIMIT_BYTES", 1024)
    torch.manual_seed(6)
    m = nn.Sequential(nn.Linear(16, 64, bias=False)).eval()     # weight 4 KiB > the limit

    class Doubled(nn.Module):                                    # 2·W: a new tensor, not a view
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(64, 16))

        def forward(self, x):
            return x @ (self.w * 2).t()
    x = torch.randn(2, 16)
    cm = opencann.compile(m, (x,))
    lin = [n for n in cm.graph.nodes if n.op == "LinearAct"]
    assert len(lin) == 1 and lin[0].inputs[1].is_const
    with torch.no_grad():
        _close(cm(x), m(x))
    d = Doubled().eval()
    cm2 = opencann.compile(d, (x,))
    assert "output larger than 0 MiB" in cm2.report.summary()
    with torch.no_grad():
        _close(cm2(x), d(x))


@pytest.mark.parametrize("rows", [1, 3])
def test_gated_mlp_is_one_gemm_on_weights_concatenated_once(rows):
    """A GatedMLP with weights >= 1 MiB runs one GEMM on W1‖W3, concatenated once and
    shared by every graph over the same weights (share_weights); values match eager (NaN/Inf
    rows, a second call); a weight changed in place and compiled again gets a fresh
    concatenation (never the stale one); a prefill-sized GatedMLP over the same weights
    shares the decode one's; small weights keep two GEMMs and no copy."""
    torch.manual_seed(3)
    m = Decoderish(d=256, h=1024, vocab=64).eval()      # gate/up 256x1024 fp32 = 1 MiB each
    x = torch.randn(rows, 256)
    shared = {"share_weights": True}                            # as opencann.llm's step graphs
    cm, again = opencann.compile(m, (x,), options=shared), opencann.compile(m, (x,), options=shared)
    mlp = [n for n in cm.graph.nodes if n.op == "GatedMLP"]
    assert len(mlp) == 1
    w1 = next(v.const for v in mlp[0].inputs if v.is_const)
    cats = [t for t in cpu_kernels.packed_copies([w1]) if t.shape == (256, 2048)]
    assert len(cats) == 1 and (cats[0].is_contiguous() if cpu_kernels.concat_row_major(256, 2048)
                               else cats[0].t().is_contiguous())   # the decode kernel's layout
    other = [n for n in again.graph.nodes if n.op == "GatedMLP"][0]
    w1b = next(v.const for v in other.inputs if v.is_const)
    assert [t.data_ptr() for t in cpu_kernels.packed_copies([w1b]) if t.shape == (256, 2048)] \
        == [cats[0].data_ptr()]                                   # one copy for both graphs
    for k in range(2):
        x = torch.randn(rows, 256)
        if rows > 1:
            x[0, 5], x[1, 9] = float("nan"), float("inf")
        with torch.no_grad():
            _close(cm(x), m(x))
            _close(again(x), m(x))
    with torch.no_grad():
        m.up.weight.mul_(-0.5)                                   # changed in place
    fresh = opencann.compile(m, (x,), options=shared)
    with torch.no_grad():
        _close(fresh(x), m(x))
    with pytest.raises(ValueError, match="was modified in place"):
        cm(x)                                                    # the old graph refuses

    def cat_of(cm):
        w = next(v.const for n in cm.graph.nodes if n.op == "GatedMLP" for v in n.inputs if v.is_const)
        return [t for t in cpu_kernels.packed_copies([w]) if t.dim() == 2 and t.shape[1] == 2 * w.shape[1]]
    wide = opencann.compile(m, (torch.randn(32, 256),), options=shared)   # a prefill-sized one
    assert len(cat_of(wide)) == 1 and cat_of(wide)[0].data_ptr() == cat_of(fresh)[0].data_ptr()
    xw = torch.randn(32, 256)
    with torch.no_grad():
        _close(wide(xw), m(xw))
    small = opencann.compile(Decoderish().eval(), (torch.randn(rows, 48),))   # small weights
    assert not cat_of(small)


class _Gated(nn.Module):
    """A SwiGLU MLP: the GatedMLP's result is an intermediate (a planned arena buffer)."""

    def __init__(self, d, h):
        super().__init__()
        self.gate, self.up = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("d,h,rows", [(256, 1024, 64), (48, 80, 9)])   # one GEMM / two GEMMs
def test_gated_mlp_writes_its_planned_buffer_with_no_temporary_per_call(d, h, rows):
    """The GatedMLP kernel writes silu(gate) * up into the buffer it is given: the [M, 2N]
    product (one GEMM on the concatenated weights) or the up projection (two GEMMs) goes
    to the thread's scratch, so no tensor of the output's size or larger is allocated
    in a call (each used to be fresh: page faults at prefill sizes). Values: eager's to
    fp32 rounding, NaN/Inf rows where eager has them, a second call, outputs independent."""
    from torch.utils._python_dispatch import TorchDispatchMode
    torch.manual_seed(5)
    m = _Gated(d, h).eval()
    x = torch.randn(rows, d)
    cm = opencann.compile(m, (x,), options={"copy_out": True})
    assert [n.op for n in cm.graph.nodes if n.op in ("GatedMLP", "LinearAct")] == ["GatedMLP", "LinearAct"]

    class Allocs(TorchDispatchMode):
        big = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            r = func(*args, **(kwargs or {}))
            name = func._schema.name.split("::")[-1]
            fresh = func._overloadname != "out" and not name.endswith("_")
            if fresh and name in ("mm", "addmm", "silu", "mul", "empty", "empty_strided") \
                    and isinstance(r, torch.Tensor) and r.numel() >= rows * h:
                self.big.append((name, tuple(r.shape)))
            return r
    outs = []
    for k in range(2):
        x = torch.randn(rows, d)
        x[1, 3], x[2, 7] = float("nan"), float("inf")
        with torch.no_grad():
            if k:
                with Allocs():
                    y = cm(x)
            else:
                y = cm(x)
            want = m(x)
        assert torch.equal(torch.isnan(y), torch.isnan(want))
        torch.testing.assert_close(y.nan_to_num(0.0, 0.0, 0.0), want.nan_to_num(0.0, 0.0, 0.0),
                                   rtol=1e-5, atol=1e-5)
        outs.append((y, y.clone()))
    assert Allocs.big == [], Allocs.big
    assert torch.equal(outs[0][0].nan_to_num(7.0), outs[0][1].nan_to_num(7.0))   # not overwritten


@pytest.mark.parametrize("kernel", ["onednn_plain", "addmm", "gemv"])
def test_gated_mlp_one_gemm_matches_eager_on_every_kernel(kernel, monkeypatch):
    """The one-GEMM GatedMLP on each kind of GEMM: one writing into the scratch (addmm, the
    GEMV) and one returning its own result that SiLU reads in place (oneDNN's:
    `cpu.FRESH_RESULT_KERNELS`); eager's values with NaN/Inf rows, a second call, and a
    result that the next call does not change."""
    if kernel == "onednn_plain" and not cpu_device.onednn_linear_available():
        pytest.skip("no oneDNN inner product in this torch")
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", ForcedGemmChoice(kernel))
    # W1‖W3 as the transpose of a contiguous [2n, k] (the decode GEMV's layout), which
    # oneDNN's inner product reads as it is (row-major, it would need a copy: not allowed)
    monkeypatch.setattr(cpu_kernels, "concat_row_major", lambda *a, **k: False)
    torch.manual_seed(5)
    m = Decoderish(d=256, h=1024, vocab=64).eval()    # gate/up 1 MiB each: one GEMM
    cm = opencann.compile(m, (torch.randn(16, 256),))
    assert [n.meta["kernel"] for n in cm.graph.nodes if n.op == "GatedMLP"] == [kernel]
    kept = None
    for k in range(2):
        x = torch.randn(16, 256)
        x[0, 5], x[3, 9] = float("nan"), float("-inf")
        with torch.no_grad():
            got = cm(x)
            _close(got, m(x))
        if kept is not None:                                 # the first result is untouched
            torch.testing.assert_close(kept[0], kept[1], rtol=0, atol=0, equal_nan=True)
        kept = (got, got.clone())
