"""Per-call cost of the frozen-weight guard (`opencann.runtime.weight_watch.WeightWatch.
changed`) on ResNet-50's parameters and buffers (transformers' config, opencann.zoo):
microseconds per call, best and median of 5 rounds of 1000 calls.

    HF_HUB_OFFLINE=1 PYTHONPATH=$PWD python bench/weight_watch.py
"""
import statistics
import time

import torch

from opencann.runtime.weight_watch import WeightWatch
from opencann.zoo import resnet50


def main() -> None:
    m = resnet50().model.eval()
    named = list(m.named_parameters()) + list(m.named_buffers())
    w = WeightWatch([t for _, t in named], [n for n, _ in named])
    for _ in range(200):
        w.changed()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(1000):
            w.changed()
        rounds.append((time.perf_counter() - t0) / 1000 * 1e6)
    print(f"{len(named)} tensors, {sum(t.numel() for _, t in named) / 1e6:.1f} M elements, "
          f"probes {len(w._want) / 1024:.0f} KiB: changed() {min(rounds):.1f} us best, "
          f"{statistics.median(rounds):.1f} us median per call (torch threads "
          f"{torch.get_num_threads()})")


if __name__ == "__main__":
    main()
