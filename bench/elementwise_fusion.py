"""The elementwise fusion's gain on cpu (issue #16 item 1): ``fuse_elementwise`` on
(``enable``) vs off (the default on cpu) vs eager, in interleaved rounds in one process
(median of each round's median), plus numba's first-call compile cost per kernel.

    .venv/bin/python bench/elementwise_fusion.py [--rounds 5] [--runs 10] [--threads 2]
        [--only chain chain_sum minilm gpt2]

Cases: ``x*sigmoid(y) + z*w`` on four [4096, 1024] float32 tensors (16 MiB each), the
same summed over the last dim, MiniLM (seq 128) and GPT-2 small (seq 128) end to end.
Prints a Markdown table and writes bench/results/elementwise_fusion.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import opencann  # noqa: E402
from opencann import zoo  # noqa: E402
from opencann.ops.kernels import ew_numba  # noqa: E402
from opencann.timing import median_ms  # noqa: E402

ON = {"enable": ["fuse_elementwise"]}


class Chain(torch.nn.Module):
    def __init__(self, reduce: bool = False):
        super().__init__()
        self.reduce = reduce

    def forward(self, x, y, z, w):
        a = x * torch.sigmoid(y) + z * w
        return a.sum(-1) if self.reduce else a


def cases(only):
    g = torch.Generator().manual_seed(0)
    big = tuple(torch.randn(4096, 1024, generator=g) for _ in range(4))
    if not only or "chain" in only:
        yield "x*sigmoid(y)+z*w [4096,1024]", Chain(), big
    if not only or "chain_sum" in only:
        yield "(x*sigmoid(y)+z*w).sum(-1) [4096,1024]", Chain(True), big
    if not only or "minilm" in only:
        z = zoo.get("minilm", seq=128)
        yield "minilm (seq 128)", z.model, z.example_inputs
    if not only or "gpt2" in only:
        z = zoo.get("gpt2", seq=128)
        yield "gpt2 (seq 128)", z.model, z.example_inputs


def bench(name, model, inputs, rounds, runs):
    off = opencann.compile(model, inputs)
    on = opencann.compile(model, inputs, options=ON)
    groups = [n for n in on.graph.nodes if n.op == "FusedElementwise"]
    before = dict(ew_numba.COMPILE_SECONDS)
    t0 = time.perf_counter()
    with torch.no_grad():
        on(*inputs)                                     # first call: numba compiles
    first = time.perf_counter() - t0
    compiled = {str(k[0][0])[:60]: v for k, v in ew_numba.COMPILE_SECONDS.items() if k not in before}
    times = {"eager": [], "off": [], "on": []}
    with torch.no_grad():
        for _ in range(rounds):
            for k, f in (("eager", model), ("off", off), ("on", on)):
                times[k].append(median_ms(f, *inputs, runs=runs))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"case": name, "groups": len(groups), "ops_fused": sum(len(n.attrs["ops"]) for n in groups),
            "first_call_s": first, "kernels_compiled": len(compiled),
            "compile_s": sorted(compiled.values()), "ms": med, "rounds": times,
            "on_vs_off": med["off"] / med["on"], "on_vs_eager": med["eager"] / med["on"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import numba
    numba.set_num_threads(min(a.threads, numba.config.NUMBA_NUM_THREADS))
    rows = [bench(n, m, x, a.rounds, a.runs) for n, m, x in cases(a.only)]
    print("| case | groups (ops) | kernels compiled | first call s | eager ms | off ms | on ms | on vs off |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ms = r["ms"]
        print(f"| {r['case']} | {r['groups']} ({r['ops_fused']}) | {r['kernels_compiled']} | "
              f"{r['first_call_s']:.2f} | {ms['eager']:.1f} | {ms['off']:.1f} | {ms['on']:.1f} | "
              f"{r['on_vs_off']:.2f}x |")
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "elementwise_fusion.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
