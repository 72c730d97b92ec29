"""`keep_freed_memory` (opencann.devices.cpu_malloc): after it, a large tensor freed and
allocated again is reused without page faults, and a compiled CNN whose convolution
outputs are allocated by oneDNN on every call gives eager's values, twice. The checks
run in a fresh interpreter: mallopt is process-wide and must not leak into this session."""
import ctypes.util
import os
import subprocess
import sys
import textwrap

import pytest

import opencann

pytestmark = pytest.mark.skipif(ctypes.util.find_library("c") is None or not sys.platform.startswith("linux"),
                                reason="glibc's mallopt is Linux-only here")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import resource, torch, opencann
    from opencann.devices.cpu_malloc import kept_bytes

    def faults_of_fresh_tensor():
        # a 24 MiB tensor allocated, written and freed twice: the second one's faults
        for _ in range(2):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = torch.empty(6 << 20)
            t.fill_(1.0)
            del t
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

    before = faults_of_fresh_tensor()
    assert kept_bytes() == 0
    assert opencann.keep_freed_memory(256 << 20) is True
    assert opencann.keep_freed_memory(1 << 20) is True      # never lowers
    assert kept_bytes() == 256 << 20, kept_bytes()
    faults_of_fresh_tensor()                                 # the block enters the heap
    after = faults_of_fresh_tensor()
    print("FAULTS", before, after)
    assert after < 100 < before, (before, after)

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(),
                            torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU()).eval()
    x = torch.randn(8, 3, 96, 96)
    x[0, 0, 5, 5] = float("nan")
    x[1, 1, 7, 7] = float("inf")
    cm = opencann.compile(m, (x,))
    with torch.no_grad():
        want = m(x)
        y1 = cm(x)
        y1c = y1.clone()
        y2 = cm(x)
    # the second call leaves the first call's output as it was (output independence)
    torch.testing.assert_close(y1, y1c, rtol=0, atol=0, equal_nan=True)
    for y in (y1c, y2):
        assert torch.equal(torch.isnan(y), torch.isnan(want))
        assert torch.equal(torch.isinf(y), torch.isinf(want))
        ok = torch.isfinite(want)
        torch.testing.assert_close(y[ok], want[ok], rtol=1e-4, atol=1e-4)
    print("OK")
""")


def _run(script: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          timeout=120)


def test_freed_blocks_are_reused_without_faults_and_models_stay_exact():
    r = _run(SCRIPT)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1G"])
def test_bad_sizes_raise_one_line(bad):
    with pytest.raises(ValueError, match="positive whole number of bytes"):
        opencann.keep_freed_memory(bad)
