"""Shared by every test folder (unit/, integration/, models/, conformance/onnx/).

``tests/`` is put on ``sys.path`` so ``import helpers`` works from each folder; each test
starts with a fresh dynamo cache, so a shape seen by an earlier test cannot turn a later
test's graphs dynamic, and with the process's torch thread count (a test that sets its
own cannot leave a later test, which compares with eager, at another count: reductions
such as a convolution's weight gradient sum in another order at 1 and at 2 threads).

Under pytest-xdist the controller first compiles the numba kernels the suite uses into
the cache, so the workers do not each compile them (`opencann.tools.numba_warm`, the
file it reads is recorded again as ``numba_warm.py`` says)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


_THREADS = torch.get_num_threads()

if os.environ.get("OPENCANN_NUMBA_RECORD"):
    from opencann.tools import numba_warm
    numba_warm.record(os.environ["OPENCANN_NUMBA_RECORD"])


def pytest_configure(config):
    """In the xdist controller (before it starts the workers) of a run over the whole
    ``tests`` folder (`make test`): `opencann.tools.numba_warm.warm` (a cache directory it
    cannot write is left to the workers, which then compile lazily)."""
    workers = getattr(config.option, "numprocesses", None)
    here = os.path.dirname(os.path.abspath(__file__))
    whole = any(os.path.abspath(a) == here for a in config.args)
    if (hasattr(config, "workerinput") or not isinstance(workers, int) or workers < 2 or not whole
            or os.environ.get("OPENCANN_NUMBA_WARM") == "0"
            or os.environ.get("OPENCANN_NUMBA_RECORD") or config.option.collectonly):
        return
    from opencann.tools import numba_warm
    try:
        seconds = numba_warm.warm(processes=workers).seconds
    except OSError:
        return
    if seconds:
        config.stash[_WARM_SECONDS] = seconds


_WARM_SECONDS = pytest.StashKey[float]()


def pytest_report_header(config):
    seconds = config.stash.get(_WARM_SECONDS, None)
    return None if seconds is None else f"numba kernels compiled into the cache first: {seconds:.1f} s"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    if torch.get_num_threads() != _THREADS:
        torch.set_num_threads(_THREADS)
