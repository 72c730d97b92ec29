"""opencann.llm under the caller's state, against eager transformers' ``generate``
(greedy, and seeded sampling) on tiny random Llama / GPT-2 models:

- ``torch.inference_mode()``: `compile`, `generate` (graphs first built inside, and a
  new prompt bucket built inside), `save` and `load` inside it give eager's tokens, and
  afterwards the generator, a fresh generator and the model's own training step work
  outside it (nothing the generator made or laid out is an inference tensor);
- torch's default dtype set to bfloat16 or float64: the caches stay float32 and the
  tokens are eager's (float32 model);
- the model's train/eval mode: `compile` leaves it as it was; a generator over a model in
  train mode (at compile or later) gives the eval-mode tokens (no dropout);
- re-entry and changed weights: a streamer calling `Generator.save` gets one line (the
  lock is not re-entrant), `save` after a weight or a module attribute changed raises
  the line `generate` raises, naming the model's own parameter, and writes no file.
"""
import os
import threading

import pytest
import torch
import transformers as T

import opencann
import opencann.llm as L

LLAMA = dict(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             eos_token_id=None, bos_token_id=None, initializer_range=0.2, attention_dropout=0.3)
GPT2 = dict(vocab_size=120, n_embd=64, n_layer=2, n_head=4, n_positions=64, eos_token_id=None,
            bos_token_id=None, initializer_range=0.2, attn_pdrop=0.3, resid_pdrop=0.3,
            embd_pdrop=0.3)


def fresh(kind="llama", seed=1234):
    """A new seeded tiny random model in eval mode (dropout configured, so train mode
    would change transformers' own tokens)."""
    torch.manual_seed(seed)
    cfg = T.LlamaConfig(**LLAMA) if kind == "llama" else T.GPT2Config(**GPT2)
    m = T.AutoModelForCausalLM.from_config(cfg).eval()
    m.generation_config.eos_token_id = None
    return m


def prompt(n, seed):
    """One random prompt [1, n] (ids 3..119)."""
    return torch.randint(3, 120, (1, n), generator=torch.Generator().manual_seed(seed))


def eager(m, ids, n, **kw):
    """transformers' greedy (or seeded sampled) tokens in eval mode, outside inference_mode."""
    was = m.training
    m.eval()
    try:
        with torch.no_grad():
            return m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              do_sample=kw.pop("do_sample", False), pad_token_id=0, **kw)
    finally:
        m.train(was)


def no_inference_tensors(m, gen):
    """The model's tensors and the generator's caches are ordinary tensors."""
    assert not any(t.is_inference() for t in list(m.parameters()) + list(m.buffers()))
    assert not any(c.is_inference() for c in gen.caches)


def train_step_works(m):
    """The model's own training step runs and gives finite gradients."""
    ids = prompt(6, seed=9)
    m.zero_grad()
    m(ids, labels=ids).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
    m.zero_grad()


def test_generate_inside_inference_mode_leaves_generator_and_model_usable():
    m = fresh()
    short, long = prompt(4, seed=1), prompt(20, seed=2)
    want_s, want_l = eager(m, short, 4), eager(m, long, 4)
    gen = L.compile(m, max_seq_len=32)          # buckets 16, 32: graphs built in generate
    with torch.inference_mode():
        assert torch.equal(gen.generate(short, max_new_tokens=4), want_s)   # first graphs
        assert torch.equal(gen.generate(long, max_new_tokens=4), want_l)    # a new bucket
    no_inference_tensors(m, gen)
    assert torch.equal(gen.generate(long, max_new_tokens=4), want_l)
    assert torch.equal(gen.generate(short, max_new_tokens=4), want_s)
    assert torch.equal(L.compile(m, max_seq_len=32).generate(short, max_new_tokens=4), want_s)
    train_step_works(m)


def test_compile_save_and_load_inside_inference_mode(tmp_path):
    m = fresh()
    ids = prompt(5, seed=3)
    want = eager(m, ids, 6)
    torch.manual_seed(5)
    sampled = eager(m, ids, 6, do_sample=True, top_k=20, temperature=0.8)
    path = str(tmp_path / "g.ocm")
    with torch.inference_mode():
        gen = L.compile(m, max_seq_len=16, options={"prefill_buckets": [8]})
        assert torch.equal(gen.generate(ids, max_new_tokens=6), want)
        gen.save(path)
        loaded = opencann.load(path)
        assert torch.equal(loaded.generate(ids, max_new_tokens=6), want)
    no_inference_tensors(m, gen)
    assert not any(c.is_inference() for c in loaded.caches)
    for g in (gen, loaded):
        assert torch.equal(g.generate(ids, max_new_tokens=6), want)
        torch.manual_seed(5)
        assert torch.equal(g.generate(ids, max_new_tokens=6, do_sample=True, top_k=20,
                                      temperature=0.8), sampled)
    train_step_works(m)


def test_a_model_made_under_inference_mode_is_one_line():
    with torch.inference_mode():
        m = fresh()
    with pytest.raises(ValueError, match="inference tensor.*outside inference_mode") as e:
        L.compile(m, max_seq_len=16)
    assert "\n" not in str(e.value)


@pytest.fixture(params=[torch.bfloat16, torch.float64], ids=["bfloat16", "float64"])
def default_dtype(request):
    """torch's default dtype set to ``request.param`` for the test, restored after."""
    was = torch.get_default_dtype()
    yield request.param
    torch.set_default_dtype(was)


@pytest.mark.parametrize("backend", ["opencann", "eager"])
def test_default_dtype_leaves_caches_float32_and_tokens_eager(default_dtype, backend):
    m = fresh()
    ids = torch.cat([prompt(7, seed=4), prompt(7, seed=5)])
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        want = m.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        torch.manual_seed(2)
        sampled = m.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=True,
                             top_p=0.9, temperature=0.7, pad_token_id=0)
    torch.set_default_dtype(default_dtype)
    gen = L.compile(m, max_seq_len=16, max_batch=2, options={"backend": backend})
    assert {c.dtype for c in gen.caches} == {torch.float32}
    assert torch.equal(gen.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0), want)
    torch.manual_seed(2)
    assert torch.equal(gen.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=True,
                                    top_p=0.9, temperature=0.7, pad_token_id=0), sampled)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_compile_keeps_train_mode_and_generates_the_eval_tokens(kind):
    m = fresh(kind)
    short, long = prompt(4, seed=6), prompt(20, seed=7)
    want_s, want_l = eager(m, short, 5), eager(m, long, 3)
    m.train()
    torch.manual_seed(0)
    with torch.no_grad():   # transformers' own generate in train mode applies dropout
        noisy = m.generate(long, attention_mask=torch.ones_like(long), max_new_tokens=3,
                           do_sample=False, pad_token_id=0)
    assert not torch.equal(noisy, want_l)
    gen = L.compile(m, max_seq_len=32)
    assert m.training and all(mod.training for mod in m.modules())
    assert torch.equal(gen.generate(short, max_new_tokens=5), want_s)
    m.eval()
    assert torch.equal(gen.generate(short, max_new_tokens=5), want_s)
    m.train()
    assert torch.equal(gen.generate(long, max_new_tokens=3), want_l)   # a new bucket
    assert m.training


def test_an_eval_compiled_generator_serves_after_model_train():
    m = fresh()
    ids = prompt(5, seed=8)
    want = eager(m, ids, 5)
    gen = L.compile(m, max_seq_len=32)
    assert not m.training
    assert torch.equal(gen.generate(ids, max_new_tokens=5), want)
    m.train()
    assert torch.equal(gen.generate(ids, max_new_tokens=5), want)
    assert torch.equal(gen.generate(prompt(20, seed=2), max_new_tokens=2),
                       eager(m, prompt(20, seed=2), 2))


def test_save_from_its_own_streamer_is_one_line_and_the_generator_stays_usable(tmp_path):
    m = fresh()
    ids = prompt(5, seed=10)
    want = eager(m, ids, 4)
    gen = L.compile(m, max_seq_len=16, options={"prefill_buckets": [8]})
    errors = []

    def save_now(_tok):
        try:
            gen.save(str(tmp_path / "s.ocm"), graphs="built")
        except ValueError as e:
            errors.append(str(e))
            raise
    raised = []

    def call():     # on a thread of its own: a re-entrant wait would hang, not fail
        try:
            gen.generate(ids, max_new_tokens=4, streamer=save_now)
        except ValueError as e:
            raised.append(str(e))
    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "Generator.save from the streamer waited for its own call's lock"
    assert raised == errors and len(errors) == 1 and "\n" not in errors[0]
    assert "Generator.save() was called from its own streamer" in errors[0]
    assert not os.path.exists(tmp_path / "s.ocm")
    assert torch.equal(gen.generate(ids, max_new_tokens=4), want)
    gen.save(str(tmp_path / "s.ocm"), graphs="built")
    assert torch.equal(opencann.load(str(tmp_path / "s.ocm")).generate(ids, max_new_tokens=4), want)


def _change_weight(m):
    with torch.no_grad():
        m.model.embed_tokens.weight.mul_(1.5)
    return "'model.embed_tokens.weight' of the LlamaForCausalLM was modified in place"


def _change_attribute(m):
    m.model.layers[1].post_attention_layernorm.variance_epsilon = 1e-3
    return ("module attribute 'model.layers.1.post_attention_layernorm.variance_epsilon' of the "
            "LlamaForCausalLM was 1e-06")


@pytest.mark.parametrize("change", [_change_weight, _change_attribute], ids=["weight", "attribute"])
def test_save_after_a_change_raises_what_generate_raises(tmp_path, change):
    m = fresh()
    ids = prompt(5, seed=11)
    gen = L.compile(m, max_seq_len=16, options={"prefill_buckets": [8]})
    gen.generate(ids, max_new_tokens=2)
    said = change(m)
    with pytest.raises(ValueError) as g:
        gen.generate(ids, max_new_tokens=2)
    assert said in str(g.value) and "opencann.llm.compile(model, max_seq_len=16" in str(g.value)
    assert "\n" not in str(g.value)
    for graphs in ("built", "all"):
        path = tmp_path / f"{graphs}.ocm"
        with pytest.raises(ValueError) as s:
            gen.save(str(path), graphs=graphs)
        assert type(s.value) is ValueError and str(s.value) == str(g.value)
        assert not path.exists()
    with pytest.raises(ValueError) as b:    # another prompt bucket: refused alike
        gen.generate(prompt(12, seed=3), max_new_tokens=2)
    assert str(b.value) == str(g.value)
    want = eager(m, ids, 3)                  # the changed model, compiled again
    assert torch.equal(L.compile(m, max_seq_len=16).generate(ids, max_new_tokens=3), want)
