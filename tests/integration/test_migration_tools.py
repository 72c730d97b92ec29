"""The migration toolkit (issue #14): compare layer by layer against eager, bisect an
injected bug to its pass and site, analyze op support, doctor. Small models only."""
import csv
import json

import pytest
import torch

import opencann.engine.pipeline as compiler_mod
from opencann.passes import Pass, default_pipeline
from opencann.tools.analyze import analyze
from opencann.tools.bisect import bisect, ddmin
from opencann.tools.compare import Session, compare, metrics, status_of
from opencann.tools.compare_html import to_html
from opencann.tools.doctor import SUPPORTED, doctor, to_json, version_check
from helpers import run_cli


class Net(torch.nn.Module):
    """Conv+BN+ReLU, a residual conv, pooling and two linears: every fusion fires."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.c2, self.b2 = torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.fc, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        y = torch.relu(self.b2(self.c2(y)) + y)
        return self.fc2(torch.nn.functional.gelu(self.fc(y.mean((2, 3)))))


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    m = Net().eval()
    for b in (m.b1, m.b2):
        b.running_mean.uniform_(-1, 1)
        b.running_var.uniform_(0.5, 2)
    return m, (torch.randn(2, 3, 16, 16),)


class CorruptBias(Pass):
    """Test-only: adds 0.5 to the bias of the second convolution (a wrong rewrite)."""

    name, stage = "corrupt_bias", "fusion"

    def run(self, graph, ctx):
        conv = [n for n in graph.nodes if n.op in ("Conv2D", "ConvBiasAct", "ConvAddAct")][1]
        b = conv.arg("bias")
        graph.replace_input(conv, b, graph.add_const(b.const + 0.5, "bad_bias"))
        ctx.applied([conv], "Corrupt bias")
        return 1


@pytest.fixture
def corrupt(monkeypatch):
    def pipeline():
        p = default_pipeline()
        p.passes.insert(p.names().index("fuse_conv_add_act") + 1, CorruptBias())
        return p
    monkeypatch.setattr(compiler_mod, "default_pipeline", pipeline)


def test_metrics_values():
    b = torch.tensor([1.0, 2.0, 0.0, -4.0])
    m = metrics(b.clone(), b)
    assert m["cosine"] == pytest.approx(1.0) and m["max_abs"] == 0 and m["thousandth"] == 1.0
    a = torch.tensor([1.0005, 2.0, 0.0, -4.04])           # rel errors 5e-4, 0, 0, 1e-2
    m = metrics(a, b)
    assert m["max_abs"] == pytest.approx(0.04, rel=1e-6)
    assert m["max_rel"] == pytest.approx(0.01, rel=1e-6)
    assert m["thousandth"] == 0.75 and m["five_thousandth"] == 0.75
    assert m["rel_rmse"] == pytest.approx(float((a - b).double().pow(2).mean().sqrt()
                                                 / b.double().pow(2).mean().sqrt()))
    nan = metrics(torch.tensor([float("nan"), 1.0]), torch.tensor([1.0, 1.0]))
    assert nan["note"] and status_of(nan, torch.float32) == "fail"
    assert status_of(metrics(torch.tensor([1, 2]), torch.tensor([1, 3])), torch.int64) == "fail"


def test_compare_exact_compile_all_pass(net, tmp_path):
    m, x = net
    res = compare(m, x)
    assert res.layers and all(r.status == "pass" for r in res.layers), res.summary()
    assert res.first_divergence is None and res.status == "pass"
    assert all(r.cosine > 0.99999 for r in res.layers + res.outputs)
    ops = {r.op for r in res.layers}
    assert {"ConvBiasAct", "ConvAddAct", "LinearAct"} <= ops   # fused layers mapped back
    conv = next(r for r in res.layers if r.op == "ConvAddAct")
    assert conv.fx_node == "relu_1" and conv.module == "c2" and "test_migration_tools.py:" in conv.source
    path = tmp_path / "l.csv"
    res.to_csv(str(path))
    rows = list(csv.DictReader(open(path)))
    assert len(rows) == len(res.layers) + len(res.outputs) and rows[0]["status"] == "pass"
    page = to_html(res)
    assert "<table>" in page and "data:image/png;base64," in page


def test_compare_precision_mode_warns_where_lowered(net):
    m, x = net
    opts = {"precision_mode": "allow_mix_precision_bf16"}
    res = compare(m, x, options=opts)
    low = [r for r in res.layers if r.dtype == "bfloat16"]
    # the convolutions run lowered (fused where oneDNN has bf16 kernels; BatchNorm folded first)
    assert {r.op for r in low} & {"ConvBiasAct", "ConvAddAct", "Conv2D"} and res.status in ("pass", "warn")
    assert all(r.status != "fail" for r in res.layers)      # what the mode allows
    assert all(1e-4 < r.rel_rmse < 3e-2 for r in low)        # bf16 rounding, not exact
    strict = Session(m, x).run(options=opts, strict=True)
    # judged by fp32's own thresholds, the fp32 layers after a bf16 one warn, and the
    # first of them is the first divergence
    fp32_after = [r for r in strict.layers if r.dtype == "float32" and r.index > low[0].index]
    assert fp32_after and all(r.status == "warn" for r in fp32_after if r.rel_rmse > 1e-4)
    assert strict.first_divergence is not None
    assert strict.layers[strict.first_divergence].index > low[0].index


def test_compare_on_vnpu_maps_transdata_back(net):
    m, x = net
    res = compare(m, x, device="vnpu")
    assert res.layers and res.status == "pass"
    assert any(r.op == "TransData" for r in res.layers)   # NPU-format values compared in ND
    # the convolutions' NC1HWC0 outputs are compared in NCHW (C0 padding dropped)
    npu = [r for r in res.layers if r.op in ("Conv2D", "ConvBiasAct", "ConvAddAct")
           or r.op == "CubeEpilogue" and r.node.startswith("convolution")]   # UB-fused convs
    assert npu and all(len(r.shape) == 4 and r.status == "pass" for r in npu), res.layers


def test_compare_flags_injected_bug_first(net, corrupt):
    m, x = net
    res = compare(m, x)
    assert res.status == "fail"
    first = res.layers[res.first_divergence]
    assert first.fx_node == "relu_1" and first.module == "c2" and first.status == "fail"
    assert all(r.status == "pass" for r in res.layers[:res.first_divergence])


def test_bisect_names_injected_pass_and_site(net, corrupt):
    m, x = net
    b = bisect(m, x)
    assert b.diverged and b.passes == ["corrupt_bias"]
    assert b.site is not None and b.site["pass"] == "corrupt_bias"
    assert b.site["detail"] == "Corrupt bias" and "c2" in b.site["where"]
    assert b.message.startswith("disabling corrupt_bias (Corrupt bias) at ")
    assert "restores accuracy" in b.message and "test_migration_tools.py:" in b.message


def test_bisect_nothing_to_do_and_precision_narrowing(net):
    m, x = net
    assert not bisect(m, x).diverged
    b = bisect(m, x, options={"precision_mode": "allow_mix_precision_bf16"}, on="warn")
    # bf16 GEMMs and convs: the precision pass, narrowed to the op types whose lowering
    # makes the outputs warn against fp32 eager
    assert b.diverged and b.passes == ["precision"]
    assert b.keep_fp32 and set(b.keep_fp32) <= {"Conv2D", "MatMulV2", "LinearAct"}
    assert "keep_fp32=" in b.message


def test_ddmin_finds_minimal_set():
    calls = []

    def restores(s):
        calls.append(s)
        return {"b", "e"} <= set(s)
    assert sorted(ddmin(list("abcdefgh"), restores)) == ["b", "e"]


def test_analyze_lists_branch_and_custom_op_with_sources():
    @torch.library.custom_op("migtest::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @twice.register_fake
    def _(x):
        return torch.empty_like(x)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            if y.sum() > 0:          # data-dependent branch
                y = y * 2
            return twice(y)          # custom op

    a = analyze(M().eval(), (torch.randn(2, 4),))
    d = a.to_dict()
    kinds = {f["kind"]: f for f in d["findings"]}
    assert kinds["data_dependent"]["sources"][0].startswith("test_migration_tools.py:")
    assert "migtest" in kinds["custom_op"]["op"]
    assert kinds["custom_op"]["sources"][0].startswith("test_migration_tools.py:")
    assert d["readiness"] == "not ready" and a.exit_code == 1


def test_analyze_host_fallback_and_vnpu_kernels():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.special.bessel_j0(self.lin(x)).cumsum(-1)   # Cumsum: no vnpu kernel

    a = analyze(M().eval(), (torch.randn(2, 4),), device="vnpu")
    c = a.counts()
    assert c["host_fallback"] == 1 and c["no_device_kernel"] >= 1 and c["converted"] >= 1
    fb = a.by_kind("host_fallback")[0]
    assert "bessel_j0" in fb.op and fb.sources[0].startswith("test_migration_tools.py:")
    assert a.readiness == "ready with host fallbacks" and a.exit_code == 1


def test_analyze_views_need_no_device_kernel():
    class V(torch.nn.Module):
        def forward(self, x):
            return (x.reshape(4, 2).t() * 2).unsqueeze(0)

    a = analyze(V().eval(), (torch.randn(2, 4),), device="vnpu")
    views = {f.op for f in a.by_kind("converted")} & {"Reshape", "Transpose", "Unsqueeze"}
    assert len(views) >= 2, a.to_text()   # counted on the device: a view is no kernel
    assert not [f for f in a.by_kind("no_device_kernel") if f.op in views], a.to_text()
    assert a.readiness == "ready"


def test_doctor_ok_here_and_old_torch_is_an_error():
    checks = doctor()
    names = [c.name for c in checks]
    assert set(SUPPORTED) <= set(names)
    assert {"cpu", "onednn", "mkl", "threads", "bf16", "int8", "parity-cache", "cuda", "vnpu"} <= set(names)
    assert not [c for c in checks if c.status == "error"], checks
    fake = doctor(installed=lambda n: "2.0.1" if n == "torch" else "99.0" if n != "python" else "3.11.0")
    torch_check = next(c for c in fake if c.name == "torch")
    assert torch_check.status == "error" and "2.5" in torch_check.advice
    assert to_json(fake)["status"] == "error"
    assert version_check("onnx", None).status == "warning"
    assert version_check("numba", None).status == "error"


def test_cli_doctor_json(capsys):
    rc, out, err = run_cli(["doctor", "--json"], capsys)
    d = json.loads(out)
    assert rc == 0 and d["status"] in ("ok", "warning") and not err
    assert {c["name"] for c in d["checks"]} >= set(SUPPORTED) | {"cpu", "onednn", "mkl", "cuda", "vnpu"}


FACTORY = '''
import torch

def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval(), (torch.randn(3, 4),)
'''


def test_cli_compare_and_analyze(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "f.py").write_text(FACTORY)
    rc, out, err = run_cli(["compare", "f.py:net", "--csv", "l.csv", "--html", "l.html", "--bisect"], capsys)
    assert rc == 0, err
    assert "outputs pass" in out and "nothing to bisect" in out
    assert (tmp_path / "l.csv").read_text().startswith("index,node,op,fx_node")
    assert "<table>" in (tmp_path / "l.html").read_text()
    rc, out, err = run_cli(["analyze", "f.py:net", "--json"], capsys)
    assert rc == 0 and json.loads(out)["readiness"] == "ready"


@pytest.mark.parametrize("argv,needle", [
    (["compare", "f.py:net", "--device", "gpu"], "device 'gpu'"),
    (["compare", "f.py:net", "--options", "{bad"], "--options is not valid JSON"),
    (["compare", "f.py:net", "--precision-mode", "fp8"], "unknown precision_mode"),
    (["analyze", "f.py:nope"], "has no function 'nope'"),
    (["analyze", "f.py:net", "--device", "vnpu:nosuch"], "nosuch"),
    (["compare", "f.py:net", "--html", "nodir/x.html"], "does not exist"),
])
def test_cli_errors_are_one_line(tmp_path, monkeypatch, capsys, argv, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "f.py").write_text(FACTORY)
    rc, out, err = run_cli(argv, capsys)
    assert rc == 2 and len(err) == 1 and needle in err[0], err


def test_analyze_counts_only_ops_that_survive_constant_folding():
    """A Transpose of a weight and a host-fallback op on a buffer are folded at compile
    time: neither is a host op nor an op without a vnpu kernel (issue #29 item 5); the
    same op on an input still is."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(5, 4))
            self.register_buffer("b", torch.randn(5))

        def forward(self, x):
            return x @ self.w.t() + torch.special.bessel_j0(self.b)

    torch.manual_seed(0)
    a = analyze(M().eval(), (torch.randn(2, 4),), device="vnpu")
    c = a.counts()
    assert c["host_fallback"] == 0 and a.folded >= 2, a.to_text()
    assert not any(f.op in ("Transpose", "TransposeD") for f in a.findings.values()), a.to_text()
    assert "after constant folding removed" in a.to_text() and a.to_dict()["folded"] == a.folded

    class OnInput(torch.nn.Module):
        def forward(self, x):
            return torch.special.bessel_j0(x)
    b = analyze(OnInput().eval(), (torch.randn(2, 4),), device="vnpu")
    assert b.counts()["host_fallback"] == 1 and b.folded == 0
