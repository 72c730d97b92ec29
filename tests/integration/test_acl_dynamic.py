"""The ACL facade on models with gears, dynamic ranges and keyword inputs (pyACL's
dynamic-shape calls), and its memory helpers: results bit for bit those of the loaded
model, misuse an error code (never an exception), no memory kept for the caller."""
import gc

import numpy as np
import pytest
import torch

import opencann
import opencann.acl as acl
from helpers import fresh_acl_session
from opencann.acl import _state


@pytest.fixture(autouse=True)
def fresh_acl(monkeypatch):
    yield from fresh_acl_session(monkeypatch)


class Conv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        return y, y.mean(dim=(1, 2, 3))


class Pair(torch.nn.Module):
    """Two inputs sharing a dynamic dim; the second taken by keyword."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(6, 5)

    def forward(self, x, *, mask):
        return self.lin(x) * mask.unsqueeze(-1)


def _rand(*shape, seed=0):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    t.view(-1)[0] = float("nan")          # NaN positions are part of the result
    return t


def _load(tmp_path, cm, name="m.ocm"):
    path = str(tmp_path / name)
    opencann.save(cm, path)
    mid, ret = acl.mdl.load_from_file(path)
    assert ret == 0
    desc = acl.mdl.create_desc()
    assert acl.mdl.get_desc(desc, mid) == 0
    return mid, desc, opencann.load(path)


def _host_ptr(t: torch.Tensor):
    arr = np.ascontiguousarray(t.numpy())
    return arr, acl.util.numpy_to_ptr(arr)


def _dataset(sizes):
    ds, ptrs = acl.mdl.create_dataset(), []
    for size in sizes:
        dev, ret = acl.rt.malloc(size, acl.ACL_MEM_MALLOC_HUGE_FIRST)
        assert ret == 0
        acl.mdl.add_dataset_buffer(ds, acl.create_data_buffer(dev, size))
        ptrs.append(dev)
    return ds, ptrs


def _fill(dev, size, t):
    arr, ptr = _host_ptr(t)
    assert acl.rt.memcpy(dev, size, ptr, arr.nbytes, acl.ACL_MEMCPY_HOST_TO_DEVICE) == 0


def _read(dev, shape, dtype=np.float32):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    host, _ = acl.rt.malloc_host(n)
    assert acl.rt.memcpy(host, n, dev, n, acl.ACL_MEMCPY_DEVICE_TO_HOST) == 0
    out = acl.util.ptr_to_numpy(host, tuple(shape), dtype).copy()
    acl.rt.free_host(host)
    return torch.from_numpy(out)


def _same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_dynamic_batch_gears(tmp_path):
    cm = opencann.compile(Conv().eval(), (_rand(2, 3, 8, 8),), options={"dynamic_batch_size": [1, 2, 4]})
    mid, desc, loaded = _load(tmp_path, cm)
    n_in = acl.mdl.get_num_inputs(desc)
    assert n_in == 2                                    # x + the dynamic-index input
    idx, ret = acl.mdl.get_input_index_by_name(desc, acl.mdl.ACL_DYNAMIC_TENSOR_NAME)
    assert (idx, ret) == (1, 0)
    dims, ret = acl.mdl.get_input_dims(desc, 0)
    assert ret == 0 and dims["dims"] == [-1, 3, 8, 8]
    assert acl.mdl.get_dynamic_batch(desc) == ({"batchCount": 3, "batch": [1, 2, 4]}, 0)
    assert acl.mdl.get_dynamic_hw(desc, -1)[0]["hwCount"] == 0
    assert acl.mdl.get_input_size_by_index(desc, 0) == 4 * 3 * 8 * 8 * 4     # the largest gear
    assert acl.mdl.get_input_data_type(desc, idx) == acl.ACL_INT64
    in_sizes = [acl.mdl.get_input_size_by_index(desc, i) for i in range(n_in)]
    out_sizes = [acl.mdl.get_output_size_by_index(desc, i) for i in range(2)]
    ins, in_ptrs = _dataset(in_sizes)
    outs, out_ptrs = _dataset(out_sizes)
    # executing before a gear is chosen: an error code, no exception
    assert acl.mdl.execute(mid, ins, outs) != 0
    for batch in (4, 1, 2, 4):
        x = _rand(batch, 3, 8, 8, seed=batch)
        _fill(in_ptrs[0], in_sizes[0], x)
        assert acl.mdl.set_dynamic_batch_size(mid, ins, idx, batch) == 0
        assert acl.mdl.execute(mid, ins, outs) == 0
        want = loaded(x)
        cur, ret = acl.mdl.get_cur_output_dims(desc, 0)
        assert ret == 0 and cur["dims"] == list(want[0].shape)
        od = acl.mdl.get_dataset_tensor_desc(outs, 1)
        assert [acl.get_tensor_desc_dim_v2(od, i)[0] for i in range(acl.get_tensor_desc_num_dims(od))] \
            == list(want[1].shape)
        _same(_read(out_ptrs[0], want[0].shape), want[0])
        _same(_read(out_ptrs[1], want[1].shape), want[1])
        _same(want[0], cm(x)[0])
    # another gear, another setter, a wrong index: codes
    assert acl.mdl.set_dynamic_batch_size(mid, ins, idx, 3) == acl.ACL_ERROR_INVALID_PARAM
    assert acl.mdl.set_dynamic_hw_size(mid, ins, idx, 8, 8) == acl.ACL_ERROR_INVALID_PARAM
    assert acl.mdl.set_dynamic_batch_size(mid, ins, 0, 2) == acl.ACL_ERROR_INVALID_PARAM


def test_dynamic_image_size_gears(tmp_path):
    cm = opencann.compile(Conv().eval(), (_rand(1, 3, 8, 8),),
                          options={"dynamic_image_size": [[8, 8], [12, 16]]})
    mid, desc, loaded = _load(tmp_path, cm)
    assert acl.mdl.get_dynamic_hw(desc, -1) == ({"hwCount": 2, "hw": [[8, 8], [12, 16]]}, 0)
    assert acl.mdl.get_input_dims(desc, 0)[0]["dims"] == [1, 3, -1, -1]
    idx, _ = acl.mdl.get_input_index_by_name(desc, "ascend_mbatch_shape_data")
    ins, in_ptrs = _dataset([acl.mdl.get_input_size_by_index(desc, i) for i in range(2)])
    outs, out_ptrs = _dataset([acl.mdl.get_output_size_by_index(desc, i) for i in range(2)])
    for h, w in ((12, 16), (8, 8)):
        x = _rand(1, 3, h, w, seed=h)
        _fill(in_ptrs[0], acl.mdl.get_input_size_by_index(desc, 0), x)
        assert acl.mdl.set_dynamic_hw_size(mid, ins, idx, h, w) == 0
        assert acl.mdl.execute(mid, ins, outs) == 0
        want = loaded(x)
        _same(_read(out_ptrs[0], want[0].shape), want[0])
    assert acl.mdl.set_dynamic_hw_size(mid, ins, idx, 9, 9) == acl.ACL_ERROR_INVALID_PARAM


def test_dynamic_dims_gears_and_keyword_inputs(tmp_path):
    x, mask = _rand(2, 3, 6), _rand(2, 3, seed=1)
    cm = opencann.compile(Pair().eval(), (x,), example_kwargs={"mask": mask},
                          dynamic_shapes={"x": {1: "seq"}, "mask": {1: "seq"}},
                          options={"dynamic_dims": [[3], [5]]})
    mid, desc, loaded = _load(tmp_path, cm)
    count, ret = acl.mdl.get_input_dynamic_gear_count(desc, -1)
    assert (count, ret) == (2, 0)
    gears, ret = acl.mdl.get_input_dynamic_dims(desc, -1, count)
    assert ret == 0 and [g["dims"] for g in gears] == [[2, 3, 6, 2, 3], [2, 5, 6, 2, 5]]
    assert acl.mdl.get_input_dynamic_dims(desc, -1, 3)[1] == acl.ACL_ERROR_INVALID_PARAM
    names = [acl.mdl.get_input_name_by_index(desc, i) for i in range(acl.mdl.get_num_inputs(desc))]
    assert names[-1] == "ascend_mbatch_shape_data"
    idx = len(names) - 1
    sizes = [acl.mdl.get_input_size_by_index(desc, i) for i in range(len(names))]
    ins, in_ptrs = _dataset(sizes)
    outs, out_ptrs = _dataset([acl.mdl.get_output_size_by_index(desc, 0)])
    for seq in (5, 3):
        xs, ms = _rand(2, seq, 6, seed=seq), _rand(2, seq, seed=seq + 1)
        by_name = {"x": xs, "mask": ms}
        for i, n in enumerate(names[:-1]):
            _fill(in_ptrs[i], sizes[i], by_name[n])
        assert acl.mdl.set_input_dynamic_dims(mid, ins, idx, gears[seq == 5]) == 0
        assert acl.mdl.execute(mid, ins, outs) == 0
        want = loaded(xs, mask=ms)
        _same(_read(out_ptrs[0], want.shape), want)
    bad = {"name": "", "dimCount": 5, "dims": [2, 4, 6, 2, 4]}
    assert acl.mdl.set_input_dynamic_dims(mid, ins, idx, bad) == acl.ACL_ERROR_INVALID_PARAM
    bad = {"name": "", "dimCount": 5, "dims": [2, 3, 7, 2, 3]}       # a static dim differs
    assert acl.mdl.set_input_dynamic_dims(mid, ins, idx, bad) == acl.ACL_ERROR_INVALID_PARAM


def test_keyword_inputs_static_model(tmp_path):
    x, mask = _rand(2, 3, 6), _rand(2, 3, seed=1)
    cm = opencann.compile(Pair().eval(), (x,), example_kwargs={"mask": mask})
    mid, desc, loaded = _load(tmp_path, cm)
    names = [acl.mdl.get_input_name_by_index(desc, i) for i in range(acl.mdl.get_num_inputs(desc))]
    sizes = [acl.mdl.get_input_size_by_index(desc, i) for i in range(len(names))]
    ins, in_ptrs = _dataset(sizes)
    outs, out_ptrs = _dataset([acl.mdl.get_output_size_by_index(desc, 0)])
    for i, n in enumerate(names):
        _fill(in_ptrs[i], sizes[i], {"x": x, "mask": mask}[n])
    for _ in range(2):
        assert acl.mdl.execute(mid, ins, outs) == 0
        _same(_read(out_ptrs[0], (2, 3, 5)), loaded(x, mask=mask))


def test_dynamic_ranges_take_dataset_tensor_descs(tmp_path):
    cm = opencann.compile(Conv().eval(), (_rand(2, 3, 8, 8),),
                          dynamic_shapes={"x": {0: torch.export.Dim("b", min=2, max=6)}})
    mid, desc, loaded = _load(tmp_path, cm)
    assert acl.mdl.get_num_inputs(desc) == 1
    assert acl.mdl.get_input_dims(desc, 0)[0]["dims"] == [-1, 3, 8, 8]
    size = acl.mdl.get_input_size_by_index(desc, 0)
    assert size == 6 * 3 * 8 * 8 * 4                    # the range's top
    ins, in_ptrs = _dataset([size])
    outs, out_ptrs = _dataset([acl.mdl.get_output_size_by_index(desc, i) for i in range(2)])
    assert acl.mdl.execute(mid, ins, outs) == acl.ACL_ERROR_INVALID_PARAM     # shape not given
    for b in (3, 6):
        x = _rand(b, 3, 8, 8, seed=b)
        _fill(in_ptrs[0], size, x)
        td = acl.create_tensor_desc(acl.ACL_FLOAT, [b, 3, 8, 8], acl.ACL_FORMAT_NCHW)
        assert acl.mdl.set_dataset_tensor_desc(ins, td, 0) == 0
        assert acl.mdl.execute(mid, ins, outs) == 0
        want = loaded(x)
        _same(_read(out_ptrs[0], want[0].shape), want[0])
    td = acl.create_tensor_desc(acl.ACL_FLOAT, [7, 3, 8, 8], acl.ACL_FORMAT_NCHW)   # out of range
    acl.mdl.set_dataset_tensor_desc(ins, td, 0)
    assert acl.mdl.execute(mid, ins, outs) != 0


def test_numpy_to_ptr_keeps_no_array_alive():
    regions = len(_state.regions)
    for _ in range(50):
        arr = np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32)
        ptr = acl.util.numpy_to_ptr(arr)
        dev, _ = acl.rt.malloc(arr.nbytes, acl.ACL_MEM_MALLOC_HUGE_FIRST)
        assert acl.rt.memcpy(dev, arr.nbytes, ptr, arr.nbytes, acl.ACL_MEMCPY_HOST_TO_DEVICE) == 0
        back = _read(dev, arr.shape)
        _same(back, torch.from_numpy(arr))
        acl.rt.free(dev)
        del arr
    gc.collect()
    assert len(_state.regions) == regions          # every borrowed array's region went with it
    ro = np.frombuffer(bytes(range(16)), dtype=np.uint8)   # read-only: addressed through a copy
    ptr = acl.util.numpy_to_ptr(ro)
    assert acl.util.ptr_to_bytes(ptr, 16) == bytes(range(16))


def test_memory_calls_return_codes():
    dev, _ = acl.rt.malloc(64, acl.ACL_MEM_MALLOC_HUGE_FIRST)
    src = np.arange(64, dtype=np.uint8)
    assert acl.rt.memcpy(dev, 64, acl.util.numpy_to_ptr(src), 64, acl.ACL_MEMCPY_HOST_TO_DEVICE) == 0
    # overlapping ranges of one allocation: memmove semantics
    assert acl.rt.memcpy(dev + 8, 56, dev, 32, acl.ACL_MEMCPY_DEVICE_TO_DEVICE) == 0
    got = _read(dev, (64,), np.uint8).numpy()
    want = src.copy()
    want[8:40] = src[0:32]
    assert (got == want).all()
    assert acl.rt.memset(dev, 64, 256, 8) == acl.ACL_ERROR_INVALID_PARAM
    assert acl.rt.memset(dev, 64, -1, 8) == acl.ACL_ERROR_INVALID_PARAM
    assert acl.rt.memset(dev, 64, 7, 8) == 0
    assert (_read(dev, (8,), np.uint8).numpy() == 7).all()


def test_single_op_with_a_bad_attribute_returns_a_code():
    x = np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32)
    dev, _ = acl.rt.malloc(x.nbytes, acl.ACL_MEM_MALLOC_HUGE_FIRST)
    acl.rt.memcpy(dev, x.nbytes, acl.util.numpy_to_ptr(x), x.nbytes, acl.ACL_MEMCPY_HOST_TO_DEVICE)
    out, _ = acl.rt.malloc(64, acl.ACL_MEM_MALLOC_HUGE_FIRST)
    attr = acl.op.create_attr()
    acl.op.set_attr_list_int(attr, "dim", [7])
    ret = acl.op.execute_v2("ReduceSum", [acl.create_tensor_desc(acl.ACL_FLOAT, [2, 3])],
                            [acl.create_data_buffer(dev, x.nbytes)],
                            [acl.create_tensor_desc(acl.ACL_FLOAT, [2])],
                            [acl.create_data_buffer(out, 64)], attr, 0)
    assert ret == acl.ACL_ERROR_OP_ATTR_NOT_MATCH


def test_no_call_raises_for_a_bad_argument():
    """Every public pyACL call answers arguments of the wrong type with an error code (or
    its failure value), never an exception."""
    import inspect
    import itertools
    junk = [None, "x", -1, 1 << 62, 3.5, [7], {"dims": None}, True]
    raised = []
    for mod in (acl, acl.rt, acl.mdl, acl.op, acl.util):
        for name, fn in vars(mod).items():
            if (name.startswith("_") or not inspect.isfunction(fn) or name in ("init", "finalize")
                    or not getattr(fn, "__acl_guarded__", False)):
                continue
            n = len([p for p in inspect.signature(fn).parameters.values()
                     if p.default is inspect.Parameter.empty])
            for args in itertools.islice(itertools.product(junk, repeat=n), 40):
                try:
                    fn(*args)
                except Exception as e:  # noqa: BLE001 - collected and reported
                    raised.append(f"{mod.__name__}.{name}{args}: {type(e).__name__}")
                    break
    assert not raised, raised
    assert acl.finalize() == 0
    assert acl.init([7]) == acl.ACL_ERROR_INVALID_PARAM      # a config path of the wrong type


def test_gear_setters_and_tensor_descs_check_types_dims_and_dtypes(tmp_path):
    cm = opencann.compile(Conv().eval(), (_rand(2, 3, 8, 8),), options={"dynamic_batch_size": [1, 2, 4]})
    mid, desc, _ = _load(tmp_path, cm)
    ins, _ = _dataset([acl.mdl.get_input_size_by_index(desc, i) for i in range(2)])
    for bad in ("4", 2.0, True):
        assert acl.mdl.set_dynamic_batch_size(mid, ins, 1, bad) == acl.ACL_ERROR_INVALID_PARAM
    rng = opencann.compile(Conv().eval(), (_rand(2, 3, 8, 8),), dynamic_shapes={"x": {0: ("b", 2, 6)}})
    rid, rdesc, _ = _load(tmp_path, rng, "r.ocm")
    size = acl.mdl.get_input_size_by_index(rdesc, 0)
    rins, _ = _dataset([size])
    routs, _ = _dataset([acl.mdl.get_output_size_by_index(rdesc, i) for i in range(2)])
    for dtype, dims in ((acl.ACL_FLOAT, [2, 3, 8, 9]), (acl.ACL_FLOAT16, [2, 3, 8, 8])):
        acl.mdl.set_dataset_tensor_desc(rins, acl.create_tensor_desc(dtype, dims), 0)
        assert acl.mdl.execute(rid, rins, routs) == acl.ACL_ERROR_MODEL_INPUT_NOT_MATCH
    assert acl.mdl.destroy_dataset(rins) == 0
    assert acl.mdl.execute(rid, rins, routs) == acl.ACL_ERROR_INVALID_PARAM
