"""Inputs for a compiled model run from the command line (``opencann run`` / ``bench`` of
an ``.ocm`` model file or an ONNX model): random tensors of the graph's recorded input
shapes and dtypes, a dynamic model's dims taken from ``--input-shape`` (ATC's
``--input_shape`` form, parsed by `opencann.tools.atc.input_shape`) or else from the
example it was compiled with, and the call that hands them to the model through its
saved calling convention (`CompiledModel.calling_convention`)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree

from ..ir.symbolic import bind, is_symbol

#: (graph input name, concrete shape, dtype)
InputSpec = Tuple[str, Tuple[int, ...], torch.dtype]


def random_tensor(shape: Sequence[int], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """A random tensor of ``shape`` and ``dtype``, never all zeros: floats standard
    normal, bools fair coin flips, integers uniform in [0, 2) (valid token ids and
    indices for any table)."""
    shape = tuple(shape)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(0, 2, shape, generator=g).to(dtype)


def _pattern(name: str, shape, readable) -> str:
    """``x:batch,3,8,8``: an input as ``--input-shape`` takes it, dims named."""
    return f"{name}:" + ",".join(readable(d) if isinstance(d, str) else str(d) for d in shape)


def input_specs(cm, given: Optional[Dict[str, Tuple[int, ...]]] = None,
                what: str = "the model") -> List[InputSpec]:
    """The concrete (name, shape, dtype) of each graph input of the compiled model ``cm``
    (`opencann.CompiledModel`): its static dims as recorded; its dynamic dims (a model
    compiled with dynamic dims or gears) from ``given`` (name -> sizes, ``--input-shape``)
    where it names them, else the example the model was compiled with, which every input
    sharing the dim follows. Raises ValueError (one line, naming ``what``) for a name
    that is no input (listing the inputs), a size of -1, another rank, a fixed dim given
    another size, or one dynamic dim given two sizes."""
    inputs = list(cm.graph.inputs)
    names = [v.name for v in inputs]
    binder = getattr(cm.shapes, "binder", None)   # None: a static model
    readable = binder.readable if binder is not None else str
    given = dict(given or {})
    unknown = [n for n in given if n not in names]
    if unknown:
        raise ValueError(f"--input-shape names {unknown}, not inputs of {what}; its inputs: "
                         + "; ".join(_pattern(n, v.desc.shape, readable) for n, v in zip(names, inputs)))
    values: Dict[str, int] = {}
    if binder is not None:
        values = dict(zip(binder.order, cm.shapes.example_key))
    fixed: Dict[str, Tuple[str, int]] = {}   # symbol -> (the input that set it, its size)
    for name, v in zip(names, inputs):
        if name not in given:
            continue
        sizes, shape = tuple(given[name]), v.desc.shape
        want = _pattern(name, shape, readable)
        if any(s < 0 for s in sizes):
            raise ValueError(f"--input-shape {name}:{','.join(map(str, sizes))} has -1; give "
                             f"every size of the shape to run, e.g. {want}")
        if len(sizes) != len(shape):
            raise ValueError(f"--input-shape gives {name} {len(sizes)} dims but it has "
                             f"{len(shape)} in {what}: {want}")
        for i, (s, d) in enumerate(zip(sizes, shape)):
            if not isinstance(d, str):
                if s != d:
                    raise ValueError(f"--input-shape {name}: dim {i} is fixed at {d} in {what}, "
                                     f"got {s}: give {want}")
            elif is_symbol(d):
                seen = fixed.get(d)
                if seen is not None and seen[1] != s:
                    raise ValueError(f"--input-shape gives dim {readable(d)} as {seen[1]} in "
                                     f"{seen[0]} and {s} in {name}: the inputs share it")
                fixed[d] = (name, s)
                values[d] = s
    specs = []
    for name, v in zip(names, inputs):
        shape = tuple(int(bind(d, values)) if isinstance(d, str) else int(d)
                      for d in v.desc.shape)
        specs.append((name, shape, v.desc.dtype.torch))
    return specs


def random_inputs(specs: Sequence[InputSpec], seed: int = 0) -> List[torch.Tensor]:
    """`random_tensor` per spec, from one generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [random_tensor(shape, dtype, g) for _, shape, dtype in specs]


def call_args(cm, tensors: Sequence[torch.Tensor]) -> Tuple[tuple, Dict[str, Any]]:
    """(args, kwargs) that call ``cm`` with ``tensors`` as its graph inputs, in order:
    its saved calling convention places them (and the non-tensor arguments baked in at
    compile time) where the compiled call had them; an ONNX model takes them
    positionally."""
    conv = cm.calling_convention()
    spec = conv["in_spec"]
    if spec is None:
        return tuple(tensors), {}
    flat: List[Any] = [None] * spec.num_leaves
    for i, value in conv["baked"].items():
        flat[int(i)] = value
    positions = conv["input_positions"]
    for p, t in zip(positions if positions is not None else range(len(tensors)), tensors):
        flat[p] = t
    args, kwargs = pytree.tree_unflatten(flat, spec)
    return tuple(args), dict(kwargs)


def describe(specs: Sequence[InputSpec]) -> str:
    """``x float32[2,3,8,8], mask int64[2,8]``."""
    return ", ".join(f"{n} {str(dt).replace('torch.', '')}[{','.join(map(str, s))}]"
                     for n, s, dt in specs)


def describe_outputs(out) -> str:
    """The tensor outputs as ``float32[2,8,8,8]``, then how many values are NaN or Inf."""
    leaves = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    shown = ", ".join(f"{str(x.dtype).replace('torch.', '')}[{','.join(map(str, x.shape))}]"
                      for x in leaves[:6]) + (", ..." if len(leaves) > 6 else "")
    bad = sum(int((~torch.isfinite(x)).sum()) for x in leaves
              if x.dtype.is_floating_point or x.dtype.is_complex)
    return f"{shown}; " + ("all finite" if not bad else f"{bad} NaN/Inf values")


def same_outputs(a, b) -> bool:
    """Whether two calls' outputs are equal bit for bit (NaN where the other has NaN)."""
    la = [x for x in pytree.tree_leaves(a) if isinstance(x, torch.Tensor)]
    lb = [x for x in pytree.tree_leaves(b) if isinstance(x, torch.Tensor)]
    return len(la) == len(lb) and all(
        x.shape == y.shape and x.dtype == y.dtype and torch.equal(
            torch.nan_to_num(x) if x.is_floating_point() else x,
            torch.nan_to_num(y) if y.is_floating_point() else y)
        and (not x.is_floating_point() or torch.equal(x.isnan(), y.isnan()))
        for x, y in zip(la, lb))
