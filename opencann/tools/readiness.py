"""NPU readiness (``opencann readiness``): one report joining what a user moving a model
to an Ascend-style NPU needs to decide, each part from the tool that owns it:

- op support after constant folding (`opencann.tools.analyze`): what would run on the
  host, with the model's source lines;
- formats, TransData and latency (`opencann.tools.estimate` on ``vnpu:<preset>``): the
  storage formats the layout pass chose, the TransData kernels and their cost, the
  estimated time with its bottleneck per op type (Cube / Vector / memory / launch);
- memory fit in the preset's HBM: weights, peak activations (the estimate's arena,
  kernel-allocated peak and inputs) and, for an LLM (a transformers model whose config
  `opencann.llm.arch.read_arch` reads), the KV cache at ``context`` tokens and ``batch``
  sequences (`LLMArch.kv_cache_bytes`);
- accuracy risk at the target precision (`opencann.tools.compare`): every layer of the
  model compiled for the device under the precision's CANN ``precision_mode`` against
  eager fp32 on sample inputs, judged by msprobe's thresholds (`compare.THRESHOLDS`);
  the failing layers are named;
- a verdict, ``ready``, ``ready with host ops`` or ``not ready``, and next steps.

Precision -> what is checked (`PRECISIONS`): ``fp16`` estimates fp16 weights and compares
under ``force_fp16`` (ATC's default ``--precision_mode`` for inference, CANN ATC
documentation: every op that has an fp16 kernel runs in fp16); ``bf16`` estimates bf16 weights and compares under
``allow_mix_precision_bf16`` (CANN has no ``force_bf16``). ``precision_mode`` overrides
the compared mode.

Models: a torch.nn.Module with sample inputs, a zoo name, an ``.onnx`` file (op support,
formats, memory and latency from its converted graph; accuracy of its outputs compiled at
the target precision against fp32, the ONNX graph having no eager layers to compare), or
an ``.ocm`` model file (its compiled graph audited and costed as saved; no accuracy check:
the file holds no fp32 reference).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from .analyze import Analysis
from .compare import CompareResult, UnjudgeableInputs
from .estimate import GiB, MiB, EstimateReport

#: target precision -> (estimate dtype, compared CANN precision_mode, KV-cache bytes per element)
PRECISIONS = {"fp16": ("float16", "force_fp16", 2), "bf16": ("bfloat16", "allow_mix_precision_bf16", 2)}
VERDICTS = ("ready", "ready with host ops", "not ready")
#: the estimate's kernel bounds, as op classes
BOUND_CLASS = {"cube": "Cube", "vector": "Vector", "mte": "memory", "memory": "memory",
               "launch": "launch", "fused": "fused"}
#: TransData above this share of the estimated time is worth a next step (a judgement
#: call of this report, not a CANN figure)
TRANSDATA_SHARE = 0.2


@dataclass
class KvCache:
    """An LLM's KV cache at ``context`` tokens and ``batch`` sequences: ``nbytes`` =
    `LLMArch.kv_cache_bytes` = 2 (K and V) x layers x batch x KV heads x context x head dim
    x ``itemsize`` bytes."""

    model_type: str
    layers: int
    batch: int
    kv_heads: int
    context: int
    head_dim: int
    itemsize: int
    nbytes: int

    @property
    def bytes_per_token(self) -> int:
        """Bytes one more token of context adds over the whole batch."""
        return self.nbytes // self.context

    def formula(self) -> str:
        """``2 x 2 layers x batch 2 x 2 KV heads x 256 tokens x 16 x 2 B``."""
        return (f"2 x {self.layers} layers x batch {self.batch} x {self.kv_heads} KV heads x "
                f"{self.context} tokens x head dim {self.head_dim} x {self.itemsize} B")


@dataclass
class MemoryFit:
    """Device memory, bytes: ``weights`` (in the target precision's dtype and NPU formats),
    ``activations`` (arena + kernel-allocated peak + inputs of one forward of the sample
    inputs), ``kv_cache`` (0 for a model that is no LLM) against ``hbm`` (the preset's)."""

    hbm: int
    weights: int
    activations: int
    kv_cache: int = 0

    @property
    def total(self) -> int:
        """weights + activations + KV cache, bytes."""
        return self.weights + self.activations + self.kv_cache

    @property
    def fits(self) -> bool:
        """Whether ``total`` is within the HBM."""
        return self.total <= self.hbm


@dataclass
class OpClass:
    """One op type of the estimate: ``count`` kernels, ``time_us`` (µs) summed,
    ``bound``: the op class (`BOUND_CLASS`) where most of that time goes."""

    op: str
    count: int
    time_us: float
    bound: str


@dataclass
class ReadinessReport:
    """What `readiness` found. Sections are None when not computed, with the reason in
    ``skipped`` (section -> one line): ``support`` (`Analysis`), ``estimate``
    (`EstimateReport`), ``memory`` (`MemoryFit`), ``kv`` (`KvCache`, LLMs only),
    ``accuracy`` (`CompareResult`, its ``layers`` empty for an ONNX model: outputs only).
    ``verdict`` is one of `VERDICTS`; ``reasons`` says why it is not "ready";
    ``next_steps`` what to do, most important first."""

    model: str
    device: str
    precision: str
    precision_mode: str
    batch: int
    support: Optional[Analysis] = None
    estimate: Optional[EstimateReport] = None
    memory: Optional[MemoryFit] = None
    kv: Optional[KvCache] = None
    accuracy: Optional[CompareResult] = None
    skipped: Dict[str, str] = field(default_factory=dict)
    verdict: str = "not ready"
    reasons: List[str] = field(default_factory=list)
    next_steps: List[str] = field(default_factory=list)

    # -- derived views ----------------------------------------------------------------
    def host_ops(self) -> list:
        """The op findings that run on the host (host fallbacks, custom ops, ops without a
        device kernel), most frequent first (`analyze.OpFinding`)."""
        if self.support is None:
            return []
        return [f for k in ("host_fallback", "custom_op", "no_device_kernel")
                for f in self.support.by_kind(k)]

    def blockers(self) -> list:
        """Findings that keep the model from one device graph (dynamic shapes,
        data-dependent branches, conversion errors)."""
        if self.support is None:
            return []
        return [f for k in ("dynamic_shape", "data_dependent", "conversion_error")
                for f in self.support.by_kind(k)]

    def formats(self) -> Dict[str, int]:
        """Kernels per output storage format (ND, NC1HWC0, FRACTAL_NZ, ...)."""
        out: Dict[str, int] = {}
        for r in (self.estimate.rows if self.estimate else []):
            out[r.format] = out.get(r.format, 0) + 1
        return out

    def trans_data(self) -> Dict[str, float]:
        """TransData kernels: ``count``, ``time_us`` (µs), ``hbm_bytes`` and ``share`` of the
        estimated time."""
        rows = [r for r in (self.estimate.rows if self.estimate else []) if r.op == "TransData"]
        t = sum(r.time_us for r in rows)
        total = self.estimate.total_time_us if self.estimate else 0.0
        return {"count": len(rows), "time_us": t, "hbm_bytes": sum(r.hbm_bytes for r in rows),
                "share": t / total if total else 0.0}

    def op_classes(self) -> List[OpClass]:
        """Estimated time per op type, largest first, each with its bottleneck class."""
        by: Dict[str, Dict[str, Any]] = {}
        for r in (self.estimate.rows if self.estimate else []):
            d = by.setdefault(r.op, {"count": 0, "time": 0.0, "bounds": {}})
            d["count"] += 1
            d["time"] += r.time_us
            cls = BOUND_CLASS.get(r.bound, r.bound)
            d["bounds"][cls] = d["bounds"].get(cls, 0.0) + r.time_us
        out = [OpClass(op, d["count"], d["time"], max(d["bounds"], key=d["bounds"].get))
               for op, d in by.items()]
        return sorted(out, key=lambda c: -c.time_us)

    def time_by_class(self) -> Dict[str, float]:
        """Estimated µs per op class (Cube, Vector, memory, launch, fused)."""
        out: Dict[str, float] = {}
        for b, t in (self.estimate.time_by_bound().items() if self.estimate else ()):
            cls = BOUND_CLASS.get(b, b)
            out[cls] = out.get(cls, 0.0) + t
        return out

    def failing_layers(self, status: str = "fail") -> list:
        """The compared floating-point layers of ``status`` ("fail" or "warn"), in
        execution order (`compare.LayerResult`). Integer layers are left out: an index
        output (max pooling's argmax) picks another of two tied values at a lower
        precision, which is no error; the outputs' status judges what reaches the user."""
        return [r for r in (self.accuracy.layers if self.accuracy else [])
                if r.status == status and r.dtype in ("float16", "bfloat16", "float32", "float64")]

    # -- output -----------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready form (``opencann readiness --json``). Times in µs, sizes in bytes."""
        est = self.estimate
        acc = self.accuracy
        return {
            "model": self.model, "device": self.device, "precision": self.precision,
            "precision_mode": self.precision_mode, "batch": self.batch, "verdict": self.verdict,
            "reasons": self.reasons, "next_steps": self.next_steps, "skipped": self.skipped,
            "support": self.support.to_dict() if self.support else None,
            "formats": self.formats(), "trans_data": self.trans_data(),
            "memory": None if self.memory is None else {
                "hbm_bytes": self.memory.hbm, "weights_bytes": self.memory.weights,
                "activation_bytes": self.memory.activations, "kv_cache_bytes": self.memory.kv_cache,
                "total_bytes": self.memory.total, "fits": self.memory.fits},
            "kv_cache": None if self.kv is None else dict(vars(self.kv), bytes=self.kv.nbytes),
            "latency": None if est is None else {
                "total_us": est.total_time_us, "time_by_class_us": self.time_by_class(),
                "op_classes": [vars(c) for c in self.op_classes()], "notes": est.notes},
            "accuracy": None if acc is None else {
                "status": acc.status, "counts": acc.counts(),
                "failing_layers": [_layer(r) for r in self.failing_layers()],
                "warning_layers": [_layer(r) for r in self.failing_layers("warn")],
                "outputs": [_layer(r) for r in acc.outputs]},
        }

    def to_json(self, path: Optional[str] = None) -> str:
        """`to_dict` as JSON text, written to ``path`` when given."""
        s = json.dumps(self.to_dict(), indent=2, default=str)
        if path:
            with open(path, "w", encoding="utf-8") as f:
                f.write(s)
        return s

    def memory_lines(self) -> List[str]:
        """The memory section as lines: each part in MiB/GiB, the KV cache with its
        formula, the total against the HBM and whether it fits."""
        m = self.memory
        if m is None:
            return [f"not estimated: {self.skipped.get('memory', '?')}"]
        lines = [f"weights {_size(m.weights)}", f"peak activations {_size(m.activations)}"]
        if self.kv is not None:
            lines.append(f"KV cache {_size(self.kv.nbytes)} at context {self.kv.context}, batch "
                         f"{self.kv.batch} = {self.kv.formula()} = {self.kv.nbytes} B")
        lines.append(f"total {_size(m.total)} of {m.hbm / GiB:.0f} GiB HBM: "
                     + (f"fits ({_share(m.total, m.hbm)})" if m.fits else
                        f"does NOT fit ({_size(m.total - m.hbm)} over)"))
        return lines


def accuracy_counts(acc: CompareResult) -> str:
    """``415 layers compared: 415 pass, 0 warn, 0 fail (msprobe's thresholds)``, or for
    an outputs-only comparison (ONNX) how many outputs were compared."""
    if not acc.layers:
        return (f"{len(acc.outputs)} outputs compared with the fp32 compile (an ONNX graph has "
                "no eager layers to compare layer by layer)")
    c = acc.counts()
    ints = sum(r.status == "fail" and not r.dtype.startswith(("float", "bfloat")) for r in acc.layers)
    return (f"{len(acc.layers)} layers compared: {c['pass']} pass, {c['warn']} warn, "
            f"{c['fail']} fail (msprobe's thresholds)"
            + (f"; {ints} of the fails integer (indices of tied values), not errors" if ints else ""))


def _layer(r) -> Dict[str, Any]:
    return {"node": r.node, "op": r.op, "module": r.module, "source": r.source, "dtype": r.dtype,
            "cosine": r.cosine, "rel_rmse": r.rel_rmse, "status": r.status}


def _size(n: float) -> str:
    """Bytes as GiB, MiB or KiB, whichever gives a number of at least 1 (else B)."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024.0)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _share(part: float, whole: float) -> str:
    """``part`` as a percentage of ``whole``, "<0.01%" when smaller."""
    p = 100 * part / whole if whole else 0.0
    return "<0.01%" if 0 < p < 0.01 else f"{p:.2f}%"


# -- the model -------------------------------------------------------------------------

@dataclass
class _Source:
    """What readiness checks: a torch module and its sample inputs, an ONNX path (with
    its ``input_shapes``) or a loaded ``.ocm`` model (``compiled``)."""

    name: str
    module: Optional[torch.nn.Module] = None
    args: tuple = ()
    kwargs: Optional[Dict[str, Any]] = None
    onnx: Optional[str] = None
    input_shapes: Optional[Dict[str, Any]] = None
    compiled: Any = None


def _source(model, inputs, batch: Optional[int], seq: Optional[int], name: Optional[str],
            example_kwargs, input_shapes) -> _Source:
    """The `_Source` of ``model``: a module (``inputs`` required), a zoo name (its example
    inputs at ``batch`` and ``seq``), an ``.onnx`` or ``.ocm`` path. Raises ValueError."""
    import os
    if isinstance(model, torch.nn.Module):
        if inputs is None:
            raise ValueError("readiness: give sample inputs for a torch.nn.Module (a tensor or tuple "
                             "of its positional inputs), or pass a zoo name such as 'resnet50'")
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        return _Source(name or type(model).__name__, model.eval(), args, example_kwargs)
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"readiness takes a torch.nn.Module, a zoo name, an .onnx or an .ocm path, "
                        f"got {type(model).__name__}")
    path = os.fspath(model)
    low = path.lower()
    if low.endswith((".onnx", ".ocm")):
        if not os.path.isfile(path):
            raise ValueError(f"{path}: no such file")
        if low.endswith(".onnx"):
            return _Source(name or path, onnx=path, input_shapes=input_shapes)
        from ..engine.loading import load_model_file
        return _Source(name or path, compiled=load_model_file(path))
    if input_shapes:
        raise ValueError("readiness: input_shapes (--input-shape) is for .onnx files; a zoo model's "
                         "or module's sample inputs fix the shapes")
    from .. import zoo
    kw = {"batch": batch or 1}
    if seq is not None:
        kw["seq"] = seq
    try:
        zm = zoo.get(path, **kw)
    except KeyError as e:
        raise ValueError(f"{e.args[0]}; or pass an .onnx / .ocm file or a torch.nn.Module") from None
    return _Source(name or zm.name, zm.model, tuple(zm.example_inputs))


# -- the parts --------------------------------------------------------------------------

def _support(src: _Source, device: str) -> Analysis:
    from .analyze import Analysis, analyze, analyze_onnx, audit_graph
    from ..devices import parse_device
    if src.module is not None:
        return analyze(src.module, src.args, device, example_kwargs=src.kwargs, name=src.name)
    if src.onnx is not None:
        return analyze_onnx(src.onnx, device, src.input_shapes)
    res = Analysis(src.name, parse_device(src.compiled.report.device), capture="model file")
    audit_graph(copy.deepcopy(src.compiled.graph), res)
    return res


def _estimate(src: _Source, device: str, dtype: str, mode: str,
              batch: Optional[int]) -> EstimateReport:
    from .estimate import estimate, estimate_compiled, estimate_onnx
    if src.module is not None:
        # estimate casts the module it is given: a copy keeps the caller's (and the
        # accuracy check's) fp32 model
        return estimate(copy.deepcopy(src.module), src.args, device, batch=batch, dtype=dtype,
                        check_fit=False, fusion_comparison=False)
    if src.onnx is not None:
        return estimate_onnx(src.onnx, device, src.input_shapes, check_fit=False, precision_mode=mode,
                             fusion_comparison=False)
    return estimate_compiled(src.compiled, src.name, check_fit=False)


def _accuracy(src: _Source, device: str, mode: str) -> CompareResult:
    from .compare import Session, compare_onnx
    if src.onnx is not None:
        return compare_onnx(src.onnx, device, {"precision_mode": mode}, src.input_shapes)
    return Session(src.module, src.args, src.kwargs).run(device, {"precision_mode": mode})


def llm_arch(model):
    """The `LLMArch` of ``model`` when it is a transformers model whose config
    `read_arch` reads (GPT-2, Llama, Mistral, Qwen2), else None."""
    from ..llm.arch import GPT2_TYPES, LLAMA_TYPES, read_arch
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in GPT2_TYPES + LLAMA_TYPES:
        return None
    return read_arch(config)


def _kv(src: _Source, context: Optional[int], batch: int, itemsize: int) -> Optional[KvCache]:
    """The KV cache of an LLM at ``context`` (None: its position table) and ``batch``;
    None for another model. Raises ValueError for ``context`` given to a model that is
    no LLM, or one beyond the model's positions."""
    arch = llm_arch(src.module) if src.module is not None else None
    if arch is None:
        if context is not None:
            raise ValueError(f"readiness: context is for LLMs (transformers GPT-2, Llama, Mistral, "
                             f"Qwen2 models); {src.name} is not one: drop --context")
        return None
    if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 1):
        raise ValueError(f"readiness: context must be a whole number of tokens >= 1, got {context!r}")
    ctx = context if context is not None else arch.max_positions
    try:
        arch.check_max_seq_len(ctx)
    except ValueError as e:   # the generator's wording (max_seq_len) in readiness's (context)
        raise ValueError("readiness: " + str(e).replace("compile with max_seq_len", "give --context")
                         .replace("max_seq_len", "context")) from None
    return KvCache(arch.model_type, arch.num_layers, batch, arch.num_kv_heads, ctx, arch.head_dim,
                   itemsize, arch.kv_cache_bytes(batch, ctx, itemsize))


def _check_compiled_for(src: _Source, dev) -> None:
    """Raise ValueError (one line) when the model file ``src`` was compiled for another
    device than ``dev``: a model file is checked as it was saved."""
    from ..devices import parse_device
    have = parse_device(str(src.compiled.report.device))
    if have.kind != "vnpu":
        raise ValueError(f"{src.name} was compiled for {have}, not for an NPU: convert the model for "
                         f"{dev} (opencann atc --soc_version Ascend910B) or run readiness on the "
                         "model it came from")
    if have.spec.name != dev.spec.name:
        raise ValueError(f"{src.name} was compiled for {have} and is checked as saved: give --device "
                         f"{have}, or convert the model for {dev} (opencann atc --soc_version)")


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: " + ((str(e).strip().splitlines() or [""])[0])


# -- verdict and next steps -----------------------------------------------------------------

def _judge(rep: ReadinessReport) -> None:
    """Set ``rep.verdict``, ``reasons`` and ``next_steps`` from its sections: "not ready"
    for a model that does not compile into one device graph, a part that could not be
    computed, a plan beyond the HBM or outputs failing at the precision; else "ready with
    host ops" when ops run on the host; else "ready"."""
    reasons = [f"{f.kind.replace('_', ' ')}: {f.op}" + (f" at {f.sources[0]}" if f.sources else "")
               for f in rep.blockers()]
    if not reasons and rep.estimate is None and "estimate" in rep.skipped:
        reasons.append(f"estimate not computed: {rep.skipped['estimate']}")
    m = rep.memory
    if m is not None and not m.fits:
        reasons.append(f"needs {_size(m.total)}, the device has {m.hbm / GiB:.0f} GiB of HBM")
    if _cube_lacks(rep):
        spec, dtype = _cube_lacks(rep)
        reasons.append(f"the Cube of {spec.name} has no {dtype} kernels")
    if rep.accuracy is not None and rep.accuracy.status == "fail":
        reasons.append(f"outputs fail msprobe's {rep.precision} thresholds against fp32")
    steps = _blocker_steps(rep) + ([_fit_step(rep)] if m is not None and not m.fits else [])
    steps += _host_steps(rep) + _accuracy_steps(rep) + _estimate_steps(rep)
    host = rep.host_ops()
    if reasons:
        rep.verdict = "not ready"
    elif host:
        rep.verdict = "ready with host ops"
        reasons.append(f"{sum(f.count for f in host)} ops of {len(host)} types run on the host")
    else:
        rep.verdict = "ready"
    if not steps:
        steps.append(f"compile for {rep.device} with precision_mode '{rep.precision_mode}' "
                     "(opencann.compile(model, inputs, device=..., options=...)) and measure")
    rep.reasons, rep.next_steps = reasons, steps


def _blocker_steps(rep: ReadinessReport) -> List[str]:
    """Each blocking finding with its lines and its fix."""
    return [f"{f.op}" + (f" at {'; '.join(f.sources[:3])}" if f.sources else "")
            + f": {f.detail or f.message or 'make the shapes static and the branches tensor-free'}"
            for f in rep.blockers()]


def _host_steps(rep: ReadinessReport) -> List[str]:
    """One step per host fallback / custom op (at its lines), one for the ops without a
    device kernel."""
    steps = []
    host = rep.host_ops()
    for f in host:
        where = f" at {'; '.join(f.sources[:3])}" if f.sources else ""
        if f.kind == "custom_op":
            steps.append(f"custom op {f.op} x{f.count}{where} runs on the host: register it with "
                         "opencann.extend.register_op(..., kernels={'vnpu': ...})")
        elif f.kind == "host_fallback":
            steps.append(f"{f.op} x{f.count}{where} has no converter and runs on the host: rewrite "
                         "that line with supported torch ops, or register the op with "
                         "opencann.extend.register_op")
    nokernel = [f for f in host if f.kind == "no_device_kernel"]
    if nokernel:
        shown = ", ".join(f"{f.op} x{f.count}" + (f" ({f.sources[0]})" if f.sources else "")
                          for f in nokernel[:6]) + (", ..." if len(nokernel) > 6 else "")
        many = len(nokernel) > 1
        steps.append(f"{len(nokernel)} op type{'s' if many else ''} without a {rep.device} kernel "
                     f"run{'' if many else 's'} on the host, a copy each way: {shown}; give them "
                     "one with opencann.extend.register_op(..., kernels={'vnpu': ...}) or express "
                     "them with ops that have one")
    return steps


def _accuracy_steps(rep: ReadinessReport) -> List[str]:
    """The first failing layer (the others follow it) and the op to keep in fp32; or why
    accuracy was not checked."""
    fails, acc = rep.failing_layers(), rep.accuracy
    if fails:
        first = fails[0]
        rest = ", ".join(f"{r.node} ({r.op})" for r in fails[1:6]) + (", ..." if len(fails) > 6 else "")
        return [f"{len(fails)} layer{'s' if len(fails) > 1 else ''} fail at {rep.precision}, the "
                f"first {first.node} ({first.op}) at {first.source or first.module or '?'}"
                + (f" ({first.note})" if first.note else
                   f" (cosine {first.cosine:.6f}, relative RMSE {first.rel_rmse:.3g})")
                + (f"; after it {rest}" if rest else "")
                + f": keep {first.op} in fp32 with options={{'precision_mode': "
                f"'allow_mix_precision', 'keep_fp32': ['{first.op}']}}"
                + (" or try --precision bf16 (fp32's range)" if rep.precision == "fp16" else "")]
    if acc is not None and acc.status == "fail":
        return [f"the outputs fail at {rep.precision}: compile with precision_mode "
                "'allow_mix_precision' (keeps the keep_fp32 ops in fp32) or use fp32"]
    why = rep.skipped.get("accuracy", "")
    if acc is None and why and not why.startswith(("turned off", "the model does not", "a model file")):
        return [f"accuracy not checked ({why}): run opencann compare on the model"]
    return []


def _estimate_steps(rep: ReadinessReport) -> List[str]:
    """A precision the preset's Cube does not take (``NpuSpec.cube_dtypes``), TransData
    beyond `TRANSDATA_SHARE` of the time, ops costed by the fallback, fp32 Cube operands
    cast to fp16 (the estimate's note)."""
    steps = []
    missing = _cube_lacks(rep)
    if missing:
        spec, dtype = missing
        others = sorted(n for n, p in _presets().items() if dtype in p.cube_dtypes)
        steps.append(f"the Cube of {spec.name} takes {'/'.join(spec.cube_dtypes)}, not {dtype}: "
                     f"no Conv/MatMul kernel there computes in {dtype} (the compile is refused, "
                     f"as CANN's); use --precision fp16, or a preset whose Cube takes {dtype} "
                     f"({', '.join(others) or 'none built in'})")
    td = rep.trans_data()
    if td["share"] > TRANSDATA_SHARE:
        steps.append(f"{td['count']} TransData kernels take {100 * td['share']:.0f}% of the "
                     "estimated time: they convert at the edges of NPU-format regions; larger "
                     "batches amortise them, and ops without an NPU format between Cube ops split "
                     "regions (see the formats section)")
    if rep.estimate is not None and rep.estimate.fallbacks:
        steps.append("the estimate costs " + ", ".join(f"{k} x{v}" for k, v in rep.estimate.fallbacks.items())
                     + " as memory-bound copies (no cost model): their latency is a guess")
    return steps + [n for n in (rep.estimate.notes if rep.estimate else []) if n.startswith("fp32 to fp16")]


def _cube_lacks(rep: ReadinessReport):
    """(the preset's spec, the precision's dtype) when the device's Cube takes no operands
    of that dtype (``NpuSpec.cube_dtypes``: bf16 on Ascend 910/310), else None."""
    from ..devices import parse_device
    spec = getattr(parse_device(rep.device), "spec", None)
    dtype = PRECISIONS[rep.precision][0]
    return (spec, dtype) if spec is not None and dtype not in spec.cube_dtypes else None


def _presets():
    from ..devices import PRESETS
    return PRESETS


def _fit_step(rep: ReadinessReport) -> str:
    """What to change when the model does not fit: the largest context (LLM) or the
    share of the batch that fits, and a preset with more HBM."""
    m = rep.memory
    free = m.hbm - m.weights
    bigger = sorted(s.name for s in _presets().values() if s.hbm_bytes >= m.total)
    more = f"; or a device with more HBM ({', '.join(bigger)})" if bigger else \
        "; or split the weights over several devices (tensor parallelism)"
    if free <= 0:
        return f"the weights alone ({_size(m.weights)}) exceed the HBM: quantize them (int8: " \
               f"opencann.tools.quantize){more}"
    if rep.kv is not None and free > m.activations:
        ctx = int((free - m.activations) // rep.kv.bytes_per_token)
        return f"at batch {rep.kv.batch} a context of about {ctx} tokens fits (--context {ctx}), " \
               f"or a smaller batch{more}"
    per = (m.activations + m.kv_cache) / max(rep.batch, 1)
    return f"about {int(free // per) if per else 0} sequences/images fit per batch (--batch){more}"


# -- the function ----------------------------------------------------------------------

def readiness(model, inputs=None, device: str = "vnpu:ascend910b", precision: str = "fp16",
              context: Optional[int] = None, batch: Optional[int] = None, *,
              seq: Optional[int] = None, precision_mode: Optional[str] = None,
              example_kwargs: Optional[Dict[str, Any]] = None,
              input_shapes: Optional[Dict[str, Any]] = None, accuracy: bool = True,
              name: Optional[str] = None) -> ReadinessReport:
    """Check ``model`` for ``device``: op support, formats and TransData, memory fit,
    latency, accuracy at ``precision``; a verdict and next steps (module docstring).

    Args:
        model: a torch.nn.Module (with ``inputs``), a zoo name ('resnet50', 'minilm',
            'bert-base', 'gpt2'), an ``.onnx`` path (``input_shapes``: name -> sizes for
            its symbolic dims) or an ``.ocm`` model file.
        inputs: sample inputs of a module: a tensor or tuple, random (never all zeros);
            they fix the shapes the estimate costs and the values the accuracy check
            compares.
        device: ``vnpu:<preset>`` (ascend910, ascend910b, ascend310) or
            ``vnpu:<spec.json|.toml>``.
        precision: "fp16" or "bf16" (`PRECISIONS`).
        context: an LLM's context in tokens (prompt + generated) for its KV cache;
            None: the model's position table. Only for LLMs.
        batch: sequences / images per call: the estimate's dim 0 and the KV cache's
            batch; None: the sample inputs' dim 0 (a zoo model: 1).
        seq: a zoo transformer's sequence length (its example inputs).
        precision_mode: the CANN precision mode the accuracy check compiles with
            (default: the precision's, `PRECISIONS`).
        accuracy: False skips the accuracy check (it runs the model twice).
    Returns: `ReadinessReport` (µs, bytes).
    Raises:
        ValueError: a device that is not a vnpu, an unknown preset or precision, a module
            without inputs, an unknown zoo name or missing file, a model file compiled for
            another device, ``input_shapes`` for a model that is no ONNX file, ``batch``
            for an ONNX or model file, ``context`` for a model that is no LLM, < 1 or
            beyond its positions, batch < 1; sample inputs giving an output with no
            finite value (`compare.UnjudgeableInputs`: accuracy would pass anything).
        TypeError: ``model`` of another type.
    Failures inside a part (a capture error, a graph that does not convert) are findings:
    the part is None and ``skipped`` says why.
    """
    dev, (dtype, mode, itemsize) = _check_args(device, precision, batch, precision_mode)
    src = _source(model, inputs, batch, seq, name, example_kwargs, input_shapes)
    if src.compiled is not None:
        _check_compiled_for(src, dev)
    if batch is not None and src.module is None:
        raise ValueError(f"readiness: batch is for torch models and zoo names; {src.name} runs at "
                         "the batch of its input shapes (an .onnx file: set it with input_shapes / "
                         "--input-shape)")
    if batch is None:
        x = next((a for a in src.args if isinstance(a, torch.Tensor) and a.dim()), None)
        batch = int(x.shape[0]) if x is not None else 1
    rep = ReadinessReport(src.name, str(dev), precision, mode, batch)
    rep.kv = _kv(src, context, batch, itemsize)
    rep.support = _support(src, str(dev))
    if rep.blockers():
        rep.skipped.update({p: "the model does not compile into one device graph (see op support)"
                            for p in ("estimate", "memory", "accuracy")})
    else:
        _run_parts(rep, src, dtype, batch if src.module is not None else None, accuracy)
    _judge(rep)
    return rep


def _check_args(device, precision: str, batch, precision_mode: Optional[str]):
    """(the vnpu `Device`, (estimate dtype, compared precision mode, KV itemsize)).
    Raises ValueError, one line: not a vnpu, unknown preset, precision or mode, batch < 1."""
    from ..devices import parse_device
    if precision not in PRECISIONS:
        raise ValueError(f"readiness: precision {precision!r} is not one of {sorted(PRECISIONS)}; "
                         "use fp16 (force_fp16) or bf16 (allow_mix_precision_bf16)")
    dev = parse_device(device, kind="vnpu")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ValueError(f"readiness: batch must be a whole number >= 1, got {batch!r}")
    dtype, mode, itemsize = PRECISIONS[precision]
    if precision_mode is not None:
        from ..passes.prepare.precision import low_dtype
        low_dtype(precision_mode)   # one ValueError line listing the modes
        mode = precision_mode
    return dev, (dtype, mode, itemsize)


def _run_parts(rep: ReadinessReport, src: _Source, dtype: str, batch: Optional[int],
               accuracy: bool) -> None:
    """Fill ``rep.estimate``, ``memory`` and ``accuracy``; a part that fails is skipped
    with its error's first line."""
    try:
        rep.estimate = _estimate(src, rep.device, dtype, rep.precision_mode, batch)
    except Exception as e:  # noqa: BLE001 - a finding of the report, in one line
        rep.skipped["estimate"] = rep.skipped["memory"] = _first_line(e)
    if rep.estimate is not None:
        e = rep.estimate
        rep.memory = MemoryFit(e.spec.hbm_bytes, e.weights_bytes,
                               e.arena_bytes + e.kernel_alloc_peak_bytes + e.input_bytes,
                               rep.kv.nbytes if rep.kv else 0)
    if src.compiled is not None:
        rep.skipped["accuracy"] = ("a model file holds no fp32 reference: run readiness on the "
                                   "model it was compiled from")
    elif not accuracy:
        rep.skipped["accuracy"] = "turned off (accuracy=False / --no-accuracy)"
    else:
        try:
            rep.accuracy = _accuracy(src, rep.device, rep.precision_mode)
        except UnjudgeableInputs:
            raise   # bad sample inputs (all-NaN outputs): the caller's error, not a finding
        except Exception as e:  # noqa: BLE001 - a finding of the report, in one line
            rep.skipped["accuracy"] = _first_line(e)


__all__ = ["BOUND_CLASS", "KvCache", "accuracy_counts", "MemoryFit", "OpClass", "PRECISIONS", "ReadinessReport",
           "VERDICTS", "llm_arch", "readiness"]
