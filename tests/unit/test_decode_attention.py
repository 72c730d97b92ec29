"""The DecodeAttention kernel (`opencann.ops.kernels.decode_attention_cpu.decode_attention`,
FlashDecoding split-KV) against eager ``F.scaled_dot_product_attention`` with the GQA
heads repeated (transformers' ``repeat_kv`` order) and a boolean mask from the lengths:
random shapes (odd D, S_max, head groups), lengths 1 and S_max, on the calling-thread kernel and split into several
chunks and one, NaN/Inf in live and in dead cache positions, a second call, output
independence, and one clear error per bad input. Tolerance: fp32 rounding of the
softmax-weighted sum in another order: |out - ref| <= 1e-5 + 1e-5·|ref|, elementwise."""
import pytest
import torch

from opencann.ops.kernels import decode_attention_cpu as dac
from opencann.ops.kernels.decode_attention_cpu import decode_attention


def _reference(q, k, v, lengths, scale=None):
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    keep = torch.arange(k.shape[2])[None, :] < lengths[:, None]          # [B, S_max]
    return torch.nn.functional.scaled_dot_product_attention(
        q, kk, vv, attn_mask=keep[:, None, None, :], scale=scale)


def _close(out, ref):
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    fin = torch.isfinite(ref)
    assert fin.any()
    assert ((out - ref).abs()[fin] <= 1e-5 + 1e-5 * ref.abs()[fin]).all()


def _path(monkeypatch, min_chunk):
    """"serial": the calling-thread kernel (every call of these sizes); an int: the split-KV
    kernels with chunks of at least that many keys (4: many chunks, the merge exercised)."""
    if min_chunk != "serial":
        monkeypatch.setattr(dac, "SERIAL_MAX", -1)
        monkeypatch.setattr(dac, "MIN_CHUNK", min_chunk)


def test_serial_and_split_kv_agree_to_rounding(monkeypatch):
    q, k, v, g = _inputs(2, 12, 4, 300, 64, 5)
    lengths = torch.tensor([300, 131])
    serial = decode_attention(q, k, v, lengths)
    monkeypatch.setattr(dac, "SERIAL_MAX", -1)
    monkeypatch.setattr(dac, "MIN_CHUNK", 16)
    split = decode_attention(q, k, v, lengths)
    torch.testing.assert_close(serial, split, rtol=1e-5, atol=1e-6)
    _close(serial, _reference(q, k, v, lengths))


def _inputs(b, hq, hkv, s, d, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, 1, d, generator=g), torch.randn(b, hkv, s, d, generator=g),
            torch.randn(b, hkv, s, d, generator=g), g)


@pytest.mark.parametrize("b,hq,hkv,s,d", [(1, 1, 1, 1, 8), (2, 12, 4, 200, 64), (3, 6, 3, 77, 13),
                                          (1, 4, 1, 1030, 32), (4, 2, 2, 9, 1), (2, 16, 2, 70, 128),
                                          (1, 5, 1, 33, 48)])
@pytest.mark.parametrize("min_chunk", [4, dac.MIN_CHUNK, "serial"])
def test_matches_sdpa_with_repeated_heads_and_length_mask(b, hq, hkv, s, d, min_chunk, monkeypatch):
    _path(monkeypatch, min_chunk)
    q, k, v, g = _inputs(b, hq, hkv, s, d, b * 100 + s + d)
    lengths = torch.randint(1, s + 1, (b,), generator=g)
    lengths[0] = s                                     # the full cache
    if b > 1:
        lengths[1] = 1                                 # a single live key
    out = decode_attention(q, k, v, lengths)
    _close(out, _reference(q, k, v, lengths))
    again = decode_attention(q, k, v, lengths)
    assert torch.equal(again, out)                     # a second call: same bits
    out.add_(1)                                        # the result is the caller's
    assert not torch.equal(again, out)
    assert torch.equal(decode_attention(q, k, v, lengths), again)


def test_scale_int32_lengths_strided_cache_and_out():
    q, k, v, g = _inputs(2, 8, 2, 50, 16, 7)
    lengths = torch.tensor([50, 23], dtype=torch.int32)
    _close(decode_attention(q, k, v, lengths, scale=0.3), _reference(q, k, v, lengths.long(), 0.3))
    kb = k.transpose(1, 2).contiguous().transpose(1, 2)     # a BSND cache seen as BNSD
    vb = v.transpose(1, 2).contiguous().transpose(1, 2)
    out = torch.empty(2, 8, 1, 16)
    assert decode_attention(q, kb, vb, lengths, out=out) is out
    _close(out, _reference(q, k, v, lengths.long()))


def test_length_zero_row_gives_zeros_like_sdpa():
    q, k, v, _ = _inputs(2, 2, 1, 10, 4, 3)
    lengths = torch.tensor([0, 10])
    out = decode_attention(q, k, v, lengths)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    _close(out[1:], _reference(q[1:], k[1:], v[1:], lengths[1:]))


@pytest.mark.parametrize("min_chunk", [4, dac.MIN_CHUNK, "serial"])
@pytest.mark.parametrize("d", [8, 64])     # 64: the register blocks (decode_attention_tile)
def test_nan_in_dead_positions_does_not_leak_and_in_live_ones_does(min_chunk, d, monkeypatch):
    _path(monkeypatch, min_chunk)
    q, k, v, _ = _inputs(3, 4, 2, 40, d, 11)
    lengths = torch.tensor([20, 40, 5])
    clean = decode_attention(q, k, v, lengths)
    kd, vd = k.clone(), v.clone()
    kd[0, :, 20:] = float("nan")                       # garbage past the live length
    vd[0, :, 25] = float("inf")
    kd[2, 1, 5:] = float("inf")
    vd[2, 0, 39] = float("nan")
    assert torch.equal(decode_attention(q, kd, vd, lengths), clean)
    # live positions: NaN/Inf reach the output as in eager SDPA
    kl, vl = k.clone(), v.clone()
    kl[0, 0, 3, 2] = float("nan")                      # NaN score: the group's rows are NaN
    vl[1, 1, 30, 5] = float("inf")                     # Inf value: Inf in that channel
    kl[2, 1, 4, 0] = float("inf")                      # an Inf score: NaN/Inf as eager's softmax
    out = decode_attention(q, kl, vl, lengths)
    ref = _reference(q, kl, vl, lengths)
    _close(out, ref)
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    assert torch.isnan(out[0, :2]).all() and not torch.isnan(out[0, 2:]).any()
    assert torch.isinf(out[1, 2:, 0, 5]).all()


@pytest.mark.parametrize("args,match", [
    (lambda q, k, v: (q[:, :, 0], k, v, torch.tensor([3, 3])), "BNSD"),
    (lambda q, k, v: (q[:, :3], k, v, torch.tensor([3, 3])), "multiple of Hkv"),
    (lambda q, k, v: (q.double(), k, v, torch.tensor([3, 3])), "float32"),
    (lambda q, k, v: (q, k, v, torch.tensor([3.0, 3.0])), "integer"),
    (lambda q, k, v: (q, k, v, torch.tensor([3, 9])), r"\[0, S_max=8\]"),
    (lambda q, k, v: (q, k, v, torch.tensor([-1, 2])), "S_max"),
])
def test_bad_input_is_one_clear_error(args, match):
    q, k, v, _ = _inputs(2, 4, 2, 8, 4, 5)
    with pytest.raises(ValueError, match=match):
        decode_attention(*args(q, k, v))


def test_registered_op_binds_the_kernel_and_counts_the_cache_read():
    from opencann.ir import DataType, Graph, TensorDesc, TensorRef
    from opencann.ops import get_op
    g = Graph("decode")
    descs = [TensorDesc((2, 6, 1, 16), DataType.FLOAT), TensorDesc((2, 2, 30, 16), DataType.FLOAT),
             TensorDesc((2, 2, 30, 16), DataType.FLOAT), TensorDesc((2,), DataType.INT64)]
    ins = [g.add_input(d) for d in descs]
    node = g.create_node("DecodeAttention", ins,
                         {"query": TensorRef(0), "key": TensorRef(1), "value": TensorRef(2),
                          "lengths": TensorRef(3), "scale": None}, [descs[0]])
    op = get_op("DecodeAttention")
    cost = op.cost(node)
    assert cost.flops == 4 * 2 * 6 * 30 * 16
    assert cost.bytes == 4 * (2 * 6 * 16 * 2 + 2 * 2 * 2 * 30 * 16) + 2 * 8
    run = op.kernel_factory("cpu")(node, descs, [None] * 4)
    q, k, v, _ = _inputs(2, 6, 2, 30, 16, 21)
    lengths = torch.tensor([30, 17])
    _close(run(q, k, v, lengths), _reference(q, k, v, lengths))


def test_concurrent_calls_from_threads_agree():
    from concurrent.futures import ThreadPoolExecutor
    q, k, v, _ = _inputs(2, 4, 2, 300, 16, 31)
    lengths = torch.tensor([300, 129])
    want = decode_attention(q, k, v, lengths)
    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda _: decode_attention(q, k, v, lengths), range(8)))
    assert all(torch.equal(g, want) for g in got)
