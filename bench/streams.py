"""Streams on the CPU: 2 streams x 1 intra-op thread vs 1 stream x 2 threads, batch 1,
and why the one beats the other or not on this machine.

Three branchy models: an Inception-style stack (stem conv + 3 blocks of four branches:
1x1; 1x1 -> 3x3; 1x1 -> 3x3 -> 3x3; 3x3 max-pool -> 1x1; concatenated); the same with
the pool after the pool branch's 1x1 projection (``inception_pp``): the compiled
convolutions (oneDNN) return channels-last tensors but the concatenation writes NCHW,
and ATen's max-pool on NCHW at stride 1 takes ~2.3 ms at 1 thread where channels-last
takes ~0.15 ms, so in ``inception`` two pools lie on the critical path; in
``inception_pp`` the pool reads a convolution's output and no kernel dominates. And a
two-tower MLP (two inputs, four 1024-wide Linear+ReLU layers each, joined by a head). Each configuration runs in a
fresh subprocess (intra-op threads are process state): ``torch.set_num_threads`` set to
the total thread budget (default 2), the model compiled with ``streams`` S, so each
stream's worker thread gets budget // S intra-op threads (`opencann.runtime.streams`);
"S streams (model costs)" assigns streams by the FLOPs/bytes cost model
(``stream_costs="model"``), "S streams" by node times measured at binding (the default).
Time is the median of ``--calls`` calls after warm-up, per round; rounds alternate the
configurations (A B C A B C ...) so that load from other processes hits them alike, and
the table shows the median over rounds and the best round, with the load average.

The "why" lines (one process per model, budget threads):
- node times at 1 thread (`Executor.node_seconds`, least of 5): their sum (one stream)
  and the DAG's critical path (the longest chain: no number of 1-thread streams beats
  it), so ``sum / critical path`` caps what streams can gain over 1 stream x 1 thread;
- the compiled schedule's predicted busy time per stream and call time (report);
- per-stream busy time and overlap measured in real 2-stream calls (each kernel
  wrapped and time-stamped on its worker thread; medians over calls);
- thread-level concurrency: two independent 1-thread calls of the 1-stream model on two
  threads at once, as throughput over one (what perfectly balanced streams could get),
  beside intra-op scaling (1 stream x 1 thread / 1 stream x 2 threads, from the table);
- the same node times at the whole budget of threads (their sum: 1 stream x 2 threads
  without preemption), so intra-op scaling is also given from least-of-5 node times,
  which load from other processes disturbs far less than call medians;
- the best 2 streams could do here: max(critical path, sum / concurrency), against the
  measured 1 stream x 2 threads and that node sum.

Usage: python bench/streams.py [--rounds 5] [--calls 30] [--threads 2] [--wait-policy passive]
                               [--models inception inception_pp two_tower] [--json out.json]
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
costs = sys.argv[5]
torch.set_num_threads(threads)
sys.path.insert(0, "bench")
from streams import build
import opencann
m, inputs = build(model_name)
if streams == 0:
    fn = lambda: m(*inputs)
    extra = {}
else:
    cm = opencann.compile(m, inputs, options={"streams": streams, "stream_costs": costs})
    fn = lambda: cm(*inputs)
    rep = cm.report.streams or {"streams": 1, "events": 0}
    extra = {"arena_bytes": cm.plan.arena_bytes, "streams": rep["streams"], "events": rep["events"],
             "nodes_per_stream": rep.get("nodes_per_stream", [len(cm.graph.nodes)]),
             "predicted_busy_us": rep.get("predicted_busy_us")}
with torch.no_grad():
    for _ in range(5):
        fn()
    ts = []
    for _ in range(calls):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
print("CELL" + json.dumps({"ms": 1e3 * statistics.median(ts), **extra}))
"""

WHY = r"""
import json, sys
import torch
model_name, streams, threads, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
sys.path.insert(0, "bench")
from streams import build, why
print("WHY" + json.dumps(why(*build(model_name), streams, threads, calls)))
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

    class BlockPP(Block):  # the pool after the 1x1 projection: it reads a conv's output
        def __init__(self, c):
            super().__init__(c)
            self.b4 = nn.Sequential(cbr(c, c // 4, 1), nn.MaxPool2d(3, 1, 1))

    if name in ("inception", "inception_pp"):
        B = Block if name == "inception" else BlockPP
        return nn.Sequential(cbr(3, 128, 3), B(128), B(128), B(128)).eval(), \
            (torch.randn(1, 3, 28, 28),)
    if name == "two_tower":
        return Towers().eval(), (torch.randn(1, 1024), torch.randn(1, 1024))
    raise ValueError(f"unknown model {name!r}; use inception, inception_pp or two_tower")


# -- why: node times, critical path, stream busy/overlap, concurrency --------------------

def _chain_ms(graph, secs):
    """(sum of node times, longest dependence chain) in ms."""
    from opencann.ops import ordering_deps
    t = [secs[x.name] for x in graph.nodes]
    preds = [[] for _ in t]
    for p, c in ordering_deps(graph):
        preds[c].append(p)
    fin = []
    for i, ti in enumerate(t):
        fin.append(ti + max((fin[p] for p in preds[i]), default=0.0))
    return 1e3 * sum(t), 1e3 * max(fin, default=0.0)


def _overlap(intervals):
    """Seconds during which two or more of the (stream, start, end) intervals run."""
    edges = sorted([(s, 1) for _, s, _ in intervals] + [(e, -1) for _, _, e in intervals])
    depth, last, both = 0, 0.0, 0.0
    for t, d in edges:
        if depth >= 2:
            both += t - last
        depth, last = depth + d, t
    return both


def _stream_busy(cm, inputs, calls):
    """Medians over ``calls`` 2-stream calls of: call ms, kernel-busy ms per stream,
    ms with kernels of two streams running at once (each kernel K<i> of the generated
    code wrapped and time-stamped on the worker thread that runs it)."""
    import threading
    import time
    glb, rec = cm.executor._glb, []

    def wrap(k):
        def timed(*a, **kw):
            t = time.perf_counter()
            r = k(*a, **kw)
            rec.append((threading.current_thread().name, t, time.perf_counter()))
            return r
        return timed
    for name in [n for n in glb if n[:1] == "K" and n[1:].isdigit()]:
        glb[name] = wrap(glb[name])
    rows = []
    for _ in range(calls + 3):
        rec.clear()
        t = time.perf_counter()
        cm(*inputs)
        call = time.perf_counter() - t
        busy = {}
        for th, s, e in rec:
            busy[th] = busy.get(th, 0.0) + e - s
        rows.append((call, [busy[k] for k in sorted(busy)], _overlap(rec)))
    rows = rows[3:]
    med = lambda xs: round(1e3 * statistics.median(xs), 3)  # noqa: E731
    return {"call_ms": med([r[0] for r in rows]),
            "busy_ms": [med([r[1][k] for r in rows if len(r[1]) > k])
                        for k in range(max(len(r[1]) for r in rows))],
            "overlap_ms": med([r[2] for r in rows])}


def _concurrency(cm1, inputs, calls, threads):
    """Throughput of two 1-thread callers of the 1-stream model at once over one
    1-thread caller doing the same calls (best of 3 tries each, interleaved)."""
    import threading
    import time
    import torch

    def loop(k, out):
        torch.set_num_threads(1)
        t = time.perf_counter()
        for _ in range(k):
            cm1(*inputs)
        out.append(time.perf_counter() - t)
    one, two = [], []
    for _ in range(3):
        th = threading.Thread(target=loop, args=(2 * calls, one))
        th.start()
        th.join()
        wall, out = time.perf_counter(), []
        ts = [threading.Thread(target=loop, args=(calls, out)) for _ in range(2)]
        for x in ts:
            x.start()
        for x in ts:
            x.join()
        two.append(time.perf_counter() - wall)
    torch.set_num_threads(threads)
    return round(min(one) / min(two), 3)


def why(model, inputs, streams, threads, calls):
    """The "why" figures of one model (see the module docstring), as a dict."""
    import opencann
    import torch
    with torch.no_grad():
        cm1 = opencann.compile(model, inputs, options={"concurrent_calls": 2})
        secs = cm1.executor.node_seconds(list(inputs), threads=1)
        serial, chain = _chain_ms(cm1.graph, secs)
        serial2, _ = _chain_ms(cm1.graph, cm1.executor.node_seconds(list(inputs), threads=threads))
        cmS = opencann.compile(model, inputs, options={"streams": streams})
        for _ in range(5):
            cmS(*inputs)
            cm1(*inputs)
        conc = _concurrency(cm1, inputs, calls, threads)
        busy = _stream_busy(cmS, inputs, calls)
    st = cmS.report.streams or {}
    return {"serial_1thread_ms": round(serial, 3), "critical_path_1thread_ms": round(chain, 3),
            f"serial_{threads}threads_ms": round(serial2, 3),
            "predicted_busy_ms": [round(b / 1e3, 3) for b in st.get("predicted_busy_us", [])],
            "predicted_call_ms": round(st.get("predicted_call_us", 0) / 1e3, 3),
            "measured": busy, "concurrency_2_threads": conc, "load": os.getloadavg()}


def run_cell(model, streams, threads, calls, wait_policy="", costs="measured", code=None,
             tag="CELL"):
    """Run ``code`` (default the timing cell) in a fresh process; its JSON result."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if wait_policy:
        env["OMP_WAIT_POLICY"] = wait_policy
    p = subprocess.run([sys.executable, "-c", code or CELL, model, str(streams), str(threads),
                        str(calls), costs], cwd=root, env=env, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith(tag):
            return json.loads(line[len(tag):])
    raise RuntimeError(f"{model} streams={streams} failed:\n{p.stderr[-3000:]}")


def _table(model, cells):
    """Median/best/rounds per configuration and the 1-stream / S-stream speed-ups."""
    res = {}
    for k, rs in cells.items():
        ms = [r["ms"] for r in rs]
        res[k] = {**{x: v for x, v in rs[0].items() if x not in ("ms", "load")},
                  "median_ms": round(statistics.median(ms), 3), "best_ms": round(min(ms), 3),
                  "rounds_ms": [round(x, 3) for x in ms],
                  "load_1min": [round(r["load"], 2) for r in rs]}
    return res


def _print(model, res, w, a):
    one, one1 = res["1 stream"], res["1 stream x 1 thread"]
    many, old = res[f"{a.streams} streams"], res[f"{a.streams} streams (model costs)"]
    print(f"{model} (load {min(one['load_1min']):.1f}-{max(one['load_1min']):.1f}): eager "
          f"{res['eager']['median_ms']:.2f} | 1 stream x {a.threads} thr {one['median_ms']:.2f} "
          f"(best {one['best_ms']:.2f}) | 1 x 1 thr {one1['median_ms']:.2f} | {a.streams} streams "
          f"model costs {old['median_ms']:.2f} (best {old['best_ms']:.2f}) | {a.streams} streams "
          f"measured {many['median_ms']:.2f} (best {many['best_ms']:.2f}) ms | speed-up vs 1 x "
          f"{a.threads}: {res['speedup_median']:.2f}x median, {res['speedup_best']:.2f}x best",
          flush=True)
    m = w["measured"]
    print(f"  why: 1-thread node sum {w['serial_1thread_ms']:.2f} ms, critical path "
          f"{w['critical_path_1thread_ms']:.2f} ms (streams gain at most "
          f"{w['serial_1thread_ms'] / w['critical_path_1thread_ms']:.2f}x over 1 x 1) | predicted "
          f"busy {w['predicted_busy_ms']} ms, call {w['predicted_call_ms']:.2f} | measured busy "
          f"{m['busy_ms']} ms, overlap {m['overlap_ms']:.2f}, call {m['call_ms']:.2f} | 2 callers "
          f"on 2 threads {w['concurrency_2_threads']:.2f}x one, intra-op 1->2 threads "
          f"{w['intra_op_scaling']:.2f}x (node sums {w['serial_1thread_ms']:.2f} -> "
          f"{w[f'serial_{a.threads}threads_ms']:.2f} ms: {w['intra_op_scaling_nodes']:.2f}x) | "
          f"best for streams {w['streams_best_ms']:.2f} ms vs 1 x {a.threads} "
          f"{one['median_ms']:.2f} ms (node sum {w[f'serial_{a.threads}threads_ms']:.2f}) "
          f"(load {w['load'][0]:.1f})", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2, help="total intra-op thread budget")
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--models", nargs="*", default=["inception", "inception_pp", "two_tower"])
    ap.add_argument("--wait-policy", default="", choices=["", "active", "passive"],
                    help="OMP_WAIT_POLICY for every run (default: the OpenMP runtime's); "
                         "passive: idle OpenMP threads sleep instead of spinning, which a "
                         "loaded machine punishes less")
    ap.add_argument("--why-only", action="store_true",
                    help="only the why lines (node times, critical path, busy/overlap, concurrency)")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    S = a.streams
    if a.why_only:
        for model in a.models:
            w = run_cell(model, S, a.threads, a.calls, a.wait_policy, code=WHY, tag="WHY")
            print(model, json.dumps(w), flush=True)
        return
    # name -> (streams (0: eager), total intra-op threads, stream costs)
    configs = {"eager": (0, a.threads, "measured"), "1 stream": (1, a.threads, "measured"),
               "1 stream x 1 thread": (1, 1, "measured"),
               f"{S} streams (model costs)": (S, a.threads, "model"),
               f"{S} streams": (S, a.threads, "measured")}
    out = {"threads": a.threads, "wait_policy": a.wait_policy or "default", "rounds": a.rounds,
           "calls": a.calls, "load": os.getloadavg(), "cpus": os.cpu_count(), "models": {}}
    for model in a.models:
        cells = {k: [] for k in configs}
        for _ in range(a.rounds):
            for k, (s, t, c) in configs.items():
                load = os.getloadavg()[0]
                cells[k].append({**run_cell(model, s, t, a.calls, a.wait_policy, c), "load": load})
        res = _table(model, cells)
        one, many = res["1 stream"], res[f"{S} streams"]
        res["speedup_median"] = round(one["median_ms"] / many["median_ms"], 3)
        res["speedup_best"] = round(one["best_ms"] / many["best_ms"], 3)
        w = res["why"] = run_cell(model, S, a.threads, a.calls, a.wait_policy, code=WHY, tag="WHY")
        w["intra_op_scaling"] = round(res["1 stream x 1 thread"]["median_ms"] / one["median_ms"], 3)
        w["intra_op_scaling_nodes"] = round(w["serial_1thread_ms"]
                                            / w[f"serial_{a.threads}threads_ms"], 3)
        w["streams_best_ms"] = round(max(w["critical_path_1thread_ms"],
                                         w["serial_1thread_ms"] / w["concurrency_2_threads"]), 3)
        out["models"][model] = res
        _print(model, res, w, a)
    out["load_after"] = os.getloadavg()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
