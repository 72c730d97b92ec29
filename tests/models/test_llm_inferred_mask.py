"""``generate(input_ids)`` without an attention_mask, as transformers' ``generate``: a set
``pad_token_id`` that is not a stop token marks padding where it occurs in a tensor of
ids (``GenerationMixin._prepare_attention_mask_for_generation``); an unset pad, a pad
that is a stop token or a pad absent from the ids leaves every id a prompt token. Greedy
tokens equal eager transformers' (no mask passed to either) for left-padded batches; a
right-padded batch (or a pad id inside a prompt) is one ValueError line naming the fix,
where transformers runs a mask no unpadded prompt gives. Tiny random Llama (hidden 32,
2 layers), the eager step backend."""
import pytest
import torch
import transformers as T

import opencann.llm as L

LEFT = torch.tensor([[0, 0, 0, 11, 22, 33], [44, 55, 66, 77, 88, 99], [0, 5, 6, 7, 8, 9]])
_MODEL = []


def model():
    if not _MODEL:
        torch.manual_seed(0)
        cfg = T.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            initializer_range=0.2)
        _MODEL.append(T.LlamaForCausalLM(cfg).eval())
    return _MODEL[0]


@pytest.fixture
def gen():
    g = L.compile(model(), max_seq_len=32, max_batch=4, options={"backend": "eager"})
    g.generation_config = T.GenerationConfig(pad_token_id=0, eos_token_id=2)
    return g


def eager(ids, config, **kw):
    m = model()
    m.generation_config = config
    kw.setdefault("max_new_tokens", 10)
    with torch.no_grad():
        return m.generate(ids, do_sample=False, **kw)


@pytest.mark.parametrize("settings, call", [
    ({"pad_token_id": 0, "eos_token_id": 2}, {}),                    # inferred: pad 0 masked
    ({"pad_token_id": None, "eos_token_id": None}, {"pad_token_id": 0}),   # the call's pad
    ({"pad_token_id": 0, "eos_token_id": [2, 0]}, {}),               # pad is a stop token: ids
    ({"pad_token_id": None, "eos_token_id": 0}, {}),                 # unset pad: ids
    ({"pad_token_id": 1, "eos_token_id": 2}, {}),                    # pad absent: ids
], ids=["pad", "call_pad", "pad_is_eos", "no_pad", "pad_absent"])
def test_without_a_mask_tokens_equal_transformers(gen, settings, call):
    gen.generation_config = T.GenerationConfig(**settings)
    want = eager(LEFT, T.GenerationConfig(**settings), **call)
    assert torch.equal(gen.generate(LEFT, max_new_tokens=10, **call), want)


def test_the_inferred_mask_is_the_given_one(gen):
    mask = (LEFT != 0).long()
    assert torch.equal(gen.generate(LEFT, max_new_tokens=10),
                       gen.generate(LEFT, attention_mask=mask, max_new_tokens=10))
    ones = gen.generate(LEFT, attention_mask=torch.ones_like(LEFT), max_new_tokens=10)
    assert torch.equal(ones, eager(LEFT, T.GenerationConfig(pad_token_id=0, eos_token_id=2),
                                   attention_mask=torch.ones_like(LEFT)))


@pytest.mark.parametrize("ids, row", [
    (torch.tensor([[11, 22, 33, 0, 0], [44, 55, 66, 77, 88]]), 0),     # right padding
    (torch.tensor([[44, 55, 66, 77, 88], [11, 0, 33, 34, 35]]), 1),    # the pad id inside a prompt
])
def test_right_padding_without_a_mask_is_one_line(gen, ids, row):
    with pytest.raises(ValueError, match=f"input_ids row {row} holds pad_token_id 0 after a prompt "
                       "token, and no attention_mask was given") as e:
        gen.generate(ids, max_new_tokens=10)
    assert "\n" not in str(e.value) and "pad on the left" in str(e.value)
    assert gen.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3).shape == (2, 8)


def test_a_row_of_pad_ids_only_without_a_mask_is_one_line(gen):
    ids = torch.tensor([[5, 6, 7], [0, 0, 0]])
    with pytest.raises(ValueError, match=r"^input_ids row 1 holds only pad_token_id 0, and no "
                       r"attention_mask was given: .* leaves the row no prompt; pass attention_mask") as e:
        gen.generate(ids, max_new_tokens=3)
    assert "\n" not in str(e.value)
    assert gen.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3).shape == (2, 6)


def test_transformers_right_padded_output_is_not_the_prompts_continuation():
    """Why right padding is refused, not run: transformers' tokens for a right-padded row
    (positions from the inferred mask, the first token predicted at a pad) differ from the
    unpadded prompt's."""
    gc = T.GenerationConfig(pad_token_id=0, eos_token_id=2)
    padded = eager(torch.tensor([[11, 22, 33, 0, 0]]), gc)[0, 5:]
    plain = eager(torch.tensor([[11, 22, 33]]), gc)[0, 3:]
    assert not torch.equal(padded, plain)


def test_a_list_of_prompts_is_its_own_lengths(gen):
    """A list carries its lengths: a pad id in it is a token."""
    out = gen.generate([[0, 11, 22], [5, 6]], max_new_tokens=4)
    want = eager(torch.tensor([[0, 11, 22]]), T.GenerationConfig(pad_token_id=0, eos_token_id=2),
                 attention_mask=torch.ones(1, 3, dtype=torch.long), max_new_tokens=4)
    assert torch.equal(out[0, :want.shape[1]], want[0])
