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
    ts = tuple(t for _, t in named)
    ids, versions, ptrs = tuple(map(id, ts)), tuple(t._version for t in ts), tuple(t.data_ptr() for t in ts)

    def tuple_guard():   # what opencann.dynamo.freezing compared per call before the watch
        return (tuple(map(id, ts)) == ids and tuple(t._version for t in ts) == versions
                and tuple(t.data_ptr() for t in ts) == ptrs)
    print(f"{len(named)} tensors, {sum(t.numel() for _, t in named) / 1e6:.1f} M elements, "
          f"probes {len(w._want) / 1024:.0f} KiB, torch threads {torch.get_num_threads()}")
    for name, f in (("WeightWatch.changed()", w.changed), ("id/version/data_ptr tuples", tuple_guard)):
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(1000):
                f()
            rounds.append((time.perf_counter() - t0) / 1000 * 1e6)
        print(f"  {name}: {min(rounds):.1f} us best, {statistics.median(rounds):.1f} us median per call")


if __name__ == "__main__":
    main()
