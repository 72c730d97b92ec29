"""opencann.llm's generation settings and inputs against transformers' ``generate`` on a
tiny random Llama (eager step backend: the settings logic, not the graphs):

- every transformers GenerationConfig field, in the call or in the model's
  generation_config, is applied, cannot change the tokens (`sampling.NEUTRAL`), or is one
  ValueError line naming it (by construction: the fields are enumerated from transformers,
  so a field it adds later is refused too); ``min_length`` / ``min_new_tokens`` are applied
  and give transformers' tokens;
- a setting given as None sets None (``eos_token_id=None``: no stop token), a setting not
  given takes the generation_config's, as in transformers 5;
- settings of the wrong type, attention masks with values other than 0/1 (checked before
  any cast), NumPy and 0-d tensor ids, and the step options' types.
"""
import numpy as np
import pytest
import torch
import transformers as T

import opencann.llm as L
from opencann.llm.sampling import APPLIED, NEUTRAL

_MODEL = []


@pytest.fixture(autouse=True)
def _eager_steps(monkeypatch):
    """Eager steps on one thread: the tiny model's ops gain nothing from a second thread,
    and under xdist each of them waited for a worker the other test process held (6-12 s
    a test instead of 0.05 in one CI run); conftest restores the thread count after."""
    monkeypatch.setattr("opencann.llm.generator.DEFAULT_BACKEND", "eager")
    torch.set_num_threads(1)


def model():
    """A seeded tiny random Llama (vocab 97, 64 positions), built once."""
    if not _MODEL:
        torch.manual_seed(1234)
        cfg = T.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=64, initializer_range=0.2, eos_token_id=None)
        _MODEL.append(T.LlamaForCausalLM(cfg).eval())
    return _MODEL[0]


@pytest.fixture
def gen():
    """A generator of max_batch 2 over the tiny Llama, its generation_config a copy that a
    test may change (the model's own is restored after)."""
    m = model()
    saved = m.generation_config
    m.generation_config = T.GenerationConfig(**{**saved.to_dict(), "eos_token_id": None})
    g = L.compile(m, max_seq_len=40, max_batch=2)
    g.generation_config = m.generation_config
    yield g
    m.generation_config = saved


def padded_batch():
    """A left-padded batch of two random prompts (6 and 4 tokens, pad id 0)."""
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ids[1, :2] = 0
    return ids, mask


def both(gen, ids, mask, **kw):
    """(opencann's, transformers') tokens for the same call, each after
    ``torch.manual_seed(5)`` (sampling without ``seed`` draws from the global RNG)."""
    torch.manual_seed(5)
    got = gen.generate(ids, attention_mask=mask, **kw)
    torch.manual_seed(5)
    with torch.no_grad():
        want = model().generate(ids, attention_mask=mask, **kw)
    return got, want


def stop_of(gen, ids, mask):
    """Row 0's third greedy token: a stop token that ends it early."""
    return int(gen.generate(ids, attention_mask=mask, max_new_tokens=6)[0, 8])


@pytest.mark.parametrize("kw", [
    dict(min_new_tokens=7), dict(min_length=14), dict(min_length=14, min_new_tokens=3),
    dict(min_new_tokens=7, do_sample=True, temperature=0.9, top_k=8),
])
@pytest.mark.parametrize("where", ["call", "generation_config"])
def test_min_length_and_min_new_tokens_equal_transformers(gen, kw, where):
    ids, mask = padded_batch()
    stop = stop_of(gen, ids, mask)
    gen.generation_config.eos_token_id, gen.generation_config.pad_token_id = stop, 0
    free = gen.generate(ids, attention_mask=mask, max_new_tokens=12)
    assert free.shape[1] < 6 + 12 or (free[:, 6:] == stop).any()   # the stop token does stop
    if where == "generation_config":
        for k, v in kw.items():
            setattr(gen.generation_config, k, v)
        kw = {}
    got, want = both(gen, ids, mask, max_new_tokens=12, **kw)
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    assert got.shape[1] > 9      # no stop before the minimum: the rows went on past row 0's stop


def _marker_fields():
    """Every GenerationConfig field opencann neither applies nor counts as neutral."""
    names = {k for k in vars(T.GenerationConfig()) if not k.startswith("_")}
    return sorted(names - set(APPLIED) - set(NEUTRAL))


def test_every_generation_config_field_is_applied_neutral_or_refused(gen):
    """Each field transformers' GenerationConfig has (enumerated from transformers, so a
    field it adds is covered) set to a value that is not its default is refused in one
    line naming it, from the generation_config and from the call; the ones the
    reproducers found ignored among them."""
    fields = _marker_fields()
    assert {"top_h", "encoder_repetition_penalty", "exponential_decay_length_penalty",
            "watermarking_config", "stop_strings", "num_beams", "typical_p",
            "return_dict_in_generate"} <= set(fields)
    marker = type("Marker", (), {"__repr__": lambda self: "<marker>"})()
    for name in fields:
        setattr(gen.generation_config, name, marker)
        with pytest.raises(ValueError, match=rf"^generate\(\) does not apply {name}=<marker> "
                                             r"\(from the model's generation_config: unset it") as e:
            gen.generate([[5, 6, 7]], max_new_tokens=2)
        assert "\n" not in str(e.value)
        setattr(gen.generation_config, name, None)
        with pytest.raises(ValueError, match=rf"^generate\(\) does not apply {name}=<marker> "
                                             r"\(from the call: drop it\)"):
            gen.generate([[5, 6, 7]], max_new_tokens=2, **{name: marker})


@pytest.mark.parametrize("kw", [
    dict(encoder_repetition_penalty=3.0), dict(exponential_decay_length_penalty=(1, 50.0)),
    dict(do_sample=True, top_h=0.3), dict(do_sample=True, typical_p=0.5),
    dict(stop_strings=["w1"]), dict(no_repeat_ngram_size=2), dict(num_beams=2),
    dict(max_time=5.0), dict(renormalize_logits=True), dict(suppress_tokens=[3]),
])
def test_settings_transformers_applies_are_refused(gen, kw):
    ids, mask = padded_batch()
    name = [k for k in kw if k != "do_sample"][0]
    with pytest.raises(ValueError, match=rf"does not apply {name}="):
        gen.generate(ids, attention_mask=mask, max_new_tokens=8, **kw)
    for k, v in kw.items():
        setattr(gen.generation_config, k, v)
    with pytest.raises(ValueError, match=rf"does not apply {name}=.*generation_config\.{name} = None"):
        gen.generate(ids, attention_mask=mask, max_new_tokens=8)


def test_default_and_neutral_values_are_taken_and_unknown_keywords_refused(gen):
    """A field at transformers' default, or one that cannot change the tokens, is taken
    (tokens as transformers'); a keyword that is no generation setting is one line."""
    ids, mask = padded_batch()
    kw = dict(max_new_tokens=8, num_beams=1, typical_p=1.0, encoder_repetition_penalty=1.0,
              use_cache=False, output_scores=True, length_penalty=2.0, bos_token_id=1)
    got, want = both(gen, ids, mask, **kw)
    assert torch.equal(got, want)
    gen.generation_config.cache_implementation = "static"
    assert torch.equal(gen.generate(ids, attention_mask=mask, max_new_tokens=8), want)
    with pytest.raises(ValueError, match=r"^generate\(\) does not take no_such_setting: not a "
                                         r"transformers generation setting"):
        gen.generate(ids, attention_mask=mask, max_new_tokens=8, no_such_setting=1)


@pytest.mark.parametrize("kw", [
    {}, dict(eos_token_id=None), dict(top_k=None), dict(temperature=None), dict(do_sample=None),
    dict(pad_token_id=None), dict(repetition_penalty=None), dict(top_p=None),
    dict(max_new_tokens=None), dict(max_new_tokens=None, max_length=15),
])
def test_a_setting_given_as_none_is_none_as_in_transformers(gen, kw):
    """transformers 5 sets a keyword given as None (``GenerationConfig.update``) over the
    generation_config's value: no stop token for eos_token_id=None, no top-k for
    top_k=None, greedy for do_sample=None; one not given keeps the config's."""
    ids, mask = padded_batch()
    stop = stop_of(gen, ids, mask)
    gc = gen.generation_config
    gc.eos_token_id, gc.pad_token_id, gc.max_new_tokens = stop, 0, 9
    gc.do_sample, gc.temperature, gc.top_k, gc.top_p, gc.repetition_penalty = True, 0.7, 5, 0.8, 1.2
    got, want = both(gen, ids, mask, **kw)
    assert torch.equal(got, want), (got.tolist(), want.tolist())


def test_eos_none_generates_past_the_configs_stop_token(gen):
    ids, mask = padded_batch()
    stop = stop_of(gen, ids, mask)
    gen.generation_config.eos_token_id, gen.generation_config.pad_token_id = stop, 0
    stopped = gen.generate(ids[:1], max_new_tokens=8)
    assert stopped.shape[1] == 6 + 3
    free = gen.generate(ids[:1], max_new_tokens=8, eos_token_id=None)
    assert free.shape[1] == 6 + 8 and torch.equal(free[:, :9], stopped)


@pytest.mark.parametrize("kw, match", [
    (dict(do_sample=True, temperature="0.7"), r"^temperature must be a number, got str '0.7'$"),
    (dict(temperature=[0.7]), r"^temperature must be a number"),
    (dict(do_sample=True, top_p="0.9"), r"^top_p must be a number"),
    (dict(do_sample=True, min_p=torch.tensor(0.1)), r"^min_p must be a number"),
    (dict(repetition_penalty="1.1"), r"^repetition_penalty must be a number"),
    (dict(do_sample=True, top_k=2.5), r"^top_k must be an int >= 0"),
    (dict(do_sample="yes"), r"^do_sample must be True \(sampling\) or False \(greedy\)"),
    (dict(min_length=-1), r"^min_length must be an int >= 0"),
    (dict(min_new_tokens=1.5), r"^min_new_tokens must be an int >= 0"),
    (dict(max_new_tokens=None, max_length="20"), r"^max_length must be a positive int"),
    (dict(do_sample=True, min_p=1.5), r"^min_p must be in \[0, 1\]"),
    (dict(do_sample=True, temperature=float("nan")), r"^temperature must be > 0"),
    (dict(do_sample=True, seed=2 ** 64), r"^seed must be an int in \[0, 2\*\*64\)"),
    (dict(do_sample=True, seed=-1), r"^seed must be an int in \[0, 2\*\*64\)"),
    (dict(pad_token_id="1"), r"^pad_token_id '1' is not an integer id"),
    (dict(pad_token_id=1.0), r"^pad_token_id 1.0 is not an integer id"),
    (dict(pad_token_id=True), r"^pad_token_id True is not an integer id"),
    (dict(pad_token_id=10 ** 6), r"^pad_token_id 1000000 is outside the vocabulary"),
])
def test_settings_of_the_wrong_type_are_one_line(gen, kw, match):
    kw = {"max_new_tokens": 3, **kw}
    with pytest.raises(ValueError, match=match) as e:
        gen.generate([[5, 6, 7]], **kw)
    assert "\n" not in str(e.value)
    ids, mask = padded_batch()
    got, want = both(gen, ids, mask, max_new_tokens=4)     # still usable
    assert torch.equal(got, want)


def test_numpy_settings_are_taken(gen):
    ids, mask = padded_batch()
    kw = dict(max_new_tokens=6, do_sample=True, temperature=0.8, top_k=7, top_p=0.9,
              min_new_tokens=2)
    np_kw = dict(max_new_tokens=np.int64(6), do_sample=np.bool_(True), temperature=np.float32(0.8),
                 top_k=np.int32(7), top_p=np.float64(0.9), min_new_tokens=np.int64(2))
    a = gen.generate(ids, attention_mask=mask, seed=np.int64(3), **np_kw)
    assert torch.equal(a, gen.generate(ids, attention_mask=mask, seed=3, **kw))


@pytest.mark.parametrize("mask", [
    [[0.5, 1, 1, 1], [1, 1, 1, 1]], [[0, 0.9, 1, 1], [1, 1, 1, 1]], [[0, 1, 1, 1], [1, 1, 1, 2]],
    [[float("nan"), 1, 1, 1], [1, 1, 1, 1]], [[-1, 1, 1, 1], [1, 1, 1, 1]],
])
def test_a_mask_value_other_than_0_and_1_is_refused_before_any_cast(gen, mask):
    ids = torch.randint(3, 97, (2, 4), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match=r"^attention_mask must hold 0 \(padding\) and 1 "
                                         r"\(prompt token\) only, got "):
        gen.generate(ids, attention_mask=torch.tensor(mask), max_new_tokens=2)


def test_masks_of_any_dtype_holding_0_and_1_are_taken(gen):
    ids, mask = padded_batch()
    want = gen.generate(ids, attention_mask=mask, max_new_tokens=5)
    for m in (mask.float(), mask.bool(), mask.to(torch.int32), mask.double().numpy().tolist()):
        assert torch.equal(gen.generate(ids, attention_mask=m, max_new_tokens=5), want)


@pytest.mark.parametrize("convert", [
    lambda r: [np.int64(x) for x in r], lambda r: [np.int32(x) for x in r],
    lambda r: list(np.array(r)), lambda r: list(torch.tensor(r)), lambda r: [np.uint8(x) for x in r],
])
def test_a_flat_list_of_numpy_or_tensor_ids_is_one_prompt(gen, convert):
    """A flat list of NumPy integers or 0-d integer tensors (``list(array)``) is one
    prompt, as a flat list of Python ints is (transformers takes them through
    torch.tensor); a list of such lists is a batch."""
    rows = [[5, 17, 40, 9], [12, 60]]
    want = gen.generate(rows[0], max_new_tokens=5)
    assert torch.equal(gen.generate(convert(rows[0]), max_new_tokens=5), want)
    batch = gen.generate(rows, max_new_tokens=5, pad_token_id=0)
    assert torch.equal(gen.generate([convert(r) for r in rows], max_new_tokens=5, pad_token_id=0),
                       batch)
    with torch.no_grad():
        ref = model().generate(torch.tensor([rows[0]]), max_new_tokens=5, do_sample=False)
    assert torch.equal(want, ref)


@pytest.mark.parametrize("options, match", [
    ({"prefill_buckets": 8}, r"option 'prefill_buckets' takes prompt lengths in 1..16"),
    ({"prefill_buckets": "8"}, r"option 'prefill_buckets' takes prompt lengths"),
    ({"prefill_buckets": {"8": 1}}, r"option 'prefill_buckets' takes prompt lengths"),
    ({"prefill_buckets": [8.0]}, r"option 'prefill_buckets' takes prompt lengths"),
    ({"batch_sizes": 2}, r"option 'batch_sizes' takes batch sizes in 1..2"),
    ({"batch_sizes": [True]}, r"option 'batch_sizes' takes batch sizes"),
    ({"backend": ["eager"]}, r"option 'backend' takes 'eager' or 'opencann'"),
    ({"disable": 5}, r"option 'disable' takes a list of names"),
    ({"enable": {"fuse_silu": 1}}, r"option 'enable' takes a list of names"),
    ({"keep_dtype": 5}, r"option 'keep_dtype' takes a list of names"),
    ({"keep_fp32": 3}, r"option 'keep_fp32' takes a list of names"),
    ({"lower_ops": 3}, r"option 'lower_ops' takes a list of names"),
    ({"disable_rewrites": 3}, r"option 'disable_rewrites' takes a list of names"),
])
def test_options_of_the_wrong_type_are_one_line(options, match):
    with pytest.raises(ValueError, match=match) as e:
        L.compile(model(), max_seq_len=16, max_batch=2, options=options)
    assert "\n" not in str(e.value)


def test_bucket_and_batch_options_take_numpy_ints_and_tuples():
    gen = L.compile(model(), max_seq_len=16, max_batch=2,
                    options={"prefill_buckets": (np.int64(8),), "batch_sizes": [np.int32(1)]})
    assert gen.buckets == (8, 16) and gen.batch_sizes == (1, 2)
    assert all(type(b) is int for b in gen.buckets + gen.batch_sizes)
