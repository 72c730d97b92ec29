"""Saving and loading models compiled with dynamic dims and with ATC-style gears
(issue #12): the loaded model takes the same shapes and gears, equals the live model
bit for bit, and refuses other shapes with the same error."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import opencann
from opencann.runtime.model_file import describe, describe_text, read_sections

from helpers import save_and_load, seeded as _seeded


class Attention(nn.Module):
    """Projection → per-head SDPA → projection; views built from the input's sizes."""

    def __init__(self, d=16, heads=4):
        super().__init__()
        self.heads, self.qkv, self.o = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(a.transpose(1, 2).reshape(b, t, d)) + x


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.c1(x))).mean((2, 3)))


def _error(fn, *args):
    with pytest.raises(ValueError) as e:
        fn(*args)
    return str(e.value)


def test_dynamic_model_roundtrip(tmp_path):
    m = _seeded(Attention())
    cm = opencann.compile(m, (torch.randn(2, 8, 16),), dynamic_shapes={"x": {0: "b", 1: "t"}},
                          dim_ranges={"t": (2, 64), "b": (1, 4)})
    lm, path = save_and_load(cm, tmp_path, "dyn.ocm")
    header, secs = read_sections(path)
    meta = json.loads(bytes(secs["metadata"]))
    assert meta["format_version"] == 3 and meta["dynamic"] and meta["gears"] == []
    assert b"pickle" not in bytes(secs["graph"])
    assert isinstance(lm, opencann.CompiledModel) and lm.shapes.name == "dynamic"
    for shape in [(2, 8, 16), (3, 17, 16), (1, 64, 16), (3, 17, 16)]:
        x = torch.randn(*shape)
        x[0, 1, 2] = float("nan")
        got, live = lm(x), cm(x)
        assert torch.equal(got.isnan(), live.isnan())
        assert torch.equal(got.nan_to_num(), live.nan_to_num())          # bit for bit
        torch.testing.assert_close(got, m(x).detach(), rtol=1e-4, atol=1e-4, equal_nan=True)
    again = lm(x)
    assert again.data_ptr() != got.data_ptr()
    for bad in [(1, 65, 16), (5, 8, 16)]:
        x = torch.randn(*bad)
        assert _error(lm, x) == _error(cm, x)
    text = describe_text(describe(path))
    assert "dynamic dims: b in [1, 4], t in [2, 64]" in text


def test_gear_model_roundtrip_keeps_gears_and_padding(tmp_path):
    m = _seeded(ConvNet())
    cm = opencann.compile(m, (torch.randn(2, 3, 10, 10),),
                          options={"dynamic_batch_size": [1, 2, 4, 8]})
    lm, path = save_and_load(cm, tmp_path, "gears.ocm")
    assert lm.report.dynamic["gears"] == cm.report.dynamic["gears"]
    assert lm.report.dynamic["padding"] == cm.report.dynamic["padding"]
    assert sorted(lm.plans.keys()) == [(1,), (2,), (4,), (8,)]        # every gear planned
    built = lm.plans.misses
    for n in (1, 3, 5, 8, 3):
        x = torch.randn(n, 3, 10, 10)
        assert torch.equal(lm(x), cm(x))
        torch.testing.assert_close(lm(x), m(x).detach(), rtol=1e-5, atol=1e-5)
    assert lm.plans.misses == built
    x = torch.randn(9, 3, 10, 10)
    assert "not one of the gears" in _error(lm, x) and _error(lm, x) == _error(cm, x)
    assert sum("padded to the smallest gear" in n for n in lm.report.notes) == 1


class BatchMean(nn.Module):
    def forward(self, x):
        return x - x.mean(0)


def test_exact_gear_model_roundtrip(tmp_path):
    m = BatchMean()
    cm = opencann.compile(m, (torch.randn(2, 6),), options={"dynamic_batch_size": [2, 4]})
    lm, path = save_and_load(cm, tmp_path, "exact.ocm")
    assert lm.report.dynamic["padding"]["dims"]["batch"]["blocked_by"]["op"] == "ReduceMean"
    x = torch.randn(4, 6)
    assert torch.equal(lm(x), cm(x))
    x = torch.randn(3, 6)
    assert "only exact gears" in _error(lm, x) and _error(lm, x) == _error(cm, x)


def test_a_static_model_is_written_in_format_3_which_older_readers_refuse(tmp_path):
    cm = opencann.compile(_seeded(ConvNet()), (torch.randn(2, 3, 10, 10),))
    path = str(tmp_path / "static.ocm")
    assert opencann.save(cm, path) is None
    meta = json.loads(bytes(read_sections(path)[1]["metadata"]))
    assert meta["format_version"] == 3 and meta["dynamic"] is None
    x = torch.randn(2, 3, 10, 10)
    assert torch.equal(opencann.load(path)(x), cm(x))


def test_vnpu_gear_model_roundtrip(tmp_path):
    m = _seeded(ConvNet())
    cm = opencann.compile(m, (torch.randn(2, 3, 10, 10),), device="vnpu",
                          options={"dynamic_batch_size": [1, 4]})
    lm, path = save_and_load(cm, tmp_path, "vnpu.ocm")
    assert lm.device == "vnpu" and lm.report.device == "vnpu"
    for n in (1, 3, 4):
        x = torch.randn(n, 3, 10, 10)
        assert torch.equal(lm(x), cm(x))
    x = torch.randn(5, 3, 10, 10)
    assert _error(lm, x) == _error(cm, x)
