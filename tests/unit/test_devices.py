"""`opencann.devices`: one parser of device strings, `Device` capabilities, cpu facts."""
import pytest
import torch

import opencann
from opencann.devices import DeviceError, parse_device
from opencann.devices import cpu as cpu_device
from opencann.devices.vnpu import PRESETS


def test_parse_cpu_and_vnpu():
    for s in ("cpu", "cpu:0"):
        d = parse_device(s)
        assert (d.kind, d.name, d.spec) == ("cpu", s, None)
        assert d.formats == ("ND", "NCHW") and d.memory_bytes > 0
    d = parse_device("vnpu")
    assert d.kind == "vnpu" and d.spec.name == "ascend910b" and str(d) == "vnpu"
    for name, spec in PRESETS.items():
        d = parse_device(f"vnpu:{name}")
        assert d.spec is spec and d.memory_bytes == spec.hbm_bytes
        assert "NC1HWC0" in d.formats and d.tile_buffer()[0] == spec.ub_bytes


@pytest.mark.parametrize("text,reason,match", [
    ("cuda", "kind", r"device 'cuda' is not supported by the compiler yet; use one of \['cpu', 'vnpu'\]"),
    ("cpu:1", "index", r"device 'cpu:1': the host is one device, 'cpu'"),
    ("vnpu:ascend999", "preset", r"unknown NPU preset 'ascend999'; known presets: ascend310, ascend910, "
                                 r"ascend910b"),
])
def test_bad_device_strings_say_what_to_write(text, reason, match):
    with pytest.raises(DeviceError, match=match) as e:
        parse_device(text)
    assert e.value.reason == reason and "\n" not in str(e.value)
    with pytest.raises(ValueError, match=match):      # the compiler's check is the same parser
        opencann.compile(torch.nn.ReLU(), (torch.ones(2),), device=text)


def test_kind_required_and_spec_files_not_read_without_load(tmp_path):
    with pytest.raises(DeviceError, match=r"'cpu' is not a vnpu device; use 'vnpu:<preset>'"):
        parse_device("cpu", kind="vnpu")
    missing = str(tmp_path / "chip.json")
    assert parse_device(f"vnpu:{missing}", load=False).spec is None
    with pytest.raises(FileNotFoundError, match="does not exist"):
        parse_device(f"vnpu:{missing}")


def test_cpu_facts():
    size, src = cpu_device.cpu_l2()
    assert size > 0 and src
    assert isinstance(cpu_device.isa(), str) and cpu_device.isa()
    assert isinstance(cpu_device.mkldnn_available(), bool)
    assert isinstance(cpu_device.mkl_packed_available(), bool)


def test_device_is_a_hashable_value_that_prints_as_its_string():
    import copy
    d = parse_device("vnpu:ascend910")
    assert str(d) == f"{d}" == "vnpu:ascend910"
    assert d == parse_device("vnpu:ascend910") == "vnpu:ascend910" and d != "vnpu:ascend310"
    assert {d: 1}["vnpu:ascend910"] == 1 and len({d, parse_device("vnpu:ascend910")}) == 1
    assert parse_device(d) is d and copy.deepcopy(d) is d
    with pytest.raises(DeviceError, match="is not a vnpu device"):
        parse_device(parse_device("cpu"), kind="vnpu")


def test_device_parsed_once_and_carried_by_context_nodes_and_model_files(tmp_path):
    """The compile entry parses the device string; PassContext, every node and a loaded
    model file carry `Device` objects, while the report and the file keep the string."""
    import json
    from helpers import save_and_load
    from opencann.devices import Device
    from opencann.passes import PassContext
    from opencann.report import CompileReport
    from opencann.engine.options import complete
    ctx = PassContext(options=complete({}), report=CompileReport(), device="vnpu:ascend310")
    assert isinstance(ctx.device, Device) and ctx.device_kind == "vnpu"
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
    x = torch.randn(1, 3, 8, 8)
    for name in ("cpu", "vnpu:ascend910b"):
        cm = opencann.compile(model, x, device=name)
        assert all(isinstance(n.device, Device) for n in cm.graph.nodes)
        assert cm.report.device == name and json.loads(cm.report.to_json())["device"] == name
        loaded, _ = save_and_load(cm, tmp_path, name.replace(':', '_') + '.ocm')
        assert [n.device for n in loaded.graph.nodes] == [n.device for n in cm.graph.nodes]
        assert all(isinstance(n.device, Device) for n in loaded.graph.nodes)
        torch.testing.assert_close(loaded(x), model(x))
    assert {n.device.kind for n in cm.graph.nodes} == {"vnpu"}
