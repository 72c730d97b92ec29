"""``torch.compile(model, backend="opencann")``.

Dynamo hands us each graph between graph breaks; AOTAutograd lowers it to ATen with our
decomposition table; each ATen graph goes through the same passes and runtime as
``opencann.compile``. A graph break therefore simply yields several compiled graphs.
Parameters arrive as graph inputs (not constants), so constant-only rewrites (Conv+BN
folding, weight prepacking) report "not constants" there; use ``opencann.compile`` for
frozen inference graphs. Source: PyTorch "Custom Backends" (torch.compiler docs).
"""
from __future__ import annotations

import torch

from ..frontend.torch import decomposition_table
from ..log import logger
from .compile_fx import compile_fx

def _dynamic(example_inputs) -> bool:
    for t in example_inputs:
        if isinstance(t, torch.SymInt):
            return True
        if isinstance(t, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in t.shape):
            return True
    return False


def opencann_backend(gm: torch.fx.GraphModule, example_inputs, **options):
    """The dynamo backend: AOTAutograd → opencann passes → runtime. Inference graphs get
    the forward compiler only; when gradients are needed (a parameter or input requires
    grad and grad mode is on) the training backend compiles forward and backward.
    ``torch.compile(..., options={...})`` passes opencann's compile options."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    options = dict(options.pop("options", None) or {}, **options)
    training = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                               for t in example_inputs)
    if _dynamic(example_inputs) and training:
        logger.warning(
            "opencann: dynamo passed a training graph with symbolic shapes (it recompiled for "
            "a new input shape); opencann's training backend compiles static shapes, so this "
            "graph runs eagerly. Use torch.compile(model, backend='opencann', dynamic=False) "
            "to get one static graph per shape")
        return gm.forward
    if _dynamic(example_inputs):
        logger.info("opencann: dynamo passed a graph with symbolic shapes (a recompile for a "
                    "new input shape): compiled once, memory planned per concrete shape")
    hops = sorted({n.target.name() for n in gm.graph.nodes if n.op == "call_function"
                   and isinstance(n.target, torch._ops.HigherOrderOperator)})
    if hops:
        logger.warning(
            "opencann: this graph holds %s (control flow or a subgraph, a higher-order op "
            "opencann does not compile), so it runs eagerly; compute both branches and pick "
            "with torch.where(pred, a, b) to compile it", ", ".join(f"torch.{h}" for h in hops))
        return gm.forward
    if training:
        from .training import opencann_training_backend
        return opencann_training_backend(gm, example_inputs, **options)

    def fw(g, inputs):
        with unset_fake_temporarily():  # constant folding must make real tensors
            return compile_fx(g, inputs, options or None)

    return aot_autograd(fw_compiler=fw, decompositions=decomposition_table())(gm, example_inputs)


def register() -> None:
    """Register the ``"opencann"`` backend name with torch.compile (idempotent)."""
    from torch._dynamo import list_backends, register_backend
    if "opencann" not in list_backends(exclude_tags=()):
        register_backend(name="opencann")(opencann_backend)
