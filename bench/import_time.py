"""Import cost of opencann against torch's, each in fresh processes (best of N wall
times, seconds), and which heavy modules a bare ``import opencann`` and ``opencann
--help`` load. Goal (issue "the house"): ``import opencann`` <= 1.3x ``import torch``;
``--help`` without torch._dynamo or transformers.

    python bench/import_time.py [--runs 5]

Run from an installed opencann (``pip install -e .``): without the installed
``torch_dynamo_backends`` entry point, ``import opencann`` registers the torch.compile
backend itself and pays torch._dynamo's import.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

HEAVY = ("torch", "torch._dynamo", "transformers", "onnx", "numba", "sympy")
CASES = {"import torch": "import torch",
         "import opencann": "import opencann",
         "import torch, opencann": "import torch, opencann",
         "opencann --help": "import sys; sys.argv = ['opencann', '--help']\n"
                            "from opencann.cli import main\ntry:\n    main()\nexcept SystemExit:\n    pass"}


def best_wall(code: str, runs: int) -> float:
    """Best wall time (s) of ``python -c code`` over ``runs`` fresh processes."""
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)
        best = min(best, time.perf_counter() - t0)
    return best


def loaded(code: str) -> list:
    """The `HEAVY` modules loaded after running ``code`` in a fresh process."""
    probe = code + f"\nimport sys\nprint(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True)
    return [m for m in out.stdout.rstrip("\n").split("\n")[-1].split(",") if m]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    base = None
    for name, code in CASES.items():
        t = best_wall(code, args.runs)
        base = base or t
        print(f"{name:24s} {t:6.2f} s  {t / base:5.2f}x import torch   loads: "
              f"{', '.join(loaded(code)) or '-'}")


if __name__ == "__main__":
    main()
