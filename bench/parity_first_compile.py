"""First compile in a fresh process, with a cold and with a warm eager-parity probe cache
(`opencann.ops.parity.cache`).

A small MLP with a spelled-out LayerNorm, a spelled-out RMSNorm and an erf GELU (what
``fuse_layer_norm``, ``fuse_rms_norm`` and ``fuse_gelu_erf`` probe this CPU for) is
compiled in a new Python process twice, both pointed (``OPENCANN_CACHE_DIR``) at the same
new, empty cache directory: the first pays the probes, the second reads their answers.
Each process also times one eager forward (best of 20) and prints the compile time as a
multiple of it, and the seconds each probe took (timings on a shared machine are noisy:
compare the ratios).

    PYTHONPATH=$PWD python bench/parity_first_compile.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, math, time
import torch
import opencann
from opencann.ops import parity


class MLP(torch.nn.Module):
    def __init__(self, d=256):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(d, d) for _ in range(3))
        self.g, self.w = torch.nn.Parameter(torch.ones(d)), torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        h = self.a(x)
        mu = h.mean(-1, keepdim=True)
        h = (h - mu) / torch.sqrt(((h - mu) ** 2).mean(-1, keepdim=True) + 1e-5) * self.g
        h = 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))
        h = self.b(h)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        return self.c(h)


torch.manual_seed(0)
m, x = MLP().eval(), torch.randn(8, 256)
with torch.no_grad():
    m(x)
    eager = min(b - a for a, _, b in [(time.perf_counter(), m(x), time.perf_counter()) for _ in range(20)])
t0 = time.perf_counter()
cm = opencann.compile(m, (x,))
comp = time.perf_counter() - t0
fused = sorted({a["pass"] for a in cm.report.applied if a["pass"].startswith("fuse_")})
print(json.dumps({"compile_s": comp, "eager_s": eager, "probes_run": sum(parity.RUNS.values()),
                  "probe_s": {k: round(v, 3) for k, v in parity.probe.SECONDS.items()},
                  "fused": fused, "nodes": len(cm.graph.nodes)}))
"""


def run(cache_dir: str) -> dict:
    env = dict(os.environ, OPENCANN_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    with tempfile.TemporaryDirectory() as d:
        for label in ("cold cache", "warm cache"):
            r = run(d)
            print(f"{label}: first compile {r['compile_s']:.2f} s = {r['compile_s'] / r['eager_s']:.0f}× "
                  f"one eager forward ({r['eager_s'] * 1e3:.3f} ms, best of 20); "
                  f"{r['probes_run']} probes run {r['probe_s']}; fused {', '.join(r['fused'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
