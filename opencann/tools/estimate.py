"""``estimate``: how fast a model would run on an Ascend-style NPU, and whether it fits.

Compiles the model for the virtual NPU (``vnpu:<preset>``: formats, TransData, memory
plan) without running it, costs every node with the vnpu cost model
(``opencann.devices.vnpu.cost_model``), and reports per-op time and bound, totals, HBM
traffic with and without the fusion passes, and peak device memory. A plan that does
not fit in the preset's HBM raises ValueError saying by how much and what to change.

Op → cost function: each op's ``OpDef.device_cost["vnpu"]`` column (the functions of
``opencann.ops.kernels.vnpu_cost``, all on the op's storage sizes, in its dtype):

- Conv2D / ConvBiasAct / ConvAddAct → `conv2d_cost` (groups g as g·N convolutions of
  C/g channels: same FLOPs and activation bytes); MatMul, BatchMatMul, MatMulV2,
  LinearAct → `matmul_cost`; CubeEpilogue (the pass ``vnpu_ub_epilogue``) → the Cube
  op's model with its epilogue; FlashAttention → `flash_attention_cost` (the row notes
  the kernel's tiles and buffer occupancy);
  ScaledDotProductAttention (unfused) → QKᵀ `matmul_cost` + `softmax_cost` (+ mask add)
  + PV `matmul_cost`, the S×S scores going through HBM;
- SoftmaxV2 / LogSoftmaxV2 → `softmax_cost`; LayerNorm → `layernorm_cost`; BatchNorm
  (inference, x·scale + shift) → `elementwise_cost` with 2 vector ops per element;
- elementwise ops → `elementwise_cost` with the op's vector cost key;
- reductions and pooling → `reduction_cost`; TransData → `trans_data_cost`;
- ops without the column: data movement (Embedding, Identity, concat, gathers, padding)
  and creation ops → `elementwise_cost("copy")` on the output (read + write; creation:
  write only); views → free (no kernel, not listed);
- anything else (host fallbacks, ops without a model) → **fallback**: memory-bound
  ``copy`` of its largest tensor, read by each input and written once; such rows are
  flagged ``fallback`` and listed in the report.

Peak memory = weights (constants, in their NPU formats) + the memory plan's arena +
the peak of kernel-allocated tensors (values outside the plan, by liveness) + inputs.
matplotlib (Agg backend) draws the roofline: the de-facto standard plotting library.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..devices import parse_device
from ..devices.vnpu import KernelCost, NpuSpec
from ..ir import Graph, MemoryPlan, Node
from ..ir.liveness import peak_live_bytes
from ..ops import OpKind, get_op, output_aliases
from ..ops.kernels import vnpu_cost

GiB = float(1 << 30)
MiB = float(1 << 20)

@dataclass
class OpRow:
    """One costed node: time in µs, HBM bytes read + written, FLOPs (fractal-padded),
    ``bound`` (cube / vector / mte / memory / launch; "fused" for a node run in a Cube
    kernel's epilogue, costed there), ``model`` (the cost function used), ``fallback``
    (True when no cost function fits and the memory-bound fallback is used) and ``note``
    (why a Cube node's epilogue was not fused, else "")."""

    name: str
    op: str
    time_us: float
    bound: str
    hbm_bytes: float
    flops: float
    model: str
    fallback: bool = False
    format: str = "ND"
    note: str = ""

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP per HBM byte."""
        return self.flops / self.hbm_bytes if self.hbm_bytes else 0.0

    @property
    def tflops(self) -> float:
        """Achieved TFLOP/s."""
        return self.flops / (self.time_us * 1e-6) / 1e12 if self.time_us else 0.0


@dataclass
class EstimateReport:
    """What `estimate` found. Times in µs, sizes in bytes.

    ``rows``: per-op costs of the reported graph (fused unless ``fused=False``);
    ``hbm_bytes_fused`` / ``hbm_bytes_unfused``: total HBM traffic with the fusion
    passes on / off (``time_us_fused`` / ``time_us_unfused`` likewise); memory:
    ``weights_bytes``, ``arena_bytes``, ``kernel_alloc_peak_bytes``, ``input_bytes`` and
    their sum ``peak_bytes`` against ``spec.hbm_bytes``.
    """

    model: str
    device: str
    spec: NpuSpec
    batch: int
    fused: bool
    dtype: str
    rows: List[OpRow]
    time_us_fused: float
    time_us_unfused: float
    hbm_bytes_fused: float
    hbm_bytes_unfused: float
    weights_bytes: int
    arena_bytes: int
    kernel_alloc_peak_bytes: int
    input_bytes: int
    views: int = 0
    notes: List[str] = field(default_factory=list)

    # -- totals ---------------------------------------------------------------------
    @property
    def total_time_us(self) -> float:
        """Sum of kernel times, µs (kernels run one after another on one stream)."""
        return sum(r.time_us for r in self.rows)

    @property
    def total_flops(self) -> float:
        """Sum of fractal-padded FLOPs."""
        return sum(r.flops for r in self.rows)

    @property
    def total_hbm_bytes(self) -> float:
        """Sum of HBM bytes read + written by the reported graph."""
        return sum(r.hbm_bytes for r in self.rows)

    @property
    def peak_bytes(self) -> int:
        """Weights + arena + kernel-allocated peak + inputs, bytes."""
        return self.weights_bytes + self.arena_bytes + self.kernel_alloc_peak_bytes + self.input_bytes

    @property
    def fallbacks(self) -> Dict[str, int]:
        """Ops costed with the memory-bound fallback: op -> count."""
        out: Dict[str, int] = {}
        for r in self.rows:
            if r.fallback:
                out[r.op] = out.get(r.op, 0) + 1
        return out

    def time_by_bound(self) -> Dict[str, float]:
        """µs per bound (cube, vector, mte, memory, launch)."""
        out: Dict[str, float] = {}
        for r in self.rows:
            out[r.bound] = out.get(r.bound, 0.0) + r.time_us
        return out

    def time_by_op(self) -> Dict[str, float]:
        """µs per op type, largest first."""
        out: Dict[str, float] = {}
        for r in self.rows:
            out[r.op] = out.get(r.op, 0.0) + r.time_us
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    # -- rendering ------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready dict: totals, fusion comparison, memory, per-op rows."""
        return {
            "model": self.model, "device": self.device, "preset": self.spec.name, "batch": self.batch,
            "fused": self.fused, "dtype": self.dtype,
            "totals": {"time_us": self.total_time_us, "flops": self.total_flops,
                       "hbm_bytes": self.total_hbm_bytes, "ops": len(self.rows), "views": self.views,
                       "achieved_tflops": self.total_flops / (self.total_time_us * 1e-6) / 1e12
                       if self.total_time_us else 0.0},
            "fusion": {"time_us_fused": self.time_us_fused, "time_us_unfused": self.time_us_unfused,
                       "hbm_bytes_fused": self.hbm_bytes_fused, "hbm_bytes_unfused": self.hbm_bytes_unfused},
            "memory": {"weights_bytes": self.weights_bytes, "arena_bytes": self.arena_bytes,
                       "kernel_alloc_peak_bytes": self.kernel_alloc_peak_bytes, "input_bytes": self.input_bytes,
                       "peak_bytes": self.peak_bytes, "hbm_capacity_bytes": self.spec.hbm_bytes},
            "time_by_bound_us": self.time_by_bound(), "time_by_op_us": self.time_by_op(),
            "fallbacks": self.fallbacks, "notes": self.notes,
            "rows": [asdict(r) for r in self.rows],
        }

    def to_json(self, path: Optional[str] = None, indent: int = 2) -> str:
        """The report as JSON (written to ``path`` when given)."""
        s = json.dumps(self.to_dict(), indent=indent, default=str)
        if path:
            with open(path, "w") as f:
                f.write(s)
        return s

    def to_text(self, top: int = 15) -> str:
        """Readable summary: the ``top`` ops by time with their bound, then totals."""
        t = self.total_time_us
        lines = [f"opencann estimate: {self.model} on {self.device} ({self.spec.name}), batch {self.batch}, "
                 f"{self.dtype}, {'fused' if self.fused else 'unfused'} graph",
                 f"  {'node':28s} {'op':18s} {'time us':>10s} {'%':>6s} {'bound':>7s} {'HBM MB':>9s} "
                 f"{'GFLOP':>9s} {'TFLOP/s':>8s}"]
        for r in sorted(self.rows, key=lambda r: -r.time_us)[:top]:
            lines.append(f"  {r.name[:28]:28s} {r.op[:18]:18s} {r.time_us:10.2f} {100 * r.time_us / t:5.1f}% "
                         f"{r.bound:>7s} {r.hbm_bytes / 1e6:9.3f} {r.flops / 1e9:9.3f} {r.tflops:8.2f}"
                         + ("  (fallback)" if r.fallback else ""))
        lines.append(f"  total: {t / 1e3:.3f} ms over {sum(r.bound != 'fused' for r in self.rows)} kernels ({self.views} views free), "
                     f"{self.total_flops / 1e9:.2f} GFLOP, {self.to_dict()['totals']['achieved_tflops']:.2f} TFLOP/s "
                     f"achieved of {self.spec.peak_cube_tflops(_bytes(self.dtype)):.1f} peak Cube")
        share = ", ".join(f"{k} {100 * v / t:.0f}%" for k, v in
                          sorted(self.time_by_bound().items(), key=lambda kv: -kv[1])) if t else ""
        lines.append(f"  time by bound: {share}")
        top_ops = ", ".join(f"{k} {v / 1e3:.3f} ms" for k, v in list(self.time_by_op().items())[:6])
        lines.append(f"  time by op: {top_ops}")
        saved = 1 - self.hbm_bytes_fused / self.hbm_bytes_unfused if self.hbm_bytes_unfused else 0.0
        lines.append(f"  HBM traffic: {self.hbm_bytes_fused / 1e6:.1f} MB fused vs "
                     f"{self.hbm_bytes_unfused / 1e6:.1f} MB unfused ({100 * saved:.1f}% saved); time "
                     f"{self.time_us_fused / 1e3:.3f} ms fused vs {self.time_us_unfused / 1e3:.3f} ms unfused")
        lines.append(f"  memory: peak {self.peak_bytes / MiB:.1f} MiB of {self.spec.hbm_bytes / GiB:.0f} GiB HBM "
                     f"(weights {self.weights_bytes / MiB:.1f} MiB, arena {self.arena_bytes / MiB:.1f} MiB, "
                     f"kernel-allocated peak {self.kernel_alloc_peak_bytes / MiB:.1f} MiB, "
                     f"inputs {self.input_bytes / MiB:.1f} MiB)")
        if self.fallbacks:
            lines.append("  costed with the memory-bound fallback (no cost function): "
                         + ", ".join(f"{k} x{v}" for k, v in self.fallbacks.items()))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def roofline_plot(self, path: str) -> str:
        """Write a roofline PNG to ``path``: each op with FLOPs as a point (arithmetic
        intensity FLOP/B vs achieved TFLOP/s, colour = bound) under the preset's roofline
        min(peak Cube TFLOP/s, HBM GB/s × intensity) (Williams, Waterman, Patterson,
        "Roofline", CACM 2009). Ops without FLOPs (TransData, copies) are left out and
        counted in the title. Returns ``path``."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        peak = self.spec.peak_cube_tflops(_bytes(self.dtype))
        bw = self.spec.hbm_gbps * 1e9 / 1e12            # TB/s: TFLOP/s per FLOP/B
        pts = [r for r in self.rows if r.flops > 0 and r.hbm_bytes > 0 and r.time_us > 0]
        fig, ax = plt.subplots(figsize=(8, 5.5))
        lo = min([r.intensity for r in pts] + [0.1]) / 2
        hi = max([r.intensity for r in pts] + [peak / bw * 4]) * 2
        xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        ax.plot(xs, [min(peak, bw * x) for x in xs], "k-", lw=2,
                label=f"roofline: {peak:.0f} TFLOP/s Cube ({self.dtype}), {self.spec.hbm_gbps:.0f} GB/s HBM")
        colours = {"cube": "tab:red", "vector": "tab:green", "mte": "tab:orange", "memory": "tab:blue",
                   "launch": "tab:gray"}
        for b in sorted({r.bound for r in pts}):
            sel = [r for r in pts if r.bound == b]
            ax.scatter([r.intensity for r in sel], [r.tflops for r in sel], s=18, alpha=0.75,
                       color=colours.get(b, "tab:purple"), label=f"{b}-bound ops ({len(sel)})")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity (FLOP / HBM byte)")
        ax.set_ylabel("achieved TFLOP/s")
        ax.set_title(f"{self.model} on {self.spec.name}, batch {self.batch} "
                     f"({len(self.rows) - len(pts)} ops without FLOPs not shown)", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


# -- costing -----------------------------------------------------------------------------

def _bytes(dtype: str) -> int:
    return max(1, torch.empty((), dtype=getattr(torch, dtype)).element_size())


def node_cost(node: Node, spec: NpuSpec) -> Tuple[Optional[KernelCost], str, bool]:
    """(cost, cost-function name, fallback?) of one node on ``spec``; (None, "view",
    False) for views. The op's ``device_cost["vnpu"]`` column when it has one; else data
    movement / creation ops cost a copy and anything else the memory-bound fallback (see
    ``opencann.ops.kernels.vnpu_cost``)."""
    op = get_op(node.op)
    if op.is_view:
        return None, "view", False
    fn = op.device_cost.get("vnpu")
    if fn is not None:
        c, model = fn(node, spec)
        return c, model, False
    if op.kind in (OpKind.DATA, OpKind.CREATION):
        c, model = (vnpu_cost.create if op.kind == OpKind.CREATION else vnpu_cost.copy)(node, spec)
        return c, model, False
    c, model = vnpu_cost.fallback(node, spec)
    return c, model, True


def cost_graph(graph: Graph, spec: NpuSpec, ub_epilogue: bool = True) -> Tuple[List[OpRow], int]:
    """Per-node rows of ``graph`` on ``spec`` and the number of (free) views.

    The graph is read as it runs: a CubeEpilogue node (the pass ``vnpu_ub_epilogue``:
    Conv/MatMul + bias Add / activation / residual Add as one kernel) is one row costed as a
    Cube kernel with its epilogue (``ub_epilogue`` False: as the Cube kernel and one Vector
    kernel per link, `cube_epilogue.vnpu_unfused_cost`, for a graph compiled with the pass);
    a Cube node the pass left alone says why in its row's ``note``
    (``node.meta["epilogue_not_fused"]``); a FlashAttention row notes its tiles and buffer
    occupancy (``node.meta["tiles"]``, or the preset's plan when unbound)."""
    from ..ops.cube_epilogue import vnpu_unfused_cost
    rows, views = [], 0
    for n in graph.nodes:
        fmt = n.outputs[0].desc.format.value
        if n.op == "CubeEpilogue" and not ub_epilogue:
            (c, model), fb = vnpu_unfused_cost(n, spec), False
        else:
            c, model, fb = node_cost(n, spec)
        if c is None:
            views += 1
            continue
        note = f"epilogue not fused: {n.meta['epilogue_not_fused']}" if "epilogue_not_fused" in n.meta else ""
        if n.op == "FlashAttention":
            note = "tiles " + ", ".join(f"{k} {v}" for k, v in _tiles(n, spec).items())
        rows.append(OpRow(n.name, n.op, float(c.time_us), c.bound, float(c.hbm_bytes), float(c.flops), model,
                          fb, fmt, note))
    return rows, views


def _tiles(node: Node, spec: NpuSpec) -> Dict[str, Any]:
    """The FlashAttention node's tile plan on ``spec`` (`plan_npu_tiles`, as its vnpu kernel
    binds it): block_q, block_k and bytes used / capacity per on-chip buffer."""
    if "tiles" in node.meta:
        return node.meta["tiles"]
    from ..ops.flash_attention.planner import plan_npu_tiles
    from ..ops.flash_attention.vnpu import tiles_meta
    q, k = node.arg("query").desc, node.arg("key").desc
    try:
        return tiles_meta(plan_npu_tiles(spec, int(q.shape[-1]), q.dtype.torch, seq_q=int(q.shape[-2]),
                                         seq_k=int(k.shape[-2])))
    except ValueError as e:          # the buffers cannot hold a 16 x 16 tile: say so in the row
        return {"none": str(e)}


# -- memory ------------------------------------------------------------------------------

def kernel_alloc_peak(graph: Graph, plan: MemoryPlan) -> int:
    """Peak bytes of intermediates outside the arena (kernel-allocated values and graph
    outputs), by liveness in the graph's order: live from the producing step to the
    last read (graph outputs to the end). Outputs that alias an input (views, host
    views by their ATen schema, in-place results) cost nothing."""
    step = {n: i for i, n in enumerate(graph.nodes)}
    end = len(graph.nodes)
    outs = {id(v) for v in graph.outputs}
    ranges = []
    for n in graph.nodes:
        for o, aliased in zip(n.outputs, output_aliases(n)):
            if aliased or o.id in plan.value_buffer or not o.desc.is_static:
                continue
            last = max([step[u] for u in o.users] + [step[n]])
            if id(o) in outs:
                last = end
            ranges.append((step[n], last, o.desc.nbytes))
    return peak_live_bytes(ranges)


# -- driver ------------------------------------------------------------------------------

def _rebatch(inputs: Tuple, batch: int) -> Tuple:
    """Same inputs with dim 0 = ``batch``, as fake tensors (shape and dtype, no storage:
    estimate never runs the model, so a batch far beyond the host's memory costs none)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        return tuple(torch.empty((batch, *x.shape[1:]), dtype=x.dtype)
                     if isinstance(x, torch.Tensor) and x.dim() else x for x in inputs)


def _load(model_or_zoo_name, example_inputs, batch: int, zoo_kwargs: Dict[str, Any]):
    if isinstance(model_or_zoo_name, str) and model_or_zoo_name.lower().endswith(".onnx"):
        raise ValueError(f"{model_or_zoo_name}: estimate takes zoo names (resnet50, bert-base, "
                         "gpt2, minilm) or a torch.nn.Module; ONNX models are not supported by "
                         "estimate yet")
    if isinstance(model_or_zoo_name, str):
        from .. import zoo
        zm = zoo.get(model_or_zoo_name, batch=1, **zoo_kwargs)
        return zm.name, zm.model, _rebatch(zm.example_inputs, batch)
    if example_inputs is None:
        raise ValueError("estimate: give example_inputs for a torch.nn.Module (or pass a zoo name such as "
                         "'resnet50')")
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    args = _rebatch(args, batch)
    return type(model_or_zoo_name).__name__, model_or_zoo_name, args


def _fusion_options(fused: bool, ub_epilogue: bool = True) -> Dict[str, Any]:
    """Compile options of the fused graph (every fusion pass on, ``vnpu_ub_epilogue`` as
    ``ub_epilogue`` says) or of the unfused one (every fusion pass and ``vnpu_ub_epilogue`` off)."""
    from ..passes import default_pipeline
    pm = default_pipeline()
    names = pm.names()
    if fused:
        off_by_default = [p.name for p in pm.passes if p.stage == "fusion" and not p.default_enabled]
        return {"enable": off_by_default, **({} if ub_epilogue else {"disable": [vnpu_cost.UB_EPILOGUE]})}
    return {"disable": [p.name for p in pm.passes if p.stage == "fusion" and p.name in names]
            + [vnpu_cost.UB_EPILOGUE]}


def _compile(graph, device: str, fused: bool, options: Optional[Dict[str, Any]] = None,
             ub_epilogue: bool = True):
    from ..engine import compile_graph
    return compile_graph(graph, device, {**_fusion_options(fused, ub_epilogue), **(options or {})})


def _load_factory(spec: str):
    """``file.py:factory`` -> (model, example_inputs) from ``factory()``. Raises ValueError."""
    import importlib.util
    import os
    path, sep, fn = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not fn.isidentifier():
        raise ValueError(f"{spec!r}: give file.py:factory, a .py file and the name of a function in it that "
                         f"returns (model, example_inputs), e.g. {spec.rsplit(':', 1)[0]}:make")
    if not os.path.isfile(path):
        raise ValueError(f"{path} does not exist; give file.py:factory")
    mod_spec = importlib.util.spec_from_file_location("user_model", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    if not callable(getattr(mod, fn, None)):
        raise ValueError(f"{path} has no function {fn!r}")
    res = getattr(mod, fn)()
    if not (isinstance(res, tuple) and len(res) == 2 and isinstance(res[0], torch.nn.Module)):
        raise ValueError(f"{fn}() must return (model, example_inputs) with model a torch.nn.Module")
    return res[0].eval(), res[1] if isinstance(res[1], tuple) else (res[1],)


def _as_dtype(model, inputs, dtype: Optional[str]):
    if dtype is None:
        return model, inputs
    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(f"--dtype {dtype!r}: give a floating dtype such as float16, bfloat16 or float32")
    conv = tuple(x.to(dt) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)
    return model.to(dt), conv


def _default_batch(model_or_zoo_name, example_inputs) -> int:
    """A module's example inputs' dim 0; 1 for a zoo model or scalar inputs."""
    ex = example_inputs[0] if isinstance(example_inputs, tuple) else example_inputs
    return (int(ex.shape[0]) if isinstance(model_or_zoo_name, torch.nn.Module)
            and isinstance(ex, torch.Tensor) and ex.dim() else 1)


def _check_fits(name: str, batch: int, spec, weights: int, arena: int, kalloc: int,
                inputs: int) -> None:
    """Raise ValueError when weights + arena + kernel-allocated peak + inputs (bytes)
    exceed ``spec.hbm_bytes``; the message gives the numbers in GiB and the largest batch
    that fits (activations scaled linearly with the batch)."""
    peak = weights + arena + kalloc + inputs
    if peak > spec.hbm_bytes:
        act = arena + kalloc + inputs
        fits = int((spec.hbm_bytes - weights) // (act / batch)) if act and spec.hbm_bytes > weights else 0
        raise ValueError(
            f"{name} at batch {batch} needs {peak / GiB:.2f} GiB on {spec.name} but it has "
            f"{spec.hbm_bytes / GiB:.2f} GiB of HBM: {(peak - spec.hbm_bytes) / GiB:.2f} GiB too much "
            f"(weights {weights / GiB:.2f} GiB + activation arena {arena / GiB:.2f} GiB + "
            f"kernel-allocated peak {kalloc / GiB:.2f} GiB + inputs {inputs / GiB:.2f} GiB). "
            f"Use a smaller batch (activations scale with it: about {fits} fits), recompute activations "
            f"instead of keeping them (training), or a device with more HBM.")


def _weight_dtype(graph) -> str:
    """The most common floating dtype among the constants ("float32" when none are)."""
    dtypes = [v.desc.dtype.value for v in graph.constants if v.desc.dtype.is_floating]
    return max(set(dtypes), key=dtypes.count) if dtypes else "float32"


def estimate(model_or_zoo_name, example_inputs=None, device: str = "vnpu:ascend910b",
             batch: Optional[int] = None, fused: bool = True, dtype: Optional[str] = None,
             ub_epilogue: bool = True, check_fit: bool = True, fusion_comparison: bool = True,
             **zoo_kwargs) -> EstimateReport:
    """Estimate time, HBM traffic and peak memory of a model on a virtual NPU.

    Args:
        model_or_zoo_name: a torch.nn.Module, or a zoo name ('resnet50', 'bert-base',
            'gpt2', 'minilm'; ``zoo_kwargs`` such as ``size=64`` or ``seq=32`` go to the
            zoo factory), or an ``.onnx`` path (`estimate_onnx`, static shapes).
        example_inputs: tensor or tuple fixing shapes and dtypes (modules only).
        device: ``vnpu:<preset>`` (ascend910, ascend910b, ascend310) or
            ``vnpu:<spec.json|.toml>``.
        batch: batch size; the inputs' dim 0 is set to it (uninitialized tensors: the
            model is never run). None: 1 for a zoo model, the example inputs' dim 0 for
            a module.
        fused: report the graph with the fusion passes on (True; FlashAttention enabled)
            or off. HBM traffic of both is always reported.
        dtype: cast the model and its floating inputs to this dtype first ('float16',
            'bfloat16', 'float32'); None keeps them. ``model_or_zoo_name`` may also be
            ``"file.py:factory"`` (factory() returns (model, example_inputs)).
        ub_epilogue: with ``fused``, compile with the pass ``vnpu_ub_epilogue`` (GE's
            UB fusion: Conv/MatMul + bias Add / Relu / residual Add become one
            CubeEpilogue node, run and costed as one Cube kernel with a Vector epilogue);
            False disables it, each op its own kernel. The unfused comparison never uses it.
        check_fit: raise ValueError when the peak memory exceeds the preset's HBM (True);
            False returns the report anyway (``peak_bytes`` against ``spec.hbm_bytes``:
            `opencann.tools.readiness` judges the fit itself, with an LLM's KV cache).
        fusion_comparison: compile and cost the model a second time with the fusion passes
            the other way (True); False skips it (the ``*_unfused`` totals are then the
            reported graph's, and a note says so).
    Returns: `EstimateReport` (µs, bytes, FLOPs).
    Raises:
        ValueError: not a vnpu device, unknown preset, batch < 1, missing inputs, an
            ``.onnx`` path with dtype, batch or zoo options, or (``check_fit``) a plan whose
            peak memory exceeds the preset's HBM (the message gives the numbers, the
            largest batch that fits and what to change).
        CaptureError: torch.export cannot capture the model.
    """
    from ..frontend.torch import capture
    spec = parse_device(device, kind="vnpu").spec
    if isinstance(model_or_zoo_name, str) and model_or_zoo_name.lower().endswith(".onnx"):
        _check_onnx_call(model_or_zoo_name, dtype, batch, zoo_kwargs)
        return estimate_onnx(model_or_zoo_name, device, fused=fused, ub_epilogue=ub_epilogue,
                             check_fit=check_fit, fusion_comparison=fusion_comparison)
    if isinstance(model_or_zoo_name, str) and model_or_zoo_name.split(":")[0].endswith(".py"):
        model_or_zoo_name, example_inputs = _load_factory(model_or_zoo_name)
    if batch is None:
        batch = _default_batch(model_or_zoo_name, example_inputs)
    if batch < 1:
        raise ValueError(f"estimate: batch must be >= 1, got {batch}")
    name, model, args = _load(model_or_zoo_name, example_inputs, batch, zoo_kwargs)
    model, args = _as_dtype(model, args, dtype)
    ep, _ = capture(model, args)

    def build():
        from ..frontend.torch import from_exported_program
        return from_exported_program(ep, name=name)
    return _report(name, device, spec, batch, build, fused, ub_epilogue, check_fit,
                   fusion_comparison=fusion_comparison)


def _check_onnx_call(path: str, dtype, batch, zoo_kwargs) -> None:
    """Raise ValueError (one line) for `estimate` options an ONNX file does not take."""
    if dtype is not None or zoo_kwargs or batch is not None:
        raise ValueError(f"{path}: an ONNX model is estimated as its file gives it; drop dtype, "
                         "batch and the zoo options (give symbolic dims' sizes with "
                         "estimate_onnx(path, input_shapes=...))")


def estimate_onnx(path: str, device: str = "vnpu:ascend910b", input_shapes=None,
                  fused: bool = True, ub_epilogue: bool = True, check_fit: bool = True,
                  precision_mode: Optional[str] = None,
                  fusion_comparison: bool = True) -> EstimateReport:
    """`estimate` of an ONNX file: its graph (converted by the ONNX frontend, weights in
    the file's dtypes, ``input_shapes`` name -> sizes for symbolic dims) compiled for
    ``device`` (with ``precision_mode``, e.g. "force_fp16", when given) and costed as
    `estimate` does (``fusion_comparison`` as there); batch = the first input's dim 0. Raises what `estimate` raises,
    OnnxLoadError (unreadable file), ConversionError (a graph that does not convert) and
    ValueError (an unknown precision mode)."""
    from ..frontend.onnx import from_onnx, load_model
    spec = parse_device(device, kind="vnpu").spec
    model = load_model(path)

    def build():
        return from_onnx(model, input_shapes)
    first = build().inputs
    batch = int(first[0].desc.shape[0]) if first and first[0].desc.shape else 1
    extra = {"precision_mode": precision_mode} if precision_mode else {}
    return _report(path, device, spec, batch, build, fused, ub_epilogue, check_fit, extra,
                   fusion_comparison)


def estimate_compiled(compiled, name: str, check_fit: bool = True) -> EstimateReport:
    """`estimate` of a compiled model (`opencann.CompiledModel`, e.g. loaded from an
    ``.ocm`` file) as it is: its graph and memory plan costed on the vnpu preset it was
    compiled for; the fused / unfused comparison is not available (both are its graph's).
    Raises ValueError when it was not compiled for a vnpu, and (``check_fit``) as
    `estimate` when it does not fit."""
    dev = parse_device(str(compiled.report.device))
    if dev.kind != "vnpu":
        raise ValueError(f"{name} was compiled for {dev}, not for an NPU: convert it for one "
                         "(opencann atc --soc_version Ascend910B) or check the model it came from")
    graph, plan = compiled.graph, compiled.plan
    first = graph.inputs
    batch = int(first[0].desc.shape[0]) if first and first[0].desc.shape else 1
    rep = _costed(name, str(dev), dev.spec, batch, graph, plan, True, True, check_fit, None)
    rep.notes.append("a compiled model file: costed as saved; no fused / unfused comparison")
    return rep


def _report(name: str, device: str, spec, batch: int, build, fused: bool, ub_epilogue: bool,
            check_fit: bool, options: Optional[Dict[str, Any]] = None,
            fusion_comparison: bool = True) -> EstimateReport:
    """Compile ``build()`` (a fresh IR graph per call) with the fusion passes as ``fused``
    asks (and ``options``), cost it, and (``fusion_comparison``) cost it once more the
    other way for the fusion comparison."""
    graph, plan, creport = _compile(build(), device, fused, options, ub_epilogue)
    other = cost_graph(_compile(build(), device, not fused, options, ub_epilogue)[0],
                       spec)[0] if fusion_comparison else None
    rep = _costed(name, device, spec, batch, graph, plan, fused, ub_epilogue, check_fit, creport,
                  other)
    if not fusion_comparison:
        rep.notes.append("fusion comparison not computed: the fused / unfused totals are this graph's")
    return rep


def _costed(name: str, device: str, spec, batch: int, graph, plan, fused: bool, ub_epilogue: bool,
            check_fit: bool, creport, other_rows=None) -> EstimateReport:
    """The `EstimateReport` of a compiled ``graph`` and ``plan``; ``other_rows``: the rows
    of the other fusion setting (None: the same rows)."""
    weights = sum(c.desc.nbytes for c in graph.constants)
    kalloc = kernel_alloc_peak(graph, plan)
    inputs = sum(v.desc.nbytes for v in graph.inputs)
    if check_fit:
        _check_fits(name, batch, spec, weights, plan.arena_bytes, kalloc, inputs)
    rows, views = cost_graph(graph, spec)
    t_here, b_here = _totals(rows)
    t_other, b_other = _totals(rows if other_rows is None else other_rows)
    rep = EstimateReport(
        model=name, device=device, spec=spec, batch=batch, fused=fused, dtype=_weight_dtype(graph), rows=rows,
        time_us_fused=t_here if fused else t_other, time_us_unfused=t_other if fused else t_here,
        hbm_bytes_fused=b_here if fused else b_other, hbm_bytes_unfused=b_other if fused else b_here,
        weights_bytes=int(weights), arena_bytes=int(plan.arena_bytes), kernel_alloc_peak_bytes=int(kalloc),
        input_bytes=int(inputs), views=views)
    rep.notes += _notes(rows) + (_cast_notes(creport, spec) if creport is not None else [])
    return rep


def _cast_notes(compile_report, spec) -> List[str]:
    """A note naming the Cube ops whose fp32 operands the compile cast to fp16 (presets without an
    fp32 Cube), or none."""
    cast = [a["nodes"] for a in compile_report.applied if a["detail"] == "fp32 to fp16 for the Cube"]
    if not cast:
        return []
    return [f"fp32 to fp16 for the Cube: {len(cast)} Conv/MatMul/attention ops run with float16 operands "
            f"({spec.name} has no fp32 Cube; values beyond float16's range become inf): "
            + ", ".join(cast[:5]) + (f", ... ({len(cast)} in all)" if len(cast) > 5 else "")
            + "; use vnpu:ascend910b to keep float32"]


def _totals(rows: List[OpRow]) -> Tuple[float, float]:
    """(time µs, HBM bytes) summed over ``rows``."""
    return sum(r.time_us for r in rows), sum(r.hbm_bytes for r in rows)


def _notes(rows: List[OpRow]) -> List[str]:
    """Report notes: the TransData kernels' cost, each distinct FlashAttention tile plan, and
    the ``vnpu_ub_epilogue`` rewrite (Cube kernels that took an epilogue, the first few left
    alone and why)."""
    td = [r for r in rows if r.op == "TransData"]
    out = [f"{len(td)} TransData kernels cost {sum(r.time_us for r in td):.1f} us "
           f"({sum(r.hbm_bytes for r in td) / 1e6:.1f} MB of HBM traffic)"] if td else []
    fa = list(dict.fromkeys(r.note for r in rows if r.op == "FlashAttention"))
    out += [f"FlashAttention {t} (plan_npu_tiles: bytes used/capacity per on-chip buffer)" for t in fa]
    fused = [r for r in rows if r.op == "CubeEpilogue"]
    kept = [r for r in rows if r.note.startswith("epilogue not fused")]
    if not fused and not kept:
        return out
    why = "; ".join(f"{r.name}: {r.note}" for r in kept[:3]) + (f"; ... ({len(kept)} in all)" if len(kept) > 3 else "")
    return out + [f"{vnpu_cost.UB_EPILOGUE}: {len(fused)} Cube kernels run their bias Add / Relu / residual Add "
                  f"in the epilogue, one CubeEpilogue node each (UB fusion)" + (f"; not fused: {why}" if kept else "")]


__all__ = ["EstimateReport", "OpRow", "estimate", "estimate_compiled", "estimate_onnx", "node_cost",
           "cost_graph", "kernel_alloc_peak"]
