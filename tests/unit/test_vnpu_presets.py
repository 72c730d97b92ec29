"""NpuSpec presets carry sources; load_spec reads JSON/TOML and explains mistakes."""

import json

import pytest

from opencann.devices.vnpu.presets import FIELD_DOCS, PRESETS, ascend910, ascend910b, get_preset, load_spec


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_number_has_a_source(name):
    spec = PRESETS[name]
    for f in FIELD_DOCS:
        if f == "name":
            continue
        src = spec.sources.get(f, "")
        assert src, f"{name}.{f} has no source"
        assert src.startswith("estimate:") or "[" in src, f"{name}.{f}: cite a source or mark as estimate"
    text = spec.describe()
    assert "ub_bytes" in text and "peak fp16 Cube" in text


def test_derived_peaks_follow_the_cube_shape():
    # 16x16x16 fp16 MACs = 8192 FLOP/cycle/core
    assert ascend910b.cube_flops_per_cycle == 8192
    assert ascend910b.peak_cube_tflops(2) == pytest.approx(24 * 8192 * 1.8e9 / 1e12)
    assert ascend910b.peak_cube_tflops(1) == pytest.approx(2 * ascend910b.peak_cube_tflops(2))
    assert ascend910b.aiv_per_aic == 2 and ascend910.aiv_per_aic == 1
    # Ascend 910: ~256 TFLOPS fp16 (Hot Chips 31)
    assert ascend910.peak_cube_tflops(2) == pytest.approx(256, rel=0.05)


def test_load_json_and_toml(tmp_path):
    data = {k: getattr(ascend910b, k) for k in FIELD_DOCS}
    data["name"] = "mychip"
    data["cube_cores"] = 20
    data["vector_cores"] = 40
    p = tmp_path / "chip.json"
    p.write_text(json.dumps(data))
    spec = load_spec(p)
    assert spec.cube_cores == 20 and spec.name == "mychip"
    assert spec.sources["cube_cores"].startswith("user spec file")
    t = tmp_path / "chip.toml"
    t.write_text('base = "ascend910b"\nname = "b3"\ncube_cores = 20\nvector_cores = 40\n'
                 '[sources]\ncube_cores = "Ascend910B3.ini ai_core_cnt=20"\n')
    spec = load_spec(t)
    assert spec.cube_cores == 20 and spec.ub_bytes == ascend910b.ub_bytes
    assert spec.sources["cube_cores"] == "Ascend910B3.ini ai_core_cnt=20"
    assert spec.sources["ub_bytes"] == ascend910b.sources["ub_bytes"]


@pytest.mark.parametrize("body,match", [
    ('base = "ascend910b"\nname = "x"\ncube_cors = 3\n', "unknown key 'cube_cors'"),
    ('name = "x"\ncube_cores = 3\n', "missing key"),
    ('base = "ascend910b"\nname = "x"\nclock_ghz = 0\n', "'clock_ghz'.*positive"),
    ('base = "ascend910b"\nname = "x"\nub_bytes = -5\n', "'ub_bytes'.*positive"),
    ('base = "ascend910b"\nname = "x"\nub_bytes = "big"\n', "'ub_bytes'.*number"),
    ('base = "ascend999"\nname = "x"\n', "unknown NPU preset"),
    ('name = = 3', "cannot parse"),
])
def test_load_errors_name_key_and_fix(tmp_path, body, match):
    p = tmp_path / "bad.toml"
    p.write_text(body)
    with pytest.raises(ValueError, match=match):
        load_spec(p)


def test_load_missing_file_and_suffix(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_spec(tmp_path / "nope.json")
    p = tmp_path / "chip.yaml"
    p.write_text("x: 1")
    with pytest.raises(ValueError, match=".json or .toml"):
        load_spec(p)


def test_get_preset_and_replace():
    assert get_preset("Ascend910B") is ascend910b
    s = ascend910b.replace(cube_cores=20, vector_cores=40)
    assert s.cube_cores == 20 and s.sources["cube_cores"] == "user override"
    with pytest.raises(ValueError, match="positive"):
        ascend910b.replace(hbm_gbps=-1.0)
