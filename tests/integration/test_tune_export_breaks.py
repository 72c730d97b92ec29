"""Breaking `TuneResult.export(quant_config=...)` and ``opencann atc --quant_config`` as a
user would: a file that cannot build the tuned graph (another model's, another device's,
a hand-edited record) is one error line naming the problem, never a graph built in fp32
without a word."""
from __future__ import annotations

import json

import pytest
import torch

import opencann
from helpers import run_cli
from opencann.tools.tune import tune

_ATTN_FILE = """import torch
class A(torch.nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.q, self.k, self.v = torch.nn.Linear(d, d), torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.o, self.ln = torch.nn.Linear(d, d), torch.nn.LayerNorm(d)
    def forward(self, x):
        h = self.ln(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        a = torch.softmax(torch.bmm(q, k.transpose(1, 2)) / 5.66, -1)
        return x + self.o(torch.bmm(a, v))
def make():
    torch.manual_seed(0)
    return A().eval(), (torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1)),)
"""

_CONV_FILE = """import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.fc1 = torch.nn.Linear(8, 8)
    def forward(self, x):
        return self.fc1(torch.relu(self.c1(x)).mean((2, 3)))
def make():
    torch.manual_seed(0)
    return M().eval(), (torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(1)),)
"""


@pytest.fixture(scope="module")
def attn(tmp_path_factory):
    """(model file, tuned fp32/int8 result, its exported quant_config path)."""
    d = tmp_path_factory.mktemp("attn")
    path = d / "attn.py"
    path.write_text(_ATTN_FILE)
    ns: dict = {}
    exec(_ATTN_FILE, ns)
    model, (x,) = ns["make"]()
    res = tune(model, (x,), candidates=("fp32", "int8"), timing=False)
    assert "int8" in res.precision.values(), res.summary()
    q = d / "q.json"
    res.export(quant_config=str(q))
    return path, res, q, x


def test_another_models_quant_config_is_refused_not_ignored(attn, tmp_path, capsys):
    """A quant_config tuned for one model, given to atc with another: its layers name no
    node there; atc used to build the other model all in fp32 and report success."""
    _, _, q, _ = attn
    other = tmp_path / "conv.py"
    other.write_text(_CONV_FILE)
    rc, _, err = run_cli(["atc", "--model", f"{other}:make", "--output", str(tmp_path / "o"),
                          "--quant_config", str(q)], capsys)
    assert rc != 0 and len(err) == 1 and f"--quant_config {q}" in err[0] and "another model" in err[0], err


def test_cpu_quant_config_on_the_virtual_npu_is_refused_not_ignored(attn, tmp_path, capsys):
    """The file names the CPU's fused layers; on --soc_version Ascend910B1 (vnpu) none of
    them is a node, so atc used to build the model without int8 and report success."""
    path, _, q, _ = attn
    rc, _, err = run_cli(["atc", "--model", f"{path}:make", "--output", str(tmp_path / "v"),
                          "--soc_version", "Ascend910B1", "--quant_config", str(q)], capsys)
    assert rc != 0 and len(err) == 1 and f"--quant_config {q}" in err[0] and "cpu" in err[0], err


def test_hand_edited_typo_in_a_layer_name_is_refused(attn, tmp_path, capsys):
    path, res, q, _ = attn
    cfg = json.loads(q.read_text())
    name = sorted(cfg["layers"])[0]
    cfg["layers"][name + "x"] = cfg["layers"].pop(name)
    bad = tmp_path / "typo.json"
    bad.write_text(json.dumps(cfg))
    rc, _, err = run_cli(["atc", "--model", f"{path}:make", "--output", str(tmp_path / "t"),
                          "--quant_config", str(bad)], capsys)
    assert rc != 0 and len(err) == 1 and name + "x" in err[0], err


def test_exported_quant_config_still_builds_the_tuned_graph(attn, tmp_path, capsys):
    """The check above must not cost the round trip: Q/K/V merged into one GEMM and all."""
    path, res, q, x = attn
    out, keep = str(tmp_path / "a.ocm"), str(tmp_path / "keep.txt")
    res.export(keep_dtype=keep)
    rc, _, err = run_cli(["atc", "--model", f"{path}:make", "--output", out, "--keep_dtype", keep,
                          "--quant_config", str(q)], capsys)
    assert rc == 0, err
    assert torch.equal(opencann.load(out)(x), res.compiled(x))


@pytest.mark.parametrize("text,says", [
    ('{"layers": {"fc": {"scale_d": 1e400, "offset_d": 3}}}', "scale_d"),
    ('{"layers": {"fc": {"scale_d": 100000000000000000000000000000000000000000000000000000000000000000000000000000'
     '0000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000'
     '0000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000'
     '000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000, '
     '"offset_d": 3}}}', "scale_d"),
    ("null", "quant_config"),
])
def test_hand_edited_record_errors_are_one_line(tmp_path, capsys, text, says):
    from opencann.tools.precision_files import read_quant_config
    q = tmp_path / "q.json"
    q.write_text(text)
    with pytest.raises(ValueError) as e:
        read_quant_config(str(q))
    assert says in str(e.value) and str(q) in str(e.value) and "\n" not in str(e.value)


def test_a_directory_is_not_called_a_missing_file(tmp_path):
    from opencann.tools.precision_files import read_quant_config
    with pytest.raises(ValueError) as e:
        read_quant_config(str(tmp_path))
    assert "is a directory" in str(e.value) and "no such file" not in str(e.value), e.value


_MIXED_CONV_FILE = """import torch
class C(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c0 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.w1 = torch.nn.Parameter(torch.randn(8, 8, 3, 3) * 0.1)
        self.fc = torch.nn.Linear(8, 4)
    def forward(self, x):
        y = torch.relu(self.c0(x))
        y = torch.nn.functional.conv2d(y, self.w1 * 1.0, padding=1)   # computed weight: no int8
        return self.fc(y.mean((2, 3)))
def make():
    torch.manual_seed(0)
    return C().eval(), (torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)),)
"""


def test_a_choice_the_mixlist_cannot_say_is_an_error_not_another_graph(tmp_path, capsys):
    """One convolution int8 from fp32, the other bf16: Conv2D is in neither list, the bf16
    mode lowers both, and atc used to build the int8 one in bf16 and report success. It
    must build the tuned graph or say (one line) that these files cannot."""
    path = tmp_path / "mc.py"
    path.write_text(_MIXED_CONV_FILE)
    ns: dict = {}
    exec(_MIXED_CONV_FILE, ns)
    model, (x,) = ns["make"]()
    res = tune(model, (x,), candidates=("fp32", "bf16", "int8"), timing=False)
    assert res.precision["convolution"] == "int8" and res.precision["convolution_1"] == "bf16", res.summary()
    keep, mix, q, out = (str(tmp_path / n) for n in ("keep.txt", "mix.json", "q.json", "a.ocm"))
    res.export(keep_dtype=keep, modify_mixlist=mix, quant_config=q)
    rc, _, err = run_cli(["atc", "--model", f"{path}:make", "--output", out, "--precision_mode",
                          "allow_mix_precision_bf16", "--keep_dtype", keep, "--modify_mixlist", mix,
                          "--quant_config", q], capsys)
    if rc == 0:
        assert torch.equal(opencann.load(out)(x), res.compiled(x))
    else:
        assert len(err) == 1 and f"--quant_config {q}" in err[0] and "opencann tune --out" in err[0], err
