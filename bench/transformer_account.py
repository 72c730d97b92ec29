"""Where a compiled transformer's call goes, op type by op type, at batch 1: each node's
step in the call (`Executor.node_seconds`: its kernel, copy-out and the generated code's
Python since the previous node, least of ``--reps`` calls) summed per op type, against
the same bound kernel alone (`alone`: the node's kernel factory bound afresh, called in
a loop on the inputs the call gave it, least time: hot caches, an awake OpenMP team) for
the op types that have a kernel factory (LinearAct, ScaledDotProductAttention, the fused
norms), and the whole call (median and least of ``--calls``). The difference "in the
call - alone" is what sequencing costs (the GEMM before a node evicting its inputs, the
OpenMP team waking between kernels), the node sum against the call is the executor's
own cost (guards, outputs) and the noise of the host.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/transformer_account.py --model minilm
    .venv/bin/python bench/transformer_account.py --model bert-base --precision fp32

``--precision bf16`` (default) compiles with ``precision_mode="allow_mix_precision_bf16"``,
``fp32`` without options, ``int8`` is every linear static int8 inside the bf16 graph
(``opencann.quantize`` calibrated on the example, ``precision_mode`` bf16: the norms write
the linears' uint8 input). Models: the zoo's (`opencann.zoo.get`, seeded random tokens at
seq 128; MiniLM with its real weights where the package is installed). Prints a Markdown
table (µs per call and per node) and the call; nothing is written.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import opencann  # noqa: E402
from opencann import zoo  # noqa: E402
from opencann.devices.cpu import best_time_us  # noqa: E402
from opencann.ops import get_op  # noqa: E402

BF16 = "allow_mix_precision_bf16"


def alone(cm, inputs: List[torch.Tensor], reps: int) -> Dict[str, float]:
    """Node name -> least µs of its kernel alone (module docstring), for the nodes whose
    OpDef has a cpu kernel factory; inputs captured from one observed call (cloned: the
    arena's buffers are reused)."""
    graph = cm.executor.graph
    vals = {v.id: x for v, x in zip(graph.inputs, inputs)}
    vals.update({c.id: c.const for c in graph.constants})

    def keep(node, outs):
        for o, t in zip(node.outputs, outs):
            vals[o.id] = t.clone() if isinstance(t, torch.Tensor) else t
    with torch.no_grad():
        cm.executor.run_observed(inputs, keep)
        times = {}
        for node in graph.nodes:
            factory = get_op(node.op).kernel_factories.get("cpu")
            if factory is None:
                continue
            kernel = factory(node, [v.desc for v in node.inputs], [v.const for v in node.inputs])
            args = [vals[v.id] for v in node.inputs]
            times[node.name] = best_time_us(lambda: kernel(*args), reps)
    return times


def account(name: str, precision: str, reps: int, calls: int) -> None:
    """Compile ``name`` at batch 1 and print its table (module docstring)."""
    zm = zoo.get(name, batch=1)
    x = list(zm.example_inputs)
    options = {"precision_mode": BF16} if precision in ("bf16", "int8") else {}
    if precision == "int8":
        cm = opencann.quantize(zm.model, [tuple(x)], options=options)
    else:
        cm = opencann.compile(zm.model, tuple(x), options=options)
    with torch.no_grad():
        for _ in range(3):
            cm(*x)
        ts = []
        for _ in range(calls):
            t0 = time.perf_counter_ns()
            cm(*x)
            ts.append((time.perf_counter_ns() - t0) / 1e6)
    in_call = cm.executor.node_seconds(x, reps=reps)
    solo = alone(cm, x, reps)
    rows: Dict[str, list] = collections.defaultdict(lambda: [0.0, 0, 0.0, 0])
    for node in cm.executor.graph.nodes:
        kind = node.op + (f" ({node.meta['kernel']})" if isinstance(node.meta.get("kernel"), str) else "")
        r = rows[kind]
        r[0] += in_call[node.name] * 1e6
        r[1] += 1
        if node.name in solo:
            r[2] += solo[node.name]
            r[3] += 1
    total = sum(in_call.values()) * 1e3
    print(f"\n{name} {precision} batch 1, {torch.get_num_threads()} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(default)')}, load {os.getloadavg()[0]:.2f}")
    print("| op (kernel) | nodes | in the call, µs | per node | alone, µs | in the call / alone |")
    print("|---|---|---|---|---|---|")
    for kind, (t, n, s, ns) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
        tail = f"{s:.0f} | {t / s:.2f}" if ns else "— | —"
        print(f"| {kind} | {n} | {t:.0f} | {t / n:.1f} | {tail} |")
    print(f"nodes summed {total:.2f} ms; call median {statistics.median(ts):.2f} ms, least "
          f"{min(ts):.2f} ms ({calls} calls)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="*", default=["minilm"], choices=["minilm", "bert-base"])
    ap.add_argument("--precision", choices=["bf16", "fp32", "int8"], default="bf16")
    ap.add_argument("--reps", type=int, default=20, help="calls per node timing (least kept)")
    ap.add_argument("--calls", type=int, default=40, help="timed whole calls (median, least)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    for name in a.model:
        account(name, a.precision, a.reps, a.calls)


if __name__ == "__main__":
    main()
