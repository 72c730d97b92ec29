"""The step graphs of a `Generator`: one prefill graph per (batch size, prompt bucket)
and ONE decode graph per batch size, each built once on first use and kept (`StepGraphs`).

Shapes are the only thing a graph is specialised on; positions and live lengths are
int tensors (data), so the decode graph of a batch size serves every position. Prompts
are padded up to a bucket (ATC's gear idea, ``--dynamic_dims``: a few fixed shapes
instead of one per length; `prefill_buckets`), batches up to a batch size
(`batch_sizes`); padded rows and tokens never reach real ones, whatever they compute:
rows are independent, a prompt's padding comes after its tokens (causal), its keys and
values are zeroed before attention (`builder.attend`: a select, so a NaN or Inf there
never enters a real token's 0 x value), and decode attention reads each row's live
positions only. Caches are the generator's, [max_batch, Hkv, max_seq_len, D] per layer;
a step of batch b takes views of their first b rows (contiguous), written in place.

Backends: ``"eager"`` runs `DecoderLM` with torch (the reference, and the path that
needs no capture); ``"opencann"`` compiles each step graph with ``opencann.compile``
(its caches are inputs written in place; weights shared between the graphs through the
compile option ``share_weights``, the merged Q/K/V and gate/up weights being the module's
own memory, laid out as their concatenations before the first graph, `hold_weights_once`;
prefill attention through the project's FlashAttention, `StepGraphs.compile_options`).
While the host is oversubscribed a step runs with one intra-op thread (`StepGraphs._runner`)."""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..log import logger
from .builder import DecoderLM
from .stats import GenerationStats

BACKENDS = ("eager", "opencann")
#: the smallest default prefill bucket and the default buckets' step up to 64 (tokens)
MIN_BUCKET = 8


def prefill_buckets(max_seq_len: int, given: Optional[Sequence[int]] = None) -> Tuple[int, ...]:
    """Prompt-length buckets (tokens), ascending, the last being ``max_seq_len``:
    ``given`` (ints in 1..max_seq_len), or by default multiples of `MIN_BUCKET` up to 64,
    then four per octave: 8, 16, 24, ..., 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, ...
    (a step of a quarter of the power of two below), so a prompt's padding is under 8
    tokens up to 64 and under a quarter of its length above. Many buckets cost little:
    each is built on first use, a batch size's prefill graphs after its first share one
    capture (`StepGraphs._compile`: then ~1 s a bucket up to a few hundred tokens) and
    every step graph runs in one arena (`StepGraphs._share_arenas`). A prompt runs in
    the smallest bucket that holds it. Raises ValueError (one line) for a bad list."""
    if given is None:
        out, b = [], MIN_BUCKET
        while b < max_seq_len:
            out.append(b)
            b += MIN_BUCKET if b < 64 else (1 << (b.bit_length() - 1)) // 4
        return tuple(out) + (max_seq_len,)
    if not _sizes_in(given, max_seq_len):
        raise ValueError(f"option 'prefill_buckets' takes prompt lengths in "
                         f"1..{max_seq_len} (max_seq_len), e.g. {list(prefill_buckets(max_seq_len))} "
                         f"(the default), got {given!r:.80}")
    return tuple(sorted({int(b) for b in given} | {max_seq_len}))


def _sizes_in(given: Any, most: int) -> bool:
    """Whether ``given`` is a list (tuple, set, range) of ints in 1..``most`` (Python or
    NumPy integers): an option's value as JSON or Python gives it."""
    return isinstance(given, (list, tuple, set, frozenset, range)) and all(
        isinstance(b, (int, np.integer)) and not isinstance(b, (bool, np.bool_)) and 1 <= b <= most
        for b in given)


def batch_sizes(max_batch: int, given: Optional[Sequence[int]] = None) -> Tuple[int, ...]:
    """Batch sizes step graphs are built for, ascending, the last being ``max_batch``:
    ``given`` (ints in 1..max_batch) or powers of two. A batch of b rows runs in the
    smallest size >= b. Raises ValueError (one line) for a bad max_batch or list."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be a positive int (the most prompts per generate "
                         f"call), got {max_batch!r}")
    if given is None:
        return tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch) + (max_batch,)
    if not _sizes_in(given, max_batch):
        raise ValueError(f"option 'batch_sizes' takes batch sizes in 1..{max_batch} "
                         f"(max_batch), e.g. {list(batch_sizes(max_batch))} (the default), got "
                         f"{given!r:.80}")
    return tuple(sorted({int(b) for b in given} | {max_batch}))


def smallest(sizes: Sequence[int], n: int) -> int:
    """The smallest of ascending ``sizes`` that is >= n (callers check n <= sizes[-1])."""
    return next(s for s in sizes if s >= n)


class StepMemory(NamedTuple):
    """Bytes the step graphs hold (`step_memory`), each storage counted once."""

    module_bytes: int   #: the module's parameters and buffers (a loaded generator: its graphs' constants)
    packed_bytes: int   #: copies beyond those, = sum(by_kind.values())
    by_kind: Dict[str, int]  #: packed bytes per kind (`PACKED_KINDS`)
    arena_bytes: int    #: the graphs' activation arenas, a buffer they share counted once
    #: of module_bytes, the module's storages the graphs read as their concatenated GEMM
    #: operands (Q/K/V, gate/up: `hold_weights_once`), held once instead of copied
    shared_bytes: int = 0


#: the kinds of copies a step graph may hold beside the module's weights: Q/K/V weights
#: concatenated (`fuse_qkv_linear`), gate and up weights concatenated (GatedMLP),
#: ``addmm_kn``'s [k, n] copies, oneDNN's blocked copies, the GEMV's [n, k] copies, the
#: panel GEMM's [P, k, NR] panels, and other constants that are not the module's memory
#: (folded at compile time)
PACKED_KINDS = ("qkv_concat", "gate_up_concat", "addmm_kn", "onednn_packed", "gemv", "panel",
                "constants")
_CACHE_KIND = {"concat": "gate_up_concat", "addmm_kn": "addmm_kn", "onednn_packed": "onednn_packed",
               "gemv": "gemv", "panel": "panel"}


def _storage_key(t: torch.Tensor) -> Tuple[int, int]:
    """(key, bytes) of the memory ``t`` views: its storage (oneDNN's blocked copy, an
    opaque tensor with no storage to share, by identity)."""
    if t.is_mkldnn:
        return -id(t), t.numel() * t.element_size()
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def step_memory(graphs: Sequence[Any], module: Optional[torch.nn.Module] = None) -> StepMemory:
    """What compiled step ``graphs`` hold (`StepMemory`): ``module``'s parameters and
    buffers (every storage once, whether a graph reads it or not: the module keeps it
    alive), then each storage the graphs' constants and their kernels' packed copies
    (`cpu.packed_copies_by_kind`) view that is not the module's, once, under its kind
    (`PACKED_KINDS`; a concatenation's own packed copy under the packed kind), and the
    sum of the graphs' arenas. A concatenation that is the module's own memory (laid out
    by `hold_weights_once`) counts under the module, and once more in ``shared_bytes``
    (what holding the weights once saved). Without ``module`` (a loaded generator) the
    graphs' constants count as the module's weights; with no graph (the eager backend)
    only the module's."""
    from ..ops.kernels.cpu import packed_copies_by_kind
    seen: Dict[int, int] = {}
    shared: Dict[int, int] = {}
    by_kind = {k: 0 for k in PACKED_KINDS}

    def count(t: torch.Tensor) -> int:
        key, nbytes = _storage_key(t)
        if key in seen:
            return 0
        seen[key] = nbytes
        return nbytes
    own = sum(count(t) for t in ([] if module is None else
                                 list(module.parameters()) + list(module.buffers())))
    mine = set(seen)

    def held_once(t: torch.Tensor) -> None:
        key, nbytes = _storage_key(t)
        if key in mine and hasattr(t, "_opencann_parts"):
            shared[key] = nbytes
    arenas: Dict[int, int] = {}
    consts = []
    for cm in graphs:   # a buffer the graphs share (`StepGraphs._share_arenas`) counts once
        ex = getattr(cm.shapes, "executor", None)
        if ex is None:
            arenas[id(cm)] = int(cm.plan.arena_bytes)
        else:
            arenas[ex.arena.untyped_storage().data_ptr()] = ex.arena.untyped_storage().nbytes()
        consts += [v.const for v in cm.graph.constants if isinstance(v.const, torch.Tensor)]
    for t in consts:
        n = count(t)
        held_once(t)
        if module is None:
            own += n
        else:
            by_kind["qkv_concat" if hasattr(t, "_opencann_parts") else "constants"] += n
    for kind, copies in packed_copies_by_kind(consts).items():
        by_kind[_CACHE_KIND[kind]] += sum(count(t) for t in copies)
        for t in copies:
            held_once(t)
    return StepMemory(own, sum(by_kind.values()), by_kind, sum(arenas.values()),
                      sum(shared.values()))


#: a weight `hold_weights_once` left in place (its kernel reads the row-major layout and
#: keeps its own copy, or another generator's graphs read it there) -> the `StepGraphs`
#: whose graphs read it there (weak)
_LEFT_BY: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def hold_weights_once(lm: DecoderLM, options: Optional[Dict[str, Any]] = None,
                      rows: int = 1, owner: Any = None) -> int:
    """Lay ``lm``'s sibling weights out as the concatenations its compiled step graphs
    merge them into (`opencann.ops.weight_concat.concatenate_in_place`), so those graphs
    read the module's memory instead of a copy beside it: per Llama/Mistral/Qwen2 layer
    the q/k/v projections' weights (and biases), as ``fuse_qkv_linear`` merges them, and
    the gate/up projections' weights where GatedMLP runs one GEMM on them (each of
    `cpu.COLD_RACE_BYTES` or more, ``fuse_gated_mlp``), where their decode kernel reads
    the [Σn, k] layout (`cpu.concat_row_major` at ``rows``, the first decode graph's batch,
    False: every weight a contiguous row block of it). Where the kernel reads the row-major [k, Σn] one, every weight would become a
    transposed, non-contiguous view, which ``save_pretrained`` / safetensors and any
    ``weight.view(...)`` refuse: those weights are left alone and the kernel keeps its
    concatenated copy, as a pass the compile ``options`` disable leaves its weights
    alone. The parameters keep their values, shapes, contiguity and identity (the
    transformers model they come from runs and saves as before), their old memory is
    freed: the Q/K/V and gate/up weights are held once, not twice (198 MB of
    the 499 MB random Llama-125M). Done once, before the first step graph is compiled
    (its weight guards record the new memory); a module laid out already is not copied
    again. Only for opencann.llm's step graphs, compiled with ``share_weights``: a plain
    ``opencann.compile`` snapshots the user's module and never moves its memory.
    Weights left in place for another live ``owner`` (an earlier generator's
    `StepGraphs` over the same model whose race at its decode batch chose the row-major
    layout, or whose graphs read them in place for a third) stay so: laying them out now
    would give them new storage under that generator's graphs, whose next call would
    then be refused (two generators over one model at max_batch 1 and 8); this
    ``owner``'s kernels keep their own concatenated copy instead.
    Returns the bytes laid out (0: nothing to merge, e.g. GPT-2's fused c_attn)."""
    from ..ops.kernels.cpu import COLD_RACE_BYTES, concat_row_major
    from ..ops.weight_concat import concatenate_in_place
    from .builder import LlamaBlock
    off = set((options or {}).get("disable") or ())
    done = 0
    for blk in lm.blocks:
        if not isinstance(blk, LlamaBlock):
            continue
        groups = []
        if "fuse_qkv_linear" not in off:
            groups.append([blk.attn.q_proj, blk.attn.k_proj, blk.attn.v_proj])
        gate, up = blk.mlp.gate_proj, blk.mlp.up_proj
        if "fuse_gated_mlp" not in off and gate.weight.shape == up.weight.shape and all(
                w.numel() * w.element_size() >= COLD_RACE_BYTES for w in (gate.weight, up.weight)):
            groups.append([gate, up])
        for mods in groups:
            ws = [m.weight for m in mods]
            if any(w.dtype != torch.float32 for w in ws):
                continue
            n, k = sum(int(w.shape[0]) for w in ws), int(ws[0].shape[1])
            if _left_in_place(ws, concat_row_major(k, n, ws[0].dtype, rows=rows), owner):
                continue
            concatenate_in_place(ws, row_major=False)
            biases = [m.bias for m in mods]
            if all(b is not None for b in biases):
                concatenate_in_place(biases)
            done += sum(w.numel() * w.element_size() for w in ws)
    return done


def _left_in_place(ws: Sequence[torch.Tensor], row_major: bool, owner: Any) -> bool:
    """Whether `hold_weights_once` leaves the sibling weights ``ws`` where they are:
    where their kernel reads the ``row_major`` layout (each weight would be a transposed
    view; the kernel keeps a copy), or where another live generator's graphs read them
    there (`_LEFT_BY`); then ``owner``'s graphs read them there too, and it is recorded."""
    if not row_major and all(o is owner for w in ws for o in _LEFT_BY.get(w, ())):
        return False
    if owner is not None:
        for w in ws:
            _LEFT_BY.setdefault(w, weakref.WeakSet()).add(owner)
    return True


def _plans(compiled: Any) -> int:
    """Memory plans a compiled step graph holds: a dynamic model's plans built, else 1."""
    plans = getattr(getattr(compiled, "shapes", None), "plans", None)
    return int(getattr(plans, "misses", 1)) if plans is not None else 1


class StepGraphs:
    """The generator's step graphs over ``lm`` and its ``caches`` (2 * L tensors
    [max_batch, Hkv, max_seq_len, D]), built on first use by ``backend`` (`BACKENDS`) for
    ``device`` with compile ``options``, counted in ``stats``.

    ``step(batch, tokens)`` returns a callable ``(input_ids [batch, tokens], positions
    [batch], lengths [batch]) -> logits [batch, vocab]`` that writes the caches' first
    ``batch`` rows in place (tokens == 1: the decode graph).

    A generator loaded from a file (`opencann.llm.load`) has no ``lm``: its graphs are
    ``loaded`` ((batch, tokens) -> CompiledModel, counted in ``stats.graphs_loaded``), and
    a step it lacks is one ValueError line naming ``source`` and the steps it has."""

    def __init__(self, lm: Optional[DecoderLM], caches: List[torch.Tensor], backend: str,
                 device: str, options: Optional[Dict[str, Any]], stats: GenerationStats,
                 loaded: Optional[Dict[Tuple[int, int], Any]] = None, source: str = ""):
        self.lm, self.caches, self.backend = lm, caches, backend
        self.device, self.options, self.stats = device, dict(options or {}), stats
        self.source = source
        self._graphs: Dict[Tuple[int, int], Callable] = {}
        self._views: Dict[int, List[torch.Tensor]] = {}
        self._laid_out = False   # `hold_weights_once` done
        #: batch size -> the prefill graphs' shared capture (None: captured per bucket)
        self._symbolic: Dict[int, Any] = {}
        self._arena: Optional[torch.Tensor] = None   # `_share_arenas`
        for (b, t), cm in (loaded or {}).items():
            self._graphs[(b, t)] = self._runner(cm, b)
            stats.graphs_loaded += 1
            stats.graphs.append(f"{'decode' if t == 1 else 'prefill'} b{b} t{t}")
        if loaded:
            self._share_arenas()
            self._count_memory()

    def _count_memory(self) -> None:
        """Set ``stats.weight_bytes`` / ``arena_bytes`` from the graphs built so far."""
        self.stats.set_memory(step_memory(list(self.compiled().values()), self.lm))

    def views(self, batch: int) -> List[torch.Tensor]:
        """The caches' first ``batch`` rows (views, no copy)."""
        if batch not in self._views:
            self._views[batch] = [c[:batch] for c in self.caches]
        return self._views[batch]

    def step(self, batch: int, tokens: int) -> Callable:
        """The step graph for ``batch`` rows of ``tokens`` new tokens (built once)."""
        g = self._graphs.get((batch, tokens))
        if g is None:
            g = self._graphs[(batch, tokens)] = self._build(batch, tokens)
        return g

    def _build(self, batch: int, tokens: int) -> Callable:
        key = f"{'decode' if tokens == 1 else 'prefill'} b{batch} t{tokens}"
        if self.lm is None:
            have = ", ".join(f"{'decode' if t == 1 else 'prefill'} b{b} t{t}" for b, t in self._graphs)
            raise ValueError(f"{self.source} holds no step graph {key} (it holds {have}): save "
                             "the generator with graphs='all' (the default) to serve every "
                             "bucket and batch size")
        self._weights_unchanged()
        views = self.views(batch)
        if self.backend == "eager":
            lm = self.lm

            def run(ids, positions, lengths):
                if not lm.rope_table_current():   # the rotary module's values, as eager reads them
                    lm.rope_table(lm.rope_cos.shape[0])
                return lm(ids, positions, lengths, *views)
            self.stats.graph_built(key, 0)
            self.stats.set_memory(step_memory([], lm))
            return run
        if not self._laid_out:
            # before the first graph: its concatenations are then the module's memory (the
            # cpu's: the vnpu keeps the unfused GEMMs)
            self._laid_out = True
            if str(self.device).split(":")[0] == "cpu":
                hold_weights_once(self.lm, self.options, rows=batch, owner=self)
        if tokens > 1 and (batch, 1) not in self._graphs:
            # the decode graph first: its GEMMs stream every weight once per token, so
            # their races choose each weight's one packed layout (`cpu.copy_allowed`);
            # a prefill graph's races then share it or keep none
            self.step(batch, 1)
        example = (torch.zeros(batch, tokens, dtype=torch.long),
                   torch.zeros(batch, dtype=torch.long),
                   torch.full((batch,), tokens, dtype=torch.long), *views)
        cm = self._compile(example, batch, tokens)
        self.stats.graph_built(key, _plans(cm))
        run = self._runner(cm, batch)
        self._graphs[(batch, tokens)] = run
        self._share_arenas()
        self._count_memory()
        return run

    def _share_arenas(self) -> None:
        """Run every compiled step graph in ONE activation arena, the largest graph's
        size: a generator's graphs never run at the same time (each call holds the
        generator's lock, and a step's outputs are fresh tensors, its caches inputs), so
        memory is weights + caches + one arena, not an arena per bucket and batch size
        (a 125M Llama at max_seq_len 2048: 24 prefill buckets held 223 MiB of arenas,
        the largest 35 MiB). A graph built later and larger replaces the buffer by one of
        its size, every graph rebound to it (`StaticShapes.share_arena`: ~15 ms a graph)."""
        shapes = [cm.shapes for cm in self.compiled().values()
                  if callable(getattr(cm.shapes, "share_arena", None))]
        if not shapes:
            return
        need = max(int(s.plan.arena_bytes) for s in shapes)
        grow = self._arena is None or self._arena.numel() < need
        if grow:
            with torch.inference_mode(False):   # outlives the call: an ordinary tensor
                self._arena = torch.empty(max(need, 1), dtype=torch.uint8)
        for s in shapes:
            if grow or s.executor.arena.untyped_storage().data_ptr() != self._arena.data_ptr():
                s.share_arena(self._arena)

    def _compile(self, example: Tuple[torch.Tensor, ...], batch: int, tokens: int) -> Any:
        """The compiled step graph for ``example`` (``batch`` rows of ``tokens`` tokens).
        A batch size's first prefill graph is captured at its shape, as the decode graph
        is; its later prefill graphs share one capture (`SymbolicCapture`: exported once
        with the prompt length as a dynamic dim in 2..max_seq_len, then each bucket
        specialised and compiled whole). For SmolLM2-135M on the 2-core host a static
        capture took 14-17 s, the dynamic one 30-34 s, each bucket from it ~1 s: a
        generator that serves one prompt bucket pays one static capture, one that serves
        more pays the dynamic capture once. A model torch.export cannot trace that way
        (whatever the shared capture raises: the static capture then gives its own error
        if the model cannot be captured at all) and a max_seq_len of 2 (one prompt length
        > 1, nothing dynamic) have each graph captured at its own shape."""
        from ..engine import compile_module
        from ..engine.per_shape import SymbolicCapture
        options = self.compile_options(tokens)
        most = int(self.caches[0].shape[2])
        later = any(b == batch and t > 1 for b, t in self._graphs)
        if tokens > 1 and most > 2 and later and self._symbolic.get(batch, True) is not None:
            family = self._symbolic.get(batch)
            if family is None:
                self.stats.captures += 1
                try:
                    family = SymbolicCapture(
                        self.lm, example, {"input_ids": {1: "prompt_tokens"}},
                        {"prompt_tokens": (2, most)}, self.device)
                except Exception as e:   # noqa: BLE001 - any failure: the static capture's own error
                    logger.info("prefill graphs captured per bucket: %s: %s", type(e).__name__, e)
                self._symbolic[batch] = family
            if family is not None:
                return family.compile(example, options)
        self.stats.captures += 1
        return compile_module(self.lm, example, device=self.device, options=options)

    def _weights_unchanged(self) -> None:
        """`WeightChanged` when a weight the built graphs froze was changed since: a new
        step graph (another batch size or prompt bucket) would compile the changed
        weights and serve them where the built ones refuse them, so every shape is refused
        alike (the generator's one-line error names the parameter)."""
        for cm in self.compiled().values():
            for g in cm.guards:
                if g.name in ("frozen_weights", "unrecorded_writes"):
                    g.check(None)
            return

    def _runner(self, cm: Any, batch: int) -> Callable:
        """``cm`` (a compiled step graph of ``batch`` rows) called on the caches' views;
        the callable carries it as ``.compiled``, and as ``.unguarded`` the same call
        without the guards (`CompiledModel.call_unguarded`: for the decode steps after a
        call's first). A step runs with one intra-op thread on the calling thread while
        the host is `oversubscribed` (other processes' runnable threads plus ours exceed
        the CPUs), as opencann's numba kernels launch then (`numba_cache.launch_threads`):
        torch's two-thread GEMMs then waited out every OpenMP barrier for a thread the
        other processes held (a 32-token Llama-125M prefill, 2-core host at load 2.8-3.0:
        516-535 ms on 2 threads, 221-232 ms on 1; docs/performance.md). Results do not
        depend on the count beyond the GEMMs' rounding."""
        from ..ops.kernels.numba_cache import oversubscribed
        from ..runtime.thread_count import restore_this_thread, set_this_thread
        views = self.views(batch)

        def run_compiled(ids, positions, lengths):
            saved = set_this_thread(1) if oversubscribed() else None
            try:
                return cm(ids, positions, lengths, *views)
            finally:
                restore_this_thread(saved)

        def unguarded(ids, positions, lengths):
            saved = set_this_thread(1) if oversubscribed() else None
            try:
                return cm.call_unguarded(ids, positions, lengths, *views)
            finally:
                restore_this_thread(saved)
        run_compiled.compiled, run_compiled.unguarded = cm, unguarded
        return run_compiled

    def compiled(self) -> Dict[Tuple[int, int], Any]:
        """(batch, tokens) -> CompiledModel of every compiled step graph (opencann backend
        or loaded), in build order."""
        return {k: g.compiled for k, g in self._graphs.items() if hasattr(g, "compiled")}

    def compile_options(self, tokens: int) -> Dict[str, Any]:
        """The opencann.compile options of a step graph of ``tokens`` new tokens: the
        generator's, with ``share_weights`` on and, for a prefill graph (tokens > 1), the
        pass ``fuse_flash_attention`` enabled (the project's FlashAttention-2 kernel,
        attention memory O(T)) unless the options disable it."""
        opts = dict(self.options, share_weights=True)
        off = list(opts.get("disable") or ())
        if tokens > 1 and "fuse_flash_attention" not in off:
            on = list(opts.get("enable") or ())
            opts["enable"] = on + ["fuse_flash_attention"] * ("fuse_flash_attention" not in on)
        return opts

    def report(self) -> str:
        """One line per graph built: its key, then (opencann backend) the compile
        report's fusions and memory lines."""
        lines = []
        for (b, t), g in self._graphs.items():
            lines.append(f"{'decode' if t == 1 else 'prefill'} b{b} t{t}")
            cm = getattr(g, "compiled", None)
            if cm is not None:
                lines += ["  " + ln.strip() for ln in cm.report.summary().splitlines()
                          if ln.strip().startswith(("fusions applied", "memory"))]
        return "\n".join(lines)

    def keys(self) -> List[Tuple[int, int]]:
        """(batch, tokens) of every graph built, in build order."""
        return list(self._graphs)


__all__ = ["BACKENDS", "MIN_BUCKET", "PACKED_KINDS", "StepGraphs", "StepMemory", "batch_sizes",
           "hold_weights_once", "prefill_buckets", "smallest", "step_memory"]
