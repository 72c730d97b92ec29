"""Prefill graphs of one batch size share one torch.export capture (the prompt length a
dynamic dim), each bucket specialised from it and compiled whole
(`opencann.engine.per_shape.SymbolicCapture`): tokens equal transformers' greedy
``generate`` in every bucket, each bucket's graph is the one a capture at its own shape
gives (same ops, same logits to fp32 rounding), a model export cannot trace with a
dynamic length falls back to one capture per bucket, and the default buckets pad a
prompt by less than 16 tokens up to 64 and by less than a quarter above."""
import pytest
import torch
import transformers as T

import opencann.llm as L
from opencann.engine import compile_module
from opencann.engine.per_shape import SymbolicCapture
from opencann.frontend.torch import CaptureError
from opencann.llm.steps import prefill_buckets, smallest

CONFIGS = {
    "llama": lambda: T.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, eos_token_id=None),
    "gpt2": lambda: T.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                 bos_token_id=1, eos_token_id=None),
    "qwen2": lambda: T.Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, eos_token_id=None),
}


def _model(name):
    torch.manual_seed(7)
    return T.AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()


def _count_exports(monkeypatch):
    calls = []
    real = torch.export.export

    def counted(*a, **k):
        calls.append(k.get("dynamic_shapes"))
        return real(*a, **k)
    monkeypatch.setattr(torch.export, "export", counted)
    return calls


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_buckets_share_one_capture_and_equal_transformers(name, monkeypatch):
    m = _model(name)
    exports = _count_exports(monkeypatch)
    gen = L.compile(m, max_seq_len=48, options={"prefill_buckets": [8, 12, 20]})
    g = torch.Generator().manual_seed(3)
    for n in (5, 11, 17, 12, 2):   # buckets 8, 12, 20, 12 (again), 8
        ids = torch.randint(3, 97, (1, n), generator=g)
        want = m.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(gen.generate(ids, max_new_tokens=6), want), n
        assert torch.equal(gen.generate(ids, max_new_tokens=6), want), n   # a second call
    s = gen.stats
    assert s.graphs == ["decode b1 t1", "prefill b1 t8", "prefill b1 t12", "prefill b1 t20"]
    # the decode graph's capture, then one for every prefill bucket
    assert s.captures == 2 == len(exports) and s.recompiles == 0
    assert [d is not None for d in exports] == [False, True]
    notes = [" ".join(cm.report.notes) for cm in gen.steps.compiled().values()]
    assert all("specialised to prompt_tokens=" in n for n in notes[1:]), notes


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_specialised_graph_is_the_static_capture(name):
    """A bucket's graph has the ops and logits of a capture at that length."""
    m = _model(name)
    gen = L.compile(m, max_seq_len=32, options={"prefill_buckets": [6, 12]})
    for t in (6, 12):
        gen.steps.step(1, t)
        spec = gen.steps.compiled()[(1, t)]
        views = gen.steps.views(1)
        ids = torch.randint(3, 97, (1, t), generator=torch.Generator().manual_seed(t))
        args = (ids, torch.zeros(1, dtype=torch.long), torch.tensor([t - 1]))
        static = compile_module(gen.lm, args + tuple(views),
                                options=gen.steps.compile_options(t))
        assert spec.graph.op_counts() == static.graph.op_counts()
        got = spec(*args, *views).clone()
        caches = [v.clone() for v in views]
        want = static(*args, *views)
        for a, b in zip(caches, views):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            eager = m(ids[:, :t - 1]).logits[:, -1]
        torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)


def test_a_model_export_cannot_trace_dynamically_is_captured_per_bucket(monkeypatch):
    def refuse(self, *a, **k):
        raise CaptureError("torch.export rejects the dynamic length (test)")
    monkeypatch.setattr(SymbolicCapture, "__init__", refuse)
    m = _model("llama")
    gen = L.compile(m, max_seq_len=32, options={"prefill_buckets": [8, 12]})
    for n in (5, 10):
        ids = torch.randint(3, 97, (1, n), generator=torch.Generator().manual_seed(n))
        want = m.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(gen.generate(ids, max_new_tokens=4), want)
    # decode, the failed shared capture, then one capture per bucket
    assert gen.stats.graphs_built == 3 and gen.stats.captures == 4


def test_batch_sizes_each_share_their_own_capture():
    m = _model("llama")
    gen = L.compile(m, max_seq_len=32, max_batch=2, options={"prefill_buckets": [8, 12]})
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(1))
    for rows in (ids[:1, :5], ids[:1], ids[:, :5], ids):
        want = m.generate(rows, max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert torch.equal(gen.generate(rows, max_new_tokens=3), want)
    assert gen.stats.graphs_built == 6 and gen.stats.captures == 4


def test_default_buckets_pad_little():
    assert prefill_buckets(512) == (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256,
                                    320, 384, 448, 512)
    assert prefill_buckets(100) == (16, 32, 48, 64, 80, 96, 100)
    assert prefill_buckets(8) == (8,) and prefill_buckets(17) == (16, 17)
    buckets = prefill_buckets(8192)
    for n in range(2, 8193):
        b = smallest(buckets, n)
        assert b - n < 16 if n <= 64 else b < 1.25 * n, (n, b)
