"""`thread_scratch`: one buffer per thread and dtype, reused and grown; never shared between
threads; a request above KEEP_MAX_BYTES is served fresh and not kept."""
import threading

import torch

from opencann.ops.kernels import scratch


def test_reused_grown_per_dtype_and_per_thread():
    a = scratch.thread_scratch(100)
    b = scratch.thread_scratch(50)
    assert a.data_ptr() == b.data_ptr() and b.numel() == 50 and b.dtype == torch.float32
    c = scratch.thread_scratch(100, torch.bfloat16)
    assert c.dtype == torch.bfloat16 and c.data_ptr() != a.data_ptr()
    big = scratch.thread_scratch(10_000)
    assert big.numel() == 10_000 and scratch.thread_scratch(10).data_ptr() == big.data_ptr()
    other = []
    t = threading.Thread(target=lambda: other.append(scratch.thread_scratch(100).data_ptr()))
    t.start()
    t.join()
    assert other[0] != big.data_ptr()


def test_a_request_above_the_cap_is_fresh_and_not_kept(monkeypatch):
    monkeypatch.setattr(scratch, "KEEP_MAX_BYTES", 4096)
    f64 = torch.float64                                  # a dtype no other test here uses
    kept = scratch.thread_scratch(256, f64)              # 2 KiB: kept
    huge = scratch.thread_scratch(1024, f64)             # 8 KiB: fresh
    assert huge.numel() == 1024 and huge.data_ptr() != kept.data_ptr()
    assert scratch.thread_scratch(256, f64).data_ptr() == kept.data_ptr()   # the kept one stays
