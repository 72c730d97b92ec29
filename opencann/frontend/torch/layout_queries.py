"""Which user inputs the model's own Python code asks the memory layout of while it is
exported (``x.is_contiguous()``, ``x.stride(0)``, ``x.storage_offset()``, on the input or
a view of it).

torch.export runs the model's ``forward`` on fake tensors and bakes what such a query
answered into the graph (a branch taken, a stride used as a number), so the graph is
right only for inputs laid out as the example was. `LayoutQueries` records the queries
made from outside torch and opencann (the model's code, transformers' included) and maps
them to the exported program's user-input placeholders by storage; the compiled model
then refuses a call whose input would differ in layout from the example (strides, or
the storage offset where the offset was read) instead of answering for the example's
layout. Queries torch makes itself (fakification, meta kernels) are not counted: only a
call whose first caller frame outside torch is outside opencann too.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, List, Set

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

_TORCH_DIR = os.path.dirname(torch.__file__)
_OPENCANN_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LAYOUT = {torch.Tensor.stride: "layout", torch.Tensor.is_contiguous: "layout",
           torch.Tensor.storage_offset: "offset"}


def _from_model_code() -> bool:
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_TORCH_DIR):
        f = f.f_back
    return f is not None and not f.f_code.co_filename.startswith(_OPENCANN_DIR)


class LayoutQueries(TorchFunctionMode):
    """A torch function mode recording, per kind ("layout": strides or contiguity;
    "offset": the storage offset), the storages whose layout the model's code queried."""

    def __init__(self):
        super().__init__()
        self.storages: Dict[str, Set[StorageWeakRef]] = {"layout": set(), "offset": set()}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kind = _LAYOUT.get(func)
        if kind is not None and args and isinstance(args[0], torch.Tensor) and _from_model_code():
            try:
                self.storages[kind].add(StorageWeakRef(args[0].untyped_storage()))
            except (RuntimeError, NotImplementedError):  # a tensor without storage
                pass
        return func(*args, **(kwargs or {}))

    def user_inputs(self, ep: torch.export.ExportedProgram) -> Dict[str, List[str]]:
        """Per kind, the names of ``ep``'s user-input placeholders whose storage was
        queried (an input or a view of it)."""
        from torch.export.graph_signature import InputKind
        users = {s.arg.name for s in ep.graph_signature.input_specs
                 if s.kind == InputKind.USER_INPUT and hasattr(s.arg, "name")}
        out: Dict[str, List[str]] = {"layout": [], "offset": []}
        for node in ep.graph.nodes:
            val = node.meta.get("val")
            if node.op != "placeholder" or node.name not in users or not isinstance(val, torch.Tensor):
                continue
            ref = StorageWeakRef(val.untyped_storage())
            for kind, seen in self.storages.items():
                if ref in seen:
                    out[kind].append(node.name)
        return out
