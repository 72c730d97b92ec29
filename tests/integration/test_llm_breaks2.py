"""Faults a new user's break session found in opencann.llm, each checked against eager
transformers on tiny random models (2 layers, hidden 64; < 60 s in all):

- the default length (no max_new_tokens, no max_length) was capped at the RoPE-scaled
  context, where transformers' ``generate`` caps it at the config's
  ``max_position_embeddings`` (``_prepare_generated_length``): more tokens than eager;
- ``Generator.save`` raised a deep TypeError for a generation_config holding NumPy or
  tensor values that ``generate`` takes;
- ``compile`` refused NumPy integer ``max_seq_len`` / ``max_batch``, which its bucket and
  batch options take.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import opencann.llm as L

EAGER = {"backend": "eager"}


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg.update(kw)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


def _ids(n: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (batch, n), generator=g)


def _eager(m, ids, **kw):
    with torch.no_grad():
        return m.generate(ids, do_sample=False, pad_token_id=0, **kw)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_default_length_is_capped_at_the_configs_positions_not_the_scaled_context():
    """max_position_embeddings 32 with a linear RoPE factor 2 (a 64-token context): a
    20-token prompt without max_new_tokens gets 12 new tokens, as eager (32 in all), not
    20; a 32-token prompt gets none, and both raise one ValueError line."""
    m = _llama(max_position_embeddings=32,
               rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    gen = L.compile(m, max_seq_len=64, options=EAGER)
    assert gen.arch.max_positions == 64 and gen.arch.default_length_cap == 32
    ids = _ids(20)
    want = _eager(m, ids, eos_token_id=None)
    assert want.shape == (1, 32)
    assert torch.equal(gen.generate(ids, eos_token_id=None), want)
    long = _ids(32, seed=2)
    with pytest.raises(ValueError):
        _eager(m, long, eos_token_id=None)
    with pytest.raises(ValueError, match=r"^max_new_tokens not given, .*max_position_embeddings "
                                         r"32\) leaves none after a prompt of 32 tokens"):
        gen.generate(long, eos_token_id=None)
    # the generator stays usable, and an explicit count still reaches the scaled context
    assert torch.equal(gen.generate(long, max_new_tokens=8, eos_token_id=None),
                       _eager(m, long, max_new_tokens=8, eos_token_id=None))


def test_an_unscaled_models_default_length_is_unchanged():
    m = _llama(max_position_embeddings=30)
    gen = L.compile(m, max_seq_len=30, max_batch=2, options=EAGER)
    ids = _ids(14, batch=2, seed=3)
    with pytest.warns(UserWarning):
        want = _eager(m, ids, eos_token_id=None)
    assert want.shape == (2, 30) and torch.equal(gen.generate(ids, eos_token_id=None), want)


def test_save_takes_the_numpy_and_tensor_settings_generate_takes(tmp_path):
    """A generation_config with eos as np.int64 or a tensor of ids, a NumPy temperature:
    generate takes them, so save stores them (as JSON numbers and lists) and the loaded
    generator stops where eager does; a value JSON cannot hold is one line naming it,
    before any step graph is built."""
    m = _llama(num_hidden_layers=1)
    ids = _ids(5, seed=4)
    free = _eager(m, ids, max_new_tokens=6, eos_token_id=None)
    stop = int(free[0, 7])                      # the third new token
    want = _eager(m, ids, max_new_tokens=6, eos_token_id=stop)
    assert want.shape[1] == 8
    gen = L.compile(m, max_seq_len=16, options={"prefill_buckets": [8]})
    for eos in (np.int64(stop), torch.tensor([stop, 299])):
        m.generation_config.eos_token_id = eos
        m.generation_config.temperature = np.float32(0.5)
        assert torch.equal(gen.generate(ids, max_new_tokens=6), want)
        path = tmp_path / "g.ocm"
        gen.save(str(path))
        loaded = L.load(str(path))
        assert torch.equal(loaded.generate(ids, max_new_tokens=6), want)
        assert loaded.generation_config.temperature == pytest.approx(0.5)
    m.generation_config.my_note = object()
    fresh = L.compile(m, max_seq_len=16, options={"prefill_buckets": [8]})
    with pytest.raises(ValueError, match=r"^Generator.save: generation_config.my_note = "):
        fresh.save(str(tmp_path / "h.ocm"))
    assert fresh.stats.graphs_built == 0 and not (tmp_path / "h.ocm").exists()


def test_compile_takes_numpy_sizes_as_its_options_do():
    m = _llama()
    gen = L.compile(m, max_seq_len=np.int64(24), max_batch=np.int32(2),
                    options={**EAGER, "prefill_buckets": [np.int64(8)]})
    assert type(gen.max_seq_len) is int and type(gen.max_batch) is int
    assert gen.buckets == (8, 24) and gen.batch_sizes == (1, 2)
    ids = _ids(6, batch=2, seed=5)
    assert torch.equal(gen.generate(ids, max_new_tokens=5, eos_token_id=None),
                       _eager(m, ids, max_new_tokens=5, eos_token_id=None))
    with pytest.raises(ValueError, match=r"^max_seq_len must be a positive int"):
        L.compile(m, max_seq_len=np.float64(24.0), options=EAGER)
