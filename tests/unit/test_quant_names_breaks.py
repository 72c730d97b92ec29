"""int8 ``quant_config`` names where they break most easily:

- a ``skip_layers`` name of a Linear merged into one Q/K/V GEMM (`FuseQKVLinear`) keeps
  that GEMM in fp32 whichever part it names (k or v had passed the name check, as labels of
  the GEMM's slices, and left the GEMM that does their work in int8 without a word);
- odd names: unicode, dotted module names, duplicates, a set, a tuple; a parent module,
  a typo and a name with a space are one ValueError line with near matches;
- ``check_names`` not a bool is one line; a config made for one model applied to another
  is one line (and ``check_names: False`` lets it through);
- a good config never raises: ``opencann.quantize`` with dynamic shapes, gears and its own
  records reused on a dynamic-shape compile, saved and loaded."""
import pytest
import torch
from torch import nn

import opencann
from opencann.engine.quantize import calibrate, quant_report
from opencann.tools.quantize import create_quant_config

G = torch.Generator().manual_seed(11)


class Attn(nn.Module):
    """A unicode-named block and sibling q / k / v linears (merged into one GEMM)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleDict({"é1": nn.Linear(16, 32), "b": nn.Linear(32, 16)})
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.blocks["b"](torch.relu(self.blocks["é1"](x)))
        return self.q(h) + self.k(h) * self.v(h)


class Other(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        return self.fc(x)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    m = Attn().eval()
    cal = [(torch.randn(4, 16, generator=G),) for _ in range(3)]
    return m, cal, calibrate(opencann.compile(m, cal[0]), cal)


def _int8(cm):
    return {r["layer"]: r["int8"] for r in quant_report(cm)}


def _one_line(call, *parts):
    with pytest.raises(ValueError) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg and all(p in msg for p in parts), msg


@pytest.mark.parametrize("skip", [["q"], ["k"], ["v"], ("k",), {"v", "blocks.b"}])
def test_any_part_of_a_merged_gemm_keeps_it_fp32(setup, skip):
    m, cal, _ = setup
    q = opencann.quantize(m, cal, config=create_quant_config(skip_layers=skip))
    got = _int8(q)
    qkv = [name for name in got if name.endswith("_qkv")]
    assert len(qkv) == 1 and got[qkv[0]] is False, got
    assert sum(got.values()) == (1 if "blocks.b" in skip else 2), got
    x = torch.randn(4, 16, generator=G)
    with torch.no_grad():
        assert torch.nn.functional.cosine_similarity(q(x).flatten(), m(x).flatten(), dim=0) > 0.99


def test_odd_names(setup):
    m, cal, records = setup
    got = _int8(opencann.quantize(m, cal, config=create_quant_config(skip_layers=["blocks.é1", "blocks.é1"])))
    assert list(got.values()).count(False) == 1
    for bad, near in (("blocks", "blocks.b"), ("é1", "blocks.é1"), (" q", "q"), ("blocks.e1", "blocks.é1")):
        _one_line(lambda: opencann.quantize(m, cal, config=create_quant_config(skip_layers=[bad])),
                  "skip_layers names no layer", repr(bad), near)
    _one_line(lambda: create_quant_config(skip_layers=["q", ""]), "skip_layers", "holding ''")
    for flag in (0, 1, "false"):
        _one_line(lambda: opencann.compile(m, cal[0], options={"quant_config": {
            "layers": records, "check_names": flag}}), "'check_names' takes True or False")


def test_a_config_for_another_model(setup):
    m, cal, records = setup
    other = Other().eval()
    x = torch.randn(4, 16, generator=G)
    _one_line(lambda: opencann.compile(other, (x,), options={"quant_config": {"layers": records}}),
              "'layers' names no", "Fix:")
    _one_line(lambda: opencann.compile(other, (x,), options={"quant_config": {"skip_layers": ["q"]}}),
              "skip_layers names no layer", "'q'")
    cm = opencann.compile(other, (x,), options={"quant_config": {"layers": records, "check_names": False}})
    with torch.no_grad():
        assert torch.allclose(cm(x), other(x), atol=1e-5)


def test_good_configs_never_raise(setup, tmp_path):
    m, cal, records = setup
    dyn = dict(dynamic_shapes={"x": {0: "b"}}, dim_ranges={"b": (1, 16)})
    layers = {k: {f: r[f] for f in ("scale_d", "offset_d") if f in r} for k, r in records.items()}
    for cm in (opencann.quantize(m, [(torch.randn(n, 16, generator=G),) for n in (2, 5, 3)], **dyn),
               opencann.quantize(m, cal, options={"dynamic_batch_size": [1, 4, 8]}),
               opencann.compile(m, cal[0], options={"quant_config": {
                   "layers": layers, "skip_layers": {"k"}}}, **dyn)):
        path = str(tmp_path / "q.ocm")
        opencann.save(cm, path)
        loaded = opencann.load(path)
        for n in (1, 4, 8):
            x = torch.randn(n, 16, generator=G)
            out = cm(x)
            assert out.shape == (n, 16) and torch.isfinite(out).all()
            assert torch.equal(loaded(x), out)


def test_set_valued_options_save_with_dynamic_dims(setup, tmp_path):
    """A set where a list of names is taken (skip_layers, disable, keep_dtype) is stored
    as the sorted list: a dynamic model keeps its options in the file, which has no set
    encoding (saving had raised ModelFileError)."""
    m, cal, records = setup
    layers = {k: {f: r[f] for f in ("scale_d", "offset_d") if f in r} for k, r in records.items()}
    given = {"layers": layers, "skip_layers": {"v", "blocks.b"}}
    cm = opencann.compile(m, cal[0], dynamic_shapes={"x": {0: "b"}}, dim_ranges={"b": (1, 8)},
                          options={"quant_config": given, "disable": {"fuse_silu"}})
    assert isinstance(given["skip_layers"], set)          # the caller's dict untouched
    path = str(tmp_path / "d.ocm")
    opencann.save(cm, path)
    x = torch.randn(3, 16, generator=G)
    assert torch.equal(opencann.load(path)(x), cm(x))
