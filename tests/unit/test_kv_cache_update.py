"""KvCacheUpdate: the kernel (`opencann.ops.kernels.kv_cache_update_cpu.kv_cache_update`)
against eager slice assignment ``cache[b, :, p:p+T] = new[b]`` (random caches, several
positions per row, rows at different positions, the first and the last position, NaN/Inf
and -0.0 copied as bits, a bf16 cache, a permuted ``new``, a second call), one clear line
per bad input with the cache left as it was; and the op's facts on a hand-built graph:
the output is the cache's memory (no buffer planned), readers of the old contents are
ordered before the write, a write into an undeclared graph input is refused, its cost
counts the written bytes only, and both LLM ops keep their dtypes under mixed precision."""
import pytest
import torch

from opencann.ir import DataType, Graph, TensorDesc, TensorRef
from opencann.ops import get_op, inplace_inputs, lookup_custom_op, output_aliases, written_inputs
from opencann.ops.kernels.kv_cache_update_cpu import kv_cache_update


def _eager(cache, new, positions):
    out = cache.clone()
    for b, p in enumerate(positions.tolist()):
        out[b, :, p:p + new.shape[2]] = new[b]
    return out


def _bits_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(width), b.view(width))


@pytest.mark.parametrize("b,h,s,d,t", [(1, 1, 1, 1, 1), (3, 2, 17, 8, 1), (2, 4, 33, 5, 4),
                                       (4, 1, 9, 16, 9)])
def test_matches_eager_slice_assignment(b, h, s, d, t):
    g = torch.Generator().manual_seed(b * 100 + s + t)
    cache = torch.randn(b, h, s, d, generator=g)
    new = torch.randn(b, h, t, d, generator=g)
    positions = torch.randint(0, s - t + 1, (b,), generator=g)
    positions[0] = s - t                                   # the last positions
    if b > 1:
        positions[1] = 0                                   # the first
    want = _eager(cache, new, positions)
    got = kv_cache_update(cache, new, positions)
    assert got is cache                                    # in place, the caller's tensor
    assert _bits_equal(cache, want)
    positions2 = (positions + 1) % (s - t + 1)             # a second call, other positions
    new2 = torch.randn(b, h, t, d, generator=g)
    want2 = _eager(want, new2, positions2)
    kv_cache_update(cache, new2, positions2)
    assert _bits_equal(cache, want2)


def test_special_values_bf16_int32_positions_and_permuted_new():
    g = torch.Generator().manual_seed(3)
    new = torch.randn(2, 5, 3, 4, generator=g).permute(0, 2, 1, 3)   # [B, Hkv=3, T=5, D], strided
    new[0, 0, 0, :3] = torch.tensor([float("nan"), float("inf"), -0.0])
    new[1, 2, 4, 0] = float("-inf")
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.randn(2, 3, 12, 4, generator=g).to(dtype)
        cache[:, :, 11] = float("nan")                     # NaN outside the window stays
        positions = torch.tensor([6, 2], dtype=torch.int32)
        src = new.to(dtype)
        want = _eager(cache, src, positions.long())
        kv_cache_update(cache, src, positions)
        assert _bits_equal(cache, want)
        assert torch.signbit(cache[0, 0, 6, 2]) and torch.isnan(cache[0, 0, 6, 0])


def test_torch_custom_op_agrees_with_the_kernel():
    import opencann.ops.llm_torch  # noqa: F401  (registers torch.ops.opencann.*)
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(3, 2, 10, 6, generator=g)
    new = torch.randn(3, 2, 2, 6, generator=g)
    positions = torch.tensor([0, 8, 3])
    mine = cache.clone()
    torch.ops.opencann.kv_cache_update(cache, new, positions)
    kv_cache_update(mine, new, positions)
    assert _bits_equal(cache, mine)


@pytest.mark.parametrize("cache,new,positions,match", [
    ((2, 2, 8, 4), (2, 2, 1, 3), [0, 0], r"expected cache \[B, Hkv, S_max, D\]"),
    ((2, 2, 8, 4), (1, 2, 1, 4), [0, 0], r"expected cache \[B, Hkv, S_max, D\]"),
    ((2, 2, 8, 4), (2, 2, 1, 4), [0], r"positions must be an integer tensor \[2\]"),
    ((2, 2, 8, 4), (2, 2, 1, 4), [0.0, 1.0], r"positions must be an integer tensor"),
    ((2, 2, 8, 4), (2, 2, 2, 4), [0, 7], r"row 1 writes positions 7..8 but the cache holds positions 0..7; compile with a larger max_seq_len"),
    ((2, 2, 8, 4), (2, 2, 1, 4), [-1, 0], r"row 0 writes positions -1..-1"),
])
def test_bad_inputs_one_line_cache_unchanged(cache, new, positions, match):
    c = torch.randn(*cache)
    before = c.clone()
    pos = torch.tensor(positions)
    with pytest.raises(ValueError, match=match) as e:
        kv_cache_update(c, torch.randn(*new), pos)
    assert "\n" not in str(e.value)
    assert torch.equal(c, before)


def test_dtype_mismatch_names_the_fix():
    with pytest.raises(ValueError, match="cast the new keys/values to the cache dtype"):
        kv_cache_update(torch.zeros(1, 1, 4, 2), torch.ones(1, 1, 1, 2, dtype=torch.bfloat16),
                        torch.tensor([0]))


# -- the graph op ------------------------------------------------------------------------

F32 = DataType.FLOAT


def _decode_graph(declare_written=True, old_reader=False):
    """cache, new, positions, q -> KvCacheUpdate -> DecodeAttention (the updated cache);
    ``old_reader``: a Neg of the cache's old contents, listed before the write."""
    g = Graph("decode")
    cache_d = TensorDesc((2, 2, 16, 8), F32)
    cache = g.add_input(cache_d, "kc")
    new = g.add_input(TensorDesc((2, 2, 1, 8), F32), "new")
    pos = g.add_input(TensorDesc((2,), DataType.INT64), "pos")
    q = g.add_input(TensorDesc((2, 4, 1, 8), F32), "q")
    outs = []
    if old_reader:
        outs.append(g.create_node("Neg", [cache], {"self": TensorRef(0)}, [cache_d], "old").output)
    w = g.create_node("KvCacheUpdate", [cache, new, pos],
                      {"cache": TensorRef(0), "new": TensorRef(1), "positions": TensorRef(2)},
                      [cache_d], "write")
    att = g.create_node("DecodeAttention", [q, w.output, w.output, pos],
                        {"query": TensorRef(0), "key": TensorRef(1), "value": TensorRef(2),
                         "lengths": TensorRef(3), "scale": None}, [q.desc], "attn")
    g.outputs = [w.output, att.output] + outs
    if declare_written:
        g.signature = g.signature.replace(input_mutations=(0,), n_outputs=len(g.outputs))
    return g, w


def test_op_facts_inplace_aliasing_and_capture_name():
    g, w = _decode_graph()
    assert inplace_inputs(w) == {0: 0} and written_inputs(w) == (0,)
    assert output_aliases(w) == [(0,)]
    assert lookup_custom_op("opencann::kv_cache_update").name == "KvCacheUpdate"
    assert lookup_custom_op("opencann::decode_attention").name == "DecodeAttention"
    cost = get_op("KvCacheUpdate").cost(w)
    assert cost.flops == 0 and cost.bytes == 2 * (2 * 2 * 1 * 8 * 4) + 2 * 8


def test_memory_plan_gives_the_cache_no_buffer_and_the_write_is_checked():
    from opencann.passes.memory import plan_memory
    g, w = _decode_graph()
    plan = plan_memory(g)
    assert w.output.id not in plan.value_buffer          # the cache's own memory
    assert all(b.size < 2 * 2 * 16 * 8 * 4 for b in plan.buffers.values())
    undeclared, _ = _decode_graph(declare_written=False)
    with pytest.raises(ValueError, match="graph input the model does not declare written"):
        plan_memory(undeclared)


def test_readers_of_the_old_cache_run_before_the_write():
    from opencann.passes.memory import plan_memory
    from opencann.passes.schedule_order import order_edges
    g, w = _decode_graph(old_reader=True)
    assert [(a.name, b.name) for a, b in order_edges(g)] == [("old", "write")]
    g.reorder([w, g.nodes[0], g.nodes[2]])               # the old reader after the write
    assert [n.name for n in g.nodes] == ["write", "old", "attn"]
    with pytest.raises(ValueError, match="still read afterwards"):
        plan_memory(g)


def test_vnpu_costs_are_memory_bound_on_the_bytes_moved():
    from opencann.devices.vnpu import get_preset
    from opencann.devices.vnpu.cost_model import HBM_EFFICIENCY
    g, w = _decode_graph()
    spec = get_preset("ascend910b")
    upd, name = get_op("KvCacheUpdate").device_cost["vnpu"](w, spec)
    assert upd.hbm_bytes == 2 * (2 * 2 * 1 * 8 * 4) + 2 * 8 and "fused_vector_cost" in name
    big = Graph("big")                                    # a 125M-Llama-sized layer cache
    ins = [big.add_input(TensorDesc(s, dt)) for s, dt in
           [((8, 32, 1, 128), F32), ((8, 8, 4096, 128), F32), ((8, 8, 4096, 128), F32),
            ((8,), DataType.INT64)]]
    att = big.create_node("DecodeAttention", ins, {"query": TensorRef(0), "key": TensorRef(1),
                                                   "value": TensorRef(2), "lengths": TensorRef(3),
                                                   "scale": None}, [ins[0].desc])
    c, _ = get_op("DecodeAttention").device_cost["vnpu"](att, spec)
    cache_bytes = 2 * 8 * 8 * 4096 * 128 * 4
    assert c.hbm_bytes >= cache_bytes and c.bound == "memory"
    assert c.time_us >= cache_bytes / (spec.hbm_gbps * HBM_EFFICIENCY * 1e3)


def test_mixed_precision_keeps_the_cache_dtype_and_decode_attention_fp32():
    from opencann.engine.options import complete
    from opencann.passes.base import PassContext
    from opencann.passes.prepare.precision import MixedPrecision
    from opencann.report import CompileReport
    for mode in ("allow_mix_precision_bf16", "force_fp16"):
        g, w = _decode_graph()
        ctx = PassContext(options=complete({"precision_mode": mode}), report=CompileReport())
        MixedPrecision().run(g, ctx)
        byop = {n.op: n for n in g.nodes}
        assert byop["KvCacheUpdate"].inputs[0].desc.dtype == F32   # the caller's cache itself
        assert byop["KvCacheUpdate"].inputs[0] is g.inputs[0]
        assert all(v.desc.dtype == F32 for v in byop["DecodeAttention"].inputs[:3])
        assert byop["DecodeAttention"].outputs[0].desc.dtype == F32
