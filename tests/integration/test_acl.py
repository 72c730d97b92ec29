"""`opencann.acl`, the AscendCL-style facade: pyACL's sample flow on a saved model gives
the compiled model's outputs bit for bit; misuse returns pyACL's error codes."""
import json
import logging

import numpy as np
import pytest
import torch

import opencann
import opencann.acl as acl
from opencann.acl import _state


@pytest.fixture(autouse=True)
def fresh_acl(monkeypatch):
    monkeypatch.delenv("OPENCANN_ACL_DEVICES", raising=False)
    if _state.initialized:
        acl.finalize()
    _state.finalized_once = False
    yield
    if _state.initialized:
        acl.finalize()
    _state.finalized_once = False


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return y, y.mean(dim=(2, 3))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    m = Net().eval()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    cm = opencann.compile(m, (x,))
    path = str(tmp_path_factory.mktemp("acl") / "net.ocm")
    opencann.save(cm, path)
    return cm, path


def run_sample(path, x: np.ndarray, async_=False):
    """The classic pyACL sample flow; returns the outputs as numpy arrays."""
    assert acl.init() == acl.ACL_SUCCESS
    assert acl.rt.set_device(0) == 0
    context, ret = acl.rt.create_context(0)
    assert ret == 0
    stream, ret = acl.rt.create_stream()
    assert ret == 0
    model_id, ret = acl.mdl.load_from_file(path)
    assert ret == 0
    desc = acl.mdl.create_desc()
    assert acl.mdl.get_desc(desc, model_id) == 0
    # inputs: device buffers filled from host
    in_ds = acl.mdl.create_dataset()
    in_ptrs = []
    for i in range(acl.mdl.get_num_inputs(desc)):
        size = acl.mdl.get_input_size_by_index(desc, i)
        assert size == x.nbytes
        dev, ret = acl.rt.malloc(size, acl.ACL_MEM_MALLOC_HUGE_FIRST)
        assert ret == 0
        assert acl.rt.memcpy(dev, size, acl.util.numpy_to_ptr(x), x.nbytes,
                             acl.ACL_MEMCPY_HOST_TO_DEVICE) == 0
        _, ret = acl.mdl.add_dataset_buffer(in_ds, acl.create_data_buffer(dev, size))
        assert ret == 0
        in_ptrs.append(dev)
    out_ds = acl.mdl.create_dataset()
    out_ptrs = []
    for i in range(acl.mdl.get_num_outputs(desc)):
        size = acl.mdl.get_output_size_by_index(desc, i)
        dev, ret = acl.rt.malloc(size, acl.ACL_MEM_MALLOC_HUGE_FIRST)
        assert ret == 0
        acl.mdl.add_dataset_buffer(out_ds, acl.create_data_buffer(dev, size))
        out_ptrs.append((dev, size))
    if async_:
        assert acl.mdl.execute_async(model_id, in_ds, out_ds, stream) == 0
        assert acl.rt.synchronize_stream(stream) == 0
    else:
        assert acl.mdl.execute(model_id, in_ds, out_ds) == 0
    outs = []
    for i, (dev, size) in enumerate(out_ptrs):
        dims, ret = acl.mdl.get_output_dims(desc, i)
        assert ret == 0 and dims["dimCount"] == len(dims["dims"])
        assert acl.mdl.get_output_data_type(desc, i) == acl.ACL_FLOAT
        host, ret = acl.rt.malloc_host(size)
        assert acl.rt.memcpy(host, size, dev, size, acl.ACL_MEMCPY_DEVICE_TO_HOST) == 0
        outs.append(acl.util.ptr_to_numpy(host, tuple(dims["dims"]), acl.util.NPY_FLOAT32).copy())
        assert acl.rt.free_host(host) == 0
    for ds in (in_ds, out_ds):
        for i in range(acl.mdl.get_dataset_num_buffers(ds)):
            assert acl.destroy_data_buffer(acl.mdl.get_dataset_buffer(ds, i)) == 0
        assert acl.mdl.destroy_dataset(ds) == 0
    for dev in in_ptrs + [p for p, _ in out_ptrs]:
        assert acl.rt.free(dev) == 0
    assert acl.mdl.destroy_desc(desc) == 0
    assert acl.mdl.unload(model_id) == 0
    assert acl.rt.destroy_stream(stream) == 0
    assert acl.rt.destroy_context(context) == 0
    assert acl.rt.reset_device(0) == 0
    assert acl.finalize() == 0
    return outs


@pytest.mark.parametrize("async_", [False, True])
def test_sample_flow_bit_for_bit(saved, async_):
    cm, path = saved
    for seed in (2, 3):   # a second call with other values
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed))
        x[0, 1, 2, 3] = float("nan")
        want = cm(x.clone())
        got = run_sample(path, x.numpy().copy(), async_=async_)
        assert len(got) == 2
        for g, w in zip(got, want):
            assert g.shape == tuple(w.shape)
            assert torch.equal(torch.from_numpy(g).isnan(), w.isnan())
            assert g.tobytes() == w.numpy().tobytes()   # bit for bit, NaN positions included


def _loaded(path):
    assert acl.init() == 0 and acl.rt.set_device(0) == 0
    mid, ret = acl.mdl.load_from_file(path)
    assert ret == 0
    desc = acl.mdl.create_desc()
    assert acl.mdl.get_desc(desc, mid) == 0
    return mid, desc


def _dataset(sizes):
    ds = acl.mdl.create_dataset()
    for s in sizes:
        p, ret = acl.rt.malloc(s, 0)
        assert ret == 0
        acl.mdl.add_dataset_buffer(ds, acl.create_data_buffer(p, s))
    return ds


def test_execute_misuse_codes(saved, caplog):
    _, path = saved
    mid, desc = _loaded(path)
    n_in = acl.mdl.get_input_size_by_index(desc, 0)
    outs = [acl.mdl.get_output_size_by_index(desc, i) for i in range(acl.mdl.get_num_outputs(desc))]
    good_in, good_out = _dataset([n_in]), _dataset(outs)
    with caplog.at_level(logging.ERROR, logger="opencann"):
        assert acl.mdl.execute(mid + 12345, good_in, good_out) == acl.ACL_ERROR_INVALID_MODEL_ID
        assert "not loaded" in caplog.text
        assert acl.mdl.execute(mid, _dataset([n_in - 4]), good_out) == \
            acl.ACL_ERROR_GE_EXEC_MODEL_DATA_SIZE_INVALID
        assert f"needs {n_in} bytes, its data buffer has {n_in - 4}" in caplog.text
        assert acl.mdl.execute(mid, good_in, _dataset([outs[0], outs[1] - 1])) == \
            acl.ACL_ERROR_GE_EXEC_MODEL_DATA_SIZE_INVALID
        assert acl.mdl.execute(mid, _dataset([]), good_out) == acl.ACL_ERROR_MODEL_INPUT_NOT_MATCH
        assert acl.mdl.execute(mid, good_in, _dataset(outs[:1])) == acl.ACL_ERROR_MODEL_OUTPUT_NOT_MATCH
        assert acl.mdl.execute(mid, good_in, good_out) == 0
        assert acl.mdl.unload(mid) == 0
        assert acl.mdl.unload(mid) == acl.ACL_ERROR_INVALID_MODEL_ID
        assert acl.mdl.execute(mid, good_in, good_out) == acl.ACL_ERROR_INVALID_MODEL_ID
        assert acl.mdl.get_num_inputs(desc) == 0     # the desc's model is gone


def test_a_zero_size_tensor_executes_from_an_empty_data_buffer(tmp_path):
    """A model with a zero-size input and output (ATC and opencann.compile take it)
    executes through acl with (0, 0) data buffers: a zero-size tensor needs no memory;
    a non-empty one still needs its bytes inside one allocation."""
    class M(torch.nn.Module):
        def forward(self, x, y):
            return torch.relu(x) * 2, y + 1
    path = str(tmp_path / "zero.ocm")
    opencann.save(opencann.compile(M().eval(), (torch.randn(0, 8), torch.randn(2))), path)
    mid, desc = _loaded(path)
    assert acl.mdl.get_input_size_by_index(desc, 0) == 0
    ins, outs = acl.mdl.create_dataset(), acl.mdl.create_dataset()
    y, ret = acl.rt.malloc(8, 0)
    yo, ret2 = acl.rt.malloc(8, 0)
    assert ret == ret2 == 0
    src = np.array([1.5, -2.0], np.float32)
    assert acl.rt.memcpy(y, 8, acl.util.numpy_to_ptr(src), 8, acl.ACL_MEMCPY_HOST_TO_DEVICE) == 0
    for ds, p in ((ins, y), (outs, yo)):
        acl.mdl.add_dataset_buffer(ds, acl.create_data_buffer(0, 0))
        acl.mdl.add_dataset_buffer(ds, acl.create_data_buffer(p, 8))
    assert acl.mdl.execute(mid, ins, outs) == 0
    host, _ = acl.rt.malloc_host(8)
    assert acl.rt.memcpy(host, 8, yo, 8, acl.ACL_MEMCPY_DEVICE_TO_HOST) == 0
    assert acl.util.ptr_to_numpy(host, (2,), np.float32).tolist() == [2.5, -1.0]
    bad = acl.mdl.create_dataset()
    acl.mdl.add_dataset_buffer(bad, acl.create_data_buffer(0, 0))
    acl.mdl.add_dataset_buffer(bad, acl.create_data_buffer(0, 8))   # 8 bytes at no allocation
    assert acl.mdl.execute(mid, bad, outs) == acl.ACL_ERROR_RT_PARAM_INVALID
    assert acl.mdl.unload(mid) == 0


def test_load_misuse_codes(saved, tmp_path):
    _, path = saved
    assert acl.mdl.load_from_file(path)[1] == acl.ACL_ERROR_UNINITIALIZE
    assert acl.init() == 0
    assert acl.mdl.load_from_file(path)[1] == acl.ACL_ERROR_RT_CONTEXT_NULL   # no set_device
    assert acl.rt.set_device(0) == 0
    assert acl.mdl.load_from_file(str(tmp_path / "missing.ocm"))[1] == acl.ACL_ERROR_INVALID_FILE
    bad = tmp_path / "bad.ocm"
    bad.write_bytes(b"not a model")
    assert acl.mdl.load_from_file(str(bad))[1] == acl.ACL_ERROR_DESERIALIZE_MODEL
    assert acl.mdl.get_desc(acl.mdl.create_desc(), 999) == acl.ACL_ERROR_INVALID_MODEL_ID


def test_init_finalize_device_and_memory_misuse(caplog):
    assert acl.finalize() == acl.ACL_ERROR_UNINITIALIZE
    assert acl.rt.set_device(0) == acl.ACL_ERROR_UNINITIALIZE
    assert acl.init() == 0
    assert acl.init() == acl.ACL_ERROR_REPEAT_INITIALIZE
    assert acl.rt.malloc(16, 0)[1] == acl.ACL_ERROR_RT_CONTEXT_NULL
    with caplog.at_level(logging.ERROR, logger="opencann"):
        assert acl.rt.set_device(7) == acl.ACL_ERROR_RT_INVALID_DEVICEID
        assert "device id 7 does not exist" in caplog.text
    assert acl.rt.create_context(-1)[1] == acl.ACL_ERROR_RT_INVALID_DEVICEID
    assert acl.rt.set_device(0) == 0
    p, ret = acl.rt.malloc(64, acl.ACL_MEM_MALLOC_NORMAL_ONLY)
    assert ret == 0
    assert acl.rt.malloc(0, 0)[1] == acl.ACL_ERROR_INVALID_PARAM
    assert acl.rt.malloc(16, 9)[1] == acl.ACL_ERROR_INVALID_PARAM
    h, _ = acl.rt.malloc_host(64)
    # memcpy: count beyond dest_max, beyond the allocation, wrong kind
    assert acl.rt.memcpy(p, 32, h, 64, acl.ACL_MEMCPY_HOST_TO_DEVICE) == acl.ACL_ERROR_INVALID_PARAM
    assert acl.rt.memcpy(p, 128, h, 128, acl.ACL_MEMCPY_HOST_TO_DEVICE) == acl.ACL_ERROR_RT_PARAM_INVALID
    assert acl.rt.memcpy(p, 64, h, 64, acl.ACL_MEMCPY_DEVICE_TO_HOST) == acl.ACL_ERROR_INVALID_PARAM
    # pointer arithmetic inside an allocation
    src = np.arange(16, dtype=np.uint8)
    assert acl.rt.memcpy(p + 8, 56, acl.util.numpy_to_ptr(src), 16, acl.ACL_MEMCPY_HOST_TO_DEVICE) == 0
    assert acl.util.ptr_to_bytes(p + 8, 16) == src.tobytes()
    assert acl.util.ptr_to_bytes(acl.util.bytes_to_ptr(b"abc"), 3) == b"abc"
    with caplog.at_level(logging.ERROR, logger="opencann"):
        assert acl.rt.free(p) == 0
        assert acl.rt.free(p) == acl.ACL_ERROR_INVALID_PARAM      # double free
        assert "freed twice" in caplog.text
    assert acl.rt.free(h) == acl.ACL_ERROR_INVALID_PARAM          # host memory via rt.free
    assert acl.rt.free_host(h) == 0
    assert acl.rt.memcpy(p, 64, h, 64, acl.ACL_MEMCPY_HOST_TO_DEVICE) == acl.ACL_ERROR_RT_PARAM_INVALID
    b = acl.create_data_buffer(p, 64)
    assert acl.destroy_data_buffer(b) == 0
    assert acl.destroy_data_buffer(b) == acl.ACL_ERROR_INVALID_PARAM
    s, _ = acl.rt.create_stream()
    assert acl.rt.destroy_stream(s) == 0 and acl.rt.destroy_stream(s) == acl.ACL_ERROR_INVALID_PARAM
    assert acl.finalize() == 0
    assert acl.finalize() == acl.ACL_ERROR_REPEAT_FINALIZE
    assert acl.init() == 0     # init again after finalize


def test_vnpu_hbm_accounting(tmp_path):
    cfg = tmp_path / "acl.json"
    cfg.write_text(json.dumps({"devices": ["vnpu:ascend310", "cpu"]}))
    assert acl.init(str(cfg)) == 0
    assert acl.rt.get_device_count() == (2, 0)
    assert acl.rt.set_device(2) == acl.ACL_ERROR_RT_INVALID_DEVICEID
    assert acl.rt.set_device(0) == 0
    free, total, ret = acl.rt.get_mem_info(0)
    from opencann.devices.vnpu.presets import get_preset
    assert ret == 0 and free == total == get_preset("ascend310").hbm_bytes
    assert acl.rt.malloc(total + 1, 0)[1] == acl.ACL_ERROR_RT_MEMORY_ALLOCATION
    p, ret = acl.rt.malloc(1 << 20, 0)
    assert ret == 0 and acl.rt.get_mem_info(0)[0] == total - (1 << 20)
    assert acl.rt.malloc(total - (1 << 20) + 1, 0)[1] == acl.ACL_ERROR_RT_MEMORY_ALLOCATION
    assert acl.rt.free(p) == 0 and acl.rt.get_mem_info(0)[0] == total
    assert acl.finalize() == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"devices": ["vnpu:nosuchchip"]}))
    assert acl.init(str(bad)) == acl.ACL_ERROR_INVALID_PARAM
    assert acl.init(str(tmp_path / "missing.json")) == acl.ACL_ERROR_INVALID_FILE


def test_loaded_model_counts_against_device_memory(saved, tmp_path, monkeypatch):
    cm, path = saved
    from opencann.acl.mdl import model_bytes
    need = model_bytes(cm)
    assert need >= 8 * 3 * 3 * 3 * 4        # at least the conv weight
    monkeypatch.setattr(_state, "device_capacity", lambda dev: need + 4096)  # a small device
    assert acl.init() == 0 and acl.rt.set_device(0) == 0
    free0 = acl.rt.get_mem_info(0)[0]
    mid, ret = acl.mdl.load_from_file(path)
    assert ret == 0 and acl.rt.get_mem_info(0)[0] == free0 - need
    p, ret = acl.rt.malloc(free0 - need, 0)                  # the rest of the device
    assert ret == 0
    assert acl.mdl.load_from_file(path)[1] == acl.ACL_ERROR_RT_MEMORY_ALLOCATION
    assert acl.rt.free(p) == 0 and acl.mdl.unload(mid) == 0
    assert acl.rt.get_mem_info(0)[0] == free0


def _put(t: torch.Tensor):
    t = t.contiguous()
    p, ret = acl.rt.malloc(max(t.numel() * t.element_size(), 1), 0)
    assert ret == 0
    host = t.numpy()
    assert acl.rt.memcpy(p, host.nbytes, acl.util.numpy_to_ptr(host), host.nbytes,
                         acl.ACL_MEMCPY_HOST_TO_DEVICE) == 0
    desc = acl.create_tensor_desc(acl.dtype_to_acl(t.dtype), list(t.shape), acl.ACL_FORMAT_ND)
    return desc, acl.create_data_buffer(p, host.nbytes), p


@pytest.mark.parametrize("op_type", ["Add", "Relu"])
def test_single_op_matches_torch(op_type):
    assert acl.init() == 0 and acl.rt.set_device(0) == 0
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    a[1, 1] = float("nan")
    ins = [a, b] if op_type == "Add" else [a]
    attr = acl.op.create_attr()
    if op_type == "Add":
        assert acl.op.set_attr_float(attr, "alpha", 0.5) == 0
    want = torch.add(a, b, alpha=0.5) if op_type == "Add" else torch.relu(a)
    in_d = [_put(t) for t in ins]
    out = _put(torch.zeros(3, 5))
    stream, _ = acl.rt.create_stream()
    ret = acl.op.execute_v2(op_type, [d for d, _, _ in in_d], [b for _, b, _ in in_d],
                            [out[0]], [out[1]], attr, stream)
    assert ret == 0 and acl.rt.synchronize_stream(stream) == 0
    got = acl.util.ptr_to_numpy(out[2], (3, 5), acl.util.NPY_FLOAT32)
    assert got.tobytes() == want.numpy().tobytes()
    # wrong output description, unknown op, too small an input buffer
    wrong = acl.create_tensor_desc(acl.ACL_FLOAT, [5, 3], acl.ACL_FORMAT_ND)
    assert acl.op.execute(op_type, [d for d, _, _ in in_d], [b for _, b, _ in in_d], [wrong],
                          [out[1]], attr, stream) == acl.ACL_ERROR_OP_OUTPUT_NOT_MATCH
    assert acl.op.execute("NoSuchOp", [], [], [], [], 0, stream) == acl.ACL_ERROR_OP_NOT_FOUND
    small = acl.create_data_buffer(in_d[0][2], 8)
    assert acl.op.execute(op_type, [in_d[0][0]], [small], [out[0]], [out[1]], 0, stream) == \
        acl.ACL_ERROR_OP_INPUT_NOT_MATCH


def test_example_runs_on_a_saved_model(saved, capsys):
    """examples/acl_resnet50.py's flow (on the small model, to stay fast)."""
    import importlib.util
    import pathlib
    p = pathlib.Path(__file__).resolve().parents[2] / "examples" / "acl_resnet50.py"
    spec = importlib.util.spec_from_file_location("acl_resnet50", p)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    cm, path = saved
    assert ex.main(["--model", path]) == 0
    assert "top-5: #" in capsys.readouterr().out
    x, outs = ex.run(path)
    want = cm(torch.from_numpy(x))
    assert [o.tobytes() for o in outs] == [w.numpy().tobytes() for w in want]
