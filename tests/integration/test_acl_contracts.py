"""The ACL facade's contracts where features meet: a derived dynamic dim (``2 * Dim``)
bound through ``set_dataset_tensor_desc`` as the loaded model binds it, a str name per
input and output (a non-str name is an error code), host pointers into numpy views of one
buffer, and an internal fault reported as one (not as the caller's bad argument)."""
import gc
import logging

import numpy as np
import pytest
import torch
from torch.export import Dim

import opencann
import opencann.acl as acl
from helpers import fresh_acl_session
from opencann.acl import _state
from opencann.acl import model_shapes as ms


@pytest.fixture(autouse=True)
def fresh_acl(monkeypatch):
    yield from fresh_acl_session(monkeypatch)


class Halves(torch.nn.Module):
    def forward(self, x):
        h = x.shape[1] // 2
        return x[:, :h] + x[:, h:]


class HalfPlus(torch.nn.Module):
    """``x`` has twice ``y``'s columns (a derived dim shared with a plain one)."""

    def forward(self, x, y):
        return x[:, : y.shape[1]] * 2 + y


def _load(tmp_path, cm, name="m.ocm"):
    path = str(tmp_path / name)
    opencann.save(cm, path)
    mid, ret = acl.mdl.load_from_file(path)
    assert ret == 0
    desc = acl.mdl.create_desc()
    assert acl.mdl.get_desc(desc, mid) == 0
    return mid, desc, opencann.load(path)


def _dataset(arrays):
    ds = acl.mdl.create_dataset()
    for a in arrays:
        acl.mdl.add_dataset_buffer(ds, acl.create_data_buffer(acl.util.numpy_to_ptr(a), a.nbytes))
    return ds


def _rand(*shape, seed=0):
    a = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    a.reshape(-1)[0] = np.nan          # NaN positions are part of the result
    return a


def _shape(ds, index, dims):
    return acl.mdl.set_dataset_tensor_desc(ds, acl.create_tensor_desc(acl.ACL_FLOAT, dims), index)


def test_a_derived_dim_executes_as_the_loaded_model_binds_it(tmp_path):
    s = Dim("s", min=2, max=8)
    cm = opencann.compile(Halves(), (torch.randn(3, 10),), dynamic_shapes={"x": {1: 2 * s}})
    mid, desc, loaded = _load(tmp_path, cm)
    assert acl.mdl.get_input_dims(desc, 0)[0]["dims"] == [3, -1]
    assert acl.mdl.get_input_size_by_index(desc, 0) == 3 * 16 * 4       # 2 * s at s's top
    out = np.zeros((3, 8), np.float32)
    for n in (4, 12, 16):
        x = _rand(3, n, seed=n)
        ins, outs = _dataset([x]), _dataset([out])
        assert _shape(ins, 0, [3, n]) == 0
        assert acl.mdl.execute(mid, ins, outs) == acl.ACL_SUCCESS
        want = loaded(torch.from_numpy(x))
        got = torch.from_numpy(out.reshape(-1)[:want.numel()].reshape(want.shape).copy())
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(got, Halves()(torch.from_numpy(x)), equal_nan=True)
    for n in (11, 18):   # not 2 * s for any s; s = 9 outside [2, 8]
        x = np.zeros((3, n), np.float32)
        ins = _dataset([x])
        _shape(ins, 0, [3, n])
        assert acl.mdl.execute(mid, ins, _dataset([out])) == acl.ACL_ERROR_MODEL_INPUT_NOT_MATCH


def test_a_derived_dim_shared_with_a_plain_one_is_checked(tmp_path):
    s = Dim("s", min=2, max=8)
    cm = opencann.compile(HalfPlus(), (torch.randn(2, 8), torch.randn(2, 4)),
                          dynamic_shapes={"x": {1: 2 * s}, "y": {1: s}})
    mid, desc, loaded = _load(tmp_path, cm)
    x, y, out = _rand(2, 12, seed=1), _rand(2, 6, seed=2), np.zeros((2, 8), np.float32)
    ins = _dataset([x, y])
    assert _shape(ins, 0, [2, 12]) == 0 and _shape(ins, 1, [2, 6]) == 0
    assert acl.mdl.execute(mid, ins, _dataset([out])) == 0
    want = loaded(torch.from_numpy(x), torch.from_numpy(y))
    torch.testing.assert_close(torch.from_numpy(out.reshape(-1)[:12].reshape(2, 6).copy()), want,
                               rtol=0, atol=0, equal_nan=True)
    y5 = np.zeros((2, 5), np.float32)
    ins = _dataset([x, y5])
    _shape(ins, 0, [2, 12])
    _shape(ins, 1, [2, 5])                  # x's 12 columns say s = 6
    assert acl.mdl.execute(mid, ins, _dataset([out])) == acl.ACL_ERROR_MODEL_INPUT_NOT_MATCH


class TwoOut(torch.nn.Module):
    def forward(self, x):
        return x + 1, x * 2


class DictOut(torch.nn.Module):
    def forward(self, x, y):
        x.add_(1)                            # a mutated input and a literal take no name
        return {"sum": x + y, "n": 3, "diff": x - y}


def test_every_output_has_a_str_name_and_a_non_str_name_is_refused(tmp_path):
    _, desc, _ = _load(tmp_path, opencann.compile(TwoOut(), (torch.randn(2, 3),)))
    names = [acl.mdl.get_output_name_by_index(desc, i) for i in range(2)]
    assert names == ["output0", "output1"]
    assert acl.mdl.get_output_dims(desc, 1)[0]["name"] == "output1"
    assert acl.mdl.get_output_index_by_name(desc, "output1") == (1, 0)
    assert acl.mdl.get_input_name_by_index(desc, 0) == "x"
    for bad in (None, "nope", 0):
        assert acl.mdl.get_output_index_by_name(desc, bad) == (-1, acl.ACL_ERROR_INVALID_PARAM)
        assert acl.mdl.get_input_index_by_name(desc, bad) == (-1, acl.ACL_ERROR_INVALID_PARAM)
    cm = opencann.compile(DictOut(), (torch.randn(2, 3), torch.randn(2, 3)))
    _, desc, _ = _load(tmp_path, cm, "d.ocm")
    assert acl.mdl.get_num_outputs(desc) == 2
    assert [acl.mdl.get_output_name_by_index(desc, i) for i in range(2)] == ["sum", "diff"]
    from opencann.runtime import model_file
    meta = model_file.describe(str(tmp_path / "d.ocm"))["metadata"]
    assert [o["name"] for o in meta["outputs"]] == ["sum", "diff"]   # what inspect shows


def test_an_onnx_models_outputs_keep_their_graph_names(tmp_path):
    from onnx import TensorProto, helper
    vi = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3])  # noqa: E731
    g = helper.make_graph([helper.make_node("Sub", ["a", "b"], ["diff"]),
                           helper.make_node("Add", ["a", "b"], ["total"])], "two",
                          [vi("a"), vi("b")], [vi("total"), vi("diff")])
    cm = opencann.compile(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    mid, desc, _ = _load(tmp_path, cm)
    assert [acl.mdl.get_output_name_by_index(desc, i) for i in range(2)] == ["total", "diff"]
    assert acl.mdl.get_output_index_by_name(desc, "diff") == (1, 0)
    a, b = _rand(2, 3, seed=1), _rand(2, 3, seed=2)
    outs = [np.zeros((2, 3), np.float32) for _ in range(2)]
    assert acl.mdl.execute(mid, _dataset([a, b]), _dataset(outs)) == 0
    np.testing.assert_array_equal(outs[0], a + b)
    np.testing.assert_array_equal(outs[1], a - b)


def _regions():
    return sum(len(at) for at in _state.regions.values())


def _copy(dst, src, n):
    return acl.rt.memcpy(dst, n, src, n, acl.ACL_MEMCPY_HOST_TO_DEVICE)


def test_pointers_into_views_of_one_buffer_all_stay_valid():
    regions = _regions()
    images = np.arange(4 * 8, dtype=np.float32).reshape(4, 8)
    dev, _ = acl.rt.malloc(images.nbytes, acl.ACL_MEM_MALLOC_HUGE_FIRST)
    p_all = acl.util.numpy_to_ptr(images)
    p0 = acl.util.numpy_to_ptr(images[0])           # same address: must not shrink images
    assert p0 == p_all
    assert _copy(dev, p_all, images.nbytes) == 0
    gc.collect()                                     # the images[0] view is gone
    assert _copy(dev, p_all, images.nbytes) == 0
    row1 = images[1]
    p1 = acl.util.numpy_to_ptr(row1)
    assert p1 == p_all + 32
    assert _copy(dev, p_all + 32, 64) == 0           # rows 1-2 straddle the registered row
    got = acl.util.ptr_to_numpy(dev, (16,), acl.util.NPY_FLOAT32)
    np.testing.assert_array_equal(got, images[1:3].reshape(-1))
    # writes through a view's pointer land in the parent
    src = np.full(8, -1.0, np.float32)
    assert acl.rt.memcpy(p1, 32, acl.util.numpy_to_ptr(src), 32, acl.ACL_MEMCPY_HOST_TO_HOST) == 0
    assert (images[1] == -1).all()
    # a view registered first, then the whole array
    other = np.arange(16, dtype=np.float32).reshape(2, 8)
    acl.util.numpy_to_ptr(other[1])
    assert _copy(dev, acl.util.numpy_to_ptr(other), other.nbytes) == 0
    # the buffer lives while a view of it does: the view's pointer too
    del images
    gc.collect()
    assert _copy(dev, p1, 32) == 0
    np.testing.assert_array_equal(acl.util.ptr_to_numpy(dev, (8,), acl.util.NPY_FLOAT32), row1)
    # an array inside an acl allocation registers nothing
    arr = acl.util.ptr_to_numpy(dev, (2, 4), acl.util.NPY_FLOAT32)
    before = _regions()
    assert acl.util.numpy_to_ptr(arr[1]) == dev + 16
    assert _regions() == before
    del row1, other, src, arr
    gc.collect()
    acl.rt.free(dev)
    assert _regions() == regions     # every borrowed buffer's region went


def test_an_internal_fault_is_reported_as_one(tmp_path, monkeypatch, caplog):
    mid, desc, _ = _load(tmp_path, opencann.compile(TwoOut(), (torch.randn(2, 3),)))
    x = _rand(2, 3)
    outs = _dataset([np.zeros((2, 3), np.float32) for _ in range(2)])

    def broken(self, *a, **k):
        raise KeyError("an internal table lacks an entry")
    monkeypatch.setattr(ms.ModelShapes, "nbytes", broken)
    with caplog.at_level(logging.ERROR, logger="opencann"):
        assert acl.mdl.execute(mid, _dataset([x]), outs) == acl.ACL_ERROR_INTERNAL_ERROR
        assert acl.mdl.get_input_size_by_index(desc, 0) == 0
        assert acl.mdl.execute([mid], None, None) == acl.ACL_ERROR_INVALID_PARAM   # the caller's
    text = caplog.text
    assert "acl.mdl.execute failed: internal error (KeyError" in text and "fault of opencann" in text
    assert "acl.mdl.execute failed: bad argument" in text


def test_read_only_views_of_one_buffer_are_copies_that_do_not_shadow_each_other():
    data = np.frombuffer(bytes(range(64)), dtype=np.uint8).reshape(4, 16)   # read-only
    dev, _ = acl.rt.malloc(64, acl.ACL_MEM_MALLOC_HUGE_FIRST)
    p_all = acl.util.numpy_to_ptr(data)
    assert acl.util.numpy_to_ptr(data[0]) == p_all            # a copy of the row only
    assert acl.util.numpy_to_ptr(data[1]) == p_all + 16
    assert _copy(dev, p_all, 64) == 0 and _copy(dev, p_all + 16, 32) == 0
    np.testing.assert_array_equal(acl.util.ptr_to_numpy(dev, (32,), acl.util.NPY_UINT8),
                                  data[1:3].reshape(-1))
