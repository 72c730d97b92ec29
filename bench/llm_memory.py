"""Where opencann.llm's peak memory goes: resident set (VmRSS) and its peak (VmHWM) of
/proc/self/status sampled at each phase of compiling and running a generator, with the
bytes attributed (issue #27's goal: peak = weights + KV cache + arena).

Phases: imports; the model built (bench/llm.py's fp32 folder loaded as the bench loads
it, `opencann.llm.sources.load_causal_lm`); ``opencann.llm.compile`` (caches); the
module's Q/K/V and gate/up weights laid out as the graphs' concatenations
(`opencann.llm.steps.hold_weights_once`, before the first graph); each step graph's build, split into capture (torch.export), conversion, the passes and the bind
(kernels chosen: every GEMM race, `opencann.ops.kernels.cpu.gemm_kernel`, is one
sub-phase); the first ``generate``; a second one (steady decode). The peak of a phase is
read by resetting VmHWM at its start (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0)
and folding every reset into the phases still open, so nested phases keep their own
peaks. A phase's transient = its peak - the larger of its start and end RSS: memory it
held and gave back.

Attribution at the end (`GenerationStats`: the module's weights, each packed copy kind,
arenas, KV cache), the rest of RSS over the imports' baseline, and the same after
glibc's ``malloc_trim(0)`` (freed memory glibc kept resident).

    HF_HUB_OFFLINE=1 PYTHONPATH=$PWD python bench/llm_memory.py [--model llama125m]
        [--batch 1] [--prompt 32] [--new 64] [--threads 2]

Linux only (reads /proc). Prints two Markdown tables.
"""
from __future__ import annotations

import argparse
import atexit
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MiB = 2 ** 20


def status_kib(field: str) -> int:
    """``field`` (e.g. "VmRSS") of /proc/self/status in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


class Meter:
    """Phases with their RSS at start and end and their peak (VmHWM reset at each start,
    every reset folded into the phases still open)."""

    def __init__(self):
        self.open: List[dict] = []
        self.rows: List[dict] = []

    def _fold(self) -> None:
        hwm = status_kib("VmHWM") * 1024
        for p in self.open:
            p["peak"] = max(p["peak"], hwm)

    def _reset(self) -> None:
        self._fold()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def begin(self, name: str, depth: int = 0) -> dict:
        self._reset()
        rss = status_kib("VmRSS") * 1024
        p = dict(name=name, depth=depth, start=rss, peak=rss, t=time.perf_counter())
        self.open.append(p)
        self.rows.append(p)
        return p

    def end(self, p: dict) -> dict:
        self._fold()
        p["end"] = status_kib("VmRSS") * 1024
        p["anon"], p["file"] = status_kib("RssAnon") * 1024, status_kib("RssFile") * 1024
        p["s"] = time.perf_counter() - p["t"]
        self.open.remove(p)
        return p


def wrap(meter: Meter, owner, attr: str, label, depth: int) -> None:
    """Replace ``owner.attr`` by a wrapper measured as a phase named ``label(*args)``."""
    fn = getattr(owner, attr)

    def measured(*args, **kwargs):
        p = meter.begin(label(*args, **kwargs), depth)
        try:
            return fn(*args, **kwargs)
        finally:
            meter.end(p)
    setattr(owner, attr, measured)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama125m", choices=("llama125m", "smollm2"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--races", action="store_true", help="list every GEMM race's transient")
    args = ap.parse_args(argv)

    meter = Meter()
    p = meter.begin("imports (torch, transformers, opencann)")
    import torch
    import transformers  # noqa: F401
    import opencann.llm
    import opencann.engine
    from opencann.engine import entry
    from opencann.engine.binding import BindKernels
    from opencann.ops.kernels import cpu
    from opencann.llm.sources import load_causal_lm
    import llm as bench_llm
    torch.set_num_threads(args.threads)
    meter.end(p)
    base = p["end"]

    work = tempfile.mkdtemp(prefix="llm_memory_")
    atexit.register(shutil.rmtree, work, True)   # the saved model (~500 MB), once its mapping is gone
    folder = os.path.join(work, args.model)
    # written by a child process: the model built for saving would stay in this one's heap
    subprocess.run([sys.executable, "-c", f"import sys; sys.path[:0] = {[HERE, os.path.dirname(HERE)]!r}; "
                    f"import llm; llm.save_model({args.model!r}, {folder!r})"], check=True)
    p = meter.begin("model loaded (load_causal_lm)")
    model, _ = load_causal_lm(folder)
    model.generation_config.eos_token_id = None
    meter.end(p)

    def graph_label(model, example, **kw):
        t = example[0].shape
        return f"build {'decode' if t[1] == 1 else 'prefill'} b{t[0]} t{t[1]}"
    wrap(meter, opencann.engine, "compile_module", graph_label, 1)
    wrap(meter, entry, "capture", lambda *a, **k: "capture (torch.export)", 2)
    wrap(meter, entry, "convert_exported", lambda *a, **k: "convert to IR", 2)
    wrap(meter, entry, "run_pipeline", lambda *a, **k: "passes + bind", 2)
    wrap(meter, BindKernels, "run", lambda *a, **k: "bind (kernels, races)", 3)
    import opencann.llm.steps as llm_steps
    if hasattr(llm_steps, "hold_weights_once"):
        wrap(meter, llm_steps, "hold_weights_once",
             lambda *a, **k: "weights laid out once (Q/K/V, gate/up concatenations)", 1)
    races: List[dict] = []

    def race_label(node, x, wt, *a, **k):
        return f"gemm {node.name} {tuple(int(d) for d in x.shape)}x{tuple(wt.shape) if wt is not None else ''}"
    gemm = cpu.gemm_kernel

    def gemm_measured(node, x, wt, *a, **k):
        r = meter.begin(race_label(node, x, wt), 4)
        try:
            return gemm(node, x, wt, *a, **k)
        finally:
            meter.end(r)
            r["kernel"] = node.meta.get("kernel")
            races.append(r)
            meter.rows.remove(r)
    cpu.gemm_kernel = gemm_measured
    import opencann.ops.kernels.cpu_patterns as cpu_patterns
    cpu_patterns.gemm_kernel = gemm_measured

    p = meter.begin("numba GEMV loaded and run once (machine code, LLVM)")
    from opencann.ops.kernels.gemv_cpu import gemv
    gemv(torch.randn(1, 64), torch.randn(64, 64), None)
    meter.end(p)
    p = meter.begin("opencann.llm.compile (caches)")
    gen = opencann.llm.compile(model, max_seq_len=args.prompt + args.new, max_batch=args.batch)
    meter.end(p)
    ids = bench_llm.prompt_ids(args.batch, args.prompt, model.config.vocab_size)
    p = meter.begin("first generate (builds the step graphs)")
    gen.generate(ids, max_new_tokens=args.new)
    meter.end(p)
    p = meter.begin("second generate (steady decode)")
    gen.generate(ids, max_new_tokens=args.new)
    meter.end(p)
    s = gen.stats
    rss_end = status_kib("VmRSS") * 1024
    anon_end, file_end = status_kib("RssAnon") * 1024, status_kib("RssFile") * 1024
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)
    rss_trim = status_kib("VmRSS") * 1024

    print(f"\n{args.model}, batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, "
          f"{args.threads} threads, torch {torch.__version__}\n")
    print("| phase | RSS start MiB | RSS end MiB (anonymous + file) | peak MiB | transient MiB | s |")
    print("|---|---|---|---|---|---|")
    for r in meter.rows:
        trans = r["peak"] - max(r["start"], r["end"])
        print(f"| {'  ' * r['depth']}{r['name']} | {r['start'] / MiB:.0f} | {r['end'] / MiB:.0f} "
              f"({r['anon'] / MiB:.0f} + {r['file'] / MiB:.0f}) | "
              f"{r['peak'] / MiB:.0f} | {trans / MiB:.0f} | {r['s']:.1f} |")
    kept = sorted(races, key=lambda r: r["peak"] - max(r["start"], r["end"]), reverse=True)
    tr = [r["peak"] - max(r["start"], r["end"]) for r in races]
    print(f"\nGEMM binds: {len(races)}, largest transient {max(tr, default=0) / MiB:.0f} MiB, "
          f"kept {sum(r['end'] - r['start'] for r in races) / MiB:.0f} MiB in all")
    for r in kept[:len(kept) if args.races else 5]:
        print(f"  {r['name']} -> {r['kernel']}: kept {(r['end'] - r['start']) / MiB:.1f} MiB, "
              f"transient {(r['peak'] - max(r['start'], r['end'])) / MiB:.1f} MiB")

    rows = [("module weights (parameters and buffers, each storage once)", s.module_weight_bytes)]
    rows += [(f"packed: {k}", v) for k, v in sorted(s.packed_bytes_by_kind.items())]
    rows += [("KV cache", s.kv_cache_bytes), ("arenas", s.arena_bytes)]
    acc = sum(v for _, v in rows)
    print(f"\n| at the end | MiB |\n|---|---|")
    print(f"| RSS after imports (baseline) | {base / MiB:.0f} |")
    for name, v in rows:
        print(f"| {name} | {v / MiB:.1f} |")
        if name.startswith("module weights"):   # counted in the module's bytes, held once
            print(f"| of which the graphs' Q/K/V and gate/up concatenations (held once) | "
                  f"{getattr(s, 'shared_weight_bytes', 0) / MiB:.1f} |")
    print(f"| sum (weights + packed + KV + arenas) | {acc / MiB:.0f} |")
    print(f"| RSS at the end (anonymous + file-backed) | {rss_end / MiB:.0f} ({anon_end / MiB:.0f} + "
          f"{file_end / MiB:.0f}) |")
    print(f"| rest (RSS - baseline - sum) | {(rss_end - base - acc) / MiB:.0f} |")
    print(f"| RSS after malloc_trim(0) | {rss_trim / MiB:.0f} |")
    print(f"| peak RSS (VmHWM over the run, GenerationStats.peak_rss_bytes) | "
          f"{max(r['peak'] for r in meter.rows) / MiB:.0f} ({s.peak_rss_bytes / MiB:.0f}) |")
    print(f"| peak over baseline + sum | {(max(r['peak'] for r in meter.rows) - base - acc) / MiB:.0f} |")


if __name__ == "__main__":
    main()
