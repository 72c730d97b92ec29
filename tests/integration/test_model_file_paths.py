"""What `opencann.save`, `opencann.load` and `opencann atc --output` accept: only
`opencann.compile` results are saved (one TypeError line otherwise), a directory is not a
model file (one line), and ``atc --output dir/`` names the file in it after the model."""
import os

import pytest
import torch

import opencann
from opencann import cli


def _lin():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU()).eval()


@pytest.mark.parametrize("what", ["module", "torch.compile", "exported", "none"])
def test_save_refuses_what_opencann_compile_did_not_make(what, tmp_path):
    m = _lin()
    obj = {"module": m, "torch.compile": torch.compile(m, backend="opencann"),
           "exported": torch.export.export(m, (torch.randn(2, 4),)), "none": None}[what]
    with pytest.raises(TypeError, match=r"opencann\.save takes what opencann\.compile returns") as e:
        opencann.save(obj, str(tmp_path / "m.ocm"))
    assert "\n" not in str(e.value)
    assert not os.listdir(tmp_path)          # nothing half-written


def test_load_of_a_directory_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="is a directory, not a model file") as e:
        opencann.load(str(tmp_path))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("spelling", ["out/", "out"])
def test_atc_output_directory_names_the_file_after_the_model(spelling, tmp_path, monkeypatch, capsys):
    (tmp_path / "lin.py").write_text(
        "import torch\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU()).eval(), "
        "(torch.randn(2, 4),)\n")
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["atc", "--model", "lin.py:make", "--framework", "pytorch", "--output", spelling])
    assert rc == 0, capsys.readouterr().err
    assert sorted(os.listdir(tmp_path / "out")) == ["lin.ocm"]
    x = torch.randn(2, 4)
    x[0, 0] = float("nan")
    with torch.no_grad():
        torch.testing.assert_close(opencann.load("out/lin.ocm")(x), _lin()(x), equal_nan=True)


@pytest.mark.parametrize("bad", ["dir", None])
def test_save_to_a_directory_or_none_is_one_line_and_leaves_nothing(bad, tmp_path):
    cm = opencann.compile(_lin(), (torch.randn(2, 4),))
    path = str(tmp_path) if bad == "dir" else None
    with pytest.raises((ValueError, TypeError)) as e:
        opencann.save(cm, path)
    assert "\n" not in str(e.value)
    assert os.listdir(tmp_path) == []
