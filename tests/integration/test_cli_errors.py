"""Command-line mistakes get one line on stderr naming the problem and the fix, and exit
code 2 (issue #9): no traceback, no silent success."""
import pytest
import torch

from opencann import cli

FACTORIES = '''
import torch

def lam():
    return (lambda x: x * 2), (torch.randn(2),)

def wrong_shape():
    return torch.nn.Linear(4, 4), (torch.randn(2, 5),)

def ok():
    return torch.nn.Linear(4, 4), (torch.randn(2, 4),)

def boom():
    raise RuntimeError("no weights here")
'''


def _run(argv, capsys):
    """(exit code, the stderr lines) of ``opencann argv``, run in-process."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return rc, err


def _one_error(argv, capsys, *needles):
    rc, err = _run(argv, capsys)
    assert rc == 2, (rc, err)
    assert len(err) == 1, err
    for n in needles:
        assert n in err[0], err[0]
    return err[0]


@pytest.fixture
def factories(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "f.py").write_text(FACTORIES)
    (tmp_path / "syn.py").write_text("def f(:\n    pass\n")
    (tmp_path / "d").mkdir()
    return tmp_path


def test_output_paths_and_counts(factories, capsys):
    _one_error(["compile", "f.py:ok", "--report", "d"], capsys, "--report", "d is a directory")
    _one_error(["compile", "f.py:ok", "--dot", "nowhere/g.dot"], capsys,
               "directory nowhere does not exist")
    _one_error(["bench", "f.py:ok", "--runs", "0"], capsys, "--runs", "at least 1, got 0")
    _one_error(["compile", "f.py:ok", "--batch", "two"], capsys, "--batch", "'two'")
    # an argument the subcommand does not take points at that subcommand's help
    _one_error(["compare", "f.py:ok", "--tol", "3"], capsys, "unrecognized arguments: --tol 3",
               "see opencann compare -h")


def test_factory_files(factories, capsys):
    _one_error(["compile", "syn.py:f"], capsys, "syn.py:1: syntax error")
    _one_error(["compile", "f.py:lam"], capsys, "must return (model, example_inputs)",
               "a function", "wrap the function in a torch.nn.Module")
    _one_error(["compile", "f.py:boom"], capsys, "boom() raised RuntimeError: no weights here",
               "f.py:14")
    _one_error(["compile", "f.py:nope"], capsys, "has no function 'nope'")
    _one_error(["compile", "d:f"], capsys)
    _one_error(["compile", "f.py:wrong_shape"], capsys, "float32[2, 5]", "eager",
               "mat1 and mat2 shapes cannot be multiplied")
    _one_error(["compile", "f.py:ok", "--options", "{bad"], capsys, "--options is not valid JSON")
    for cmd in ("compile", "compare"):   # valid JSON that is not an object: one line, exit 2
        for text in ("[1]", "5", '"cse"'):
            _one_error([cmd, "f.py:ok", "--options", text], capsys,
                       "--options must be a JSON object", text)


def test_seq_beyond_the_model_positions(capsys):
    _one_error(["compile", "gpt2", "--seq", "2000"], capsys, "seq 2000", "1024 positions",
               "--seq 1024")


def test_spec_files(tmp_path, capsys):
    (tmp_path / "spec.toml").mkdir()
    _one_error(["estimate", "--model", "resnet50", "--device", f"vnpu:{tmp_path / 'spec.toml'}"],
               capsys, "is a directory")
    bad = tmp_path / "latin1.toml"
    bad.write_bytes('name = "café"\n'.encode("latin-1"))
    _one_error(["estimate", "--model", "resnet50", "--device", f"vnpu:{bad}"], capsys,
               str(bad), "not UTF-8")
    tiny = tmp_path / "tiny.toml"
    tiny.write_text('base = "ascend910b"\nname = "x"\nclock_ghz = 1e-300\n')
    _one_error(["estimate", "--model", "resnet50", "--device", f"vnpu:{tiny}"], capsys,
               "'clock_ghz'", "plausible range")


def test_estimate_of_a_huge_batch_needs_no_host_memory():
    """Inputs are fake tensors: a batch whose input alone is 256 GB is costed, and the
    plan is refused with the HBM message (not a host allocation failure)."""
    from opencann.tools.estimate import estimate
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).eval()
    with pytest.raises(ValueError, match="needs .* GiB on ascend910b but it has 64.00 GiB"):
        estimate(m, torch.randn(2, 64), batch=10 ** 9)


def test_flash_attention_names_a_bad_scale():
    from opencann.ops import flash_attention
    q = torch.randn(1, 1, 4, 8)
    for bad in ("big", float("nan"), None.__class__):
        with pytest.raises(ValueError, match="scale=.*finite number"):
            flash_attention(q, q, q, scale=bad)
    torch.testing.assert_close(flash_attention(q, q, q, scale=0.5),
                               torch.nn.functional.scaled_dot_product_attention(q, q, q, scale=0.5),
                               atol=1e-5, rtol=1e-5)


@pytest.fixture
def onnx_files(tmp_path, monkeypatch):
    """m.onnx (static [2, 4] input; Relu and Sign outputs) and dyn.onnx (symbolic batch)."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper
    monkeypatch.chdir(tmp_path)

    def save(name, dims):
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
        outs = [helper.make_tensor_value_info(y, TensorProto.FLOAT, dims) for y in ("y", "z")]
        nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Sign", ["x"], ["z"])]
        g = helper.make_graph(nodes, "g", [x], outs)
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), name)
    save("m.onnx", [2, 4])
    save("dyn.onnx", ["n", 4])
    return tmp_path


def test_onnx_files_compile_and_run(onnx_files, capsys):
    """``opencann compile|run|estimate m.onnx`` (inputs from the model's static shapes; run
    compares with ONNX Runtime when installed); symbolic dims, a dtype for estimate: one
    line each."""
    assert cli.main(["compile", "m.onnx"]) == 0
    assert cli.main(["run", "m.onnx", "--trace", "t.json"]) == 0
    out = capsys.readouterr().out
    assert "ran m.onnx on cpu, random inputs x float32[2,4]" in out and (onnx_files / "t.json").exists()
    if "onnxruntime" in out:
        assert "max |compiled - onnxruntime| = 0.00e+00" in out
    _one_error(["compile", "dyn.onnx"], capsys, "input x has symbolic dims", "static shapes",
               "input_shapes=", "--input-shape x:1,4")
    _one_error(["run", "missing.onnx"], capsys, "missing.onnx: no such ONNX file")
    assert cli.main(["estimate", "--model", "m.onnx"]) == 0   # the file's shapes and dtypes
    assert "opencann estimate: m.onnx on vnpu:ascend910b" in capsys.readouterr().out
    _one_error(["estimate", "--model", "m.onnx", "--dtype", "float16"], capsys,
               "an ONNX model is estimated as its file gives it")


def test_python_dash_m_opencann_is_the_command_line():
    """``python -m opencann`` runs the same command line (and its one-line errors)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(cli.__file__)))
    r = subprocess.run([sys.executable, "-m", "opencann", "compile", "no_such.onnx"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "usage: opencann" in subprocess.run([sys.executable, "-m", "opencann", "--help"],
                                               capture_output=True, text=True, env=env).stdout
