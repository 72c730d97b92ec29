"""NPU readiness (issue #29 item 4): one report joining op support after folding, formats
and TransData, HBM fit (an LLM's KV cache), latency per op class and accuracy at fp16 /
bf16, with a verdict and next steps; the ``opencann readiness`` command, its HTML page
and its one-line errors. Small models only."""
import html.parser
import inspect
import json

import pytest
import torch

import opencann
from opencann.tools.readiness import readiness
from helpers import run_cli


class Cnn(torch.nn.Module):
    """Conv+BN+ReLU, a residual conv, pooling and a linear head."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16)
        self.c2 = torch.nn.Conv2d(16, 16, 3, padding=1)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        y = torch.relu(self.c2(y) + y)
        return self.fc(y.mean((2, 3)))


def _cnn():
    torch.manual_seed(0)
    m = Cnn().eval()
    m.b1.running_mean.uniform_(-1, 1)
    m.b1.running_var.uniform_(0.5, 2)
    return m, (torch.randn(2, 3, 16, 16),)


class HostOp(torch.nn.Module):
    """A Linear, then Bessel's J0: an ATen op without an opencann converter."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.special.bessel_j0(self.lin(x))   # the host op's line


class Overflow(torch.nn.Module):
    """A Linear whose outputs (~1e6) overflow float16 (max 65504) but not bfloat16."""

    def __init__(self):
        super().__init__()
        self.big = torch.nn.Linear(16, 16)
        with torch.no_grad():
            self.big.weight.mul_(1e5)

    def forward(self, x):
        return self.big(x) * 1e-3 + x   # the overflowing line


def _line_of(cls, marker: str) -> str:
    src, first = inspect.getsourcelines(cls)
    return f"test_readiness.py:{first + next(i for i, s in enumerate(src) if marker in s)}"


def test_cnn_is_ready_and_the_callers_model_is_untouched():
    m, x = _cnn()
    before = m(*x).detach().clone()
    r = opencann.readiness(m, x, device="vnpu:ascend910b", precision="fp16")
    assert r.verdict == "ready" and not r.reasons and not r.host_ops(), r.to_dict()
    assert r.support.counts()["converted"] > 0 and r.support.folded >= 1   # the BN constants fold
    # formats: the convolutions run in NC1HWC0, with TransData at the region's edges
    assert r.formats().get("NC1HWC0", 0) >= 2 and r.trans_data()["count"] >= 2
    assert 0 < r.trans_data()["time_us"] < r.estimate.total_time_us
    # memory: fp16 weights, at least 2 bytes per parameter (NPU formats pad channels)
    params = sum(p.numel() for p in m.parameters())
    assert r.estimate.dtype == "float16" and r.memory.weights >= 2 * params
    assert r.memory.fits and r.memory.kv_cache == 0 and r.kv is None
    assert r.memory.total == r.memory.weights + r.memory.activations
    # latency: every op type with its class; the classes add up to the total
    classes = r.op_classes()
    ops = {c.op for c in classes}
    assert "TransData" in ops and ops & {"Conv2D", "CubeEpilogue"}, ops   # UB fusion: Conv+ReLU one node
    assert all(c.bound in ("Cube", "Vector", "memory", "launch", "fused") for c in classes)
    assert sum(r.time_by_class().values()) == pytest.approx(r.estimate.total_time_us)
    # accuracy: every compared layer passes at fp16
    assert r.accuracy.status == "pass" and len(r.accuracy.layers) > 0 and not r.failing_layers()
    assert r.next_steps   # never empty: at least what to do next
    # the caller's fp32 model is neither cast nor changed; a second report agrees
    assert all(p.dtype == torch.float32 for p in m.parameters())
    torch.testing.assert_close(m(*x), before, rtol=0, atol=0)
    again = readiness(m, x, accuracy=False)
    assert again.verdict == "ready" and again.memory == r.memory
    assert again.skipped["accuracy"].startswith("turned off")
    json.loads(r.to_json())   # JSON-ready


def test_host_op_is_named_with_its_source_line():
    torch.manual_seed(0)
    r = readiness(HostOp().eval(), (torch.randn(4, 8),), device="vnpu:ascend910b")
    line = _line_of(HostOp, "the host op's line")
    assert r.verdict == "ready with host ops", r.reasons
    host = [f for f in r.host_ops() if f.kind == "host_fallback"]
    assert len(host) == 1 and "bessel_j0" in host[0].op and host[0].sources == [line]
    assert any("bessel_j0" in s and line in s and "register_op" in s for s in r.next_steps), r.next_steps
    assert r.estimate.fallbacks.get("HostFallback") == 1    # costed, and said to be a guess
    assert any("HostFallback x1" in s for s in r.next_steps)


def test_fp16_overflow_names_the_failing_layer_and_bf16_passes():
    torch.manual_seed(0)
    m, x = Overflow().eval(), (torch.randn(4, 16),)
    r = readiness(m, x, precision="fp16")
    assert r.precision_mode == "force_fp16" and r.accuracy.status == "fail"
    assert r.verdict == "not ready" and any("fp16 thresholds" in s for s in r.reasons)
    fails = r.failing_layers()
    line = _line_of(Overflow, "the overflowing line")
    assert fails and any(f.source == line for f in fails), [(f.node, f.source) for f in fails]
    assert fails[0].op == "MatMulV2" and "NaN/inf" in fails[0].note   # inf where fp32 is finite
    step = next(s for s in r.next_steps if "fail at fp16" in s)
    assert f"the first {fails[0].node} (MatMulV2) at {line}" in step and "NaN/inf" in step
    assert "'keep_fp32': ['MatMulV2']" in step and "--precision bf16" in step
    b = readiness(m, x, precision="bf16")
    assert b.precision_mode == "allow_mix_precision_bf16" and b.accuracy.status == "pass"
    assert b.estimate.dtype == "bfloat16" and b.verdict == "ready"
    # the Ascend 910's Cube takes float16 / int8 only: bf16 is refused there, as by CANN
    old = readiness(m, x, device="vnpu:ascend910", precision="bf16", accuracy=False)
    assert old.verdict == "not ready" and "the Cube of ascend910 has no bfloat16 kernels" in old.reasons
    assert any(s.startswith("the Cube of ascend910 takes float16/int8, not bfloat16") and "ascend910b" in s
               for s in old.next_steps), old.next_steps


class Branchy(torch.nn.Module):
    """Python control flow on a tensor value: no single device graph."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:   # the branch's line
            return y * 2
        return y - 1


def test_data_dependent_branch_is_not_ready_with_its_fix():
    torch.manual_seed(0)
    r = readiness(Branchy().eval(), (torch.randn(2, 8),))
    line = _line_of(Branchy, "the branch's line")
    assert r.verdict == "not ready" and r.reasons == [f"data dependent: graph break at {line}"]
    assert r.estimate is r.memory is r.accuracy is None
    assert set(r.skipped) == {"estimate", "memory", "accuracy"}
    assert r.next_steps[0].startswith(f"graph break at {line}: Python control flow on a tensor")
    assert "not estimated" in r.memory_lines()[0] and r.to_dict()["latency"] is None


def _tiny_llama(positions: int = 512):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=positions)
    return LlamaForCausalLM(cfg).eval(), (torch.randint(1, 128, (2, 16)),)


def test_llm_kv_cache_line_is_the_hand_computation():
    m, x = _tiny_llama()
    r = readiness(m, x, precision="fp16", context=256, batch=2, accuracy=False)
    # K and V x 2 layers x batch 2 x 2 KV heads x 256 tokens x head dim 64/4 = 16 x 2 bytes
    hand = 2 * 2 * 2 * 2 * 256 * 16 * 2
    assert hand == 131072 and r.kv.nbytes == hand and r.memory.kv_cache == hand
    assert r.memory.total == r.memory.weights + r.memory.activations + hand
    kv_line = next(s for s in r.memory_lines() if s.startswith("KV cache"))
    assert kv_line == ("KV cache 128.00 KiB at context 256, batch 2 = 2 x 2 layers x batch 2 x "
                       "2 KV heads x 256 tokens x head dim 16 x 2 B = 131072 B")
    assert r.to_dict()["kv_cache"]["bytes"] == hand
    # beyond the model's positions: one line
    with pytest.raises(ValueError, match="exceeds the 512 positions"):
        readiness(m, x, context=1024, batch=2, accuracy=False)
    # a context the HBM cannot hold: not ready, and the context that fits
    m, x = _tiny_llama(positions=10 ** 9)
    big = readiness(m, x, context=10 ** 9, batch=2, accuracy=False)
    assert not big.memory.fits and big.verdict == "not ready"
    per_token = 2 * 2 * 2 * 2 * 16 * 2
    fits = (big.memory.hbm - big.memory.weights - big.memory.activations) // per_token
    assert any(f"--context {fits}" in s for s in big.next_steps), big.next_steps
    assert any("does NOT fit" in s for s in big.memory_lines())


def test_nan_only_sample_inputs_are_one_line(capsys):
    """All-NaN outputs would pass every accuracy rule: refused, not reported "ready"."""
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    with pytest.raises(ValueError, match=r"^the model's eager outputs on these inputs have no finite "
                                         r"value \(output 0, \(2, 8\), is all NaN/Inf\)"):
        readiness(m, (torch.full((2, 8), float("nan")),), device="vnpu:ascend910b")
    assert readiness(m, (torch.full((2, 8), float("nan")),), device="vnpu:ascend910b",
                     accuracy=False).verdict == "ready"


def test_bad_arguments_are_one_line_errors():
    m, x = _cnn()
    cases = [(dict(device="cpu"), "is not a vnpu device"),
             (dict(precision="fp8"), "precision 'fp8' is not one of"),
             (dict(context=128), "context is for LLMs"),
             (dict(batch=0), "batch must be a whole number >= 1"),
             (dict(precision_mode="fastest"), "unknown precision_mode")]
    for kw, needle in cases:
        with pytest.raises(ValueError, match=needle) as e:
            readiness(m, x, **kw)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="give sample inputs"):
        readiness(m)
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    llm = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=64)).eval()
    ids = torch.randint(1, 64, (1, 8))
    for ctx, needle in [(0, r"readiness: context must be a whole number of tokens >= 1, got 0"),
                        (2.5, "readiness: context must be a whole number"),
                        (65, r"readiness: context 65 exceeds the 64 positions .*give --context <= 64")]:
        with pytest.raises(ValueError, match=needle) as e:
            readiness(llm, (ids,), context=ctx, accuracy=False)
        assert "\n" not in str(e.value) and "max_seq_len" not in str(e.value)
    with pytest.raises(TypeError, match="readiness takes a torch.nn.Module"):
        readiness(42)


class _Sections(html.parser.HTMLParser):
    """Collects element ids and every src/href attribute."""

    def __init__(self):
        super().__init__()
        self.ids, self.links = set(), []

    def handle_starttag(self, tag, attrs):
        d = dict(attrs)
        if "id" in d:
            self.ids.add(d["id"])
        self.links += [v for k, v in attrs if k in ("src", "href")]


_FACTORIES = """import torch


class Cnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.b1(self.c1(x))).mean((2, 3)))


class HostOp(torch.nn.Module):
    def forward(self, x):
        return torch.special.bessel_j0(x * 2)


def cnn():
    torch.manual_seed(0)
    return Cnn().eval(), (torch.randn(2, 3, 16, 16),)


def host():
    torch.manual_seed(0)
    return HostOp().eval(), (torch.randn(4, 8),)


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval(), (torch.randint(1, 128, (2, 16)),)
"""


@pytest.fixture
def factory(tmp_path):
    """m.py with cnn() (a ready CNN), host() (a host op) and llama() (a tiny Llama) as
    factories; m.onnx, a static [2, 4] Relu graph."""
    (tmp_path / "m.py").write_text(_FACTORIES)
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    return tmp_path


def test_cli_report_html_and_exit_codes(factory, capsys):
    page, js = factory / "r.html", factory / "r.json"
    rc, out, err = run_cli(["readiness", f"{factory}/m.py:cnn", "--html", str(page),
                            "--json", str(js)], capsys)
    assert rc == 0, err
    for heading in ("NPU readiness: cnn on vnpu:ascend910b, fp16", "verdict: ready",
                    "op support (after constant folding)", "formats and TransData", "memory (HBM)",
                    "estimated latency", "accuracy at fp16 (force_fp16) against fp32", "next steps"):
        assert heading in out, heading
    p = _Sections()
    p.feed(page.read_text(encoding="utf-8"))
    assert {"verdict", "support", "formats", "memory", "latency", "accuracy", "next-steps"} <= p.ids
    assert all(v.startswith("data:") for v in p.links), p.links   # self-contained
    assert json.loads(js.read_text())["verdict"] == "ready"
    rc, out, err = run_cli(["readiness", f"{factory}/m.py:host"], capsys)
    assert rc == 1 and "ready with host ops" in out and "bessel_j0" in out
    rc, out, err = run_cli(["readiness", f"{factory}/m.py:llama", "--context", "256", "--batch", "2",
                            "--no-accuracy"], capsys)
    assert rc in (0, 1) and "KV cache 128.00 KiB at context 256, batch 2 = " in out, err
    assert "not checked: turned off" in out


def test_cli_bad_input_is_one_line(factory, capsys):
    cnn = f"{factory}/m.py:cnn"
    cases = [(["readiness", cnn, "--device", "cpu"], "is not a vnpu device"),
             (["readiness", cnn, "--device", "vnpu:ascend999"], "ascend999"),
             (["readiness", cnn, "--context", "64"], "context is for LLMs"),
             (["readiness", "nosuchmodel"], "unknown zoo model"),
             (["readiness", str(factory / "missing.onnx")], "no such ONNX file"),
             (["readiness", str(factory / "missing.ocm")], "no such model file"),
             (["readiness", cnn, "--input-shape", "x:1,3,8,8"], "--input-shape is for .onnx"),
             (["readiness", cnn, "--precision", "fp8"], "invalid choice: 'fp8'"),
             (["readiness", cnn, "--batch", "0"], "must be at least 1"),
             (["readiness", str(factory / "m.onnx"), "--batch", "2"], "batch is for torch models")]
    for argv, needle in cases:
        rc, out, err = run_cli(argv, capsys)
        assert rc == 2 and len(err) == 1 and needle in err[0], (argv, err)


def test_onnx_and_model_files(tmp_path, capsys):
    pytest.importorskip("onnx")
    m, x = _cnn()
    onnx_path = tmp_path / "cnn.onnx"
    torch.onnx.export(m, x, str(onnx_path), dynamo=False, opset_version=17)
    r = readiness(str(onnx_path), precision="fp16")
    assert r.verdict == "ready" and r.estimate.dtype == "float16" and r.formats().get("NC1HWC0")
    assert r.accuracy.status == "pass" and not r.accuracy.layers and r.accuracy.outputs
    ocm = tmp_path / "cnn.ocm"
    opencann.save(opencann.compile(m, x, device="vnpu:ascend910b"), str(ocm))
    f = readiness(str(ocm))
    assert f.estimate is not None and f.memory.fits and f.accuracy is None
    assert "no fp32 reference" in f.skipped["accuracy"]
    cpu = tmp_path / "cpu.ocm"
    opencann.save(opencann.compile(m, x), str(cpu))
    rc, out, err = run_cli(["readiness", str(cpu)], capsys)
    assert rc == 2 and len(err) == 1 and "compiled for cpu, not for an NPU" in err[0]
