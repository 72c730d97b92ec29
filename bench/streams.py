"""Streams on the CPU: 2 streams x 1 intra-op thread vs 1 stream x 2 threads, batch 1.

Two branchy models: an Inception-style stack (3 blocks of four branches: 1x1; 1x1 ->
3x3; 1x1 -> 3x3 -> 3x3; 3x3 max-pool -> 1x1; concatenated) and a two-tower MLP (two
inputs, four 1024-wide Linear+ReLU layers each, joined by a head). Each configuration
runs in a fresh subprocess (intra-op threads are process state): ``torch.set_num_threads``
set to the total thread budget (default 2), the model compiled with ``streams`` S, so
each stream's worker thread gets budget // S intra-op threads (`opencann.runtime.streams`).
Time is the median of ``--calls`` calls after warm-up, per round; rounds alternate the
configurations (A B C A B C ...) so that load from other processes hits them alike, and
the table shows the median over rounds and the best round. Also printed: the arena bytes
on 1 and S streams, streams/events from the compile report, and eager's time (same
threads as the 1-stream run) and 1 stream x 1 thread (what each stream gets).

Usage: python bench/streams.py [--rounds 5] [--calls 30] [--threads 2] [--wait-policy passive]
                               [--json out.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

CELL = r"""
import json, sys, time, statistics
import torch
model_name, streams, threads, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
sys.path.insert(0, "bench")
from streams import build
import opencann
m, inputs = build(model_name)
if streams == 0:
    fn = lambda: m(*inputs)
    extra = {}
else:
    cm = opencann.compile(m, inputs, options={"streams": streams})
    fn = lambda: cm(*inputs)
    rep = cm.report.streams or {"streams": 1, "events": 0}
    extra = {"arena_bytes": cm.plan.arena_bytes, "streams": rep["streams"], "events": rep["events"],
             "nodes_per_stream": rep.get("nodes_per_stream", [len(cm.graph.nodes)])}
with torch.no_grad():
    for _ in range(5):
        fn()
    ts = []
    for _ in range(calls):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
print("CELL" + json.dumps({"ms": 1e3 * statistics.median(ts), **extra}))
"""


def build(name):
    """(model, example inputs) of ``name``: "inception" or "two_tower" (batch 1)."""
    import torch
    from torch import nn
    torch.manual_seed(0)

    def cbr(i, o, k):
        return nn.Sequential(nn.Conv2d(i, o, k, padding=k // 2), nn.ReLU())

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            q = c // 4
            self.b1 = cbr(c, q, 1)
            self.b2 = nn.Sequential(cbr(c, q, 1), cbr(q, q, 3))
            self.b3 = nn.Sequential(cbr(c, q, 1), cbr(q, q, 3), cbr(q, q, 3))
            self.b4 = nn.Sequential(nn.MaxPool2d(3, 1, 1), cbr(c, q, 1))

        def forward(self, x):
            return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1)

    class Towers(nn.Module):
        def __init__(self, d=1024, layers=4):
            super().__init__()
            self.a = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(d, d), nn.ReLU())])
            self.b = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(d, d), nn.ReLU())])
            self.head = nn.Linear(2 * d, 16)

        def forward(self, u, v):
            return self.head(torch.cat([self.a(u), self.b(v)], 1))

    if name == "inception":
        return nn.Sequential(cbr(3, 128, 3), Block(128), Block(128), Block(128)).eval(), \
            (torch.randn(1, 3, 28, 28),)
    if name == "two_tower":
        return Towers().eval(), (torch.randn(1, 1024), torch.randn(1, 1024))
    raise ValueError(f"unknown model {name!r}; use inception or two_tower")


def run_cell(model, streams, threads, calls, wait_policy=""):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if wait_policy:
        env["OMP_WAIT_POLICY"] = wait_policy
    p = subprocess.run([sys.executable, "-c", CELL, model, str(streams), str(threads), str(calls)],
                       cwd=root, env=env, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("CELL"):
            return json.loads(line[4:])
    raise RuntimeError(f"{model} streams={streams} failed:\n{p.stderr[-3000:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2, help="total intra-op thread budget")
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--models", nargs="*", default=["inception", "two_tower"])
    ap.add_argument("--wait-policy", default="", choices=["", "active", "passive"],
                    help="OMP_WAIT_POLICY for every run (default: the OpenMP runtime's); "
                         "passive: idle OpenMP threads sleep instead of spinning, which a "
                         "loaded machine punishes less")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    # name -> (streams (0: eager), total intra-op threads)
    configs = {"eager": (0, a.threads), "1 stream": (1, a.threads), "1 stream x 1 thread": (1, 1),
               f"{a.streams} streams": (a.streams, a.threads)}
    out = {"threads": a.threads, "wait_policy": a.wait_policy or "default", "rounds": a.rounds, "calls": a.calls, "load": os.getloadavg(),
           "cpus": os.cpu_count(), "models": {}}
    for model in a.models:
        cells = {k: [] for k in configs}
        for _ in range(a.rounds):
            for k, (s, t) in configs.items():
                cells[k].append(run_cell(model, s, t, a.calls, a.wait_policy))
        res = {}
        for k, rs in cells.items():
            ms = [r["ms"] for r in rs]
            res[k] = {**{x: v for x, v in rs[0].items() if x != "ms"},
                      "median_ms": round(statistics.median(ms), 3), "best_ms": round(min(ms), 3),
                      "rounds_ms": [round(x, 3) for x in ms]}
        one, many = res["1 stream"], res[f"{a.streams} streams"]
        res["speedup_median"] = round(one["median_ms"] / many["median_ms"], 3)
        res["speedup_best"] = round(one["best_ms"] / many["best_ms"], 3)
        out["models"][model] = res
        print(f"{model}: eager {res['eager']['median_ms']:.2f} ms | 1 stream x {a.threads} threads "
              f"{one['median_ms']:.2f} ms (best {one['best_ms']:.2f}) | {a.streams} streams x "
              f"{max(1, a.threads // a.streams)} thread(s) {many['median_ms']:.2f} ms (best "
              f"{many['best_ms']:.2f}) | speedup {res['speedup_median']:.2f}x median, "
              f"{res['speedup_best']:.2f}x best | arena {one['arena_bytes']} B -> "
              f"{many['arena_bytes']} B | {many['streams']} streams, {many['events']} events, "
              f"nodes per stream {many['nodes_per_stream']}", flush=True)
    out["load_after"] = os.getloadavg()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
