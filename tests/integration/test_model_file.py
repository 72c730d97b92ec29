"""The offline model file (`opencann.save` / `opencann.load`, ``opencann inspect``):
round trips bit for bit against the live compiled model (and close to eager), in this
process and in a fresh one without the model's class or torch.export; every damaged or
foreign file gives one clear line; the file holds no pickle."""
import hashlib
import json
import os
import struct
import subprocess
import sys
import textwrap

import pytest
import safetensors.torch
import torch
from torch import nn

import opencann
from opencann.ir import Format
from opencann.runtime.model_file import _PREFIX, SECTIONS, ModelFileError, read_sections
from helpers import REPO

ROOT = str(REPO)


def _conv_bn_linear():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                      nn.Flatten(), nn.Linear(16 * 8 * 8, 10)).eval()
    with torch.no_grad():  # non-trivial BN statistics
        m[1].running_mean.uniform_(-1, 1)
        m[1].running_var.uniform_(0.5, 2)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    return m, x


class DictModel(nn.Module):
    """Dict in, dict out, a keyword input, a baked float and a constant output."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.register_buffer("table", torch.arange(6.0).reshape(2, 3))

    def forward(self, batch, scale=2.0):
        h = self.lin(batch["x"]) * scale
        return {"y": torch.tanh(h) + batch["bias"], "nan_pos": torch.where(h > 0, h, torch.nan),
                "table": self.table}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(model, input, live compiled model, saved path)."""
    m, x = _conv_bn_linear()
    cm = opencann.compile(m, (x,))
    path = str(tmp_path_factory.mktemp("ocm") / "small.ocm")
    opencann.save(cm, path)
    return m, x, cm, path


def _leaves(o):
    if hasattr(o, "to_tuple"):
        o = o.to_tuple()
    if isinstance(o, dict):
        return list(o.values())
    return list(o) if isinstance(o, (tuple, list)) else [o]


def _bit_equal(a, b) -> bool:
    """Same dtype, shape and bits (NaN positions included)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def test_round_trip_conv_bn_linear(small):
    m, x, cm, path = small
    lm = opencann.load(path)
    x2 = torch.randn(2, 3, 8, 8)
    for inp in (x, x2):  # the example and a second, different call
        a, b = cm(inp), lm(inp)
        assert _bit_equal(a, b)
        with torch.no_grad():
            assert torch.allclose(b, m(inp), atol=1e-5, rtol=1e-4)
    y1 = lm(x)
    y2 = lm(x2)
    assert not torch.equal(y1, y2) and _bit_equal(y1, cm(x))  # outputs do not alias
    assert lm.graph.op_counts() == cm.graph.op_counts()
    assert lm.plan.arena_bytes == cm.plan.arena_bytes and lm.plan.buffers == cm.plan.buffers
    assert lm.report.applied == cm.report.applied
    assert any("loaded from small.ocm" in n for n in lm.report.notes)


def test_same_errors_as_live_model(small):
    _, x, _, path = small
    lm = opencann.load(path)
    with pytest.raises(ValueError, match="compiled for float32"):
        lm(torch.randn(2, 3, 8, 9))
    with pytest.raises(ValueError, match="positional"):
        lm(x, x)


def test_dict_inputs_outputs_and_baked_values(tmp_path):
    torch.manual_seed(0)
    m = DictModel().eval()
    batch = {"x": torch.randn(3, 8), "bias": torch.randn(3, 4)}
    cm = opencann.compile(m, ({"x": batch["x"], "bias": batch["bias"]},), example_kwargs={"scale": 0.5})
    path = str(tmp_path / "dict.ocm")
    opencann.save(cm, path)
    lm = opencann.load(path)
    b2 = {"x": torch.randn(3, 8), "bias": torch.randn(3, 4)}
    for b in (batch, b2):
        live, got = cm(b, scale=0.5), lm(b, scale=0.5)
        assert isinstance(got, dict) and list(got) == ["y", "nan_pos", "table"]
        with torch.no_grad():
            ref = m(b, scale=0.5)
        for k in got:
            assert _bit_equal(got[k], live[k])
            assert torch.allclose(got[k], ref[k], atol=1e-6, equal_nan=True)
        assert torch.equal(got["nan_pos"].isnan(), ref["nan_pos"].isnan())
    t1, t2 = lm(batch, scale=0.5)["table"], lm(batch, scale=0.5)["table"]
    t1.add_(1)  # a constant output is fresh per call
    assert torch.equal(t2, m.table)
    with pytest.raises(ValueError, match="baked"):
        lm(batch, scale=3.0)
    names = [o["name"] for o in opencann.runtime.model_file.read(path)["metadata"]["outputs"]]
    assert names == ["y", "nan_pos", "table"]


def test_vnpu_model_round_trip(tmp_path):
    m, x = _conv_bn_linear()
    cm = opencann.compile(m, (x,), device="vnpu:ascend910b")
    path = str(tmp_path / "vnpu.ocm")
    opencann.save(cm, path)
    lm = opencann.load(path)
    fmts = {v.desc.format for v in lm.graph.values()}
    assert fmts == {v.desc.format for v in cm.graph.values()} and Format.NC1HWC0 in fmts
    assert [n.device for n in lm.graph.nodes] == [n.device for n in cm.graph.nodes]
    assert [str(v.desc) for v in lm.graph.values()] == [str(v.desc) for v in cm.graph.values()]
    assert _bit_equal(lm(x), cm(x))
    assert lm.report.device == "vnpu:ascend910b"


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    from opencann import zoo
    zm = zoo.minilm()
    ids, mask = zoo.tokenize(zoo.SENTENCES)
    cm = opencann.compile(zm.model, (ids, mask))
    d = tmp_path_factory.mktemp("minilm")
    path = str(d / "minilm.ocm")
    opencann.save(cm, path)
    return zm, ids, mask, cm, path


def test_minilm_bit_for_bit(minilm):
    zm, ids, mask, cm, path = minilm
    lm = opencann.load(path)
    live, got = cm(ids, mask), lm(ids, mask)
    assert type(got) is type(live)  # transformers is imported here: ModelOutput rebuilt
    for a, b in zip(_leaves(live), _leaves(got)):
        assert _bit_equal(a, b)
    with torch.no_grad():
        ref = zm.model(ids, mask).last_hidden_state
    assert torch.allclose(got.last_hidden_state, ref, atol=1e-4, rtol=1e-4)


_CHILD = textwrap.dedent("""
    import pickle, sys, torch, torch.export
    kept = (torch.export.export, pickle.loads, pickle.load, torch.load, pickle.Unpickler)
    def _no(*a, **k):
        raise AssertionError("loading must not use torch.export or pickle")
    def _numba_cache_only(real):
        # binding a loaded graph may load numba's own machine-code cache of opencann's
        # kernels (pickled index and data files in the user's cache, not the model file)
        def guarded(*a, **k):
            if sys._getframe(1).f_globals.get("__name__") != "numba.core.caching":
                raise AssertionError("loading must not use torch.export or pickle")
            return real(*a, **k)
        return guarded
    torch.export.export = torch.load = _no
    pickle.loads, pickle.load = _numba_cache_only(kept[1]), _numba_cache_only(kept[2])
    pickle.Unpickler = _no
    import safetensors.torch, opencann
    lm = opencann.load(sys.argv[1])
    torch.export.export, pickle.loads, pickle.load, torch.load, pickle.Unpickler = kept
    inputs = safetensors.torch.load_file(sys.argv[2])
    out = lm(*[inputs[f"in{i}"] for i in range(len(inputs))])
    flat = list(out.values()) if isinstance(out, dict) else (list(out) if isinstance(out, tuple) else [out])
    safetensors.torch.save_file({f"out{i}": t for i, t in enumerate(flat)}, sys.argv[3])
    print("OUT", type(out).__name__, sorted(k for k in ("transformers", "torchvision") if k in sys.modules))
""")


def _load_in_fresh_process(path, inputs, tmp_path):
    inp = str(tmp_path / "inputs.safetensors")
    outp = str(tmp_path / "outputs.safetensors")
    safetensors.torch.save_file({f"in{i}": t for i, t in enumerate(inputs)}, inp)
    r = subprocess.run([sys.executable, "-c", _CHILD, path, inp, outp], cwd=ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("OUT")][0]
    out = safetensors.torch.load_file(outp)
    return [out[f"out{i}"] for i in range(len(out))], line


def test_fresh_process_load_small(small, tmp_path):
    _, x, cm, path = small
    outs, line = _load_in_fresh_process(path, [x], tmp_path)
    assert _bit_equal(outs[0], cm(x))


def test_fresh_process_load_minilm_without_transformers(minilm, tmp_path):
    _, ids, mask, cm, path = minilm
    outs, line = _load_in_fresh_process(path, [ids, mask], tmp_path)
    # without the model's library the ModelOutput comes back as a dict of its fields
    assert line == "OUT dict []"
    for a, b in zip(_leaves(cm(ids, mask)), outs):
        assert _bit_equal(a, b)


# -- damaged and foreign files ----------------------------------------------------------
def _rewrite(path, out, section=None, edit=None, version=None):
    """Copy ``path`` to ``out`` with ``edit(json)`` applied to a JSON section, every
    checksum recomputed (a well-formed file with other content)."""
    header, secs = read_sections(path)
    blobs = {k: bytes(v) for k, v in secs.items()}
    if section:
        blobs[section] = json.dumps(edit(json.loads(blobs[section]))).encode()
    sections, off = [], 0
    for name in SECTIONS:
        sections.append({"name": name, "offset": off, "size": len(blobs[name]),
                         "sha256": hashlib.sha256(blobs[name]).hexdigest()})
        off += len(blobs[name])
    h = json.dumps({"sections": sections}).encode()
    with open(out, "wb") as f:
        f.write(_PREFIX.pack(b"OPENCANN", version or 1, len(h), hashlib.sha256(h).digest()) + h)
        for name in SECTIONS:
            f.write(blobs[name])
    return out


def _load_error(path) -> str:
    with pytest.raises(ModelFileError) as e:
        opencann.load(path)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 300
    return msg


@pytest.mark.parametrize("section", SECTIONS)
def test_flipped_byte_in_each_section(small, tmp_path, section):
    path = small[3]
    header, _ = read_sections(path)
    s = {s["name"]: s for s in header["sections"]}[section]
    data = bytearray(open(path, "rb").read())
    hlen = struct.unpack_from("<Q", data, 12)[0]
    data[_PREFIX.size + hlen + s["offset"] + s["size"] // 2] ^= 0x01
    bad = tmp_path / "bad.ocm"
    bad.write_bytes(bytes(data))
    assert f"section '{section}' checksum mismatch (file corrupted or modified)" in _load_error(str(bad))


def test_truncated_tampered_foreign(small, tmp_path):
    path = small[3]
    data = open(path, "rb").read()
    cases = {"trunc_end": data[:-100], "trunc_header": data[:60], "trunc_prefix": data[:20]}
    for name, blob in cases.items():
        (tmp_path / name).write_bytes(blob)
        assert "is truncated" in _load_error(str(tmp_path / name)) and "expected" in _load_error(str(tmp_path / name))
    tampered = bytearray(data)
    tampered[_PREFIX.size + 5] ^= 0x20  # a byte of the header JSON
    (tmp_path / "tampered").write_bytes(bytes(tampered))
    assert "header checksum mismatch" in _load_error(str(tmp_path / "tampered"))
    for name, blob in {"empty": b"", "zip": b"PK\x03\x04" + data[4:], "pickle": b"\x80\x04K\x01."}.items():
        (tmp_path / name).write_bytes(blob)
        assert "is not an opencann model file" in _load_error(str(tmp_path / name))
    with pytest.raises(FileNotFoundError):
        opencann.load(str(tmp_path / "missing.ocm"))


def test_bytes_after_the_last_section_are_refused(small, tmp_path, capsys):
    """Every writer ends a file with its last section: bytes after it (a damaged file, or
    another file appended) are one line, from opencann.load and opencann inspect alike;
    the file as written loads."""
    from helpers import run_cli
    m, x, cm, path = small
    data = open(path, "rb").read()
    for extra in (b"\0", b"\0" * 4096 + b"appended by another tool", data):
        bad = tmp_path / "appended.ocm"
        bad.write_bytes(data + extra)
        msg = _load_error(str(bad))
        assert msg == (f"appended.ocm has {len(extra)} bytes after its last section "
                       f"({len(data) + len(extra)} bytes, expected {len(data)}): the file is "
                       "damaged or something was appended to it (files concatenated?); save "
                       "it again"), msg
        rc, _, err = run_cli(["inspect", str(bad)], capsys)
        assert rc == 2 and len(err) == 1 and "bytes after its last section" in err[0], err
    torch.testing.assert_close(opencann.load(path)(x), cm(x), rtol=0, atol=0)


def test_newer_format_other_device_unknown_op(small, tmp_path):
    path = small[3]
    msg = _load_error(_rewrite(path, str(tmp_path / "v9.ocm"), version=9))
    assert "format version 9 is newer than this opencann supports (4): upgrade opencann" in msg

    def device(d):
        return lambda m: {**m, "device": d}
    msg = _load_error(_rewrite(path, str(tmp_path / "cuda.ocm"), "metadata", device("cuda:0")))
    assert "compiled for device 'cuda:0': this opencann has no such device" in msg
    msg = _load_error(_rewrite(path, str(tmp_path / "p.ocm"), "metadata", device("vnpu:ascend999")))
    assert "no vnpu preset 'ascend999'" in msg

    def new_op(g):
        g["nodes"][0]["op"] = "QuantumConv"
        return g
    msg = _load_error(_rewrite(path, str(tmp_path / "op.ocm"), "graph", new_op))
    assert "unknown op 'QuantumConv' in graph" in msg and "newer opencann" in msg

    def new_aten(g):
        g["nodes"][0]["meta"]["aten"] = {"$aten": "aten::warp_drive.default"}
        return g
    assert "unknown ATen operator aten::warp_drive.default" in _load_error(
        _rewrite(path, str(tmp_path / "aten.ocm"), "graph", new_aten))

    def no_field(m):
        del m["input_positions"]
        return m
    assert "missing or malformed field" in _load_error(
        _rewrite(path, str(tmp_path / "f.ocm"), "metadata", no_field))

    def garbage_nodes(g):
        g["nodes"][0]["outputs"] = "x"
        g["values"][0][2] = [1, 2]
        return g
    assert "missing or malformed field" in _load_error(
        _rewrite(path, str(tmp_path / "g.ocm"), "graph", garbage_nodes))


def test_file_holds_no_pickle(small):
    """Every section but the weights is JSON; the weights section is safetensors whose
    data is exactly the tensors' bytes (no room for anything else)."""
    path = small[3]
    header, secs = read_sections(path)
    for name in SECTIONS:
        if name != "constants":
            json.loads(bytes(secs[name]).decode("utf-8"))
    raw = bytes(secs["constants"])
    n = struct.unpack_from("<Q", raw)[0]
    st_header = json.loads(raw[8:8 + n])
    tensors = safetensors.torch.load(raw)
    assert len(raw) == 8 + n + sum(t.numel() * t.element_size() for t in tensors.values())
    assert set(st_header) - {"__metadata__"} == set(tensors)
    base = _PREFIX.size + len(json.dumps(header, separators=(",", ":")))
    data = open(path, "rb").read()
    covered = bytearray(len(data) - base)
    for s in header["sections"]:
        covered[s["offset"]:s["offset"] + s["size"]] = b"\1" * s["size"]
    gaps = [i for i, c in enumerate(covered) if not c]
    assert len(gaps) < 64 and all(data[base + i] == 0 for i in gaps)  # only alignment padding
    # weights are 64-byte aligned views of the one buffer read (as torch allocates them)
    assert all(c.const.data_ptr() % 64 == 0 for c in opencann.load(path).graph.constants)


def test_unsavable_meta_is_a_clear_error(tmp_path):
    m, x = _conv_bn_linear()
    cm = opencann.compile(m, (x,))
    cm.graph.nodes[0].meta["custom"] = object()
    with pytest.raises(ModelFileError, match=r"cannot save .*meta\['custom'\]"):
        opencann.save(cm, str(tmp_path / "x.ocm"))
    assert not os.listdir(tmp_path)  # nothing half-written


def test_constant_layouts_kept(tmp_path):
    """Transposed and expanded weights come back with their strides (same kernels,
    same bits) and expanded ones are not materialized in the file."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 32))
            self.b = nn.Parameter(torch.randn(1, 32))

        def forward(self, x):
            return x @ self.w.t().t() + self.b.expand(4, 32)

    m = M().eval()
    x = torch.randn(4, 16)
    cm = opencann.compile(m, (x,))
    path = str(tmp_path / "l.ocm")
    opencann.save(cm, path)
    lm = opencann.load(path)
    for a, b in zip(cm.graph.constants, lm.graph.constants):
        assert a.const.stride() == b.const.stride() and torch.equal(a.const, b.const)
    assert _bit_equal(lm(x), cm(x))


def test_cli_inspect(small, capsys):
    from opencann.cli import main
    path = small[3]
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    for s in ("format 3", "inputs:", "outputs:", "memory plan:", "sections:", "constants",
              "graph Sequential", "LinearAct"):
        assert s in out, s
    assert main(["inspect", path, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["metadata"]["device"] == "cpu" and [s["name"] for s in info["sections"]] == list(SECTIONS)
    bad = os.path.join(os.path.dirname(path), "not_a_model.ocm")
    open(bad, "wb").write(b"hello")
    assert main(["inspect", bad]) == 2
    assert "not an opencann model file" in capsys.readouterr().err
