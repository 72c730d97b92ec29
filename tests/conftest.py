"""Shared by every test folder (unit/, integration/, models/, conformance/onnx/).

``tests/`` is put on ``sys.path`` so ``import helpers`` works from each folder; each test
starts with a fresh dynamo cache, so a shape seen by an earlier test cannot turn a later
test's graphs dynamic."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
