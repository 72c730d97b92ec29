"""Shared by every test folder (unit/, integration/, models/, conformance/onnx/).

``tests/`` is put on ``sys.path`` so ``import helpers`` works from each folder; each test
starts with a fresh dynamo cache, so a shape seen by an earlier test cannot turn a later
test's graphs dynamic, and with the process's torch thread count (a test that sets its
own cannot leave a later test, which compares with eager, at another count: reductions
such as a convolution's weight gradient sum in another order at 1 and at 2 threads)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    if torch.get_num_threads() != _THREADS:
        torch.set_num_threads(_THREADS)
