"""Prefill graphs of one batch size after its first share one torch.export capture (the
prompt length a dynamic dim), each bucket specialised from it and compiled whole
(`opencann.engine.per_shape.SymbolicCapture`): tokens equal transformers' greedy
``generate`` in every bucket, each bucket's graph is the one a capture at its own shape
gives (same ops, same logits to fp32 rounding), a model export cannot trace with a
dynamic length falls back to one capture per bucket, the default buckets pad a
prompt by less than 8 tokens up to 64 and by less than a quarter above, and every step
graph of a generator runs in one shared arena."""
import pytest
import torch
import transformers as T

import opencann.llm as L
from helpers import tiny_llm_config
from opencann.engine import compile_module
from opencann.engine.per_shape import SymbolicCapture
from opencann.frontend.torch import CaptureError
from opencann.llm.steps import prefill_buckets, smallest

CONFIGS = ("gpt2", "llama", "qwen2")


def _model(name):
    torch.manual_seed(7)
    return T.AutoModelForCausalLM.from_config(tiny_llm_config(name)).eval()


def _count_exports(monkeypatch):
    calls = []
    real = torch.export.export

    def counted(*a, **k):
        calls.append(k.get("dynamic_shapes"))
        return real(*a, **k)
    monkeypatch.setattr(torch.export, "export", counted)
    return calls


@pytest.mark.parametrize("name", CONFIGS)
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
    # the decode graph's capture, the first bucket's, then one for every later bucket
    assert s.captures == 3 == len(exports) and s.recompiles == 0
    assert [d is not None for d in exports] == [False, False, True]
    notes = [" ".join(cm.report.notes) for cm in gen.steps.compiled().values()]
    assert not any("specialised to" in n for n in notes[:2]), notes
    assert all("specialised to prompt_tokens=" in n for n in notes[2:]), notes


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
    # decode, the first bucket, the failed shared capture, then the second bucket
    assert gen.stats.graphs_built == 3 and gen.stats.captures == 4


def test_batch_sizes_each_share_their_own_capture():
    m = _model("llama")
    gen = L.compile(m, max_seq_len=32, max_batch=2, options={"prefill_buckets": [8, 12]})
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(1))
    for rows in (ids[:1, :5], ids[:1], ids[:, :5], ids):
        want = m.generate(rows, max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert torch.equal(gen.generate(rows, max_new_tokens=3), want)
    # per batch size: decode, the first bucket, the shared capture for the second
    assert gen.stats.graphs_built == 6 and gen.stats.captures == 6


def test_default_buckets_pad_little():
    assert prefill_buckets(512) == (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192,
                                    224, 256, 320, 384, 448, 512)
    assert prefill_buckets(100) == (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100)
    assert prefill_buckets(8) == (8,) and prefill_buckets(17) == (8, 16, 17)
    buckets = prefill_buckets(8192)
    for n in range(2, 8193):
        b = smallest(buckets, n)
        assert b - n < 8 if n <= 64 else b < 1.25 * n, (n, b)


def test_step_graphs_share_one_arena(tmp_path):
    """Every step graph runs in one buffer the size of the largest graph's arena (their
    calls never overlap): memory is weights + caches + one arena, reported so, and
    results stay transformers' as graphs are built (each build may replace the buffer)."""
    m = _model("llama")
    gen = L.compile(m, max_seq_len=40, max_batch=2, options={"prefill_buckets": [4, 8, 16]})
    g = torch.Generator().manual_seed(5)
    for rows, n in ((1, 3), (2, 14), (1, 7), (2, 5), (1, 14)):
        ids = torch.randint(3, 97, (rows, n), generator=g)
        want = m.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(gen.generate(ids, max_new_tokens=5), want), (rows, n)
    graphs = gen.steps.compiled()
    assert len(graphs) == 7
    arenas = {cm.shapes.executor.arena.untyped_storage().data_ptr() for cm in graphs.values()}
    largest = max(int(cm.plan.arena_bytes) for cm in graphs.values())
    assert len(arenas) == 1 and gen.stats.arena_bytes == largest
    # a generator loaded from a file shares one arena too, and gives the same tokens
    path = str(tmp_path / "g.ocm")
    gen.save(path, graphs="built")
    back = L.load(path)
    loaded = back.steps.compiled()
    assert len({cm.shapes.executor.arena.untyped_storage().data_ptr()
                for cm in loaded.values()}) == 1 and back.stats.arena_bytes == largest
    ids = torch.randint(3, 97, (2, 12), generator=g)
    assert torch.equal(back.generate(ids, max_new_tokens=4), gen.generate(ids, max_new_tokens=4))


def test_a_shared_arena_is_not_shared_while_a_call_overlaps():
    """`ExecutorPool.share_arena` rebinds only an idle pool's one executor."""
    import opencann
    lin = torch.nn.Linear(8, 8).eval()
    cm = opencann.compile(lin, (torch.randn(4, 8),))
    buf = torch.empty(cm.plan.arena_bytes + 64, dtype=torch.uint8)
    x = torch.randn(4, 8)
    want = lin(x)
    pool = cm.shapes.pool
    ex = pool._borrow()          # a call in flight
    assert not cm.shapes.share_arena(buf)
    pool._idle.put(ex)
    assert cm.shapes.share_arena(buf) and cm.shapes.executor.arena is buf
    torch.testing.assert_close(cm(x), want)
    with pytest.raises(ValueError, match="contiguous uint8 tensor of at least"):
        cm.shapes.executor.clone(torch.empty(1, dtype=torch.float32))
