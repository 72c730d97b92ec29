"""LLM decode speed (issue #27): decode tokens/s of a random-weight Llama, batch 1, fp32,
greedy, on three paths in one process — transformers' ``generate`` (eager, dynamic cache),
``opencann.llm`` with the ``eager`` step backend (torch runs the step graphs) and with the
``opencann`` backend (step graphs compiled by opencann; path ``unfused``: the same with the
decode-step fusions ``fuse_add_rms_norm``, ``fuse_rotary_mul`` and
``fuse_decode_kv_update``, ``fuse_apply_rotary_pos_emb`` switched off, an A/B in one
process) — then the per-op time of
each compiled decode step (the executor's profile, summed per op type) so the remaining gap
is visible, and the GEMM kernel each decode linear chose.

Decode tokens/s = (n - 1) / (time from the first generated token to the last), timed by a
streamer (so prefill / TTFT is not in it); per path the best of ``--runs`` rounds, the
paths interleaved in each round (a burst of load hits all of them). The machine is
shared: the 1-minute load average is printed with every figure. Bytes/token: the fp32
weights every decode step reads (every Linear and the LM head) plus the live KV cache;
``GB/s`` = bytes/token x tokens/s, the bandwidth the path achieves.

    PYTHONPATH=. .venv/bin/python bench/llm_decode.py [--layers 4] [--new 32] [--runs 3]
        [--profile-reps 5] [--paths transformers,eager,opencann[,unfused]] [--json out.json]

Environment that changes the result (printed): torch's and numba's thread counts, numba's
threading layer, ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` (read by the OpenMP runtime when
torch is imported).
"""
import argparse
import json
import os
import time
from collections import defaultdict

import numba
import torch
import transformers

import opencann.llm

#: the decode-step fusions the ``unfused`` path switches off
DECODE_FUSIONS = ["fuse_add_rms_norm", "fuse_rotary_mul", "fuse_decode_kv_update",
                  "fuse_apply_rotary_pos_emb"]


def load() -> str:
    """The 1-minute load average, as /proc/loadavg prints it."""
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "?"


class Clock:
    """A streamer (transformers' put/end) recording the time of every put."""

    def __init__(self):
        self.times = []

    def put(self, _tokens):
        self.times.append(time.perf_counter())

    def end(self):
        pass

    def decode_rate(self, n: int) -> float:
        """Tokens/s over the last ``n`` puts (the generated tokens): n - 1 decode steps."""
        t = self.times[-n:]
        return (n - 1) / (t[-1] - t[0])


def model_of(a) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads, intermediate_size=a.intermediate, vocab_size=a.vocab,
        max_position_embeddings=max(512, a.prompt + a.new), tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


def bytes_per_token(model, seq: int) -> int:
    """fp32 bytes a decode step reads: every Linear's weight (LM head included) + the KV
    cache up to ``seq`` positions (the embedding reads one row: left out)."""
    lin = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    c = model.config
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * seq
    return 4 * (lin + kv)


def profile_step(gen, reps: int):
    """Per op type: [total µs, count] in one compiled decode step (each node's least time
    over ``reps`` profiled runs), and how many GEMM nodes chose each kernel."""
    cm = gen.steps.step(1, 1).compiled
    args = (torch.tensor([[7]]), torch.tensor([40]), torch.tensor([41]), *gen.steps.views(1))
    best, op = {}, {}
    for _ in range(reps):
        for e in cm.profile(*args):
            if e.get("ph") == "X":
                node = e["args"]["node"]
                best[node] = min(best.get(node, float("inf")), e["dur"])
                op[node] = e["name"]
    per_type = defaultdict(lambda: [0.0, 0])
    for node, t in best.items():
        per_type[op[node]][0] += t
        per_type[op[node]][1] += 1
    kernels = defaultdict(int)
    for node in cm.graph.nodes:
        if node.op in ("LinearAct", "GatedMLP", "MatMul"):   # GEMMs
            kernels[f"{node.op}:{node.meta.get('kernel', 'mm')}"] += 1
    return dict(per_type), dict(kernels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile-reps", type=int, default=5)
    ap.add_argument("--paths", default="transformers,eager,opencann")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = model_of(a)
    model.generation_config.eos_token_id = None   # no stop token: every path makes --new tokens
    ids = torch.randint(3, a.vocab, (1, a.prompt), generator=torch.Generator().manual_seed(1))
    max_seq = a.prompt + a.new
    gens = {}
    t0 = time.perf_counter()
    paths = a.paths.split(",")
    for path in ("eager", "opencann", "unfused"):
        if path not in paths and path != "opencann":
            continue
        opts = {"backend": "eager" if path == "eager" else "opencann", "prefill_buckets": [a.prompt]}
        if path == "unfused":
            opts["disable"] = DECODE_FUSIONS
        gens[path] = opencann.llm.compile(model, max_seq_len=max_seq, options=opts)

    def run(path: str):
        clock = Clock()
        with torch.no_grad():
            if path == "transformers":
                out = model.generate(ids, max_new_tokens=a.new, min_new_tokens=a.new,
                                     do_sample=False, streamer=clock, pad_token_id=0)
            else:
                out = gens[path].generate(ids, max_new_tokens=a.new, streamer=clock)
        return out, clock.decode_rate(out.shape[1] - a.prompt)

    outs = {p: run(p)[0] for p in paths}   # warm-up: graphs built, kernels chosen
    compile_s = time.perf_counter() - t0
    same = {p: torch.equal(outs[p], outs[paths[0]]) for p in paths}
    print(f"random Llama: hidden {a.hidden}, {a.layers} layers, heads {a.heads}/{a.kv_heads}, "
          f"intermediate {a.intermediate}, vocab {a.vocab}; prompt {a.prompt}, {a.new} new tokens, "
          f"batch 1, fp32")
    print(f"torch {torch.__version__} threads {torch.get_num_threads()}; numba {numba.__version__} "
          f"layer {numba.threading_layer()} threads {numba.get_num_threads()}; "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}; warm-up {compile_s:.1f} s")
    print(f"tokens equal to {paths[0]}'s: {same}")
    best = {p: 0.0 for p in paths}
    loads = []
    for r in range(a.runs):
        row = []
        for p in paths:
            rate = run(p)[1]
            best[p] = max(best[p], rate)
            row.append(f"{p} {rate:6.1f}")
        loads.append(load())
        print(f"  run {r}: " + ", ".join(row) + f" tok/s (load {loads[-1]})")
    bpt = bytes_per_token(model, a.prompt + a.new // 2)
    print(f"decode tokens/s, best of {a.runs} (load {' '.join(loads)}); {bpt / 1e6:.1f} MB read per token:")
    for p in paths:
        print(f"  {p:13s} {best[p]:7.1f} tok/s  {best[p] * bpt / 1e9:5.1f} GB/s")
    result = {"config": vars(a), "tokens_per_s": best, "load": loads, "bytes_per_token": bpt,
              "same_tokens": same}
    for path in ("opencann", "unfused"):
        if path not in paths:
            continue
        per_type, kernels = profile_step(gens[path], a.profile_reps)
        total = sum(t for t, _ in per_type.values())
        gemm = sum(t for name, (t, _) in per_type.items() if name in ("LinearAct", "GatedMLP", "MatMul"))
        print(f"one compiled decode step ({path}), per op type (least of {a.profile_reps} profiled "
              f"runs per node; load {load()}): {total / 1e3:.2f} ms in kernels, GEMMs "
              f"{gemm / 1e3:.2f} ms, the rest {(total - gemm) / 1e3:.2f} ms, "
              f"{sum(n for _, n in per_type.values())} nodes")
        for name, (t, n) in sorted(per_type.items(), key=lambda kv: -kv[1][0]):
            print(f"  {name:24s} {n:4d} x  {t:9.1f} us  {100 * t / total:5.1f} %")
        print("  GEMM kernels chosen: " + ", ".join(f"{k} x{v}" for k, v in sorted(kernels.items())))
        result.update({f"profile_us_{path}": per_type, f"kernels_{path}": kernels})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
