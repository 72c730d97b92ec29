"""The eager-parity probe cache (`opencann.ops.parity.cache`): a second process reads the
first one's answers instead of probing; a corrupt or unwritable cache is ignored; another
torch version or CPU-flag set is another key (a miss)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from opencann.ops import parity
from opencann.ops.parity import cache
from opencann.ops.parity.probe import Probe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# a second process: asks three real probes, prints their answers and how many probes ran
SCRIPT = """
import json, torch
from opencann.ops import parity
got = [parity.special_values_differ("gelu", torch.float32),
       parity.special_values_differ("silu", torch.bfloat16),
       parity.conv_post_op_differs("relu", torch.float32, "channels_last")]
print(json.dumps({"answers": got, "runs": sum(parity.RUNS.values())}))
"""


def _process(cache_dir):
    env = dict(os.environ, OPENCANN_CACHE_DIR=str(cache_dir), PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_reads_the_answers_and_runs_no_probe(tmp_path):
    first = _process(tmp_path)
    assert first["runs"] == 3
    second = _process(tmp_path)
    assert second == {"answers": first["answers"], "runs": 0}
    files = os.listdir(tmp_path / "parity")
    assert len(files) == 1 and files[0].endswith(".json")        # no temporary file left


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """A probe that counts its runs (answers "differs at x" for x < 0), with an empty
    cache directory and nothing in memory."""
    monkeypatch.setenv("OPENCANN_CACHE_DIR", str(tmp_path))
    parity.clear_memory()
    runs = []

    def run(x):
        runs.append(x)
        return f"differs at {x}" if x < 0 else None
    yield Probe("test-counted", guards="nothing (a test)", kernel="none", inputs="an int",
                run=run), runs
    parity.clear_memory()


def _again(probe, *args):
    """Ask ``probe`` as a new process would: nothing in memory, only the disk."""
    parity.clear_memory()
    return probe(*args)


def test_answers_are_kept_in_memory_and_on_disk(counted):
    probe, runs = counted
    assert probe(-1) == "differs at -1" and probe(2) is None
    assert probe(-1) == "differs at -1" and runs == [-1, 2]      # memory
    assert _again(probe, -1) == "differs at -1" and _again(probe, 2) is None
    assert runs == [-1, 2]                                        # disk
    with open(cache.cache_file()) as f:
        data = json.load(f)
    assert data["key"] == cache.machine_key()
    assert data["results"] == {probe.entry((-1,)): "differs at -1", probe.entry((2,)): None}


@pytest.mark.parametrize("garbage", ['{"format": 1, "key": ', "[1, 2]", '{"format": 1}',
                                     b"\xff\xfe\x00"])
def test_a_corrupt_cache_file_is_ignored_and_rewritten(counted, garbage):
    probe, runs = counted
    path = cache.cache_file()
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(garbage if isinstance(garbage, bytes) else garbage.encode())
    assert probe(-3) == "differs at -3" and runs == [-3]
    assert _again(probe, -3) == "differs at -3" and runs == [-3]  # the file was rewritten


def test_a_file_whose_results_are_not_answers_is_ignored(counted):
    probe, runs = counted
    path = cache.cache_file()
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        json.dump({"format": 1, "key": cache.machine_key(), "results": {probe.entry((5,)): 7}}, f)
    assert probe(5) is None and runs == [5]


def test_an_unwritable_cache_is_ignored(counted, tmp_path, monkeypatch):
    probe, runs = counted
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("OPENCANN_CACHE_DIR", str(blocker))
    assert probe(-4) == "differs at -4" and probe(-4) == "differs at -4" and runs == [-4]
    assert _again(probe, -4) == "differs at -4" and runs == [-4, -4]   # nothing on disk


def test_another_torch_version_or_cpu_flags_is_a_miss(counted, monkeypatch):
    probe, runs = counted
    probe(-1)
    mine, version = cache.cache_file(), torch.__version__
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert cache.cache_file() != mine
    assert _again(probe, -1) == "differs at -1" and runs == [-1, -1]
    monkeypatch.setattr(torch, "__version__", version)
    flags = cache.cpu_flags()
    monkeypatch.setattr(cache, "cpu_flags", lambda: flags[:-1] + ("avx512_other",))
    assert _again(probe, -1) == "differs at -1" and runs == [-1, -1, -1]
    monkeypatch.setattr(cache, "cpu_flags", lambda: flags)
    assert _again(probe, -1) == "differs at -1" and runs == [-1, -1, -1]   # back: a hit


def test_a_file_written_for_another_key_is_not_read(counted, monkeypatch):
    probe, runs = counted
    probe(-2)
    other = dict(cache.machine_key(), torch="0.0.1")
    with open(cache.cache_file()) as f:
        data = json.load(f)
    data["key"] = other                       # e.g. a file copied from another machine
    with open(cache.cache_file(), "w") as f:
        json.dump(data, f)
    assert _again(probe, -2) == "differs at -2" and runs == [-2, -2]


def test_the_isa_override_is_part_of_the_key(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    plain = cache.cache_file()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cache.cache_file() != plain


def test_cache_dir_follows_the_override_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENCANN_CACHE_DIR", str(tmp_path / "x"))
    assert cache.cache_dir() == str(tmp_path / "x")
    monkeypatch.delenv("OPENCANN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    try:
        import platformdirs  # noqa: F401
    except ImportError:
        assert cache.cache_dir() == str(tmp_path / "xdg" / "opencann")
    else:
        assert cache.cache_dir() == platformdirs.user_cache_dir("opencann")


def test_every_probe_is_declared_with_what_it_guards():
    assert set(parity.FORMULAS) | {"layout", "conv_post_op", "conv_sum"} <= set(parity.PROBES)
    for p in parity.PROBES.values():
        assert p.guards and p.kernel and p.inputs, p.name


def test_doctor_reports_the_cache_and_warns_when_it_cannot_be_written(counted, tmp_path,
                                                                        monkeypatch):
    from opencann.tools.doctor import _parity_check
    probe, _ = counted
    probe(-1)
    check = _parity_check()
    assert check.status == "ok" and check.value.startswith("1 probe answers for this CPU")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("OPENCANN_CACHE_DIR", str(blocker / "sub"))
    check = _parity_check()
    assert check.status == "warning" and "OPENCANN_CACHE_DIR" in check.advice
