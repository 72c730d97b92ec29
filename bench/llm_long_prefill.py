"""Long-prompt prefill memory (issue #27 item 3): does a prompt of S tokens prefill with
attention memory O(S)? A random-weight Llama (hidden 128, 2 layers, heads 4/2, fp32,
batch 1) prefills one prompt of ``--seq`` tokens on three paths, each in a fresh process:

  eager-attn     transformers with ``attn_implementation="eager"`` (materializes the
                 [B, H, S, S] score matrix: O(S²))
  eager-sdpa     transformers with torch's ``scaled_dot_product_attention``
  opencann       ``opencann.llm.compile`` (prefill graph with the project's FlashAttention)

Per path: peak RSS growth during the prefill (``ru_maxrss`` after minus RSS before, MiB)
and time; for opencann also the prefill graph's arena (planned intermediates) at
S/4, S/2 and S, whose growth factor per doubling is ~2 when memory is O(S) (4 for O(S²)).
The score matrix one layer would hold is printed for scale: H·S²·4 bytes.

    PYTHONPATH=. .venv/bin/python bench/llm_long_prefill.py [--seq 8192]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def model():
    import torch
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=256, vocab_size=1000,
                                   max_position_embeddings=1 << 16)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def one(path: str, seq: int) -> dict:
    """Run one path in this process; returns its figures."""
    import torch
    import opencann.llm
    m = model()
    ids = torch.randint(3, 1000, (1, seq), generator=torch.Generator().manual_seed(1))
    res = {}
    if path == "opencann":
        arenas = {}
        for s in (seq // 4, seq // 2):   # smaller buckets first: the plan's growth
            g = opencann.llm.compile(m, max_seq_len=s, options={"prefill_buckets": [s]})
            g.steps.step(1, s)
            arenas[s] = g.steps.step(1, s).compiled.executor.plan.arena_bytes
            del g
        gen = opencann.llm.compile(m, max_seq_len=seq + 1, options={"prefill_buckets": [seq]})
        gen.steps.step(1, seq)   # compiled before the measurement
        arenas[seq] = gen.steps.step(1, seq).compiled.executor.plan.arena_bytes
        res["arena_mib"] = {s: b / 2 ** 20 for s, b in arenas.items()}
        run = lambda: gen.generate(ids, max_new_tokens=1)   # noqa: E731
    else:
        m.config._attn_implementation = "eager" if path == "eager-attn" else "sdpa"
        run = lambda: m(ids)   # noqa: E731
    before = rss_mib()
    t = time.perf_counter()
    with torch.no_grad():
        run()
    res["seconds"] = time.perf_counter() - t
    res["peak_growth_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--paths", default="eager-attn,eager-sdpa,opencann")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.seq)))
        return
    print(f"random Llama hidden 128, 2 layers, heads 4/2, fp32, batch 1, prompt {a.seq}; "
          f"one layer's score matrix would be {4 * a.seq ** 2 * 4 / 2 ** 20:.0f} MiB")
    for path in a.paths.split(","):
        out = subprocess.run([sys.executable, __file__, "--seq", str(a.seq), "--one", path],
                             capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        if out.returncode:
            print(f"  {path:11s} failed: {out.stderr.strip().splitlines()[-1]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        extra = ""
        if "arena_mib" in r:
            sizes = sorted(r["arena_mib"], key=int)
            extra = "; prefill arena " + ", ".join(f"S={s}: {r['arena_mib'][s]:.1f} MiB" for s in sizes)
        print(f"  {path:11s} peak RSS growth {r['peak_growth_mib']:8.1f} MiB, "
              f"{r['seconds']:6.2f} s{extra}")


if __name__ == "__main__":
    main()
