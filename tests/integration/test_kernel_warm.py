"""``opencann warm`` and ``opencann.warm()`` (`opencann.tools.numba_warm`): the numba kernel
signatures shipped with the package compiled into an empty cache ahead of time, found
cached by a second run, bad lines and stale entries skipped with their reasons, an
unwritable cache one error line, the doctor's row, and the signatures file shipped by a
built wheel. A tiny subset (2 functions, 4 signatures, ~1 s of compiling) keeps each run
to the worker's start-up."""
import importlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile
from importlib import resources

import pytest

from helpers import run_cli
from opencann.tools import doctor, numba_warm

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = ["add_rms_norm_cpu._add_sum_squares", "relu_numba._relu_bits_serial"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty kernel cache for this test: ``OPENCANN_CACHE_DIR`` in ``tmp_path``. The
    tiny subset's modules are imported first, under the suite's cache, so this process's
    kernels keep caching there (a module's cache directory is fixed when it is imported)."""
    for qualname in TINY:
        importlib.import_module("opencann.ops.kernels." + qualname.split(".")[0])
    monkeypatch.setenv("OPENCANN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    return tmp_path / "cache" / "numba"


def _tiny_lines():
    return [ln for ln in pathlib.Path(numba_warm.signatures_path()).read_text().splitlines()
            if any(t in ln for t in TINY)]


BAD_LINES = ["not a signature line",
             "zero\topencann.ops.kernels.relu_numba._relu_bits_serial\t(int64,)",
             "0.1\topencann.ops.kernels.relu_numba.no_such_kernel\t(int64,)",
             "0.1\topencann.ops.kernels.relu_numba._relu_bits_serial\t(NoSuchType,)"]


def test_warm_fills_an_empty_cache_skips_bad_lines_and_a_second_run_finds_it_cached(cache, tmp_path):
    sigs = tmp_path / "sigs.tsv"
    sigs.write_text("\n".join(BAD_LINES + _tiny_lines()) + "\n")
    seen = []
    r = numba_warm.warm(path=str(sigs), processes=2, progress=lambda d, t, f: seen.append((d, t)))
    assert (r.total, r.compiled, r.cached, r.failed, r.ok) == (8, 4, 0, [], True)
    assert r.cache_dir == str(cache) and seen[-1] == (8, 8)
    reasons = sorted(f"{s.function}: {s.reason}" for s in r.skipped)
    assert len(reasons) == 4
    assert "line 1: 1 tab-separated fields, expected 3" in reasons[0]
    assert "line 2: seconds 'zero' is not a number" in reasons[1]
    assert "_relu_bits_serial: signature not understood (NameError" in reasons[2]
    assert "no_such_kernel: no function" in reasons[3]
    names = sorted(p.name.split("-")[0] for p in cache.rglob("*.nbi"))
    assert names == ["add_rms_norm_cpu._add_sum_squares", "relu_numba._relu_bits_serial"]
    # a second run, as a user runs it: a fresh `opencann warm` reads the index files
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, "-m", "opencann.cli", "warm", "--only", *TINY, "--json"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    again = json.loads(p.stdout)
    assert (again["total"], again["compiled"], again["cached"], again["skipped"]) == (4, 0, 4, [])


def test_a_worker_that_dies_is_a_failure_line_and_exit_1(cache, tmp_path, monkeypatch, capsys):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'boom: no numba here' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))   # the interpreter workers start with
    r = numba_warm.warm(only=TINY, processes=1)
    assert not r.ok and (r.compiled, r.cached, r.skipped) == (0, 0, [])
    assert r.failed == ["worker 1 of 1 exited with status 3: boom: no numba here"]
    rc, out, err = run_cli(["warm", "--only", *TINY, "--processes", "1"], capsys)
    assert rc == 1 and "4 not done" in out
    assert "failed: worker 1 of 1 exited with status 3: boom: no numba here" in out


def test_a_function_that_is_not_a_cached_kernel_is_skipped():
    assert numba_warm.compile_one("opencann.ops.kernels.numba_cache.cache_dir", "(int64,)") == (
        "skipped", "opencann.ops.kernels.numba_cache.cache_dir is not a numba kernel cached on "
        "disk (cache=True)")


def test_an_unwritable_cache_dir_is_one_error_line(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("OPENCANN_CACHE_DIR", str(blocker / "cache"))   # under a file: even root fails
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    with pytest.raises(OSError, match="cannot be written .*set OPENCANN_CACHE_DIR"):
        numba_warm.warm(only=TINY)
    rc, out, err = run_cli(["warm", "--only", *TINY], capsys)
    assert rc == 2 and len(err) == 1, err
    assert f"the kernel cache directory {blocker / 'cache' / 'numba'} cannot be written" in err[0]


def test_cli_warm_help_and_bad_arguments(capsys):
    rc, out, err = run_cli(["warm", "--help"], capsys)
    assert rc == 0 and "--only" in out and "--processes" in out and "OPENCANN_CACHE_DIR" in out
    rc, out, err = run_cli(["warm", "--only", "no_such_kernel"], capsys)
    assert rc == 2 and len(err) == 1
    assert "no kernel signature's function contains 'no_such_kernel'" in err[0]
    rc, out, err = run_cli(["warm", "--processes", "0"], capsys)
    assert rc == 2 and len(err) == 1 and "must be at least 1" in err[0]


def test_doctor_reports_the_kernel_cache(monkeypatch):
    monkeypatch.setattr(numba_warm, "cache_status", lambda: numba_warm.CacheStatus(3, 51, "/c"))
    monkeypatch.setattr(numba_warm, "check_writable", lambda path: None)
    c = doctor._kernel_cache_check()
    assert (c.status, c.value) == ("warning", "3 of 51 shipped kernel signatures compiled in /c")
    assert "opencann warm" in c.advice
    monkeypatch.setattr(numba_warm, "cache_status", lambda: numba_warm.CacheStatus(51, 51, "/c"))
    assert doctor._kernel_cache_check().status == "ok"


def test_the_shipped_signatures_are_package_data_and_name_cached_kernels():
    tsv = resources.files("opencann.tools").joinpath(numba_warm.SIGNATURES_FILE)
    assert tsv.is_file() and str(tsv) == numba_warm.signatures_path()
    assert "numba_signatures.tsv" in (REPO / "pyproject.toml").read_text()
    entries, bad = numba_warm.read_file()
    assert bad == [] and len(entries) >= 40
    for e in entries:
        disp = numba_warm._dispatcher(e.function)
        assert type(disp._cache).__name__ != "NullCache", e.function
        assert numba_warm._types(e.signature)


@pytest.mark.heavy   # builds a wheel (~10 s)
def test_an_installed_wheel_ships_the_signatures_file(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(REPO / "pyproject.toml", src)
    shutil.copy(REPO / "README.md", src)
    shutil.copytree(REPO / "opencann", src / "opencann", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "wheel"), str(src)], check=True, capture_output=True, timeout=600)
    site = tmp_path / "site"
    with zipfile.ZipFile(next((tmp_path / "wheel").glob("opencann-*.whl"))) as z:
        z.extractall(site)   # a pure-Python wheel installs by unpacking
    code = ("import opencann; from opencann.tools.numba_warm import read_file, signatures_path; "
            "print(opencann.__file__); print(signatures_path()); print(len(read_file()[0]))")
    p = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(site)),
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    init, path, n = p.stdout.split()
    assert init.startswith(str(site)) and path.startswith(str(site))
    assert int(n) == len(numba_warm.read())
