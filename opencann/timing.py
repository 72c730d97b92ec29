"""Latency measurement shared by the CLI and benchmarks: ``torch.utils.benchmark``
(warm-up, median of repeated runs), so eager and compiled are timed the same way."""
from __future__ import annotations

import torch
import torch.utils.benchmark as tb


def median_ms(fn, *args, runs: int = 10, warmup: int = 2) -> float:
    """Median wall time of ``fn(*args)`` in milliseconds over ``runs`` calls (no grad)."""
    with torch.no_grad():
        for _ in range(warmup):
            fn(*args)
        timer = tb.Timer("fn(*args)", globals={"fn": fn, "args": args},
                         num_threads=torch.get_num_threads())
        times = [timer.timeit(1).median for _ in range(max(runs, 1))]
    times.sort()
    return times[len(times) // 2] * 1e3
