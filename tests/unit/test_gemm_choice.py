"""LinearAct's GEMM kernels (`opencann.ops.kernels.cpu.make_linear_kernel`): addmm, oneDNN's
inner product on a prepacked weight (``onednn_packed``) or on the plain one
(``onednn_plain``) and MKL's packed GEMM, raced per
shape at bind time. Each kernel matches eager (values, NaN/Inf, a second call, output
independence); the race picks the faster one; oneDNN's prepacked weight serves every
shape of a dynamic model; model files keep the choice and fall back to addmm where the
kernel is missing."""
import gc

import pytest
import torch

import opencann
from opencann.devices import cpu as cpu_device
from opencann.engine.dynamic import pin_kernel_choices
from opencann.ir.types import DataType, TensorDesc
from opencann.ir.specialise import specialise
from opencann.ops.kernels import cpu as cpu_kernels
from helpers import ForcedGemmChoice

needs_onednn = pytest.mark.skipif(not cpu_device.onednn_linear_available(),
                                  reason="oneDNN prepacked inner product not in this torch build")


class MLP(torch.nn.Module):
    def __init__(self, d=48, h=96):
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, h), torch.nn.Linear(h, d)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x))) + x


def _kernels(cm):
    return sorted(n.meta.get("kernel") for n in cm.graph.nodes if n.op == "LinearAct")


def _close(out, ref, tol=1e-5):
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    fin = torch.isfinite(ref)
    assert fin.any()
    assert ((out[fin] - ref[fin]).abs().max() / ref[fin].abs().max()).item() < tol


@pytest.mark.parametrize("kernel,rows", [(k, r) for k in ("addmm", "mkl_packed", "onednn_packed",
                                                               "onednn_plain")
                                         for r in (1, 7, 64)] + [("gemv", 1), ("gemv", 4),
                                                                 ("panel", 2), ("panel", 7), ("panel", 64)])
def test_each_kernel_matches_eager(kernel, rows, monkeypatch):
    if kernel == "mkl_packed" and not cpu_device.mkl_packed_available():
        pytest.skip("MKL packed GEMM not in this torch build")
    if kernel.startswith("onednn") and not cpu_device.onednn_linear_available():
        pytest.skip("oneDNN prepacked inner product not in this torch build")
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", ForcedGemmChoice(kernel))
    torch.manual_seed(0)
    m = MLP().eval()
    x = torch.randn(rows, 48)
    cm = opencann.compile(m, (x,))
    assert _kernels(cm) == [kernel, kernel]
    for k in range(2):
        x = torch.randn(rows, 48)
        if rows > 2:                    # NaN and inf rows beside finite ones (gemv: 4 rows)
            x[0, 3] = float("nan")
            x[1, 5] = float("inf")
        with torch.no_grad():
            ref = m(x)
        out = cm(x)
        _close(out, ref)
        again = cm(x)
        assert torch.equal(torch.isnan(again), torch.isnan(out))
        assert torch.equal(again.nan_to_num(), out.nan_to_num())   # same bits on a second call
        out.add_(1)                                                  # outputs are the caller's
        assert not torch.equal(again.nan_to_num(), out.nan_to_num())


def test_the_race_picks_the_faster_kernel_and_prefers_addmm_on_a_tie(monkeypatch):
    import time
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", {})

    def slow(b, x, w, out):
        time.sleep(0.002)

    def fast(b, x, w, out):
        pass
    w = torch.randn(8, 4)
    assert cpu_kernels._measure_choice((2, 8, 4, "f", ("addmm", "p")),
                                       _makers({"addmm": slow, "p": fast}), None, w) == "p"
    assert cpu_kernels._measure_choice((2, 8, 4, "f", ("addmm", "q")),
                                       _makers({"addmm": fast, "q": slow}), None, w) == "addmm"
    assert cpu_kernels._measure_choice((2, 8, 4, "f", ("addmm",)), _makers({"addmm": fast}),
                                       None, w) == "addmm"


def _makers(runs: dict) -> dict:
    """`_measure_choice`'s candidate makers: each returns its ``run``."""
    return {name: (lambda r=run: r) for name, run in runs.items()}


@pytest.fixture
def given_times(monkeypatch):
    """``kernel(name, us)``: a candidate ``run`` whose race time is ``us`` microseconds
    (`best_time_us` returns the given time of the kernel it just ran), so the host's
    load decides nothing; ``kernel.ran`` lists the kernels run, in order."""
    cost_us, ran = {}, []

    def timed(fn, **_):
        fn()
        return cost_us[ran[-1]]
    monkeypatch.setattr(cpu_kernels, "best_time_us", timed)

    def kernel(name, us):
        def run(b, x, w, out):
            ran.append(name)
            cost_us[name] = us
        return run
    kernel.ran = ran
    return kernel


def test_a_kernel_keeping_a_copy_must_beat_the_copy_free_ones_by_the_margin(monkeypatch, given_times):
    """Among the kernels that beat addmm, one keeping a packed copy of the weight (the
    panel GEMM) wins over one reading the module's weight in place (the GEMV on
    nn.Linear's [n, k]) only when 3% faster; given times, so the host's load decides
    nothing. A weight the GEMV would copy (a contiguous [k, n]) has no copy-free rival."""
    kernel = given_times
    module_weight = torch.randn(64, 32).t()        # nn.Linear's weight, transposed: gemv copies nothing
    for panel_us, want in ((98.0, "gemv"), (99.9, "gemv"), (96.0, "panel"), (50.0, "panel")):
        monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", {})
        cands = {"addmm": kernel("addmm", 200.0), "gemv": kernel("gemv", 100.0),
                 "panel": kernel("panel", panel_us)}
        key = (8, 32, 64, "f", tuple(cands))
        assert cpu_kernels._measure_choice(key, _makers(cands), None, module_weight) == want, panel_us
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", {})
    cands = {"addmm": kernel("addmm", 200.0), "gemv": kernel("gemv", 100.0),
             "panel": kernel("panel", 98.0)}
    assert cpu_kernels._measure_choice((8, 32, 64, "f", tuple(cands)), _makers(cands), None,
                                       torch.randn(32, 64)) == "panel"   # both copy: the faster


def test_the_cold_race_of_a_streamed_weight_has_addmm_kn_to_beat(monkeypatch, given_times):
    """A few-row GEMM of a large weight held transposed is raced with the caches evicted
    before each timed call, addmm_kn (not addmm) being the kernel to beat: a tie keeps
    addmm_kn, a faster kernel wins, and addmm is not run at all. Each kernel's time is
    given (the timer returns it), so the outcome does not depend on the host's load."""
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", {})
    evictions, ran = [], given_times.ran
    real_evict = cpu_kernels._evict_caches
    monkeypatch.setattr(cpu_kernels, "_evict_caches", lambda s: (evictions.append(s.numel()),
                                                                 real_evict(s)))

    def kernel(name, seconds):
        return given_times(name, seconds * 1e6)
    wt = torch.randn(640, 512).t()                    # 1.25 MiB, transposed
    key = (1, 512, 640, "f", ("addmm", "addmm_kn", "p"))
    cands = {"addmm": kernel("addmm", 0.0), "addmm_kn": kernel("addmm_kn", 0.001),
             "p": kernel("p", 0.003)}
    assert cpu_kernels._measure_choice(key, _makers(cands), None, wt) == "addmm_kn"
    assert evictions and set(evictions) == {cpu_kernels.COLD_EVICT_MIN // 4}   # 1 row: 32 MiB
    assert cpu_kernels.COLD_EVICT_MIN <= cpu_kernels.cold_scratch_bytes() <= cpu_kernels.COLD_EVICT_MAX
    assert "addmm" not in ran
    cands["p"] = kernel("p", 0.0)
    assert cpu_kernels._measure_choice(key[:4] + (("addmm", "addmm_kn", "q"),), _makers(cands),
                                       None, wt) == "p"
    evictions.clear()                                  # 8 rows: the last-level cache written over
    assert cpu_kernels._measure_choice((8,) + key[1:4] + (("addmm", "addmm_kn", "p"),), _makers(cands),
                                       None, wt) == "p"
    assert set(evictions) == {cpu_kernels.cold_scratch_bytes() // 4}
    hot = (64, 512, 640, "f", ("addmm", "addmm_kn"))     # 64 rows: timed hot, addmm raced
    evictions.clear()
    ran.clear()
    assert cpu_kernels._measure_choice(hot, _makers({"addmm": kernel("addmm", 0.0),
                                                     "addmm_kn": kernel("addmm_kn", 0.003)}),
                                       None, wt) == "addmm"
    assert not evictions and "addmm" in ran
    tie = (64, 512, 640, "f", ("addmm", "addmm_kn", "t"))  # a tie keeps the shared copy
    assert cpu_kernels._measure_choice(tie, _makers({"addmm": kernel("addmm", 0.001),
                                                     "addmm_kn": kernel("addmm_kn", 0.001)}),
                                       None, wt) == "addmm_kn"


@needs_onednn
def test_onednn_prepacked_weight_is_kept_at_every_shape_of_a_dynamic_model(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", ForcedGemmChoice("onednn_packed"))
    torch.manual_seed(0)
    m = MLP().eval()
    cm = opencann.compile(m, (torch.randn(2, 5, 48),),
                          dynamic_shapes={"x": {0: "batch", 1: "seq"}},
                          dim_ranges={"batch": (1, 8), "seq": (2, 64)})
    packed = len(cpu_kernels._ONEDNN_PACKED)
    for b, t in ((1, 9), (4, 33), (2, 5)):
        x = torch.randn(b, t, 48)
        with torch.no_grad():
            ref = m(x)
        _close(cm(x), ref)
    # the blocked weights were reordered once, at compile: new shapes reuse them
    assert len(cpu_kernels._ONEDNN_PACKED) == packed
    bound = specialise(cm.graph, dict(zip(cm.binder.order, (3, 7))))
    for n in bound.nodes:
        if n.op == "LinearAct":
            n.meta["kernel"] = "onednn_packed"
    count, unpacked = pin_kernel_choices(cm.graph, bound)
    assert count >= 2 and unpacked == 0
    assert {n.meta["kernel"] for n in cm.graph.nodes if n.op == "LinearAct"} == {"onednn_packed"}


@needs_onednn
def test_model_file_keeps_the_choice_and_falls_back_where_the_kernel_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", ForcedGemmChoice("onednn_packed"))
    torch.manual_seed(0)
    m = MLP().eval()
    x = torch.randn(6, 48)
    cm = opencann.compile(m, (x,))
    path = str(tmp_path / "mlp.ocm")
    opencann.save(cm, path)
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", {})
    loaded = opencann.load(path)
    assert _kernels(loaded) == ["onednn_packed", "onednn_packed"]
    assert torch.equal(loaded(x), cm(x))
    # on a build without oneDNN's inner product the saved choice becomes addmm, not an error
    monkeypatch.setattr(cpu_kernels, "onednn_linear_available", lambda: False)
    plain = opencann.load(path)
    assert _kernels(plain) == ["addmm", "addmm"]
    with torch.no_grad():
        _close(plain(x), m(x))


@pytest.mark.parametrize("forced", ["onednn_packed", "onednn_plain", "mkl_packed", "gemv"])
def test_a_broadcast_bias_never_goes_to_onednn(forced, monkeypatch):
    """oneDNN's inner product, MKL's packed GEMM and the GEMV take a full [n] bias only
    (MKL's and oneDNN's read n values from the bias's pointer: past the end of a [1] one):
    a [1] bias binds addmm, forced or raced, and matches eager."""
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", ForcedGemmChoice(forced))

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 24))
            self.b = torch.nn.Parameter(torch.randn(1))

        def forward(self, x):
            return torch.relu(torch.addmm(self.b, x, self.w))

    m = M().eval()
    for rows in (1, 5):
        x = torch.randn(rows, 16)
        cm = opencann.compile(m, (x,))
        assert _kernels(cm) == ["addmm"]
        with torch.no_grad():
            _close(cm(x), m(x))
    assert not cpu_kernels._available("mkl_packed", 24, TensorDesc((1,), DataType.FLOAT), 5)


@pytest.mark.parametrize("kernel", ["onednn_packed", "onednn_plain", "mkl_packed", "gemv", "panel"])
@pytest.mark.parametrize("layout", ["expand", "slice", "input"])
def test_a_non_contiguous_bias_matches_eager_on_every_kernel(kernel, layout, monkeypatch):
    """A full [n] bias that is not contiguous (a [1] bias expanded, a strided slice of a
    constant or of a computed tensor) gives eager's values on every kernel (oneDNN reads
    the bias as n contiguous values: it is copied where it is not)."""
    if kernel == "mkl_packed" and not cpu_device.mkl_packed_available():
        pytest.skip("MKL packed GEMM not in this torch build")
    if kernel.startswith("onednn") and not cpu_device.onednn_linear_available():
        pytest.skip("oneDNN prepacked inner product not in this torch build")
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", ForcedGemmChoice(kernel))

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 24))
            self.b1, self.b2 = torch.nn.Parameter(torch.randn(1)), torch.nn.Parameter(torch.randn(48))

        def forward(self, x, c):
            b = {"expand": self.b1.expand(24), "slice": self.b2[::2], "input": (c * 2)[::2]}[layout]
            return torch.relu(torch.addmm(b, x, self.w))

    m = M().eval()
    x, c = torch.randn(4, 16), torch.randn(48)
    cm = opencann.compile(m, (x, c))
    assert _kernels(cm) == [kernel]
    with torch.no_grad():
        _close(cm(x, c), m(x, c))


def test_gemv_serves_decode_rows_only_and_a_file_keeps_it(tmp_path, monkeypatch):
    """The GEMV (<= MAX_ROWS = 32 rows) is raced for decode and short-prefill shapes only: a choice of it pinned onto a
    wider shape is measured again; a model file keeps it; its weight is copied once."""
    from opencann.ops.kernels.gemv_cpu import MAX_ROWS
    assert cpu_kernels.GEMV_MAX_ROWS == MAX_ROWS
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", ForcedGemmChoice("gemv"))
    torch.manual_seed(0)
    m = MLP().eval()
    x = torch.randn(2, 48)
    cm = opencann.compile(m, (x,))
    assert _kernels(cm) == ["gemv", "gemv"]
    packed = len(cpu_kernels._GEMV_PACKED)
    path = str(tmp_path / "mlp.ocm")
    opencann.save(cm, path)
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", {})
    loaded = opencann.load(path)
    assert _kernels(loaded) == ["gemv", "gemv"]
    assert torch.equal(loaded(x), cm(x))
    assert len(cpu_kernels._GEMV_PACKED) == packed + 2  # the loaded constants, copied once each
    b = cpu_kernels._known_choice("gemv", MAX_ROWS + 1, 48, 96, torch.float32, _Bias(96))
    assert b[1] != "gemv" and "gemv" not in b[0][-1]    # 33 rows: not raced, not kept
    k8 = cpu_kernels._known_choice("gemv", MAX_ROWS, 48, 96, torch.float32, _Bias(96))
    assert k8[1] == "gemv" and "gemv" in k8[0][-1]      # 32 rows (a short prefill): raced
    k1 = cpu_kernels._known_choice("gemv", 3, 48, 96, torch.float32, _Bias(96))
    assert k1[1] == "gemv" and "gemv" in k1[0][-1]
    # a broadcast bias never goes to the GEMV
    assert cpu_kernels._known_choice("gemv", 1, 48, 96, torch.float32, _Bias(1))[1] == "addmm"
    # a saved kernel that would copy a weight the copy rule forbids copying (a merged
    # Q/K/V or gate/up weight) is not kept: the shape is chosen among the allowed ones
    no_copy = lambda c: c in ("gemv", "onednn_plain")   # noqa: E731 - what copy_allowed gives
    for made in ("onednn_packed", "addmm_kn", "mkl_packed"):
        key, choice = cpu_kernels._known_choice(made, 8, 48, 96, torch.float32, None, allowed=no_copy)
        assert choice != made and made not in key[-1]
    assert cpu_kernels._known_choice("gemv", 8, 48, 96, torch.float32, None, allowed=no_copy)[1] == "gemv"


class _Bias:
    def __init__(self, n):
        self.shape = (n,)


@needs_onednn
def test_graphs_sharing_weights_share_the_packed_copies(monkeypatch):
    """With the option share_weights, two graphs compiled from one module (two shapes, as
    opencann.llm's prefill buckets) hold the module's weights and ONE oneDNN blocked copy
    of each; without it each graph snapshots and packs its own."""
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", ForcedGemmChoice("onednn_packed"))
    torch.manual_seed(0)
    m = MLP().eval()
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}

    def packed_of(cm):
        ws = [c.const for c in cm.graph.constants if c.const.dim() == 2]
        return [cpu_kernels._ONEDNN_PACKED[w]() for w in ws], ws   # weak references

    a, b = (opencann.compile(m, (torch.randn(n, 48),), options={"share_weights": True})
            for n in (6, 17))
    (pa, wa), (pb, wb) = packed_of(a), packed_of(b)
    assert len(pa) == 2 and all(x is y for x, y in zip(pa, pb))
    assert {w.untyped_storage().data_ptr() for w in wa + wb} <= params
    for cm, n in ((a, 6), (b, 17)):
        x = torch.randn(n, 48)
        with torch.no_grad():
            _close(cm(x), m(x))
    c = opencann.compile(m, (torch.randn(6, 48),))
    (pc, wc) = packed_of(c)
    assert not any(x is y for x, y in zip(pa, pc))
    assert not {w.untyped_storage().data_ptr() for w in wc} & params


@needs_onednn
def test_a_packed_copy_made_for_a_kernel_that_lost_the_race_is_freed(monkeypatch):
    """The race packs every candidate's weight; only the winner's copy stays (bound
    kernels hold it; the cache holds it weakly): a model whose GEMMs chose the GEMV keeps
    no oneDNN blocked copy beside its weights."""
    import gc
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", {})
    raced = []

    def pick_gemv(key, candidates, *a, **k):
        raced.append(sorted(candidates))
        return "gemv"
    monkeypatch.setattr(cpu_kernels, "_measure_choice", pick_gemv)
    torch.manual_seed(0)
    m = MLP().eval()
    x = torch.randn(2, 48)
    cm = opencann.compile(m, (x,))
    assert _kernels(cm) == ["gemv", "gemv"]
    assert all("onednn_packed" in r for r in raced) and raced
    gc.collect()
    ws = [c.const for c in cm.graph.constants if c.const.dim() == 2]
    assert len(ws) == 2
    assert all(cpu_kernels._ONEDNN_PACKED.get(w) is None or cpu_kernels._ONEDNN_PACKED[w]() is None
               for w in ws)
    with torch.no_grad():
        _close(cm(x), m(x))


@pytest.mark.parametrize("rows", [1, 7])
def test_addmm_kn_streams_a_transposed_weight_at_decode_rows_and_matches_eager(rows, monkeypatch):
    """``addmm_kn`` (addmm on a contiguous [k, n] copy of a weight held transposed) is
    offered for fp32 weights of 1 MiB or more at decode rows, at more rows only where
    the copy exists (a prefill graph over a decode graph's weights), and matches eager:
    values, NaN/Inf rows, a second call, outputs the caller's own; small weights never
    get it (eager's bits and memory kept)."""
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", ForcedGemmChoice("addmm_kn"))
    torch.manual_seed(0)
    m = MLP(d=512, h=640).eval()                   # 512x640 fp32 = 1.25 MiB each
    x = torch.randn(rows, 512)
    cm = opencann.compile(m, (x,))
    assert _kernels(cm) == ["addmm_kn", "addmm_kn"]
    for _ in range(2):
        x = torch.randn(rows, 512)
        if rows > 1:                   # NaN and inf rows beside finite ones
            x[0, 3], x[1, 5] = float("nan"), float("inf")
        with torch.no_grad():
            ref = m(x)
        out = cm(x)
        _close(out, ref)
        again = cm(x)
        assert torch.equal(again.nan_to_num(), out.nan_to_num())
        out.add_(1)
        assert not torch.equal(again.nan_to_num(), out.nan_to_num())
    x = torch.randn(rows, 512)
    x[-1, 7] = float("nan")                          # a NaN row: NaN where eager's is
    with torch.no_grad():
        assert torch.equal(torch.isnan(cm(x)), torch.isnan(m(x)))
    wide = opencann.compile(m, (torch.randn(64, 512),))        # a prefill-sized GEMM: no copy
    small = opencann.compile(MLP().eval(), (torch.randn(rows, 48),))   # a small weight: never
    assert "addmm_kn" not in _kernels(wide) and "addmm_kn" not in _kernels(small)
    shared = {"share_weights": True}                  # a decode graph's copy serves a prefill
    dec = opencann.compile(m, (torch.randn(rows, 512),), options=shared)
    pre = opencann.compile(m, (torch.randn(64, 512),), options=shared)
    assert _kernels(dec) == _kernels(pre) == ["addmm_kn", "addmm_kn"]
    assert not cpu_kernels.kn_offered(torch.randn(512, 640), 1)   # contiguous: addmm is NN
    assert cpu_kernels.kn_offered(torch.randn(640, 512).t(), 1)
    assert not cpu_kernels.kn_offered(torch.randn(640, 512).t(), 512)   # no [k, n] copy lives
    assert not cpu_kernels.kn_offered(torch.randn(100, 512).t(), 1)    # 200 KiB
    assert not cpu_kernels.kn_offered(torch.randn(640, 512, dtype=torch.bfloat16).t(), 1)


@pytest.mark.parametrize("kernel,write", [(k, w) for k in ("addmm_kn", "onednn_packed", "panel")
                                          for w in ("data_mul", "data_copy")])
def test_a_weight_written_through_data_and_compiled_again_is_packed_again(kernel, write, monkeypatch):
    """Under share_weights a packed copy is shared by constants viewing the same memory;
    a write through ``.data`` keeps the version counter, so the key also holds the
    weight's probe bytes (`opencann.ops.weight_probe`): the graph compiled after the
    write computes with the new weights while the first graph is still alive (it then
    refuses its next call)."""
    if kernel == "onednn_packed" and not cpu_device.onednn_linear_available():
        pytest.skip("oneDNN prepacked inner product not in this torch build")
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", ForcedGemmChoice(kernel))
    torch.manual_seed(0)
    m = MLP(d=512, h=640).eval()                   # 1.25 MiB weights: addmm_kn is offered
    x = torch.randn(2 if kernel == "panel" else 1, 512)   # the panel GEMM: 2 rows or more
    first = opencann.compile(m, (x,), options={"share_weights": True})
    assert _kernels(first) == [kernel, kernel]
    with torch.no_grad():
        _close(first(x), m(x))
    if write == "data_mul":
        m.a.weight.data.mul_(1.5)
    else:
        m.b.weight.data.copy_(torch.randn(512, 640))
    again = opencann.compile(m, (x,), options={"share_weights": True})
    with torch.no_grad():
        _close(again(x), m(x))
    with pytest.raises(Exception, match="modified in place"):
        first(x)


def test_a_weight_keeps_at_most_one_packed_layout():
    """`copy_allowed`: with no copy of a weight's memory alive every kernel races; with a
    graph holding one kind (here addmm_kn's [k, n]), also seen through another constant
    viewing that memory (share_weights), no kernel that keeps another kind races; once
    it is freed they race again. A concatenation races only kernels keeping no copy."""
    wt = torch.randn(640, 512).t()                  # nn.Linear's [n, k] as [k, n], 1.25 MiB
    assert all(cpu_kernels.copy_allowed(wt)(c) for c in cpu_kernels.GEMM_KERNELS)
    kn = cpu_kernels._kn_weight(wt)                 # a bound kernel holds it
    for view in (wt, wt.detach()):
        ok = cpu_kernels.copy_allowed(view)
        assert ok("addmm") and ok("gemv") and ok("addmm_kn")
        assert not ok("onednn_packed") and not ok("mkl_packed") and not ok("panel")
    del kn
    gc.collect()
    assert cpu_kernels.copy_allowed(wt)("onednn_packed")
    cat = cpu_kernels.concat_weights(wt, torch.randn(640, 512).t())
    ok = cpu_kernels.copy_allowed(cat)
    assert ok("addmm") and not ok("addmm_kn") and not ok("onednn_packed") and not ok("mkl_packed")
    assert not ok("panel")
    assert ok("gemv") == ok("onednn_plain") == cat.t().is_contiguous()


@pytest.mark.skipif(not cpu_device.onednn_linear_available(),
                    reason="oneDNN inner product not in this torch build")
def test_onednn_plain_reads_the_gemv_weight_itself():
    """``onednn_plain`` keeps no copy of nn.Linear's [n, k] weight (it reads it as the
    decode GEMV does), shares the GEMV's one [n, k] copy of a [k, n] weight, and with
    that copy alive both race where no other kind of copy may; its product matches
    addmm's to fp32 rounding, NaN and inf included, bias or none."""
    torch.manual_seed(0)
    w = torch.randn(96, 48)
    wt = w.t()                                       # nn.Linear's weight as [k, n]
    assert not cpu_kernels._copies("onednn_plain", wt)
    assert cpu_kernels._gemv_weight(wt).data_ptr() == w.data_ptr()
    kn = torch.randn(48, 96)                         # row-major [k, n]: one [n, k] copy
    assert cpu_kernels._copies("onednn_plain", kn)
    held = cpu_kernels._gemv_weight(kn)
    ok = cpu_kernels.copy_allowed(kn)
    assert ok("gemv") and ok("onednn_plain") and not ok("onednn_packed") and not ok("addmm_kn")
    run = cpu_kernels._packed_kernel("onednn_plain", kn, 5, None)
    assert cpu_kernels._gemv_weight(kn) is held      # the same copy, not a second one
    for bias in (torch.randn(96), None):
        x = torch.randn(5, 48)
        x[1, 2], x[3, 7] = float("nan"), float("-inf")
        ref = torch.addmm(bias, x, kn) if bias is not None else x @ kn
        out = torch.empty(5, 96)
        got = run(bias, x, kn, out)
        assert got is out
        _close(out, ref)


@pytest.mark.parametrize("kernel", ["addmm_kn", "gemv"])
def test_a_concatenation_is_made_in_its_decode_kernels_layout(kernel, monkeypatch):
    """`concat_row_major`: the layout race's winner decides (addmm_kn: row-major [k, n],
    the GEMV: the transpose of [n, k]); a weight under 1 MiB is [n, k] without a race;
    `concat_weights` follows it and holds the parts' values."""
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", ForcedGemmChoice(kernel))
    assert cpu_kernels.concat_row_major(512, 1280) == (kernel == "addmm_kn")
    assert not cpu_kernels.concat_row_major(64, 96)
    w1, w3 = torch.randn(640, 512).t(), torch.randn(700, 512).t()
    cat = cpu_kernels.concat_weights(w1, w3)
    assert cat.shape == (512, 1340) and torch.equal(cat, torch.cat([w1, w3], dim=1))
    assert cat.is_contiguous() == (kernel == "addmm_kn") and cat.t().is_contiguous() == (kernel == "gemv")


def test_a_gemm_too_large_to_race_runs_addmm_without_allocating(monkeypatch):
    """A shape whose race buffers would exceed RACE_MAX_BYTES (a huge gear's plan, refused
    by the memory check after binding) is not raced: addmm, no candidate made, nothing cached."""
    monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", {})
    made = []
    makers = {"addmm": lambda: made.append("addmm"), "onednn_packed": lambda: made.append("p")}
    wt = torch.randn(4, 4)
    key = (10 ** 12, 4, 4, "f", ("addmm", "onednn_packed"))
    assert cpu_kernels._measure_choice(key, makers, None, wt) == "addmm"
    assert made == [] and cpu_kernels.LINEAR_CHOICES == {}


@pytest.mark.parametrize("forced", [None, "onednn_packed", "onednn_plain", "gemv"])
@pytest.mark.parametrize("k,n,rows,bias", [(0, 8, 5, True), (0, 8, 1, False), (8, 0, 40, False),
                                           (8, 4, 0, True)])
def test_an_empty_gemm_binds_addmm_and_matches_eager(k, n, rows, bias, forced, monkeypatch):
    """A Linear with a zero-size dimension (in_features 0: the bias alone; out_features 0;
    no rows) compiles and gives eager's result: oneDNN creates no primitive for an empty
    product, so no kernel races or is forced there; addmm runs it."""
    if forced is not None:
        monkeypatch.setattr(cpu_kernels, "LINEAR_CHOICES", ForcedGemmChoice(forced))
    torch.manual_seed(0)
    m = torch.nn.Linear(k, n, bias=bias).eval()
    x = torch.randn(rows, k)
    cm = opencann.compile(m, (x,))
    assert set(_kernels(cm)) <= {"addmm"}
    for _ in range(2):
        with torch.no_grad():
            ref = m(x)
        out = cm(x)
        assert out.shape == ref.shape and torch.equal(out, ref)
