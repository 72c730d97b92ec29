"""A bundle file: several compiled graphs in one ``.ocm`` file, their weights stored ONCE
(an opencann.llm generator's prefill and decode graphs, which view the same weight memory
when compiled with the option ``share_weights``).

The container is `opencann.runtime.model_file`'s (magic, format version, checksummed
JSON header, checksummed sections) at format version `BUNDLE_FORMAT_VERSION` (4), with
the sections::

    metadata            the bundle's JSON: {"kind", "graphs": [key, ...], ...the caller's}
    constants           safetensors: each weight storage once ("s0", "s1", ...)
    <key>/metadata      per graph, as in a single-model file (calling convention, ...)
    <key>/graph         the graph; its ``constant_layouts`` name a storage, an element
                        offset, a shape and strides (views of one storage stay views)
    <key>/plan, <key>/schedule, <key>/report
    ...                 any further sections of the caller's (bytes)

Weights are deduplicated by storage: every constant of every graph that views the same
memory (same storage and dtype) is saved as one entry covering the storage up to the last
element any of them reaches, and loaded as views of that one tensor, so loaded graphs
share weight memory as the live ones did (and the CPU kernels' packed weight copies,
keyed by memory, `opencann.ops.kernels.cpu`, are made once). Each entry is padded to
64 bytes so every weight starts 64-byte aligned, as in a single-model file.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

import torch

from .model_file import (BUNDLE_FORMAT_VERSION, ModelFileError, check_path, encode_sections,
                         graph_sections, json_section, peek_version, read_graph,
                         read_sections,
                         safetensors_views, write_file)

_ALIGN = 64   # bytes, as model_file's: every entry starts aligned in the file


def _pack_shared(graphs: Dict[str, Any]) -> Tuple[Dict[str, torch.Tensor], Dict[str, Dict[str, Any]]]:
    """(safetensors entries, per graph key its ``constant_layouts``): one entry per
    (storage, dtype) viewed by any constant of ``graphs`` (key -> CompiledModel), covering
    the storage up to the furthest element a view reaches, padded to `_ALIGN` bytes."""
    storages: Dict[Tuple[int, torch.dtype], List[torch.Tensor]] = {}
    for cm in graphs.values():
        for v in cm.graph.constants:
            t = v.const.cpu() if v.const.device.type != "cpu" else v.const
            storages.setdefault((t.untyped_storage().data_ptr(), t.dtype), []).append(t)
    names: Dict[Tuple[int, torch.dtype], str] = {}
    tensors: Dict[str, torch.Tensor] = {}
    for i, (skey, views) in enumerate(storages.items()):
        end = max(t.storage_offset() + (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
                                         if t.numel() else 0) for t in views)
        flat = torch.as_strided(views[0], (end,), (1,), 0)
        pad = -end % max(_ALIGN // flat.element_size(), 1)
        names[skey] = f"s{i}"
        tensors[f"s{i}"] = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat.clone()
    layouts = {}
    for key, cm in graphs.items():
        layouts[key] = {}
        for v in cm.graph.constants:
            t = v.const.cpu() if v.const.device.type != "cpu" else v.const
            layouts[key][f"v{v.id}"] = {"storage": names[(t.untyped_storage().data_ptr(), t.dtype)],
                                        "offset": t.storage_offset(), "shape": list(t.shape),
                                        "strides": list(t.stride())}
    return tensors, layouts


def save_bundle(path: str, meta: Dict[str, Any], graphs: Dict[str, Any],
                extra: Dict[str, bytes]) -> Dict[str, Any]:
    """Write ``graphs`` (key -> `CompiledModel`; keys are section-name prefixes, no
    ``/``) with the bundle ``meta`` (JSON-able; must hold ``kind``, a phrase such as
    "an opencann.llm generator") and the ``extra`` sections (name -> bytes) to ``path``.
    Returns {"format_version", "sections"}. Raises ModelFileError (a graph part with no
    file encoding, a directory or missing parent, a bad key), TypeError (path type),
    OSError (writing)."""
    import safetensors.torch

    path = check_path(path)
    bad = [k for k in graphs if not k or "/" in k]
    if bad or "kind" not in meta:
        raise ModelFileError(f"bundle graph keys must be non-empty without '/' and meta must "
                             f"name its 'kind', got keys {bad} and meta keys {sorted(meta)}")
    tensors, layouts = _pack_shared(graphs)
    blobs = encode_sections({"metadata": dict(meta, graphs=list(graphs))})
    blobs["constants"] = safetensors.torch.save(tensors) if tensors else b""
    for key, cm in graphs.items():
        parts = graph_sections(cm, "", BUNDLE_FORMAT_VERSION)
        parts["graph"]["constant_layouts"] = layouts[key]
        blobs.update({f"{key}/{name}": b for name, b in encode_sections(parts).items()})
    clash = sorted(set(extra) & set(blobs))
    if clash:
        raise ModelFileError(f"bundle extra section {clash[0]!r} clashes with a graph section: "
                             "rename it")
    blobs.update(extra)
    return {"format_version": BUNDLE_FORMAT_VERSION,
            "sections": write_file(path, BUNDLE_FORMAT_VERSION, blobs)}


def read_bundle(path: str) -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]], Dict[str, memoryview]]:
    """(bundle metadata, graph key -> `model_file.read`-style parts, every section by
    name) of the bundle at ``path``; the graphs' weights are views of one copy of the
    file. Raises ModelFileError (one line: not a bundle - a single-model file names
    ``opencann.load`` -, corrupted, truncated, newer format, ...) or FileNotFoundError."""
    where = os.path.basename(path)
    _, secs = read_sections(path)
    version = peek_version(path)
    if version != BUNDLE_FORMAT_VERSION:
        raise ModelFileError(f"{where} holds one compiled model (model file format "
                             f"{version}), not a bundle of graphs such as an "
                             "opencann.llm generator: load it with opencann.load")
    meta = json_section(secs, "metadata", where)
    consts = safetensors_views(secs["constants"], where)
    graphs = {k: read_graph(secs, f"{k}/", consts, where) for k in meta.get("graphs", [])}
    return meta, graphs, secs


__all__ = ["read_bundle", "save_bundle"]
