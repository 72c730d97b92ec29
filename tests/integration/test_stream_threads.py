"""Intra-op thread counts under streams are per thread (`opencann.runtime.thread_count`).

The fault: `StreamRunner._run_here` called ``torch.set_num_threads`` around stream 0, which
also sets ATen's process default; a thread whose first parallel region fell inside that
window copied it (1 thread) for good. These tests open that window deterministically
(stream 0 waits while a fresh thread initialises) instead of hoping a race hits it."""
import threading

import pytest
import torch

import opencann
from opencann.runtime import thread_count
from opencann.runtime.streams import StreamRunner
from helpers import count_in_new_thread

pytestmark = [pytest.mark.serial,     # intra-op thread counts of this process
              pytest.mark.skipif(not thread_count.available,
                                 reason="no per-thread OpenMP count in this torch build")]


def _fresh_count_or_skip():
    fresh = count_in_new_thread()
    if fresh < 2:
        pytest.skip("the process default is 1 thread: a leaked 1 could not be seen")
    return fresh


def test_set_this_thread_changes_only_the_calling_thread():
    fresh, mine = _fresh_count_or_skip(), torch.get_num_threads()
    saved = thread_count.set_this_thread(1)
    try:
        assert torch.get_num_threads() == 1
        assert count_in_new_thread() == fresh  # the process default is untouched
    finally:
        thread_count.restore_this_thread(saved)
    assert torch.get_num_threads() == mine
    assert thread_count.set_this_thread(mine) is None  # nothing changed, nothing to restore
    with pytest.raises(ValueError, match="thread count must be >= 1"):
        thread_count.set_this_thread(0)


def test_a_thread_starting_during_stream_0_keeps_the_process_default():
    """A caller thread whose first parallel region runs while another call's stream 0
    runs with 1 intra-op thread gets the process default, also after that call ends."""
    fresh, mine = _fresh_count_or_skip(), torch.get_num_threads()
    r = StreamRunner(2, nevents=1, nslots=2, threads_per_stream=1)
    seen = {}
    first_done, call_done = threading.Event(), threading.Event()

    def newcomer():
        seen["during"] = torch.get_num_threads()  # this thread's first ATen init
        first_done.set()
        call_done.wait()
        seen["after"] = torch.get_num_threads()

    def s0(inputs, slots):
        seen["s0"] = torch.get_num_threads()
        t = threading.Thread(target=newcomer)
        t.start()
        first_done.wait()  # the newcomer initialised while stream 0 runs
        seen["thread"] = t
        slots[0] = inputs[0] + 1
        r.events[0].set()

    def s1(inputs, slots):
        seen["s1"] = torch.get_num_threads()
        r.wait(0)
        slots[1] = slots[0] * 2

    r.fns = [s0, s1]
    slots = r.run([torch.ones(2)])
    call_done.set()
    seen["thread"].join()
    torch.testing.assert_close(slots[1], torch.full((2,), 4.0))
    assert seen["s0"] == seen["s1"] == 1
    assert seen["during"] == seen["after"] == fresh
    assert torch.get_num_threads() == mine and count_in_new_thread() == fresh


class _Branches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(16, 16, generator=g) / 4, requires_grad=False)

    def forward(self, x):
        p, q, r = torch.relu(x @ self.w), torch.tanh(x), torch.sigmoid(x * 3)
        return (p + q) * r, (p - q).sum(1)


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 16, generator=g)
    x[0, seed % 16] = float("nan")
    x[1, 3] = float("inf")
    x[2, 5] = -float("inf")
    return x


@pytest.mark.parametrize("streams,costs", [(2, "measured"), (3, "model")])
def test_streams_never_call_the_process_wide_setter(monkeypatch, streams, costs):
    """Compiling (measured node times run at the streams' count) and calling never use
    ``torch.set_num_threads``; values match eager with NaN/Inf positions on two calls,
    outputs stay independent, and the caller's and new threads' counts are unchanged."""
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))
    fresh, mine = count_in_new_thread(), torch.get_num_threads()
    m = _Branches().eval()
    cm = opencann.compile(m, (_inputs(0),), options={"streams": streams, "stream_costs": costs})
    kept = []
    for seed in (1, 2):
        x = _inputs(seed)
        with torch.no_grad():
            want = m(x)
        got = cm(x)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)
        kept.append((got, [g.clone() for g in got]))
    for g, c in zip(*kept[0]):
        torch.testing.assert_close(g, c, rtol=0, atol=0, equal_nan=True)
    assert kept[0][0][0].data_ptr() != kept[0][0][1].data_ptr()
    assert calls == []
    assert torch.get_num_threads() == mine and count_in_new_thread() == fresh


def test_the_count_is_set_in_torchs_openmp_runtime_when_another_copy_loaded_first():
    """scikit-learn ships its own libgomp (``libgomp-<hash>.so``; transformers imports
    scikit-learn): loaded before opencann, it sorted first among the mapped libraries and
    the per-thread setter changed that copy's count, which torch never reads (stream 0
    then ran on the caller's count). A fresh process loads it first."""
    import subprocess
    import sys
    pytest.importorskip("sklearn")
    code = ("import sklearn.utils._openmp_helpers, torch\n"
            "torch.set_num_threads(2)\n"
            "from opencann.devices.cpu_threads import torch_openmp_library\n"
            "from opencann.runtime import thread_count as t\n"
            "s = t.set_this_thread(1); inside = torch.get_num_threads(); t.restore_this_thread(s)\n"
            "import os\n"
            "print(inside, torch.get_num_threads(), os.path.dirname(torch.__file__) in torch_openmp_library())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "2", "True"], out.stdout
