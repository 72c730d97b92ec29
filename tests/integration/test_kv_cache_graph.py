"""The KV cache as graph state through ``opencann.compile``: a tiny decoder layer written
with the torch custom ops ``opencann::kv_cache_update`` and ``opencann::decode_attention``
(GQA, caches as inputs, positions as data) compiles ONCE and equals eager over several
decode steps at different positions (batch 2, rows at different positions, NaN in the
cache past the live lengths), writes the caller's cache tensors in place (same storage,
no cache-sized allocation or copy during a call), a second call and output independence,
a model file round trip with the same in-place semantics, a prefill with a dynamic
prompt length, mixed precision keeping both
ops in fp32 on the caller's cache, a non-contiguous cache (copied back), a position past
the cache as one clear line, and the same layer through ``torch.compile``. Then
transformers' caches on the generic paths: a decode step with a ``DynamicCache``, whose
grown cache is one clear line, and ``torch.compile`` under ``generate`` (dynamic and
static cache) giving eager's tokens."""
import logging
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import opencann
import opencann.ops.llm_torch  # noqa: F401  (registers torch.ops.opencann.*)
from opencann.runtime.executor import ExecutionError

B, HQ, HKV, S, D, E = 2, 4, 2, 16, 8, 32


class DecoderLayer(torch.nn.Module):
    """RMSNorm -> q/k/v projections -> cache write -> decode attention -> o projection,
    plus the residual: one decode step for B sequences at ``positions``."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(E)
        self.q = torch.nn.Linear(E, HQ * D, bias=False)
        self.k = torch.nn.Linear(E, HKV * D, bias=False)
        self.v = torch.nn.Linear(E, HKV * D, bias=False)
        self.o = torch.nn.Linear(HQ * D, E, bias=False)

    def forward(self, x, k_cache, v_cache, positions):
        b = x.shape[0]
        h = self.norm(x)
        q = self.q(h).view(b, 1, HQ, D).transpose(1, 2)
        k = self.k(h).view(b, 1, HKV, D).transpose(1, 2)
        v = self.v(h).view(b, 1, HKV, D).transpose(1, 2)
        torch.ops.opencann.kv_cache_update(k_cache, k, positions)
        torch.ops.opencann.kv_cache_update(v_cache, v, positions)
        a = torch.ops.opencann.decode_attention(q, k_cache, v_cache, positions + 1, D ** -0.5)
        return x + self.o(a.transpose(1, 2).reshape(b, 1, HQ * D))


def _model():
    torch.manual_seed(0)
    return DecoderLayer().eval()


def _caches(seed, nan_tail=True):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, HKV, S, D, generator=g), torch.randn(B, HKV, S, D, generator=g)
    if nan_tail:   # past every live length used below: never read
        k[:, :, -2:] = float("nan")
        v[:, :, -2:] = float("inf")
    return k, v


def _same_bits(a, b):
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _same_cache(a, b):
    """Cache ``a`` against eager's ``b``: each element bit for bit (the slots no step wrote,
    their NaN/inf tails included) or, where a step wrote a projection, within fp32
    rounding: the K/V GEMM is raced per shape, and the decode GEMV sums in another order
    than eager's mm."""
    a = a.contiguous()
    same = a.view(torch.int32) == b.view(torch.int32)
    return bool((same | torch.isclose(a, b, rtol=1e-5, atol=1e-6)).all())


def _example():
    k, v = _caches(1)
    return (torch.randn(B, 1, E), k, v, torch.tensor([3, 5]))


class CacheSizedTensors(TorchDispatchMode):
    """Records every ATen call that returns a tensor of the caches' shape ``shape`` outside
    their storages ``storages`` (a cache-sized allocation or copy)."""

    def __init__(self, shape, storages):
        super().__init__()
        self.shape, self.storages, self.seen = tuple(shape), storages, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if (isinstance(t, torch.Tensor) and tuple(t.shape) == self.shape
                    and t.untyped_storage().data_ptr() not in self.storages):
                self.seen.append(str(func))
        return out


@pytest.fixture(scope="module")
def compiled():
    model = _model()
    return model, opencann.compile(model, _example())


def _steps(cm, model, positions_per_step, seed=7):
    """Run the compiled and the eager model side by side from equal caches."""
    kc, vc = _caches(seed)
    ek, ev = kc.clone(), vc.clone()
    ptrs = (kc.data_ptr(), vc.data_ptr())
    g = torch.Generator().manual_seed(seed)
    for pos in positions_per_step:
        x, p = torch.randn(B, 1, E, generator=g), torch.tensor(pos)
        with torch.no_grad():
            want = model(x, ek, ev, p)
        got = cm(x, kc, vc, p)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert _same_cache(kc, ek) and _same_cache(vc, ev)
        assert (kc.data_ptr(), vc.data_ptr()) == ptrs
    return kc, vc


def test_one_compile_serves_every_position_in_place(compiled):
    model, cm = compiled
    ops = [n.op for n in cm.graph.nodes]
    # the two cache writes and the attention run as one node (fuse_decode_kv_update)
    assert ops.count("DecodeAttentionKvUpdate") == 1 and "KvCacheUpdate" not in ops
    assert "HostFallback" not in ops
    # rows at different positions, a row at position 0 and one at the last live slot
    _steps(cm, model, [[0, 4], [1, 5], [2, 9], [3, 13]])


def test_unfused_cache_writes_serve_every_position_in_place():
    model = _model()
    cm = opencann.compile(model, _example(), options={"disable": ["fuse_decode_kv_update"]})
    ops = [n.op for n in cm.graph.nodes]
    assert ops.count("KvCacheUpdate") == 2 and ops.count("DecodeAttention") == 1
    _steps(cm, model, [[0, 4], [1, 5], [2, 9], [3, 13]])


def test_no_cache_sized_copy_or_allocation_during_a_call(compiled):
    model, cm = compiled
    kc, vc = _caches(11)
    x, p = torch.randn(B, 1, E), torch.tensor([6, 2])
    cm(x, kc, vc, p)                                     # warm (kernels bound)
    plan = cm.plan
    assert plan.arena_bytes < kc.numel() * kc.element_size()   # the cache is not in the arena
    mode = CacheSizedTensors(kc.shape, {kc.untyped_storage().data_ptr(),
                                          vc.untyped_storage().data_ptr()})
    with mode:
        cm(x, kc, vc, torch.tensor([7, 3]))
    assert mode.seen == []


def test_second_call_and_output_independence(compiled):
    model, cm = compiled
    kc, vc = _caches(3)
    x, p = torch.randn(B, 1, E), torch.tensor([4, 8])
    first = cm(x, kc, vc, p)
    snapshot = (kc.clone(), vc.clone())
    again = cm(x, kc, vc, p)                            # same write again: same caches
    assert torch.equal(first, again)
    assert _same_bits(kc, snapshot[0]) and _same_bits(vc, snapshot[1])
    first.add_(1)                                       # the caller's own tensor
    assert torch.equal(cm(x, kc, vc, p), again)


def test_model_file_round_trip_keeps_writing_in_place(compiled, tmp_path):
    model, cm = compiled
    path = os.path.join(tmp_path, "layer.ocm")
    opencann.save(cm, path)
    loaded = opencann.load(path)
    assert [n.op for n in loaded.graph.nodes].count("DecodeAttentionKvUpdate") == 1
    kc, vc = _steps(loaded, model, [[2, 3], [3, 4]], seed=21)
    mode = CacheSizedTensors(kc.shape, {kc.untyped_storage().data_ptr(),
                                          vc.untyped_storage().data_ptr()})
    with mode:
        loaded(torch.randn(B, 1, E), kc, vc, torch.tensor([5, 6]))
    assert mode.seen == []


def test_mixed_precision_keeps_both_ops_fp32_on_the_callers_cache():
    model = _model()
    cm = opencann.compile(model, _example(), options={"precision_mode": "allow_mix_precision_bf16"})
    for n in cm.graph.nodes:
        if n.op in ("KvCacheUpdate", "DecodeAttention"):
            assert all(v.desc.dtype.value == "float32" for v in n.inputs if v.desc.dtype.is_floating)
    kc, vc = _caches(5)
    ek, ev = kc.clone(), vc.clone()
    ptr = kc.data_ptr()
    x, p = torch.randn(B, 1, E), torch.tensor([1, 6])
    got = cm(x, kc, vc, p)
    with torch.no_grad():
        want = model(x, ek, ev, p)
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(kc.nan_to_num(), ek.nan_to_num(), rtol=3e-2, atol=3e-2)
    assert kc.data_ptr() == ptr


def test_non_contiguous_cache_is_written_back(compiled):
    model, cm = compiled
    k, v = _caches(9)
    kc = k.transpose(1, 2).contiguous().transpose(1, 2)   # BSND memory seen as BNSD
    vc = v.transpose(1, 2).contiguous().transpose(1, 2)
    ek, ev = k.clone(), v.clone()
    x, p = torch.randn(B, 1, E), torch.tensor([2, 10])
    got = cm(x, kc, vc, p)
    with torch.no_grad():
        want = model(x, ek, ev, p)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert _same_cache(kc, ek) and _same_cache(vc, ev)


def test_position_past_the_cache_is_one_line(compiled):
    _, cm = compiled
    kc, vc = _caches(4)
    with pytest.raises(ExecutionError, match="row 1 writes positions 16..16 but the cache holds "
                       "positions 0..15; compile with a larger max_seq_len") as e:
        cm(torch.randn(B, 1, E), kc, vc, torch.tensor([1, S]))
    assert "\n" not in str(e.value)


def test_prefill_with_a_dynamic_prompt_length_writes_in_place():
    class Prefill(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.k = torch.nn.Linear(E, HKV * D)

        def forward(self, x, k_cache, positions):
            b, t = x.shape[0], x.shape[1]
            k = self.k(x).view(b, t, HKV, D).transpose(1, 2)
            torch.ops.opencann.kv_cache_update(k_cache, k, positions)
            return k.sum(-1)

    torch.manual_seed(0)
    model = Prefill().eval()
    kc, _ = _caches(17)
    cm = opencann.compile(model, (torch.randn(B, 4, E), kc.clone(), torch.tensor([0, 0])),
                          dynamic_shapes=({1: torch.export.Dim("t", min=2, max=8)}, None, None))
    ptr = kc.data_ptr()
    for t, pos in ((3, [0, 5]), (7, [2, 0])):
        x, ek = torch.randn(B, t, E), kc.clone()
        with torch.no_grad():
            want = model(x, ek, torch.tensor(pos))
        torch.testing.assert_close(cm(x, kc, torch.tensor(pos)), want, rtol=1e-5, atol=1e-5)
        # the written rows are the projection's values: a per-shape GEMM race may bind
        # another kernel than eager's addmm for a new prompt length (fp32 rounding); the
        # rows not written keep their bits (NaN / inf tails included)
        torch.testing.assert_close(kc, ek, rtol=1e-5, atol=1e-5, equal_nan=True)
        written = torch.zeros(kc.shape, dtype=torch.bool)
        for b, p in enumerate(pos):
            written[b, :, p:p + t] = True
        assert torch.equal(kc.view(torch.int32)[~written], ek.view(torch.int32)[~written])
        assert kc.data_ptr() == ptr


def test_torch_compile_writes_the_cache_in_place_too():
    model = _model()
    torch._dynamo.reset()
    fn = torch.compile(model, backend="opencann")
    try:
        kc, vc = _caches(13)
        ek, ev = kc.clone(), vc.clone()
        g = torch.Generator().manual_seed(13)
        for pos in ([0, 3], [1, 4]):
            x, p = torch.randn(B, 1, E, generator=g), torch.tensor(pos)
            with torch.no_grad():
                want = model(x, ek, ev, p)
                mode = CacheSizedTensors(kc.shape, {kc.untyped_storage().data_ptr(),
                                                      vc.untyped_storage().data_ptr()})
                with mode:
                    got = fn(x, kc, vc, p)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert _same_cache(kc, ek) and _same_cache(vc, ev)
            assert mode.seen == []
    finally:
        torch._dynamo.reset()


# -- transformers cache objects on the generic paths (#27 item 5) --------------------------

def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                      max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_decode_step_with_a_dynamic_cache_is_one_line():
    """A DynamicCache grows by Python attribute writes: eager grows the caller's object, a
    compiled graph could only return a grown copy, and a caller reusing its object would
    read a stale cache with no error; opencann.compile refuses it in one line."""
    import copy
    model = _llama()
    ids = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    step = torch.randint(0, 100, (1, 1), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match=r"input 'past_key_values' is a transformers DynamicCache"
                       r".* use opencann.llm.compile .* or a static cache") as e:
        opencann.compile(model, (step,), example_kwargs={"past_key_values": copy.deepcopy(cache),
                                                         "use_cache": True})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("cache_implementation", [None, "static"])
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_torch_compile_under_generate_gives_eagers_tokens(cache_implementation):
    model = _llama()
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    if cache_implementation:
        kw["cache_implementation"] = cache_implementation
    want = model.generate(ids, **kw)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="opencann")
    try:
        assert torch.equal(model.generate(ids, **kw), want)
        assert torch.equal(model.generate(ids, **kw), want)   # a second generation
    finally:
        del model.forward
        torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_torch_compile_with_a_growing_cache_stops_planning_a_shape_per_token(caplog):
    """Under a DynamicCache the decode graph sees a new KV length every token: after
    ``plan_cache_size`` (at least 8) calls each at a new shape it runs eagerly (counted with its
    reason, said once), so no plan is built per token after that, and the tokens stay
    eager's, in this generation and the next."""
    from opencann.dynamo import eager_fallbacks
    from opencann.dynamo.compile_fx import COMPILED_GRAPHS
    model = _llama()
    ids = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=14, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **kw)
    torch._dynamo.reset()
    before, n0 = len(eager_fallbacks()), len(COMPILED_GRAPHS)
    model.forward = torch.compile(model.forward, backend="opencann",
                                  options={"plan_cache_size": 3})
    log = logging.getLogger("opencann")
    log.addHandler(caplog.handler)   # the opencann logger does not propagate to root
    try:
        with caplog.at_level(logging.WARNING, logger="opencann"):
            assert torch.equal(model.generate(ids, **kw), want)
            symbolic = [r for r in COMPILED_GRAPHS[n0:] if r.dynamic.get("plan_counts")]
            assert symbolic, "no graph was planned per shape"
            built = [r.dynamic["plan_counts"]["built"] for r in symbolic]
            assert max(built) <= 8          # 8 new shapes in a row (the prefill's too), then eager
            assert torch.equal(model.generate(ids, **kw), want)     # a second generation
        assert [r.dynamic["plan_counts"]["built"] for r in symbolic] == built   # none since
        churned = [m for m in caplog.messages if "runs eagerly from now on" in m]
        assert len(churned) == 1 and "opencann.llm.compile" in churned[0]
        rows = eager_fallbacks()
        assert len(rows) == before + 1 and "new input shape" in rows[-1]["reason"]
        assert opencann.dynamo.recompiles(model.forward)["eager_fallbacks"] == 1
    finally:
        log.removeHandler(caplog.handler)
        del model.forward
        torch._dynamo.reset()


def test_a_cache_held_as_a_buffer_is_one_line_saying_to_pass_it_in():
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("k_cache", torch.randn(B, HKV, S, D))

        def forward(self, k, positions):
            torch.ops.opencann.kv_cache_update(self.k_cache, k, positions)
            return self.k_cache.sum()

    with pytest.raises(ValueError, match="writes its buffer k_cache with opencann::kv_cache_update "
                       ".* Fix: pass the cache to forward as an input") as e:
        opencann.compile(Holder(), (torch.randn(B, HKV, 1, D), torch.tensor([1, 2])))
    assert "\n" not in str(e.value)


def test_batch_gears_serve_exact_batches_in_place_and_name_the_cache_write():
    """ATC-style batch gears over a graph that writes its caches: every gear equals eager
    and writes the caller's caches; padding is refused, naming KvCacheUpdate writing a
    graph input (a padded copy would be written), so a batch between gears is one line.
    The ops' per-index rules (`opencann.ops.per_index`): rows independent along the
    batch, the cache's sequence axis not."""
    from opencann.ops import per_index as pi
    model = _model()
    fused = opencann.compile(model, _example(), options={"dynamic_batch_size": [1, 2, 4]})
    why = fused.report.dynamic["padding"]["dims"]["batch"]["blocked_by"]
    assert why["op"] == "DecodeAttentionKvUpdate" and "writes graph input" in why["reason"], why
    cm = opencann.compile(model, _example(), options={"dynamic_batch_size": [1, 2, 4],
                                                      "disable": ["fuse_decode_kv_update"]})
    why = cm.report.dynamic["padding"]["dims"]["batch"]["blocked_by"]
    assert why["op"] == "KvCacheUpdate" and "writes graph input" in why["reason"], why
    g = torch.Generator().manual_seed(3)
    for b in (1, 4):
        kc, vc = (torch.randn(b, HKV, S, D, generator=g) for _ in range(2))
        ek, ev = kc.clone(), vc.clone()
        x, p = torch.randn(b, 1, E, generator=g), torch.arange(b) + 2
        with torch.no_grad():
            want = model(x, ek, ev, p)
        torch.testing.assert_close(cm(x, kc, vc, p), want, rtol=1e-5, atol=1e-5)
        assert _same_cache(kc, ek) and _same_cache(vc, ev)
    with pytest.raises(ValueError, match=r"^batch=3 is not one of the gears compiled with "
                       r"dynamic_batch_size=\[1, 2, 4\]"):
        cm(torch.randn(3, 1, E), torch.randn(3, HKV, S, D), torch.randn(3, HKV, S, D),
           torch.zeros(3, dtype=torch.long))
    upd = next(n for n in cm.graph.nodes if n.op == "KvCacheUpdate")
    att = next(n for n in cm.graph.nodes if n.op == "DecodeAttention")
    idx = {k: upd.attrs[k].index for k in ("cache", "new", "positions")}
    assert pi.kv_cache_update(upd, {i: pi.Axis(0) for i in idx.values()}, "s0") == {0: 0}
    assert pi.kv_cache_update(upd, {idx["cache"]: pi.Axis(1), idx["new"]: pi.Axis(1)}, "s0") == {0: 1}
    seq = pi.kv_cache_update(upd, {idx["cache"]: pi.Axis(2), idx["new"]: pi.Axis(2)}, "s0")
    assert "along the cache's sequence axis" in seq
    assert "different axes" in pi.kv_cache_update(upd, {idx["cache"]: pi.Axis(0), idx["new"]: pi.Axis(2)}, "s0")
    aidx = [att.attrs[k].index for k in ("query", "key", "value", "lengths")]
    assert pi.decode_attention(att, {i: pi.Axis(0) for i in aidx}, "s0") == {0: 0}
    fa = next(n for n in fused.graph.nodes if n.op == "DecodeAttentionKvUpdate")
    assert pi.decode_attention_kv_update(fa, {i: pi.Axis(0) for i in range(7)}, "s0") == {0: 0, 1: 0, 2: 0}
    assert "only the batch axis" in pi.decode_attention_kv_update(fa, {i: pi.Axis(1) for i in (1, 3)}, "s0")
    assert "only the batch axis" in pi.decode_attention(att, {i: pi.Axis(1) for i in aidx[:3]}, "s0")


@pytest.fixture
def static_cache_pytree():
    """transformers' StaticCache as a torch.export pytree node (transformers' own
    ``register_pytree_node``), registered for one test only."""
    import torch.utils._pytree as pytree
    from transformers import StaticCache
    from transformers.exporters.exporter_dynamo import register_pytree_node
    register_pytree_node(StaticCache)
    yield StaticCache
    pytree._deregister_pytree_node(StaticCache)


def test_static_cache_decode_step_writes_the_callers_cache_in_place(static_cache_pytree):
    """opencann.compile of one decode step over a transformers StaticCache: the layers'
    ``index_copy_`` (functionalized to index_put + a copy back) runs in place on the
    caller's cache (pass input_inplace, TorchAir's input_inplace_pass): logits equal eager
    over several steps, the cache object the caller holds is updated (same tensors), and a
    call makes no cache-sized tensor. Disabled, the same values arrive by copy-back."""
    import transformers as T
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    model = T.LlamaForCausalLM(cfg).eval()

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, tok, cache):
            return self.m(tok, past_key_values=cache, use_cache=True).logits

    step = Step()
    mine, ref = (static_cache_pytree(config=cfg, max_cache_len=24) for _ in range(2))
    prompt = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        step(prompt, mine), step(prompt, ref)
    cm = opencann.compile(step, (torch.tensor([[7]]), mine))
    assert [p.changed for p in cm.report.passes if p.name == "input_inplace"] == [4]
    off = opencann.compile(step, (torch.tensor([[7]]), mine), options={"disable": ["input_inplace"]})
    tensors = [t for layer in mine.layers for t in (layer.keys, layer.values)]
    ptrs = [t.data_ptr() for t in tensors]
    for i, tok in enumerate([8, 41, 3, 90]):
        t = torch.tensor([[tok]])
        with torch.no_grad():
            want = step(t, ref)
        mode = CacheSizedTensors(tensors[0].shape, {x.untyped_storage().data_ptr() for x in tensors})
        with mode:
            got = (cm if i % 2 == 0 else off)(t, mine)
        assert (mode.seen == []) == (i % 2 == 0), mode.seen      # the copy only when disabled
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b in zip(mine.layers, ref.layers):
            torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
            assert int(a.cumulative_length) == int(b.cumulative_length) == 6 + i
        assert [x.data_ptr() for x in tensors] == ptrs
