"""A `Generator` in one model file: `save` (``Generator.save``); `opencann.llm.loading.load`
(``opencann.llm.load``; ``opencann.load`` of such a file calls it) reads it back.

The file is a bundle (`opencann.runtime.bundle_file`, model file format 4): every
compiled step graph (a prefill graph per prompt bucket and batch size, a decode graph per
batch size), the weights stored ONCE (the graphs view the model's memory, option
``share_weights``; the bundle deduplicates by storage), and in its ``metadata``:

- ``kind`` `KIND` and ``generator_format`` `GENERATOR_FORMAT` (what `load` reads);
- ``arch``: the `LLMArch` (sizes, heads, family, positions);
- ``cache``: the KV-cache layout - ``max_seq_len``, ``max_batch``, ``layers``,
  ``kv_heads``, ``head_dim``, ``dtype`` - and the generator's ``buckets`` and
  ``batch_sizes``; the caches themselves are not stored (each call starts at position 0:
  a loaded generator allocates them zeroed);
- ``generation_config``: the model's transformers ``GenerationConfig`` as its JSON dict
  (eos, pad, bos, sampling defaults), or null;
- ``graphs``: the step graphs' section prefixes (``b<batch>t<tokens>``).

The tokenizer, when given, is stored inside the file (section ``tokenizer``): the files
``tokenizer.save_pretrained`` writes (tokenizer.json, tokenizer_config.json, special
tokens, chat template; sentencepiece models too), base64 in JSON, read back with
``AutoTokenizer.from_pretrained`` from a temporary folder. Stored rather than referenced,
so the file alone serves ``opencann generate model.ocm``; a tokenizer is a few MB beside
the weights.
"""
from __future__ import annotations

import base64
import copy
import json
import os
import tempfile
from typing import Any, Dict, Optional


#: the bundle ``kind`` of a generator file
KIND = "an opencann.llm generator"
#: the generator layout this opencann writes and reads (metadata fields above)
GENERATOR_FORMAT = 1
#: ``Generator.save``'s ``graphs`` choices
GRAPHS = ("all", "built")


def _tokenizer_files(tokenizer: Any) -> Dict[str, str]:
    """File name -> base64 content of what ``tokenizer.save_pretrained`` writes."""
    if not hasattr(tokenizer, "save_pretrained"):
        raise ValueError(f"tokenizer must be a transformers tokenizer (with save_pretrained), "
                         f"got {type(tokenizer).__name__}")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        out = {}
        for root, _, files in os.walk(tmp):
            for name in files:
                full = os.path.join(root, name)
                with open(full, "rb") as f:
                    out[os.path.relpath(full, tmp)] = base64.b64encode(f.read()).decode()
    return out


def _inside(folder: str, name: Any) -> str:
    """``folder``/``name`` for a tokenizer file name read from a model file: a relative
    path that stays inside ``folder`` (no absolute path, drive, ``..`` or empty part).
    Raises ValueError otherwise: a file that would write elsewhere is refused, whatever
    its checksums say (a crafted file is self-consistent)."""
    parts = name.replace("\\", "/").split("/") if isinstance(name, str) else None
    if (not parts or os.path.isabs(name) or os.path.splitdrive(name)[0]
            or any(p in ("", ".", "..") for p in parts)):
        raise ValueError(f"the model file's tokenizer names a file {name!r:.80} outside its "
                         "folder: refused (the file was not written by opencann; save the "
                         "generator again from its model)")
    return os.path.join(folder, *parts)


def load_tokenizer(files: Dict[str, str]) -> Any:
    """The transformers tokenizer of ``files`` (`_tokenizer_files`' form), written to a
    temporary folder and read by ``AutoTokenizer``. Raises ValueError (one line) for a
    file name that leaves that folder (`_inside`)."""
    from transformers import AutoTokenizer
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            full = _inside(tmp, name)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "wb") as f:
                f.write(base64.b64decode(data))
        return AutoTokenizer.from_pretrained(tmp, local_files_only=True)


def _plain(v: Any) -> Any:
    """``v`` with the NumPy scalars and arrays and the tensors `Generator.generate` takes
    as settings (``eos_token_id=np.int64(2)``, a tensor of stop ids, a set of them) made
    Python numbers and lists, JSON's kinds; anything else as it is."""
    import numpy as np
    import torch
    if isinstance(v, (np.generic, np.ndarray, torch.Tensor)):
        return v.tolist()
    if isinstance(v, (list, tuple, set, frozenset)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _generation_config_json(gc: Any) -> Optional[Dict[str, Any]]:
    """The generation_config ``gc`` (a transformers GenerationConfig, or None) as a JSON
    dict, every field (`_plain`): what `generate` reads from it, it reads back after
    `load`. Raises ValueError (one line) naming a field JSON cannot hold."""
    if gc is None:
        return None
    gc = copy.deepcopy(gc)
    for k, v in list(vars(gc).items()):
        vars(gc)[k] = _plain(v)
    try:
        return json.loads(gc.to_json_string(use_diff=False))
    except (TypeError, ValueError) as e:
        bad = next((k for k, v in vars(gc).items() if not _jsonable(v)), "?")
        raise ValueError(f"Generator.save: generation_config.{bad} = {getattr(gc, bad, None)!r:.60} "
                         f"cannot be stored in the model file ({e}); set it to a number, a "
                         f"string or a list of them") from None


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def prefix(batch: int, tokens: int) -> str:
    """The section-name prefix of the step graph of ``batch`` rows of ``tokens`` tokens."""
    return f"b{batch}t{tokens}"


def save(gen: Any, path: str, tokenizer: Any = None, graphs: str = "all") -> Dict[str, Any]:
    """``gen.save`` of a `Generator`: see `Generator.save` (this module's docstring for
    the layout)."""
    from ..engine.guards import AttributeChanged, WeightChanged
    from ..runtime.bundle_file import save_bundle
    if gen.backend != "opencann":
        raise ValueError(f"Generator.save writes compiled step graphs, but this generator runs "
                         f"backend {gen.backend!r}: compile it with options={{'backend': "
                         f"'opencann'}} (the default)")
    if graphs not in GRAPHS:
        raise ValueError(f"Generator.save takes graphs='all' (build every bucket and batch size "
                         f"first) or 'built' (those built so far), got {graphs!r}")
    tokenizer = tokenizer if tokenizer is not None else gen.tokenizer
    gc_json = _generation_config_json(gen.generation_config)   # its error before any build
    with gen._locked("Generator.save()"):
        try:
            # a weight or attribute generate() would refuse is refused here alike: the
            # graphs built would hold the old weights and new ones the changed ones
            gen._check_unchanged()
            if graphs == "all":
                for b in gen.batch_sizes:
                    for t in (*gen.buckets, 1):
                        gen.steps.step(b, t)
        except (WeightChanged, AttributeChanged) as e:
            raise gen._changed(e) from None
        steps = gen.steps.compiled()
    if not steps:
        raise ValueError("Generator.save(graphs='built'): no step graph is built yet; call "
                         "generate first or save with graphs='all'")
    a = gen.arch
    meta = {"kind": KIND, "generator_format": GENERATOR_FORMAT,
            "arch": {k: list(v) if isinstance(v, tuple) else v for k, v in a.__dict__.items()},
            "cache": {"max_seq_len": gen.max_seq_len, "max_batch": gen.max_batch,
                      "layers": a.num_layers, "kv_heads": a.num_kv_heads, "head_dim": a.head_dim,
                      "dtype": str(gen.caches[0].dtype).replace("torch.", ""),
                      "buckets": list(gen.buckets), "batch_sizes": list(gen.batch_sizes)},
            "generation_config": gc_json,
            "steps": [[b, t] for b, t in steps], "tokenizer": tokenizer is not None}
    extra = {}
    if tokenizer is not None:
        extra["tokenizer"] = json.dumps({"files": _tokenizer_files(tokenizer)}).encode()
    return save_bundle(path, meta, {prefix(b, t): cm for (b, t), cm in steps.items()}, extra)


__all__ = ["GENERATOR_FORMAT", "GRAPHS", "KIND", "save"]
