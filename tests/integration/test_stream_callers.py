"""Several threads calling one multi-stream model at once get eager's values, and the
callers' and new threads' intra-op thread counts are unchanged afterwards."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opencann
from helpers import count_in_new_thread


pytestmark = pytest.mark.serial          # thread counts of this process


def _x(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) + 0.25
    x.view(-1)[5] = float("nan")
    x.view(-1)[11] = float("inf")
    return x


class _Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(32, 32) for _ in range(4))

    def forward(self, x):
        p, q, r = F.relu(self.a(x)), torch.tanh(self.b(x)), self.c(x).sigmoid()
        return self.d(p + q) * r, (p - q).sum(1)


@pytest.mark.parametrize("streams,costs", [(2, "measured"), (3, "model")])
def test_streams_concurrent_callers_keep_thread_counts(streams, costs):
    """Four threads calling one multi-stream model at once get eager's values; the
    caller's and new threads' intra-op thread counts are unchanged afterwards."""
    torch.manual_seed(0)
    m = _Branches().eval()
    cm = opencann.compile(m, (_x(8, 32),), options={"streams": streams, "stream_costs": costs})
    mine, fresh = torch.get_num_threads(), count_in_new_thread()
    bad = []

    def caller(seed):
        x = _x(8, 32, seed=seed)
        with torch.no_grad():
            ref = m(x)
        for _ in range(5):
            out = cm(x)
            if not all(torch.allclose(a, b, atol=1e-5, equal_nan=True) for a, b in zip(ref, out)):
                bad.append(seed)
    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
    assert torch.get_num_threads() == mine and count_in_new_thread() == fresh
