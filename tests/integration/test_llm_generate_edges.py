"""opencann.llm's ``generate`` at its edges, as a new user meets them (issue #27), on the
``opencann`` backend against eager transformers' ``generate`` (greedy):

- the per-token bookkeeping in NumPy (`Generator._run`): rows of a left-padded batch
  stopping at different steps are filled with the pad token, as transformers does; a
  batch smaller than ``max_batch`` (run in a larger batch graph); 1 and 2 new tokens;
  the streamer's tensors kept and independent of later steps and of the result, and a
  streamer that writes into the tensor it was given changes nothing (as transformers);
- the rotary table (`DecoderLM.rope_table`): a generation reaching the last cache
  position, linear / llama3 RoPE scaling, ``dynamic`` refused in one line; a saved and
  loaded generator in the same process;
- the decode concatenation layout (`cpu.concat_row_major` at the decode batch): two
  generators over the SAME model, compiled at max_batch 1 and 8 in either order, with
  the race deciding the row-major layout at one row and the [Σn, k] one at more (and the
  reverse): both keep generating eager's tokens, and the model still saves.
"""
import os

import pytest
import torch
import transformers as T

import opencann.llm as L
from opencann.ops.kernels import cpu as cpu_kernels

SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, eos_token_id=None,
             max_position_embeddings=64)
_MODELS = {}


def model(**over):
    """A seeded tiny random Llama (built once per config)."""
    key = repr(sorted(over.items()))
    if key not in _MODELS:
        torch.manual_seed(1234)
        _MODELS[key] = T.AutoModelForCausalLM.from_config(T.LlamaConfig(**{**SMALL, **over})).eval()
    return _MODELS[key]


def prompts(lengths, seed):
    """A left-padded batch (ids, mask) of random prompts of ``lengths`` (pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids, mask = torch.zeros(len(lengths), n, dtype=torch.long), torch.zeros(len(lengths), n, dtype=torch.long)
    for i, k in enumerate(lengths):
        ids[i, n - k:] = torch.randint(3, 100, (k,), generator=g)
        mask[i, n - k:] = 1
    return ids, mask


@pytest.fixture(scope="module")
def gen4():
    """A generator of max_batch 4 over the tiny Llama (its graphs built once here)."""
    return L.compile(model(), max_seq_len=32, max_batch=4)


def test_rows_stop_at_different_steps_and_are_padded_like_transformers(gen4):
    m = model()
    ids, mask = prompts([5, 9, 3], seed=1)     # 3 rows run in the batch-4 graphs
    free = m.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    stop = int(free[0, 9 + 2])                 # row 0's third new token
    for eos in (stop, [stop, 7]):
        want = m.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                          pad_token_id=1, eos_token_id=eos)
        got = gen4.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=1,
                            eos_token_id=eos)
        assert (want == 1).any()               # some row did stop early and was padded
        assert torch.equal(got, want) and got.dtype == torch.long and got.is_contiguous()
    for n in (1, 2):
        want = m.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)
        got = gen4.generate(ids, attention_mask=mask, max_new_tokens=n, pad_token_id=0)
        assert torch.equal(got, want) and got.shape == (3, 9 + n)


def test_streamer_tensors_are_kept_and_independent(gen4):
    m = model()
    ids, mask = prompts([4, 7], seed=2)
    want = m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    kept = []
    got = gen4.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, streamer=kept.append)
    assert torch.equal(got, want)
    assert all(t.dtype == torch.long and t.shape == (2,) for t in kept)
    got[:] = -1                                # the result does not alias what was streamed
    assert torch.equal(torch.stack(kept, 1), want[:, 7:])


def test_a_streamer_writing_its_tensor_changes_nothing(gen4):
    """transformers' generate appends the tokens before it streams them: a streamer that
    writes into its tensor changes neither the result nor the next step's input."""
    m = model()
    ids, mask = prompts([6], seed=3)
    want = m.generate(ids, max_new_tokens=8, do_sample=False)
    got = gen4.generate(ids, max_new_tokens=8, streamer=lambda tok: tok.fill_(5))
    assert torch.equal(got, want)


def test_generation_reaches_the_last_cache_position(gen4):
    m = model()
    ids, _ = prompts([20], seed=4)
    want = m.generate(ids, max_new_tokens=13, do_sample=False)   # 20 + 13 - 1 = 32 positions
    assert torch.equal(gen4.generate(ids, max_new_tokens=13), want)
    with pytest.raises(ValueError, match="at most 13 new tokens"):
        gen4.generate(ids, max_new_tokens=14)
    assert torch.equal(gen4.generate(ids, max_new_tokens=13), want)   # still usable


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16}])
def test_rope_scaling_tokens_equal_transformers_to_max_seq_len(scaling):
    m = model(rope_scaling=scaling)
    ids, _ = prompts([9], seed=5)
    gen = L.compile(m, max_seq_len=64, max_batch=1)
    want = m.generate(ids, max_new_tokens=56, do_sample=False)   # the last position is 63
    assert torch.equal(gen.generate(ids, max_new_tokens=56), want)


def test_dynamic_rope_is_one_line_at_compile():
    m = model(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="RoPE type 'dynamic'") as e:
        L.compile(m, max_seq_len=32)
    assert "\n" not in str(e.value)


def test_saved_generator_generates_in_the_same_process(gen4, tmp_path):
    m = model()
    ids, _ = prompts([9], seed=6)
    want = m.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(gen4.generate(ids, max_new_tokens=10), want)
    path = str(tmp_path / "g.ocm")
    gen4.save(path, graphs="built")
    loaded = L.load(path)
    assert torch.equal(loaded.generate(ids, max_new_tokens=10), want)
    assert torch.equal(gen4.generate(ids, max_new_tokens=10), want)
    assert torch.equal(loaded.generate(ids, max_new_tokens=10), want)


def _pin_concat_race(monkeypatch, row_major_at_one):
    """The concatenation layout race (`cpu.concat_row_major`) answers row-major at one
    row and [Σn, k] at more (or the reverse when not ``row_major_at_one``)."""
    race = cpu_kernels._measure_choice

    def pinned(key, makers, *args, **kwargs):
        if key[0] == "concat layout":
            return "addmm_kn" if (key[1] == 1) == row_major_at_one else "gemv"
        return race(key, makers, *args, **kwargs)
    monkeypatch.setattr(cpu_kernels, "_measure_choice", pinned)
    monkeypatch.setattr(cpu_kernels, "_CONCAT_ROWS", {})


def _mib_llama():
    """1 MiB q/k/v and gate/up weights: their concatenation layout is raced."""
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(T.LlamaConfig(
        **{**SMALL, "hidden_size": 512, "intermediate_size": 512, "num_hidden_layers": 1})).eval()


# make test: each order once and each layout answer once (1 then 8 with the row-major
# layout at one row, 8 then 1 with the reverse); the other two pairs: make test-all
@pytest.mark.parametrize("order,row_major_at_one", [
    ((1, 8), True), ((8, 1), False),
    pytest.param((1, 8), False, marks=pytest.mark.full),
    pytest.param((8, 1), True, marks=pytest.mark.full)])
def test_two_generators_over_one_model_at_batch_1_and_8(monkeypatch, tmp_path, order, row_major_at_one):
    _pin_concat_race(monkeypatch, row_major_at_one)
    m = _mib_llama()
    one, batch = prompts([9], seed=7)[0], prompts([9, 6, 9], seed=8)
    want1 = m.generate(one, max_new_tokens=6, do_sample=False)
    want3 = m.generate(batch[0], attention_mask=batch[1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    gens = {}
    for mb in order:      # max_batch 8's first decode graph: batch 4 (3 rows)
        gens[mb] = L.compile(m, max_seq_len=32, max_batch=mb)
        got = (gens[mb].generate(one, max_new_tokens=6) if mb == 1 else
               gens[mb].generate(batch[0], attention_mask=batch[1], max_new_tokens=6, pad_token_id=0))
        assert torch.equal(got, want1 if mb == 1 else want3)
    for mb in order:      # each generator again, after the other was compiled
        assert torch.equal(gens[mb].generate(one, max_new_tokens=6), want1)
    assert torch.equal(m.generate(one, max_new_tokens=6, do_sample=False), want1)
    assert all(p.is_contiguous() for p in m.parameters())
    m.save_pretrained(str(tmp_path))
    from safetensors.torch import save_file
    save_file(m.state_dict(), os.path.join(str(tmp_path), "state.safetensors"))


def test_numpy_ids_are_taken_like_transformers(gen4):
    """Ids from a tokenizer's NumPy output (np.int64) for eos, pad and max_new_tokens: as
    transformers' generate takes them (a list of ids or an array too)."""
    import numpy as np
    m = model()
    ids, mask = prompts([5, 9], seed=9)
    free = m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    stop = int(free[0, 9 + 1])
    want = m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                      pad_token_id=1, eos_token_id=stop)
    for eos in (np.int64(stop), [np.int64(stop)], np.array([stop, 7])):
        got = gen4.generate(ids, attention_mask=mask, max_new_tokens=np.int64(6),
                            pad_token_id=np.int64(1), eos_token_id=eos)
        assert torch.equal(got, want)


def test_a_stop_token_that_is_not_an_id_is_one_line(gen4):
    ids, _ = prompts([4], seed=10)
    for eos in ("2", 2.0, [3, None]):
        with pytest.raises(ValueError, match="is not an integer id; pass an int") as e:
            gen4.generate(ids, max_new_tokens=2, eos_token_id=eos)
        assert "\n" not in str(e.value)
    assert gen4.generate(ids, max_new_tokens=2).shape == (1, 6)


def test_a_third_generator_after_the_first_is_gone(monkeypatch):
    """max_batch 1 (row-major: weights left in place), max_batch 8 (its graphs read them
    there), the first dropped, then max_batch 4: the second still generates."""
    import gc
    _pin_concat_race(monkeypatch, True)
    m = _mib_llama()
    one, batch = prompts([9], seed=7)[0], prompts([9, 6, 9], seed=8)
    want1 = m.generate(one, max_new_tokens=4, do_sample=False)
    want3 = m.generate(batch[0], attention_mask=batch[1], max_new_tokens=4, do_sample=False, pad_token_id=0)
    first = L.compile(m, max_seq_len=32, max_batch=1)
    assert torch.equal(first.generate(one, max_new_tokens=4), want1)
    second = L.compile(m, max_seq_len=32, max_batch=8)
    assert torch.equal(second.generate(batch[0], attention_mask=batch[1], max_new_tokens=4,
                                       pad_token_id=0), want3)
    del first
    gc.collect()
    third = L.compile(m, max_seq_len=32, max_batch=4)
    assert torch.equal(third.generate(batch[0], attention_mask=batch[1], max_new_tokens=4,
                                      pad_token_id=0), want3)
    assert torch.equal(second.generate(batch[0], attention_mask=batch[1], max_new_tokens=4,
                                       pad_token_id=0), want3)     # its batch-4 graphs again


def test_a_row_that_stops_early_returns_a_tensor_of_its_own_size(gen4):
    """One row stopping at its 3rd of 10 tokens: the result owns exactly its elements (no
    view of the call's [1, L + max_new_tokens] buffer; torch.save writes what it shows)."""
    m = model()
    ids, _ = prompts([8], seed=11)
    stop = int(m.generate(ids, max_new_tokens=3, do_sample=False)[0, -1])
    want = m.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=stop, pad_token_id=0)
    got = gen4.generate(ids, max_new_tokens=10, eos_token_id=stop, pad_token_id=0)
    assert torch.equal(got, want) and got.shape[1] < 18 and got.is_contiguous()
    assert got.untyped_storage().nbytes() == got.numel() * got.element_size()


def test_generate_from_its_own_streamer_is_one_line_and_the_generator_stays_usable(gen4):
    """A streamer that calls generate on its own generator (same thread) gets one line,
    not a wait for the lock its own call holds (a hang); the outer call raises it and the
    generator then generates as before."""
    m = model()
    ids, _ = prompts([5], seed=4)
    want = m.generate(ids, max_new_tokens=4, do_sample=False)
    errors = []

    def reenter(_tok):
        try:
            gen4.generate(ids, max_new_tokens=2)
        except ValueError as e:
            errors.append(str(e))
            raise
    with pytest.raises(ValueError, match="called from its own streamer"):
        gen4.generate(ids, max_new_tokens=4, streamer=reenter)
    assert len(errors) == 1 and "\n" not in errors[0]
    assert torch.equal(gen4.generate(ids, max_new_tokens=4), want)


def test_a_weight_changed_after_compile_is_refused_at_every_batch_size():
    """Graphs not built yet (another batch size) would compile the changed weight and
    serve it while the built ones refuse it: every batch size is refused alike, with the
    parameter's name."""
    m = T.AutoModelForCausalLM.from_config(T.LlamaConfig(**SMALL)).eval()
    gen = L.compile(m, max_seq_len=32, max_batch=4)
    ids, mask = prompts([5, 6, 4], seed=5)
    gen.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0)   # batch-4 graphs
    with torch.no_grad():
        m.model.layers[1].mlp.up_proj.weight.mul_(3.0)
    for x, msk in ((ids[:1], mask[:1]), (ids, mask), (ids[:1], mask[:1])):
        with pytest.raises(ValueError, match="up_proj.weight") as e:
            gen.generate(x, attention_mask=msk, max_new_tokens=3, pad_token_id=0)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("ids", [[1, 2 ** 70], [[1, 2], [3, -2 ** 64]]])
def test_an_id_beyond_int64_is_one_line(gen4, ids):
    with pytest.raises(ValueError, match="outside int64") as e:
        gen4.generate(ids, max_new_tokens=2)
    assert "\n" not in str(e.value)
    assert gen4.generate([5, 6, 7], max_new_tokens=2).shape == (1, 5)
