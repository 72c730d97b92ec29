"""`GenerationStats`: what a `Generator` measured and built (``Generator.stats``).

Times are wall-clock seconds of ``time.perf_counter``; rates are tokens per second.
Per call (the last ``generate``): ``ttft_s`` (time to first token: from the call's start
to the first new token of every row, prefill and its sampling included), ``prefill_tokens``
(real prompt tokens, padding not counted) and ``prefill_tokens_per_s``, ``decode_steps``,
``decode_tokens`` (steps x live rows) and ``decode_tokens_per_s``, ``graphs_built_after_warmup``
and ``plans_built_after_warmup`` (step graphs and memory plans built after the call's
first decode step: zero when nothing recompiles per token). Totals over the generator's
life: ``graphs_built`` (prefill and decode step graphs), ``recompiles`` (graphs built
again for a shape that had one), ``memory_plans`` (memory plans of the compiled step
graphs; 0 on the eager backend), ``kv_cache_bytes`` (the preallocated caches),
``weight_bytes`` (the weights the step graphs hold, each storage once: the module's
weights they share, merged Q/K/V copies, and the packed copies their GEMM kernels made:
oneDNN's blocked layout, the decode GEMMs' [k, n]), ``arena_bytes`` (the step graphs'
activation arenas, one per graph), and ``graphs`` (the step graphs by key, e.g.
``"prefill b2 t32"``; a loaded generator's too). Memory beyond the Python process:
weights + KV cache + arenas.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List


@dataclass
class GenerationStats:
    """Counters and timings of a `Generator` (see the module docstring for each field)."""

    kv_cache_bytes: int = 0
    weight_bytes: int = 0
    arena_bytes: int = 0
    graphs_built: int = 0
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

    def as_dict(self) -> Dict[str, Any]:
        """Every field, as a plain dict."""
        return asdict(self)

    def summary(self) -> str:
        """One line: TTFT, prefill and decode rates, graphs, recompiles, plans, cache."""
        return (f"TTFT {self.ttft_s * 1e3:.1f} ms, prefill {self.prefill_tokens_per_s:.1f} tok/s, "
                f"decode {self.decode_tokens_per_s:.1f} tok/s ({self.decode_steps} steps), "
                + (f"{self.graphs_loaded} graphs loaded, " if self.graphs_loaded else "")
                + f"{self.graphs_built} graphs, {self.recompiles} recompiles, "
                f"{self.memory_plans} memory plans, KV cache {self.kv_cache_bytes / 2**20:.2f} MiB, "
                f"weights {self.weight_bytes / 2**20:.1f} MiB, arenas {self.arena_bytes / 2**20:.1f} MiB")


__all__ = ["GenerationStats"]
