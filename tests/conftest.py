"""Test isolation: each test starts with a fresh dynamo cache, so a shape seen by an
earlier test cannot turn a later test's graphs dynamic."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
