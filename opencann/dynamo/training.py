"""Training through the graph engine: ``torch.compile(model, backend=...)`` in training
mode compiles both the forward and the backward graph with opencann.

AOTAutograd traces the joint forward+backward graph, opencann's recomputation pass
(`opencann.dynamo.partition.partition`) splits it into a forward graph (which also
returns the tensors saved for backward) and a backward graph, and each goes through the
same convert → `compile_graph` → `Executor` path as inference (`opencann.dynamo.compile_fx`).
Optimizer steps stay in torch. Source: PyTorch "AOTAutograd" and "Custom Backends"
(torch.compiler docs); Chen et al. 2016 (arXiv:1604.06174) for recomputation.

Options (``torch.compile(..., backend=opencann_training_backend, options={...})`` or
`make_training_backend(**options)`): ``memory_budget`` (bytes, or a fraction of the
no-recomputation peak; see `opencann.dynamo.partition`) plus every `compile_graph`
option (``disable``, ``enable``, ``verify``, ``alignment``, ``inplace``, ``copy_out``,
and ``precision_mode`` once the compiler knows it).
"""
from __future__ import annotations

from typing import Any, Dict

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..frontend.torch import decomposition_table
from ..engine.options import KNOWN_OPTIONS, TRAINING_OPTIONS
from .compile_fx import compile_fx
from .partition import PARTITION_REPORTS, make_partition_fn, resolve_budget
from .recompiles import compile_in_progress



# Fused-attention forwards whose decomposition is only valid for inference: the math
# decomposition returns a placeholder logsumexp, which the fused backward then reads.
KEEP_FOR_TRAINING = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,)

_a = torch.ops.aten
# Gradient ops kept whole in backward graphs: each is one native kernel (an opencann
# *Grad op) where core ATen's decomposition is a chain of 5-12 elementwise passes and
# reductions over the activation, with as many full-size temporaries alive at once.
NATIVE_BACKWARD_OPS = (
    _a.threshold_backward.default, _a.gelu_backward.default, _a.tanh_backward.default,
    _a.sigmoid_backward.default, _a.silu_backward.default, _a.native_dropout_backward.default,
    _a._softmax_backward_data.default, _a._log_softmax_backward_data.default,
    _a.native_layer_norm_backward.default, _a.native_batch_norm_backward.default,
    _a.embedding_dense_backward.default,
)


def training_decompositions() -> Dict:
    """The inference decomposition table minus ops whose decomposition breaks their
    fused backward (`KEEP_FOR_TRAINING`) and the gradient ops that run faster and in
    less memory as one kernel (`NATIVE_BACKWARD_OPS`)."""
    table = dict(decomposition_table())
    for op in KEEP_FOR_TRAINING + NATIVE_BACKWARD_OPS:
        table.pop(op, None)
    return table


def _boxed(run):
    def call(args):
        return run(*args)
    call._boxed_call = True
    return call


def make_training_backend(**options):
    """A dynamo backend (``torch.compile(model, backend=make_training_backend(...))``)
    that compiles forward and backward graphs with opencann. ``options``: see the
    module docstring. Raises ValueError at once for an unknown option or a malformed
    ``memory_budget``. A budget that cannot be met raises MemoryBudgetError at the first
    training step; torch.compile wraps it in ``torch._dynamo.exc.BackendCompilerFailed``,
    whose ``inner_exception`` is the MemoryBudgetError."""
    _check_training_options(options)

    def backend(gm: fx.GraphModule, example_inputs, **more):
        return opencann_training_backend(gm, example_inputs, **{**options, **more})
    return backend


def _check_training_options(opts: Dict[str, Any]) -> None:
    """Raise ValueError for an unknown option (listing compile and training options)
    or a malformed ``memory_budget``."""
    unknown = set(opts) - KNOWN_OPTIONS - TRAINING_OPTIONS - {"options"}
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)}; compile options: "
                         f"{sorted(KNOWN_OPTIONS)}; training options: {sorted(TRAINING_OPTIONS)}")
    resolve_budget(opts.get("memory_budget"), 1)


def opencann_training_backend(gm: fx.GraphModule, example_inputs, **options):
    """The training backend: AOTAutograd (joint graph) → opencann partition
    (recomputation) → opencann passes and runtime for the forward and backward graphs.
    Under ``torch.no_grad`` only the forward (inference) graph is compiled."""
    from torch._dynamo.backends.common import aot_autograd
    opts: Dict[str, Any] = dict(options.pop("options", None) or {})
    opts.update(options)
    _check_training_options(opts)
    budget = opts.pop("memory_budget", None)
    compile_opts = opts or None
    n_parts = len(PARTITION_REPORTS)
    forward = []
    entry = compile_in_progress()   # the backward is compiled later, at its first call

    def fw(g, inputs):
        with unset_fake_temporarily():  # constant folding must make real tensors
            run = compile_fx(g, inputs, compile_opts, entry=entry)
        _attach(run.report, "forward", n_parts)
        forward.append(run.report)
        return _boxed(run)

    def bw(g, inputs):
        with unset_fake_temporarily():
            run = compile_fx(g, inputs, compile_opts, entry=entry)
        _attach(run.report, "backward", n_parts)
        if forward:   # compiled at the first backward: the forward's torch.compile stamp
            run.report.torch_compile = dict(forward[-1].torch_compile)
        return _boxed(run)

    return aot_autograd(fw_compiler=fw, bw_compiler=bw, inference_compiler=fw,
                        partition_fn=make_partition_fn(budget),
                        decompositions=training_decompositions())(gm, example_inputs)


def _attach(report, role: str, n_parts: int) -> None:
    """Record the graph's role and the partition report (if this compile made one)."""
    report.notes.append(f"training graph: {role}")
    if report.dynamic:
        report.notes.append("symbolic shapes: the partition (what is saved, what recomputed) "
                            "was decided at the sizes dynamo traced with and serves every shape")
    if len(PARTITION_REPORTS) > n_parts:
        rec = PARTITION_REPORTS[-1]
        report.memory["recompute"] = {k: v for k, v in rec.items() if k not in ("saved",)}
        rec.setdefault("arena_bytes", {})[role] = report.memory.get("arena_bytes")
