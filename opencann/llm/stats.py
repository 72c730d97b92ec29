"""`GenerationStats`: what a `Generator` measured and built (``Generator.stats``).

Times are wall-clock seconds of ``time.perf_counter``; rates are tokens per second.
Per call (the last ``generate``): ``ttft_s`` (time to first token: from the call's start
to the first new token of every row, prefill and its sampling included), ``prefill_tokens``
(real prompt tokens, padding not counted) and ``prefill_tokens_per_s``, ``decode_steps``,
``decode_tokens`` (steps x live rows) and ``decode_tokens_per_s``, ``graphs_built_after_warmup``
and ``plans_built_after_warmup`` (step graphs and memory plans built after the call's
first decode step: zero when nothing recompiles per token). Totals over the generator's
life: ``graphs_built`` (prefill and decode step graphs), ``captures`` (torch.export
captures those took: one per decode graph, one for a batch size's first prefill
bucket and one shared by its later buckets, `opencann.engine.per_shape.SymbolicCapture`), ``recompiles`` (graphs built
again for a shape that had one), ``memory_plans`` (memory plans of the compiled step
graphs; 0 on the eager backend), ``kv_cache_bytes`` (the preallocated caches),
``weight_bytes`` (the weights the generator holds: ``module_weight_bytes``, the module's
own parameters and buffers, each storage once (of which ``shared_weight_bytes``: the
Q/K/V and gate/up weights laid out as the step graphs' concatenated GEMM operands, which
the graphs read as they are instead of copying: held once,
`opencann.llm.steps.hold_weights_once`), + ``packed_bytes``, the copies its step
graphs and their GEMM kernels keep beside them, each storage once, by kind in
``packed_bytes_by_kind``: ``qkv_concat``, ``gate_up_concat``, ``addmm_kn`` ([k, n]
copies), ``onednn_packed`` (oneDNN's blocked layout), ``gemv`` ([n, k] copies),
``panel`` (the panel GEMM's [P, k, NR] panels), ``constants`` (folded at compile time); `opencann.llm.steps.step_memory`),
``arena_bytes`` (the step graphs' activation arena: one buffer they all run in, the
largest graph's size, `opencann.llm.steps.StepGraphs._share_arenas`), ``graphs`` (the step
graphs by key, e.g. ``"prefill b2 t32"``; a loaded generator's too), and
``peak_rss_bytes``: the process's peak resident set so far (`peak_rss_bytes`, read after
each graph build and each ``generate``; 0 where the platform gives none). The goal: peak
RSS = the Python process (interpreter, torch, code) + weights + KV cache + arena.
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List


def peak_rss_bytes() -> int:
    """This process's peak resident set in bytes: VmHWM of /proc/self/status (Linux),
    else ``getrusage``'s ``ru_maxrss`` (KiB on Linux, bytes on macOS), else 0 (Windows).
    Never raises."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


@dataclass
class GenerationStats:
    """Counters and timings of a `Generator` (see the module docstring for each field)."""

    kv_cache_bytes: int = 0
    weight_bytes: int = 0
    module_weight_bytes: int = 0
    shared_weight_bytes: int = 0
    packed_bytes: int = 0
    packed_bytes_by_kind: Dict[str, int] = field(default_factory=dict)
    arena_bytes: int = 0
    peak_rss_bytes: int = 0
    graphs_built: int = 0
    captures: int = 0
    recompiles: int = 0
    memory_plans: int = 0
    graphs: List[str] = field(default_factory=list)
    graphs_loaded: int = 0
    ttft_s: float = 0.0
    prefill_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_tokens_per_s: float = 0.0
    graphs_built_after_warmup: int = 0
    plans_built_after_warmup: int = 0

    def begin_call(self) -> float:
        """Reset the per-call fields; returns the call's start time (s)."""
        self.ttft_s = self.prefill_tokens_per_s = self.decode_tokens_per_s = 0.0
        self.prefill_tokens = self.decode_steps = self.decode_tokens = 0
        self.graphs_built_after_warmup = self.plans_built_after_warmup = 0
        return time.perf_counter()

    def graph_built(self, key: str, plans: int) -> None:
        """Count one step graph ``key`` built with ``plans`` memory plans; a key built
        before counts as a recompile."""
        self.recompiles += key in self.graphs
        self.graphs.append(key)
        self.graphs_built += 1
        self.memory_plans += plans

    def set_memory(self, mem: Any) -> None:
        """Take the weight, packed and arena bytes of ``mem`` (a `steps.StepMemory`), and
        the process's peak RSS now."""
        self.module_weight_bytes, self.packed_bytes = mem.module_bytes, mem.packed_bytes
        self.shared_weight_bytes = mem.shared_bytes
        self.packed_bytes_by_kind = dict(mem.by_kind)
        self.weight_bytes = mem.module_bytes + mem.packed_bytes
        self.arena_bytes = mem.arena_bytes
        self.peak_rss_bytes = peak_rss_bytes()

    def prefill_done(self, start: float, prompt_tokens: int, seconds: float) -> None:
        """Record the prefill of ``prompt_tokens`` real tokens taking ``seconds`` and the
        time to first token since ``start`` (a perf_counter time)."""
        self.prefill_tokens = prompt_tokens
        self.prefill_tokens_per_s = prompt_tokens / seconds if seconds > 0 else 0.0
        self.ttft_s = time.perf_counter() - start

    def decode_done(self, steps: int, tokens: int, seconds: float) -> None:
        """Record ``steps`` decode steps making ``tokens`` row-tokens in ``seconds``."""
        self.decode_steps, self.decode_tokens = steps, tokens
        self.decode_tokens_per_s = tokens / seconds if seconds > 0 else 0.0
        self.peak_rss_bytes = peak_rss_bytes()

    def as_dict(self) -> Dict[str, Any]:
        """Every field, as a plain dict."""
        return asdict(self)

    def summary(self) -> str:
        """One line: TTFT, prefill and decode rates, graphs and captures, recompiles, plans, cache."""
        return (f"TTFT {self.ttft_s * 1e3:.1f} ms, prefill {self.prefill_tokens_per_s:.1f} tok/s, "
                f"decode {self.decode_tokens_per_s:.1f} tok/s ({self.decode_steps} steps), "
                + (f"{self.graphs_loaded} graphs loaded, " if self.graphs_loaded else "")
                + f"{self.graphs_built} graphs ({self.captures} captures), {self.recompiles} recompiles, "
                f"{self.memory_plans} memory plans, KV cache {self.kv_cache_bytes / 2**20:.2f} MiB, "
                f"weights {self.weight_bytes / 2**20:.1f} MiB (module {self.module_weight_bytes / 2**20:.1f}"
                + (f", {self.shared_weight_bytes / 2**20:.1f} of it the graphs' concatenations"
                   if self.shared_weight_bytes else "")
                + f" + packed {self.packed_bytes / 2**20:.1f}), arena {self.arena_bytes / 2**20:.1f} MiB"
                + (f", peak RSS {self.peak_rss_bytes / 2**20:.0f} MiB" if self.peak_rss_bytes else ""))


__all__ = ["GenerationStats", "peak_rss_bytes"]
