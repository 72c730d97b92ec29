"""`load`: a `Generator` read back from the model file ``Generator.save`` wrote
(`opencann.llm.saving` describes the file)."""
from __future__ import annotations

import json
import os

import torch

from .arch import LLMArch
from .generator import DEFAULT_BACKEND, Generator
from .saving import GENERATOR_FORMAT, KIND, load_tokenizer, prefix


@torch.inference_mode(False)   # its graphs' arenas and caches are written by later calls
def load(path: str) -> Generator:
    """The `Generator` saved at ``path`` by ``Generator.save``, in any process: no model
    code, no transformers model, no compile (``stats.graphs_loaded`` counts its graphs;
    ``graphs_built`` stays 0 for every prompt the saved graphs serve). Its ``tokenizer``
    is the stored one (None if none was saved) and ``generation_config`` the model's.
    Tokens equal the saved generator's, greedy and seeded sampling alike. Loading under
    ``torch.inference_mode()`` gives the same generator (its tensors are ordinary ones).
    Raises ModelFileError (a ValueError, one line): not a model file, a single compiled
    model (load it with ``opencann.load``), a generator layout of another version, a
    corrupted or truncated file; FileNotFoundError."""
    from ..engine.loading import model_from_parts
    from ..runtime.bundle_file import read_bundle
    from ..runtime.model_file import ModelFileError
    where = os.path.basename(path)
    meta, graphs, secs = read_bundle(path)
    if meta.get("kind") != KIND:
        raise ModelFileError(f"{where} holds {meta.get('kind', 'an unknown bundle')}, not an "
                             "opencann.llm generator")
    fmt = meta.get("generator_format")
    if fmt != GENERATOR_FORMAT:
        raise ModelFileError(f"{where} holds an opencann.llm generator of format {fmt}, this "
                             f"opencann reads format {GENERATOR_FORMAT}: save it again with this "
                             "opencann (Generator.save)")
    try:
        arch = LLMArch(**{k: tuple(v) if k == "attn_scales" else v
                          for k, v in meta["arch"].items()})
        cache = meta["cache"]
        gc = meta["generation_config"]
        if gc is not None:
            from transformers import GenerationConfig
            gc = GenerationConfig.from_dict(gc)
        steps = {(int(b), int(t)): model_from_parts(**{k: v for k, v in
                                                        graphs[prefix(b, t)].items()
                                                        if k != "metadata"})
                 for b, t in meta["steps"]}
        gen = Generator(None, int(cache["max_seq_len"]), int(cache["max_batch"]), "cpu",
                        {"backend": DEFAULT_BACKEND, "prefill_buckets": list(cache["buckets"]),
                         "batch_sizes": list(cache["batch_sizes"])}, {},
                        generation_config=gc, arch=arch, graphs=steps, source=where)
    except (KeyError, TypeError) as e:
        raise ModelFileError(f"{where}: generator metadata field missing or malformed "
                             f"({type(e).__name__}: {e}); save it again with this opencann") from None
    if "tokenizer" in secs:
        gen.tokenizer = load_tokenizer(json.loads(bytes(secs["tokenizer"]))["files"])
    from ..devices.cpu_threads import release_openmp_pool
    release_openmp_pool()
    return gen


__all__ = ["load"]
