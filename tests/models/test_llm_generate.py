"""opencann.llm against transformers on tiny random Llama, Qwen2, Mistral and GPT-2 models
(hidden 64, 2 layers, seeded): DecoderLM logits equal eager transformers' to fp32 rounding
over a prefill and several decode steps; greedy tokens equal transformers' ``generate``
(one prompt and a left-padded batch of different lengths); sampling reproducible with a
seed and equal to transformers' sampling with the same processors and seed; stop tokens,
streamers, stats counters (no graph or plan built per decode token), bad input one line
each with the generator still usable afterwards.

The generator's logic is checked here on the ``eager`` step backend (torch runs the step
graphs); tests/models/test_llm_compiled.py runs the same through opencann.compile."""
import pytest
import torch
import transformers as T

import opencann.llm as L
from opencann.llm.builder import shared_parameters

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4)
CONFIGS = {
    "llama": lambda: T.LlamaConfig(**SMALL, num_key_value_heads=2, eos_token_id=None),
    "qwen2": lambda: T.Qwen2Config(**SMALL, num_key_value_heads=2, eos_token_id=None),
    "mistral": lambda: T.MistralConfig(**SMALL, num_key_value_heads=1, eos_token_id=None,
                                       sliding_window=64),
    "gpt2": lambda: T.GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                 bos_token_id=1, eos_token_id=None),
}
_MODELS = {}


@pytest.fixture(autouse=True)
def _eager_steps(monkeypatch):
    monkeypatch.setattr("opencann.llm.generator.DEFAULT_BACKEND", "eager")


def model(name):
    """The seeded tiny random model ``name`` (built once per session)."""
    if name not in _MODELS:
        torch.manual_seed(1234)
        _MODELS[name] = T.AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()
    return _MODELS[name]


def prompt(n, seed, batch=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (batch, n), generator=g)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_equal_transformers_over_prefill_and_decode(name):
    m = model(name)
    lm = L.DecoderLM(m)
    ids = prompt(11, 0, batch=2)
    caches = lm.new_caches(2, 32)
    with torch.no_grad():
        got = lm(ids, torch.zeros(2, dtype=torch.long), torch.tensor([11, 11]), *caches)
        torch.testing.assert_close(got, m(ids).logits[:, -1], rtol=1e-5, atol=1e-5)
        for step in range(3):    # decode: one token per row at positions 11, 12, 13
            nxt = prompt(1, 10 + step, batch=2)
            ids = torch.cat([ids, nxt], dim=1)
            pos = torch.full((2,), ids.shape[1] - 1)
            got = lm(nxt, pos, pos + 1, *caches)
            torch.testing.assert_close(got, m(ids).logits[:, -1], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all() and got.abs().max() > 0


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_tokens_equal_transformers_generate(name):
    m = model(name)
    gen = L.compile(m, max_seq_len=48, max_batch=2)
    ids = prompt(7, 1)
    want = m.generate(ids, max_new_tokens=24, do_sample=False)
    out = gen.generate(ids, max_new_tokens=24)
    assert torch.equal(out, want)
    again = gen.generate(ids, max_new_tokens=24)     # a second call: same tokens, fresh tensor
    assert torch.equal(again, want) and again.data_ptr() != out.data_ptr()
    assert gen.stats.graphs_built == 2 and gen.stats.recompiles == 0   # prefill b1 t8, decode b1


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_default_length_equals_transformers_generate(name):
    """No max_new_tokens and no max_length anywhere: transformers' generate makes 20 new
    tokens (its default max_length counts new tokens), its total capped at the model's
    positions (GPT-2: 64); opencann made 20 - prompt before. A max_length in the model's
    generation_config counts the prompt, as in transformers."""
    m = model(name)
    gen = L.compile(m, max_seq_len=64 if name == "gpt2" else 72, max_batch=1)
    for n in (6, 50):
        ids = prompt(n, 3)
        want = m.generate(ids, do_sample=False)
        assert want.shape[1] == min(n + 20, 64 if name == "gpt2" else n + 20)
        assert torch.equal(gen.generate(ids), want)
    m.generation_config.max_length = 12
    try:
        want = m.generate(prompt(5, 4), do_sample=False)
        assert want.shape[1] == 12 and torch.equal(gen.generate(prompt(5, 4)), want)
    finally:
        m.generation_config.max_length = None


def test_a_length_past_the_cache_names_where_the_count_came_from():
    """A budget past max_seq_len is one line naming its source: the call's max_new_tokens,
    the generation_config's max_length, or transformers' default of 20 new tokens (the
    user passed no max_new_tokens in the last two, so the line does not say they did)."""
    m = model("llama")
    gen = L.compile(m, max_seq_len=8, max_batch=1)
    ids = prompt(3, 1)
    with pytest.raises(ValueError, match=r"plus max_new_tokens=7 needs 9 cache positions .* "
                                         r"at most 6 new tokens$"):
        gen.generate(ids, max_new_tokens=7)
    with pytest.raises(ValueError, match=r"plus transformers' default of 20 new tokens \(no "
                                         r"max_new_tokens given\) needs 22 cache positions"):
        gen.generate(ids)
    m.generation_config.max_length = 12
    try:
        with pytest.raises(ValueError, match=r"plus the generation_config's max_length 12 \(9 new "
                                             r"tokens; no max_new_tokens given\) needs 11"):
            gen.generate(ids)
    finally:
        m.generation_config.max_length = None
    assert torch.equal(gen.generate(ids, max_new_tokens=6), m.generate(ids, max_new_tokens=6, do_sample=False))


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_batch_of_different_prompt_lengths_equals_transformers(name):
    m = model(name)
    gen = L.compile(m, max_seq_len=48, max_batch=4)
    short, long = prompt(4, 2)[0], prompt(13, 3)[0]
    ids = torch.zeros(2, 13, dtype=torch.long)
    mask = torch.zeros(2, 13, dtype=torch.long)
    ids[0, 9:], mask[0, 9:], ids[1], mask[1] = short, 1, long, 1
    want = m.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(gen.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0), want)
    # a list of prompts is left-padded the same way
    assert torch.equal(gen.generate([short.tolist(), long], max_new_tokens=12, pad_token_id=0), want)
    # each row equals its own single-prompt generation (rows are independent)
    alone = gen.generate(short[None], max_new_tokens=12)
    assert torch.equal(want[0, 9:], alone[0])
    # a flat list of ids (a tokenizer's input_ids for one text) is one prompt, not 4 prompts
    assert torch.equal(gen.generate(short.tolist(), max_new_tokens=12), alone)
    # three rows run in the batch size 4 with one padded row
    three = gen.generate([short, long, short], max_new_tokens=12, pad_token_id=0)
    assert torch.equal(three[:2], want) and torch.equal(three[2], want[0])
    assert "decode b4 t1" in gen.stats.graphs


def test_sampling_is_seeded_and_equals_transformers_sampling():
    m = model("llama")
    gen = L.compile(m, max_seq_len=48)
    ids = prompt(6, 4)
    kw = dict(max_new_tokens=20, do_sample=True, temperature=0.8, top_k=20, top_p=0.9,
              repetition_penalty=1.3)
    a, b = gen.generate(ids, seed=7, **kw), gen.generate(ids, seed=7, **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a, gen.generate(ids, seed=8, **kw))
    torch.manual_seed(7)
    assert torch.equal(m.generate(ids, **kw), a)


def test_repetition_penalty_greedy_equals_transformers_with_padding():
    m = model("qwen2")
    gen = L.compile(m, max_seq_len=48, max_batch=2)
    ids, mask = prompt(9, 5, batch=2), torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    want = m.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                      repetition_penalty=1.8, pad_token_id=0)
    got = gen.generate(ids, attention_mask=mask, max_new_tokens=16, repetition_penalty=1.8,
                       pad_token_id=0)
    assert torch.equal(got, want)


def test_stop_tokens_end_rows_and_fill_with_pad():
    m = model("llama")
    gen = L.compile(m, max_seq_len=48, max_batch=2)
    ids = prompt(5, 6, batch=2)
    free = gen.generate(ids, max_new_tokens=12)
    stop = int(free[0, 5 + 3])           # row 0's 4th new token
    want = m.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=stop, pad_token_id=0)
    got = gen.generate(ids, max_new_tokens=12, eos_token_id=stop, pad_token_id=0)
    assert torch.equal(got, want)
    first = (got[0, 5:] == stop).nonzero()[0].item()
    assert (got[0, 5 + first + 1:] == 0).all()
    # a list of stop tokens: the call ends when every row has stopped
    both = gen.generate(ids, max_new_tokens=12, eos_token_id=[stop, int(free[1, 5])])
    assert both.shape[1] < free.shape[1]


def test_streamer_callable_and_transformers_streamer():
    m = model("gpt2")
    gen = L.compile(m, max_seq_len=48, max_batch=2)
    ids = prompt(6, 7, batch=2)
    seen = []
    out = gen.generate(ids, max_new_tokens=9, streamer=lambda tok: seen.append(tok.clone()))
    assert torch.equal(torch.stack(seen, dim=1), out[:, 6:])

    class Streamer:                       # transformers' BaseStreamer protocol
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.clone())

        def end(self):
            self.ended = True
    s = Streamer()
    out = gen.generate(ids[:1], max_new_tokens=5, streamer=s)
    assert s.ended and torch.equal(s.puts[0], ids[:1]) and len(s.puts) == 6
    assert torch.equal(torch.stack(s.puts[1:], dim=1), out[:, 6:])


def test_stats_no_graph_or_plan_per_decode_token_and_shared_weights():
    m = model("mistral")
    gen = L.compile(m, max_seq_len=64, max_batch=2)
    counts = []
    gen.generate(prompt(5, 8), max_new_tokens=20,
                 streamer=lambda tok: counts.append((gen.stats.graphs_built, gen.stats.memory_plans)))
    s = gen.stats
    assert len(set(counts[1:])) == 1 and s.graphs_built_after_warmup == 0 == s.plans_built_after_warmup
    assert s.decode_steps == 19 and s.decode_tokens == 19 and s.prefill_tokens == 5
    assert s.ttft_s > 0 and s.decode_tokens_per_s > 0 and s.prefill_tokens_per_s > 0
    a = gen.arch
    assert s.kv_cache_bytes == a.kv_cache_bytes(2, 64) == 2 * 2 * 2 * 1 * 64 * 16 * 4
    ptrs = [c.data_ptr() for c in gen.caches]
    gen.generate(prompt(20, 9), max_new_tokens=4)            # a longer prompt: bucket 24
    assert s.graphs == ["prefill b1 t8", "decode b1 t1", "prefill b1 t24"] and s.recompiles == 0
    assert [c.data_ptr() for c in gen.caches] == ptrs          # caches written in place
    names = [n for n, _ in gen.lm.named_parameters()]
    assert shared_parameters(gen.lm, m) == names and len(names) == len(list(m.parameters()))
    assert "decode" in s.summary() and s.as_dict()["graphs_built"] == 3


def test_gpt2_tied_embedding_is_one_tensor():
    m = model("gpt2")
    lm = L.DecoderLM(m)
    assert lm.lm_head.weight is lm.embed.weight is m.transformer.wte.weight


@pytest.mark.parametrize("call, match", [
    (lambda g: g.generate(prompt(40, 0), max_new_tokens=1), r"prompt of 40 tokens exceeds max_seq_len 32"),
    (lambda g: g.generate(prompt(20, 0), max_new_tokens=20), r"needs 39 cache positions .*at most 13 new"),
    (lambda g: g.generate(prompt(4, 0, batch=3), max_new_tokens=2), r"batch of 3 prompts exceeds max_batch 2"),
    (lambda g: g.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2), r"empty prompt"),
    (lambda g: g.generate([[5, 6], []], max_new_tokens=2), r"empty prompt"),
    (lambda g: g.generate(prompt(4, 0), max_new_tokens=2, eos_token_id=500), r"stop token 500 .*outside the vocabulary"),
    (lambda g: g.generate(torch.tensor([[3, 200]]), max_new_tokens=2), r"token id 200 is outside the vocabulary"),
    (lambda g: g.generate(torch.rand(1, 4), max_new_tokens=2), r"input_ids must be a LongTensor"),
    (lambda g: g.generate(prompt(4, 0), attention_mask=torch.tensor([[1, 1, 0, 0]]), max_new_tokens=2),
     r"attention_mask must be left padding"),
    (lambda g: g.generate(prompt(4, 0), max_new_tokens=0), r"max_new_tokens must be a positive int"),
    (lambda g: g.generate(prompt(25, 0)),
     r"prompt of 25 tokens plus transformers' default of 20 new tokens \(no max_new_tokens given\) needs 44"),
    (lambda g: g.generate(prompt(4, 0), max_new_tokens=2, num_beams=2), r"generate\(\) does not apply num_beams"),
    (lambda g: g.generate(prompt(4, 0), max_new_tokens=2, do_sample=True, temperature=0.0),
     r"temperature must be > 0"),
    (lambda g: g.generate(prompt(4, 0), max_new_tokens=2, seed=1.5), r"seed must be an int"),
    (lambda g: g.generate(prompt(4, 0), max_new_tokens=2, streamer=3), r"streamer must be a callable"),
    (lambda g: g.generate(prompt(4, 0).to("meta"), max_new_tokens=2), r"^input_ids is on the meta device"),
    (lambda g: g.generate([[5, 6], torch.tensor([7, 8], device="meta")], max_new_tokens=2),
     r"^prompt 1 is on the meta device"),
    (lambda g: g.generate(prompt(4, 0), attention_mask=torch.ones(1, 4, device="meta"), max_new_tokens=2),
     r"^attention_mask is on the meta device \(a shape without data\): pass the token ids"),
])
def test_bad_input_is_one_line_and_generator_stays_usable(call, match):
    m = model("llama")
    gen = L.compile(m, max_seq_len=32, max_batch=2)
    with pytest.raises((ValueError, TypeError), match=match) as e:
        call(gen)
    assert "\n" not in str(e.value)
    ids = prompt(5, 11)
    assert torch.equal(gen.generate(ids, max_new_tokens=6),
                       m.generate(ids, max_new_tokens=6, do_sample=False))


@pytest.mark.parametrize("make, match", [
    (lambda: T.AutoModel.from_config(CONFIGS["llama"]()), r"has no causal LM head .*AutoModelForCausalLM"),
    (lambda: model("llama").to(torch.float64), r"runs float32 models.*torch_dtype=torch.float32"),
])
def test_unsupported_models_are_one_line(make, match):
    m = make()
    try:
        with pytest.raises(ValueError, match=match):
            L.compile(m, max_seq_len=16)
    finally:
        m.float()


@pytest.mark.parametrize("kw, match", [
    (dict(device="cuda"), r"runs on device 'cpu'"),
    (dict(max_batch=0), r"max_batch must be a positive int"),
    (dict(max_seq_len=65), r"exceeds the model's 64 learned positions"),
    (dict(options={"backend": "tvm"}), r"option 'backend' takes 'eager' or 'opencann'"),
    (dict(options={"prefill_buckets": [0, 8]}), r"option 'prefill_buckets' takes prompt lengths in 1..32 "
     r"\(max_seq_len\), e.g. \[8, 16, 24, 32\] \(the default\)"),     # an example within 1..max_seq_len
    (dict(options={"batch_sizes": [3]}), r"option 'batch_sizes' takes batch sizes in 1..2 \(max_batch\), "
     r"e.g. \[1, 2\] \(the default\)"),
    (dict(options={"no_such_option": 1}), r"unknown compile option"),
    # pass switches: checked at compile, not at the first generate that builds a graph
    (dict(options={"disable": ["fuse_qkv_linearr"]}), r"unknown pass name\(s\) \['fuse_qkv_linearr'\]"),
    (dict(options={"backend": "eager", "enable": ["no_pass"]}), r"unknown pass name\(s\) \['no_pass'\]"),
    (dict(options={"disable": ["memory_plan"]}), r"pass\(es\) \['memory_plan'\] cannot be disabled"),
    (dict(options={"disable_rewrites": ["no_pass@x"]}), r"option 'disable_rewrites': 'no_pass@x'"),
    # checked before the caches are allocated (not the allocator's RuntimeError)
    (dict(max_batch=10 ** 9), r"^the KV cache for max_batch=1000000000 and max_seq_len=32 needs "
     r"[\d,.]+ GiB \(2 x 2 layers x 1000000000 x 4 kv heads x 32 x 16 head_dim x 4 bytes\), more "
     r"than this machine's [\d,.]+ GiB of memory: compile with a smaller max_batch or max_seq_len$"),
])
def test_bad_compile_arguments_are_one_line(kw, match):
    args = dict(max_seq_len=32, max_batch=2) | kw
    with pytest.raises(ValueError, match=match) as e:
        L.compile(model("gpt2"), **args)
    assert "\n" not in str(e.value)


def test_given_buckets_and_batch_sizes():
    gen = L.compile(model("llama"), max_seq_len=40, max_batch=3,
                    options={"prefill_buckets": [8, 24], "batch_sizes": [1]})
    assert gen.buckets == (8, 24, 40) and gen.batch_sizes == (1, 3)
    gen.generate([prompt(9, 0)[0], prompt(3, 1)[0]], max_new_tokens=2)
    assert gen.stats.graphs == ["prefill b3 t24", "decode b3 t1"]
    assert "buckets=[8, 24, 40]" in repr(gen)
    text = gen.report()
    assert "prefill buckets: [8, 24, 40]; batch sizes: [1, 3]" in text
    assert "    prefill b3 t24\n    decode b3 t1\n" in text and "1 steps" in text


def test_calls_from_two_threads_run_one_at_a_time():
    import threading
    m = model("llama")
    gen = L.compile(m, max_seq_len=48)
    prompts = [prompt(5, 20), prompt(9, 21)]
    want = [gen.generate(p, max_new_tokens=10) for p in prompts]
    got = [None, None]

    def run(i):
        got[i] = gen.generate(prompts[i], max_new_tokens=10)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_pad_token_outside_the_vocabulary_is_one_line_and_tensor_stop_ids_work():
    """A pad id the embedding cannot take is refused before any step (it fills a row that
    stopped early and is embedded by the next decode step); stop ids may be a tensor, as
    transformers takes them."""
    gen = L.compile(model("llama"), max_seq_len=48, max_batch=2)
    for pad, why in ((10 ** 6, "is outside the vocabulary"), (-1, "is outside the vocabulary"),
                     (2.0, "is not an integer id")):
        with pytest.raises(ValueError, match=f"pad_token_id .* {why}") as e:
            gen.generate([[1, 5, 9, 13, 20], [7, 7, 7]], max_new_tokens=8, eos_token_id=38,
                         pad_token_id=pad)
        assert "\n" not in str(e.value)
    a = gen.generate([[1, 5, 9]], max_new_tokens=6, eos_token_id=[38, 40])
    b = gen.generate([[1, 5, 9]], max_new_tokens=6, eos_token_id=torch.tensor([38, 40]))
    assert torch.equal(a, b)


def test_unapplied_settings_and_list_masks():
    """A transformers setting generate does not apply (beams) is one ValueError line, one
    it applies (max_length in the call) gives transformers' tokens; an attention_mask as a
    nested list, and a 1-D prompt with a 1-D mask, are taken."""
    m = model("llama")
    gen = L.compile(m, max_seq_len=48, max_batch=2)
    with pytest.raises(ValueError, match="generate\\(\\) does not apply num_beams=2") as e:
        gen.generate([[1, 5, 9]], max_new_tokens=2, num_beams=2)
    assert "\n" not in str(e.value)
    ids = torch.tensor([[1, 5, 9]])
    assert torch.equal(gen.generate(ids, max_length=9), m.generate(ids, max_length=9, do_sample=False))
    ids = torch.tensor([[0, 0, 5, 9, 13], [1, 5, 9, 13, 20]])
    mask = [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    a = gen.generate(ids, attention_mask=mask, max_new_tokens=4)
    b = gen.generate(ids, attention_mask=torch.tensor(mask), max_new_tokens=4)
    assert torch.equal(a, b)
    one = gen.generate(torch.tensor([0, 5, 9]), attention_mask=torch.tensor([0, 1, 1]), max_new_tokens=4)
    assert torch.equal(one[0, 1:], gen.generate(torch.tensor([5, 9]), max_new_tokens=4)[0])
