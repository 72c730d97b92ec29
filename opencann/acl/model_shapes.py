"""How a loaded model's inputs and outputs look to pyACL, and the shapes of one execution.

A model compiled with dynamic dims describes each dynamic dim as -1 (``aclmdlGetInputDims``).
With ATC-style gears (``dynamic_batch_size`` / ``dynamic_image_size`` / ``dynamic_dims``)
it has one more input, the dynamic-index input named ``ascend_mbatch_shape_data``
(`ACL_DYNAMIC_TENSOR_NAME`, found with ``acl.mdl.get_input_index_by_name``): the buffer
``acl.mdl.set_dynamic_batch_size`` / ``set_dynamic_hw_size`` / ``set_input_dynamic_dims``
write the chosen gear's values into (int64, one per gear dim). Input and output sizes are
those of the largest gear (the buffers an application allocates once); an execution reads
and writes the leading bytes of the chosen gear's shapes. A model with dynamic dims and no
gears (ranges) takes each input's shape from ``acl.mdl.set_dataset_tensor_desc``.
Sources: CANN AscendCL API reference (aclmdlSetDynamicBatchSize, aclmdlSetDynamicHWSize,
aclmdlSetInputDynamicDims, aclmdlGetInputDynamicDims — "dims" of every input concatenated
per gear, aclmdlGetDynamicBatch, aclmdlGetDynamicHW, aclmdlGetCurOutputDims,
aclmdlSetDatasetTensorDesc); pyACL's ``acl.mdl`` counterparts.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..ir.symbolic import bind
from ..runtime.io_names import input_names, output_names
from . import _state as S
from .errors import ACL_ERROR_INVALID_PARAM, fail

#: the dynamic-index input's name (CANN: ``ACL_DYNAMIC_TENSOR_NAME``)
ACL_DYNAMIC_TENSOR_NAME = "ascend_mbatch_shape_data"
#: ATC's gear option -> the pyACL call that sets a gear
GEAR_SETTERS = {"dynamic_batch_size": "acl.mdl.set_dynamic_batch_size",
                "dynamic_image_size": "acl.mdl.set_dynamic_hw_size",
                "dynamic_dims": "acl.mdl.set_input_dynamic_dims"}


class ModelShapes:
    """The pyACL view of a loaded `CompiledModel` ``cm``: its described inputs (graph inputs,
    plus the dynamic-index input when it has gears) and outputs, their dims (-1 where
    dynamic), their byte sizes (at the largest gear, or the top of a bounded range; 0 for an
    unbounded dim), and the concrete shapes for a gear's or a range's symbol values."""

    def __init__(self, cm):
        self.cm = cm
        g = cm.graph
        self.inputs = list(g.inputs)
        k = len(g.signature.input_mutations)
        self.outputs = list(g.outputs)[k:]
        #: one str per input / output, unique (`opencann.runtime.io_names`: a model file's)
        self.input_names = input_names(g)
        self.output_names = output_names(g, cm.calling_convention().get("out_spec"))
        #: the model's own `ShapeBinder` (None for a static model): binds shapes to symbols
        self.binder = binder = getattr(cm, "binder", None)
        self.dims: Dict[str, dict] = dict(binder.dims) if binder is not None else {}
        spec = getattr(cm, "gear_spec", None)
        self.option: Optional[str] = spec["option"] if spec else None
        by_name = {d["name"]: s for s, d in self.dims.items()}
        self.gear_symbols: List[str] = [by_name[n] for n in spec["dims"]] if spec else []
        self.gears: List[Tuple[int, ...]] = [tuple(v) for v in spec["values"]] if spec else []

    # -- description -------------------------------------------------------------------
    @property
    def dynamic(self) -> bool:
        """Whether any dim is dynamic."""
        return bool(self.dims)

    @property
    def index_input(self) -> Optional[int]:
        """The dynamic-index input's index (after the graph's inputs), None without gears."""
        return len(self.inputs) if self.gears else None

    def num_inputs(self) -> int:
        """The described inputs: the graph's, plus the dynamic-index input with gears."""
        return len(self.inputs) + (1 if self.gears else 0)

    def name(self, index: int, outputs: bool) -> str:
        """The name (a str) of input/output ``index``: the model file's (an ONNX model's
        graph names, a torch model's input names and ``output0``... or the returned dict's
        keys), `ACL_DYNAMIC_TENSOR_NAME` for the dynamic-index input."""
        if not outputs and index == self.index_input:
            return ACL_DYNAMIC_TENSOR_NAME
        return (self.output_names if outputs else self.input_names)[index]

    def described_dims(self, index: int, outputs: bool) -> List[int]:
        """Dims as ``aclmdlGetInputDims`` gives them: -1 for a dynamic dim."""
        if not outputs and index == self.index_input:
            return [len(self.gear_symbols)]
        return [int(d) if not isinstance(d, str) else -1
                for d in (self.outputs if outputs else self.inputs)[index].desc.shape]

    def dtype(self, index: int, outputs: bool) -> torch.dtype:
        """The torch dtype of input/output ``index`` (int64 for the dynamic-index input)."""
        if not outputs and index == self.index_input:
            return torch.int64
        return (self.outputs if outputs else self.inputs)[index].desc.dtype.torch

    def max_values(self) -> Optional[Dict[str, int]]:
        """Each symbol's largest value (the largest gear's, else its range's top); None
        when a dim without gears is unbounded."""
        if self.gears:
            top = {s: max(g[i] for g in self.gears) for i, s in enumerate(self.gear_symbols)}
            rest = {s: d["max"] for s, d in self.dims.items() if s not in top}
        else:
            top, rest = {}, {s: d["max"] for s, d in self.dims.items()}
        if any(v is None for v in rest.values()):
            return None
        return {**rest, **top}

    def nbytes(self, index: int, outputs: bool, values: Optional[Dict[str, int]] = None) -> int:
        """Byte size of input/output ``index`` at symbol ``values`` (default: the largest
        gear or range top; 0 when unbounded)."""
        if not outputs and index == self.index_input:
            return 8 * len(self.gear_symbols)
        values = self.max_values() if values is None else values
        if values is None and self.dims:
            return 0
        shape = self.shape(index, outputs, values or {})
        n = 1
        for s in shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype(index, outputs)).element_size()

    def shape(self, index: int, outputs: bool, values: Dict[str, int]) -> Tuple[int, ...]:
        """The concrete shape of input/output ``index`` at symbol ``values``."""
        desc = (self.outputs if outputs else self.inputs)[index].desc
        return tuple(int(bind(d, values)) if isinstance(d, str) else int(d) for d in desc.shape)

    # -- gears ---------------------------------------------------------------------------
    def gear_values(self, option: str, given: Sequence[int], api: str) -> Dict[str, int]:
        """Symbol values of the gear ``given`` by ``api`` for gear option ``option``.
        Raises ValueError (one line: the model's gears and the call to use) when the model
        has no such gears or ``given`` is not one of them."""
        if not self.gears:
            raise ValueError(f"the model has no gears (it was compiled without dynamic_batch_size, "
                             f"dynamic_image_size or dynamic_dims), so {api} does not apply")
        if option != self.option:
            raise ValueError(f"the model's gears are {self.option} ({self.gear_list()}): set them "
                             f"with {GEAR_SETTERS[self.option]}, not {api}")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in given):
            raise ValueError(f"{api} takes ints, got {list(given)!r}")
        key = tuple(given)
        if key not in self.gears:
            raise ValueError(f"{list(key) if len(key) > 1 else key[0]} is not one of the model's "
                             f"{self.option} gears {self.gear_list()}")
        return dict(zip(self.gear_symbols, key))

    def gear_list(self) -> list:
        """The gears as the user wrote them (ints for one dim, lists for several)."""
        return [g[0] if len(g) == 1 else list(g) for g in self.gears]

    def dims_gear(self, dims: Sequence[int]) -> Tuple[int, ...]:
        """The gear values named by ``aclmdlSetInputDynamicDims``'s ``dims``: every input's
        dims concatenated (static ones included), as ``aclmdlGetInputDynamicDims`` lists
        them; the symbols bound by the model's own `ShapeBinder` (a derived dim ``2 * s``
        solved for ``s``). Raises ValueError for another dim count, a static dim that
        differs, or a dynamic dim given two values."""
        want = sum(len(v.desc.shape) for v in self.inputs)
        if len(dims) != want:
            raise ValueError(f"dims has {len(dims)} values; the model's inputs have {want} dims "
                             "in all (every input's dims concatenated, as "
                             "acl.mdl.get_input_dynamic_dims lists them)")
        it, shapes = iter(dims), []
        for v, name in zip(self.inputs, self.input_names):
            shape = [int(next(it)) for _ in v.desc.shape]
            for n, d in zip(shape, v.desc.shape):
                if not isinstance(d, str) and n != int(d):
                    raise ValueError(f"dims give {n} for a static dim of input {name} "
                                     f"whose size is {d}")
            shapes.append(shape)
        values = self.binder.shape_values(shapes)
        return tuple(values.get(s, -1) for s in self.gear_symbols)

    def all_dims(self, values: Dict[str, int]) -> List[int]:
        """Every input's dims at ``values``, concatenated (one gear of
        ``aclmdlGetInputDynamicDims``)."""
        return [n for i in range(len(self.inputs)) for n in self.shape(i, False, values)]


def described(model_desc: int, api: str) -> Optional[ModelShapes]:
    """The `ModelShapes` of the loaded model ``model_desc`` (from ``acl.mdl.get_desc``)
    describes, or None (logged as a failure of ``api``)."""
    mid = S.model_descs.get(model_desc)
    if mid is None or mid not in S.models:
        fail(ACL_ERROR_INVALID_PARAM, api, f"{model_desc!r} is not a model description filled "
             "by acl.mdl.get_desc (of a loaded model)")
        return None
    return S.model_shapes[mid]
