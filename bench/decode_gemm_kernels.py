"""The batch-B decode step of bench/llm.py's random Llama 125M with every GEMM bound to one
kernel, in one process: ms per decode step (the time between two streamed tokens) for
each of ``--kernels`` (default gemv, onednn_packed, addmm: kernels the per-shape
GEMM race chooses among at decode), generations interleaved kernel by kernel so a burst
of load on a shared host hits all of them; the least and the median over ``--reps``
generations of ``--new`` tokens. Greedy tokens are compared across kernels.

The race itself (`opencann.ops.kernels.cpu.LINEAR_CHOICES`) is bypassed: each generator
is compiled while ``LINEAR_CHOICES`` answers one kernel for every shape (a kernel that
cannot serve a GEMM leaves it to the race's fallback; the kernels bound are printed).
This isolates the kernels' effect on the whole step from the race's timing noise.

    PYTHONPATH=. .venv/bin/python bench/decode_gemm_kernels.py [--batch 8] [--new 40]
        [--reps 3] [--kernels gemv onednn_packed addmm] [--threads 1 --cpu-clock]

``--cpu-clock`` (with ``--threads 1``): the steps are stamped with the calling thread's CPU
time (``time.thread_time``) instead of the wall clock. With one thread every kernel runs
on the calling thread, so a step's CPU time leaves out the time other processes held the
CPU: an A/B that holds on a loaded shared host (it measures one core's step, not the
two-thread one).
"""
import argparse
import os
import statistics
import time

import torch
import transformers

import opencann.llm
from opencann.ops.kernels import cpu as cpu_kernels

# bench/llm.py's llama125m
LLAMA125M = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, intermediate_size=2048, vocab_size=32000,
                 max_position_embeddings=2048, tie_word_embeddings=False)


class _Forced(dict):
    """A `LINEAR_CHOICES` stand-in answering ``kernel`` for every GEMM shape."""

    def __init__(self, kernel: str):
        super().__init__()
        self.kernel = kernel

    def get(self, key, default=None):
        return self.kernel


def _compile(model, kernel: str, ids: torch.Tensor, new: int):
    """A generator whose decode GEMMs are bound to ``kernel`` (its step graphs are built
    by a first 4-token generation, done here); its greedy tokens; the kernels bound."""
    batch = ids.shape[0]
    saved = cpu_kernels.LINEAR_CHOICES
    cpu_kernels.LINEAR_CHOICES = _Forced(kernel)
    try:
        gen = opencann.llm.compile(model, max_seq_len=ids.shape[1] + new, max_batch=batch)
        tokens = gen.generate(ids, max_new_tokens=4)
    finally:
        cpu_kernels.LINEAR_CHOICES = saved
    cm = gen.steps.compiled()[(batch, 1)]
    bound = sorted({n.meta.get("kernel", "?") for n in cm.graph.nodes
                    if n.op in ("LinearAct", "GatedMLP")})
    return gen, tokens, bound


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernels", nargs="+", default=["gemv", "onednn_packed", "addmm"])
    ap.add_argument("--cpu-clock", action="store_true",
                    help="stamp steps with this thread's CPU time (needs --threads 1)")
    a = ap.parse_args()
    if a.cpu_clock and a.threads != 1:
        ap.error("--cpu-clock needs --threads 1 (other threads' CPU time is not the caller's)")
    clock = time.thread_time if a.cpu_clock else time.perf_counter
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA125M)).eval()
    ids = torch.randint(0, LLAMA125M["vocab_size"], (a.batch, a.prompt),
                        generator=torch.Generator().manual_seed(1))
    print(f"load average {os.getloadavg()[0]:.2f} at the start")
    gens, tokens = {}, {}
    for k in a.kernels:
        gens[k], tokens[k], bound = _compile(model, k, ids, a.new)
        print(f"{k}: kernels bound {bound}")
    first = next(iter(tokens.values()))
    print("greedy tokens equal across kernels:", all(torch.equal(t, first) for t in tokens.values()))
    steps = {k: [] for k in gens}
    for _ in range(a.reps):
        for k, gen in gens.items():
            stamps = []
            gen.generate(ids, max_new_tokens=a.new, streamer=lambda _t: stamps.append(clock()))
            steps[k] += [t1 - t0 for t0, t1 in zip(stamps[1:], stamps[2:])]
    for k, d in steps.items():
        print(f"{k:>14}: ms per step least {min(d) * 1e3:.1f} median {statistics.median(d) * 1e3:.1f}"
              f" ({len(d)} steps)")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
