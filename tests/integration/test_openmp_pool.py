"""The calling thread's OpenMP pool is released by `release_openmp_pool`, `compile` and
`load` (opencann.devices.cpu_threads): the pool's worker threads end, the thread keeps
working, and compiled models stay correct when called from it and from other threads."""
import os
import threading
import time

import pytest
import torch

import opencann
from opencann.devices.cpu_threads import openmp_library

pytestmark = [pytest.mark.serial,     # counts this process's threads
              pytest.mark.skipif(openmp_library() is None,
                                 reason="torch runs without GNU OpenMP (libgomp) here")]


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def _wait_tasks(target: int, timeout: float = 5.0) -> int:
    end = time.monotonic() + timeout
    while _tasks() > target and time.monotonic() < end:
        time.sleep(0.01)
    return _tasks()


def _parallel_work():
    a = torch.randn(512, 512)
    (a @ a).relu_().sum()  # a GEMM and an elementwise op large enough to run in parallel


def _in_thread(fn):
    out, err = {}, []

    def run():
        try:
            torch.set_num_threads(2)
            out["v"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            err.append(e)
    th = threading.Thread(target=run)
    th.start()
    th.join()
    if err:
        raise err[0]
    return out["v"]


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 32)

    def forward(self, x):
        return torch.nn.functional.gelu(self.lin(x)) * 2


def test_release_ends_the_pool_threads_and_the_thread_keeps_working():
    def body():
        before = _tasks()
        _parallel_work()
        with_pool = _tasks()
        released = opencann.release_openmp_pool()
        after = _wait_tasks(before)
        _parallel_work()  # a new pool starts
        again = _tasks()
        second = opencann.release_openmp_pool()
        return before, with_pool, released, after, again, second, _wait_tasks(before)
    before, with_pool, released, after, again, second, last = _in_thread(body)
    assert with_pool == before + 1          # 2 intra-op threads: one pool worker
    assert released is True and after == before
    assert again == before + 1 and second is True and last == before


def test_compile_and_load_release_the_calling_threads_pool(tmp_path):
    torch.manual_seed(0)
    m = Small().eval()
    x = torch.randn(128, 64)
    x[3, 5], x[7, 1] = float("nan"), float("inf")
    with torch.no_grad():
        ref = m(x)

    opencann.compile(m, (x,))  # threads a first compile starts for good (not OpenMP's)

    def body():
        before = _tasks()
        _parallel_work()
        cm = opencann.compile(m, (x,))
        after_compile = _wait_tasks(before)
        opencann.save(cm, str(tmp_path / "m.ocm"))
        _parallel_work()
        loaded = opencann.load(str(tmp_path / "m.ocm"))
        after_load = _wait_tasks(before)
        return before, after_compile, after_load, cm, loaded
    before, after_compile, after_load, cm, loaded = _in_thread(body)
    assert after_compile == before and after_load == before
    for model in (cm, loaded):
        for _ in range(2):  # a second call, here and in a thread whose pool was released
            for y in (model(x), _in_thread(lambda: model(x))):
                torch.testing.assert_close(y, ref, equal_nan=True, rtol=1e-5, atol=1e-6)
    y1, y2 = cm(x), cm(x)
    assert y1.data_ptr() != y2.data_ptr()  # outputs stay independent
