"""Forward attention on CPU: naive (materialised scores), torch SDPA, opencann (numba).

Batch 1, 8 heads, fp32, d = 64 and 128, seq 1K..16K, 2 threads (torch and numba).
Each cell runs in a fresh subprocess; "peak extra MiB" is the RSS high-water mark
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) after the timed calls minus the one
before them (inputs allocated, kernels compiled and warmed on a small shape) - it
includes the output tensor. Time is the best of ``--reps`` calls. Naive cells whose
scores (two S x S fp32 matrices per head) would exceed ``--max-mem-gib`` are skipped
and the memory they would need is shown.

Usage: python bench/attention.py [--quick] [--max-mem-gib 8] [--seqs 1024 2048 ...]
"""
import argparse
import json
import os
import subprocess
import sys

CELL = r"""
import os, sys, time, resource, json
os.environ.setdefault("NUMBA_NUM_THREADS", "2")
import torch, torch.nn.functional as F
torch.set_num_threads(2)
from opencann.ops.flash_attention import flash_attention_forward
method, S, D, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def naive(q, k, v):
    s = (q @ k.transpose(-1, -2)) * D ** -0.5
    return torch.softmax(s, -1) @ v
fn = {"naive": naive, "sdpa": F.scaled_dot_product_attention,
      "opencann": lambda q, k, v: flash_attention_forward(q, k, v)[0]}[method]
w = [torch.randn(1, 8, 256, D) for _ in range(3)]
fn(*w)
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 8, S, D, generator=g) for _ in range(3))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ts = []
for _ in range(reps):
    t = time.perf_counter(); out = fn(q, k, v); ts.append(time.perf_counter() - t); del out
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print("CELL" + json.dumps({"t": min(ts), "mib": (peak - base) / 1024}))
"""


def run_cell(method, S, D, reps):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, NUMBA_NUM_THREADS="2", OMP_NUM_THREADS="2")
    p = subprocess.run([sys.executable, "-c", CELL, method, str(S), str(D), str(reps)],
                       cwd=root, env=env, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("CELL"):
            return json.loads(line[4:])
    raise RuntimeError(f"{method} S={S} D={D} failed:\n{p.stderr[-2000:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="seq 1K, 2K, 4K; d=64; 1 rep")
    ap.add_argument("--max-mem-gib", type=float, default=8.0)
    ap.add_argument("--seqs", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--dims", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    seqs, dims, reps = (a.seqs, a.dims, a.reps) if not a.quick else ([1024, 2048, 4096], [64], 1)
    print("| seq | d | naive ms | naive peak MiB | SDPA ms | SDPA peak MiB | opencann ms "
          "| opencann peak MiB | opencann / SDPA |")
    print("|---|---|---|---|---|---|---|---|---|")
    for D in dims:
        for S in seqs:
            need = 2 * 8 * S * S * 4 / 2**30
            cells = {}
            for m in ("naive", "sdpa", "opencann"):
                if m == "naive" and need > a.max_mem_gib:
                    cells[m] = None
                    continue
                cells[m] = run_cell(m, S, D, reps)
            nv = cells["naive"]
            nvs = (f"{nv['t'] * 1e3:.0f} | {nv['mib']:.0f}" if nv else
                   f"skipped | needs {need:.1f} GiB > cap")
            sd, oc = cells["sdpa"], cells["opencann"]
            print(f"| {S} | {D} | {nvs} | {sd['t'] * 1e3:.0f} | {sd['mib']:.0f} | "
                  f"{oc['t'] * 1e3:.0f} | {oc['mib']:.0f} | {oc['t'] / sd['t']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
