"""``torch.compile(model, backend="opencann")``.

Dynamo hands us each graph between graph breaks; AOTAutograd lowers it to ATen with our
decomposition table; each ATen graph goes through the same passes and runtime as
``opencann.compile``. A graph break therefore simply yields several compiled graphs.
Parameters arrive as graph inputs; in inference graphs they are frozen into constants
(`opencann.dynamo.freezing`, the option ``freezing``, on by default), so Conv+BN folding,
fused post-ops, weight prepacking and QKV merging apply as in ``opencann.compile``,
guarded per call against weight changes. Source: PyTorch "Custom Backends"
(torch.compiler docs).
"""
from __future__ import annotations

import torch

from ..frontend.torch import (decomposition_table, native_dispatch_of_kept, rewrite_written_unfolds,
                              written_expand)
from ..log import logger
from ..engine.options import check_options, option
from .compile_fx import COMPILED_GRAPHS
from .freezing import freezing_compiler, weight_inputs
from .recompiles import note_compile, note_eager, stamp
from .symbolic import graph_symbols


def opencann_backend(gm: torch.fx.GraphModule, example_inputs, **options):
    """The dynamo backend: AOTAutograd → opencann passes → runtime. Inference graphs get
    the forward compiler only; when gradients are needed (a parameter or input requires
    grad and grad mode is on) the training backend compiles forward and backward. Graphs
    with symbolic shapes (dynamo's recompile for a new shape, or ``dynamic=True``) are
    optimised once and planned per concrete shape, for inference and training alike; what
    is symbolic (a tensor's sizes or strides, an int argument) is read from every value of
    the graph (`opencann.dynamo.symbolic`), and a graph computing a data-dependent size or
    scalar (``.item()``, ``x[mask]`` under dynamo's ``capture_scalar_outputs`` /
    ``capture_dynamic_output_shape_ops``) runs eagerly.
    Every compile is counted per code object with dynamo's recompile reason
    (`opencann.dynamo.recompiles`) and stamped on the graphs' reports
    (``report.torch_compile``); a graph run eagerly is counted with its reason
    (`opencann.dynamo.eager_fallbacks`), as is a graph that writes through an ``expand``
    view repeating elements; writes through ``unfold`` views are respelled first
    (`opencann.frontend.torch.view_writes`). ``torch.compile(..., options={...})`` passes
    opencann's compile options."""
    options = dict(options.pop("options", None) or {}, **options)
    training = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                               for t in example_inputs)
    dynamic = graph_symbols(gm, example_inputs).dynamic
    entry = note_compile(dynamic, training)
    if dynamic:
        logger.info("opencann: dynamo passed a %s graph with symbolic shapes (a recompile for "
                    "a new input shape or int argument): compiled once, memory planned per "
                    "concrete shape",
                    "training" if training else "inference")
    hops = sorted({n.target.name() for n in gm.graph.nodes if n.op == "call_function"
                   and isinstance(n.target, torch._ops.HigherOrderOperator)})
    if hops:
        why = (f"this graph holds {', '.join(f'torch.{h}' for h in hops)} (control flow or a "
               "subgraph, a higher-order op opencann does not compile)")
        logger.warning("opencann: %s, so it runs eagerly; compute both branches and pick with "
                       "torch.where(pred, a, b) to compile it", why)
        note_eager(entry, gm.__class__.__name__, why)
        return gm.forward
    where = written_expand(gm)
    if where:   # functionalization would add up the copies' changes
        why = f"this graph writes through an expanded view that repeats elements (at {where})"
        logger.warning("opencann: %s, so it runs eagerly; write into the tensor before "
                       "expanding it to compile it", why)
        note_eager(entry, gm.__class__.__name__, why)
        return gm.forward
    rewrite_written_unfolds(gm)   # functionalization would zero what no window covers
    n0 = len(COMPILED_GRAPHS)
    if training:
        from .training import opencann_training_backend
        compiled = opencann_training_backend(gm, example_inputs, **options)
    else:
        compiled = _inference(gm, example_inputs, options, entry)
    stamp(entry, COMPILED_GRAPHS[n0:])
    return compiled


def _inference(gm, example_inputs, options, entry):
    from torch._dynamo.backends.common import aot_autograd
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    check_options(options)
    weights = weight_inputs(gm, example_inputs) if option(options, "freezing") else {}
    compiler = freezing_compiler(weights, example_inputs, options, entry)

    def fw(g, inputs):
        with unset_fake_temporarily():  # constant folding must make real tensors
            return compiler(g, inputs)

    with native_dispatch_of_kept():   # F.interpolate's ops stay whole (ATen's kernels)
        return aot_autograd(fw_compiler=fw, decompositions=decomposition_table())(gm, example_inputs)


def register() -> None:
    """Register the ``"opencann"`` backend name with torch.compile (idempotent)."""
    from torch._dynamo import list_backends, register_backend
    if "opencann" not in list_backends(exclude_tags=()):
        register_backend(name="opencann")(opencann_backend)
