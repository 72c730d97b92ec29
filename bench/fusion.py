"""The pattern fusions' gain (issue #16 items 2 and 5): each model compiled with the
fusions on and with them off (``disable``), and eager, timed in interleaved rounds in one
process (median of each round's median, so a noisy neighbour hits all three alike).

    .venv/bin/python bench/fusion.py [--rounds 5] [--runs 10] [--threads 2] [--only gpt2]

Models: GPT-2 small (spelled-out tanh GELU, seq 128) and a Llama from a transformers
config (RMSNorm, SiLU, gated MLP; hidden 512, 4 layers, seq 128). Prints a Markdown table
and writes bench/results/fusion.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import opencann  # noqa: E402
from opencann import zoo  # noqa: E402
from opencann.timing import median_ms  # noqa: E402

PATTERNS = ["fuse_silu", "fuse_gelu_tanh", "fuse_gelu_erf", "fuse_rms_norm", "fuse_layer_norm",
            "fuse_gated_mlp"]


def llama(seq: int = 128):
    """A Llama from its transformers config, seeded random weights: (module, inputs)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=1000, use_cache=False)
    return LlamaForCausalLM(cfg).eval(), (torch.randint(0, 1000, (1, seq)),)


def models(only):
    if not only or "gpt2" in only:
        z = zoo.get("gpt2", seq=128)
        yield "gpt2 (seq 128)", z.model, z.example_inputs
    if not only or "llama" in only:
        m, x = llama()
        yield "llama-4L-512 (seq 128)", m, x


def bench(name, model, inputs, rounds, runs):
    on = opencann.compile(model, inputs)
    off = opencann.compile(model, inputs, options={"disable": PATTERNS})
    fired = sorted({a["pass"] for a in on.report.applied if a["pass"] in PATTERNS})
    times = {"eager": [], "fusions off": [], "fusions on": []}
    with torch.no_grad():
        for _ in range(rounds):
            for k, f in (("eager", model), ("fusions off", off), ("fusions on", on)):
                times[k].append(median_ms(f, *inputs, runs=runs))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"model": name, "fired": fired, "ms": med, "rounds": times,
            "gain_vs_off": med["fusions off"] / med["fusions on"],
            "speedup_vs_eager": med["eager"] / med["fusions on"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = [bench(n, m, x, a.rounds, a.runs) for n, m, x in models(a.only)]
    print("| model | fusions fired | eager ms | fusions off ms | fusions on ms | on vs off |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ms = r["ms"]
        print(f"| {r['model']} | {', '.join(r['fired'])} | {ms['eager']:.1f} | "
              f"{ms['fusions off']:.1f} | {ms['fusions on']:.1f} | {r['gain_vs_off']:.2f}x |")
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "fusion.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
