"""Snapshot of what compiling the zoo produces: for each zoo model (small configs) on each
device, the compile report (times removed) and the executor's generated source, written as
one JSON file. Two snapshots are compared to show a refactoring changed nothing:

    python bench/compile_snapshot.py --out before.json   # on the old commit
    python bench/compile_snapshot.py --out after.json --compare before.json

Exit status 1 (with the differing entries named) when ``--compare`` finds a difference.
"""
from __future__ import annotations

import argparse
import json
import re
import sys

import torch

import opencann
from opencann import zoo

MODELS = {"minilm": dict(seq=16), "bert-base": dict(seq=16), "gpt2": dict(seq=16),
          "resnet50": dict(size=64)}
DEVICES = ("cpu", "vnpu:ascend910b")
_TIMING = re.compile(r"(seconds|_ms|_us|time|elapsed)", re.I)


def _scrub(o):
    """The report without wall-clock fields (they differ run to run)."""
    if isinstance(o, dict):
        return {k: _scrub(v) for k, v in o.items() if not _TIMING.search(str(k))}
    if isinstance(o, list):
        return [_scrub(v) for v in o]
    return o


def snapshot() -> dict:
    out = {}
    for name, kw in MODELS.items():
        zm = zoo.get(name, **kw)
        for dev in DEVICES:
            torch.manual_seed(0)
            cm = opencann.compile(zm.model, zm.example_inputs, device=dev)
            rep = _scrub(cm.report.to_dict())
            ex = getattr(cm, "executor", None)
            out[f"{name}@{dev}"] = {"report": rep, "source": getattr(ex, "_src", "")}
            print(f"{name}@{dev}: {len(cm.graph.nodes)} nodes", file=sys.stderr)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare")
    a = ap.parse_args()
    snap = snapshot()
    with open(a.out, "w") as f:
        json.dump(snap, f, indent=1, sort_keys=True, default=str)
    if not a.compare:
        return 0
    with open(a.compare) as f:
        old = json.load(f)
    new = json.loads(json.dumps(snap, sort_keys=True, default=str))
    bad = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    for k in bad:
        for part in ("report", "source"):
            if (old.get(k) or {}).get(part) != (new.get(k) or {}).get(part):
                print(f"differs: {k} {part}")
    print("identical" if not bad else f"{len(bad)} of {len(new)} entries differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
