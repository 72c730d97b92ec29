"""Padding never reaches a real token, also when what padding computes is not finite.

A prompt is right-padded to its prefill bucket with id 0, a batch padded up to a batch
size with rows of id 0, and the cache holds an earlier call's values past each row's
length. Here the embedding of id 0 (never in the prompts) is NaN or Inf, and an earlier
call wrote NaN keys and values into the cache: greedy tokens still equal eager
transformers' ``generate`` on every path - the default compiled one (FlashAttention
prefill), with ``fuse_flash_attention`` disabled (SDPA decomposed), the ``eager`` backend
(torch's SDPA) and the vnpu - for a GQA Llama and GPT-2 (hidden 32, 2 layers: a
prefill's last layer attends each row's last token only, the first runs the causal
attention over the padded bucket)."""
import pytest
import torch
import transformers as T

import opencann.llm as L

PATHS = {"default": ("cpu", {}), "no_flash": ("cpu", {"disable": ["fuse_flash_attention"]}),
         "eager": ("cpu", {"backend": "eager"}), "vnpu": ("vnpu:ascend910b", {})}
_MODELS = {}


def model(family, bad):
    """A tiny random model whose embedding of id 0 is ``bad`` (and of id 17 NaN)."""
    if (family, bad) not in _MODELS:
        torch.manual_seed(0)
        cfg = (T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                            eos_token_id=None, initializer_range=0.2) if family == "gpt2" else
               T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             eos_token_id=None, initializer_range=0.2))
        m = T.AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():
            m.get_input_embeddings().weight[0] = bad
            m.get_input_embeddings().weight[17] = float("nan")
        _MODELS[(family, bad)] = m
    return _MODELS[(family, bad)]


def eager(m, ids, mask=None, n=8):
    with torch.no_grad():
        return m.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask,
                          max_new_tokens=n, do_sample=False, pad_token_id=3)


NAN, INF = float("nan"), float("inf")
CASES = [("llama", NAN, p) for p in sorted(PATHS)] + [("llama", INF, "no_flash"), ("llama", INF, "eager"),
                                                      ("gpt2", NAN, "default"), ("gpt2", NAN, "vnpu")]


@pytest.mark.parametrize("family, bad, path", CASES)
def test_non_finite_padding_never_reaches_real_tokens(family, bad, path):
    m = model(family, bad)
    device, options = PATHS[path]
    gen = L.compile(m, max_seq_len=32, max_batch=4, device=device, options=options)
    one = torch.tensor([[5, 6, 9, 10, 11]])                  # in the 16-token bucket
    assert torch.equal(gen.generate(one, max_new_tokens=8, pad_token_id=3), eager(m, one))
    # three rows of different lengths in the batch-4 graphs: a padding row of id 0
    ids = torch.tensor([[3, 3, 3, 8, 21, 4], [40, 41, 42, 43, 44, 45], [3, 3, 3, 3, 30, 31]])
    mask = (ids != 3).long()
    assert torch.equal(gen.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=3),
                       eager(m, ids, mask))
    # an earlier call's NaN keys and values in the cache, past each row's length
    gen.generate(torch.tensor([[17] * 10] * 3), max_new_tokens=4, pad_token_id=3)
    assert torch.equal(gen.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=3),
                       eager(m, ids, mask))


def test_padding_repeats_real_tokens():
    """The step inputs: each prompt right-padded with its own last token, a batch padded
    with copies of its first row (prefill) and of its first row's token (decode)."""
    m = model("llama", NAN)
    gen = L.compile(m, max_seq_len=32, max_batch=4, options={"backend": "eager"})
    seen = []
    step = gen.steps.step

    def spy(batch, tokens):
        run = step(batch, tokens)
        return lambda ids, pos, lengths: (seen.append((ids.clone(), lengths.clone())),
                                          run(ids, pos, lengths))[1]
    gen.steps.step = spy
    gen.generate([[8, 21, 4], [40, 41, 42, 43, 44, 45], [30, 31]], max_new_tokens=3)
    (ids, lengths), (tok, _) = seen[0], seen[1]
    assert ids.shape == (4, 8) and lengths.tolist() == [3, 6, 2, 3]
    assert ids[0].tolist() == [8, 21] + [4] * 6 and ids[2].tolist() == [30] + [31] * 7
    assert torch.equal(ids[3], ids[0]) and tok[3] == tok[0]
