"""Attempts to break `apply_rotary_pos_emb`'s span path (`_span_pair`, `_span_args`,
`_serial_pair_span`, the kernel-argument memo) against the eager formula, bit for bit (a NaN's sign aside where the module docstring
says so), and the faults they found: a strided ``out`` overlapping an input past its
element count, ``out=(tensor, None)``."""
import threading

import pytest
import torch
import torch.nn as nn

from opencann.ops.kernels import rotary_mul_cpu as R
from opencann.ops.kernels.rotary_mul_cpu import apply_rotary_pos_emb


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), -1)


def _eager(q, k, c, s):
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def _bits(a, b, canon_nan=False):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().contiguous().clone(), b.detach().contiguous().clone()
    if canon_nan:
        a[a.isnan()] = float("nan")
        b[b.isnan()] = float("nan")
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _fused(B, S, Nq, Nk, D, g):
    F = torch.randn(B, S, (Nq + 2 * Nk) * D, generator=g)
    q = F[..., :Nq * D].view(B, S, Nq, D).transpose(1, 2)
    k = F[..., Nq * D:(Nq + Nk) * D].view(B, S, Nk, D).transpose(1, 2)
    return F, q, k


@pytest.fixture
def span_calls(monkeypatch):
    n = [0]
    orig = R._serial_pair_span

    def spy(*a):
        n[0] += 1
        return orig(*a)
    monkeypatch.setattr(R, "_serial_pair_span", spy)
    return n


@pytest.mark.parametrize("cshape", ["S,D", "1,S,D", "1,1,S,D", "B,1,S,D", "mixed"])
def test_fused_views_cos_shapes_span_path(cshape, span_calls):
    g = torch.Generator().manual_seed(1)
    B, S = (2, 16) if cshape in ("B,1,S,D", "mixed") else (1, 32)
    F, q, k = _fused(B, S, 12, 4, 64, g)
    F.view(-1)[::97] = float("inf")
    c, s = torch.randn(B, 1, S, 64, generator=g), torch.randn(B, 1, S, 64, generator=g)
    if cshape == "S,D":
        c, s = c[0, 0], s[0, 0]
    elif cshape == "1,S,D":
        c, s = c[0], s[0]
    elif cshape == "1,1,S,D":
        c, s = c[:1], s[:1]
    elif cshape == "mixed":
        s = s[:1]
    for out in (None, (torch.empty(B, S, 12, 64).transpose(1, 2), torch.empty(B, S, 4, 64).transpose(1, 2))):
        got = apply_rotary_pos_emb(q, k, c, s, out=out, memo={})
        for y, e in zip(got, _eager(q, k, c, s)):
            assert _bits(y, e)
    assert span_calls[0] == 2


@pytest.mark.parametrize("case", ["cos_bcast_S", "cos_noncontig", "cos_transposed", "q_expanded",
                                  "D2", "S1_bigB"])
def test_odd_layouts_against_eager(case):
    g = torch.Generator().manual_seed(2)
    B, S, Nq, Nk, D = (1, 32, 12, 4, 64)
    if case == "D2":
        B, S, Nq, Nk, D = 1, 1024, 8, 4, 2
    if case == "S1_bigB":
        B, S, Nq, Nk, D = 256, 1, 4, 2, 16
    F, q, k = _fused(B, S, Nq, Nk, D, g)
    c, s = torch.randn(S, D, generator=g), torch.randn(S, D, generator=g)
    if case == "cos_bcast_S":
        c, s = c[:1][None, None], s[:1][None, None]
    elif case == "cos_noncontig":
        c, s = torch.randn(S, 2 * D, generator=g)[:, :D], torch.randn(S, 2 * D, generator=g)[:, D:]
    elif case == "cos_transposed":
        c, s = torch.randn(D, S, generator=g).t(), torch.randn(D, S, generator=g).t()
    elif case == "q_expanded":
        q = torch.randn(B, 1, S, D, generator=g).expand(B, Nq, S, D)
    elif case == "S1_bigB":
        c, s = torch.randn(B, 1, 1, D, generator=g), torch.randn(B, 1, 1, D, generator=g)
    got = apply_rotary_pos_emb(q, k, c, s)
    for y, e in zip(got, _eager(q, k, c, s)):
        assert _bits(y, e)


def test_in_place_out_and_memo_follow_new_values():
    g = torch.Generator().manual_seed(3)
    F, q, k = _fused(1, 32, 12, 4, 64, g)
    c, s = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
    e = _eager(q.clone(), k.clone(), c, s)
    got = apply_rotary_pos_emb(q, k, c, s, out=(q, k), memo={})
    assert got[0] is q and _bits(q, e[0]) and _bits(k, e[1])
    memo: dict = {}
    F, q, k = _fused(1, 32, 12, 4, 64, g)
    out = (torch.empty(1, 32, 12, 64).transpose(1, 2), torch.empty(1, 32, 4, 64).transpose(1, 2))
    F2, q2, k2 = _fused(1, 24, 12, 4, 64, g)
    out2 = (torch.empty(1, 12, 24, 64), torch.empty(1, 4, 24, 64))
    c2, s2 = torch.randn(24, 64, generator=g), torch.randn(24, 64, generator=g)
    for step in range(4):
        F.normal_(generator=g), c.normal_(generator=g), s.normal_(generator=g)
        args = (q, k, c, s, out) if step % 2 == 0 else (q2, k2, c2, s2, out2)
        got = apply_rotary_pos_emb(*args[:4], out=args[4], memo=memo)
        for y, e in zip(got, _eager(*args[:4])):
            assert _bits(y, e)


def test_shared_memo_two_threads():
    memo: dict = {}
    bad = [None, None]

    def work(idx):
        g = torch.Generator().manual_seed(10 + idx)
        S = 32 if idx == 0 else 28
        n = 0
        for _ in range(60):
            F, q, k = _fused(1, S, 12, 4, 64, g)
            c, s = torch.randn(S, 64, generator=g), torch.randn(S, 64, generator=g)
            out = (torch.empty(1, S, 12, 64).transpose(1, 2), torch.empty(1, S, 4, 64).transpose(1, 2))
            got = apply_rotary_pos_emb(q, k, c, s, out=out, memo=memo)
            n += not all(_bits(y, e) for y, e in zip(got, _eager(q, k, c, s)))
        bad[idx] = n
    ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert bad == [0, 0]


@pytest.mark.parametrize("dt", [torch.float64, torch.float16])
def test_other_dtypes_raise_clear_error(dt):
    g = torch.Generator().manual_seed(4)
    F, q, k = _fused(1, 32, 12, 4, 64, g)
    c, s = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
    for args in ((q.to(dt), k.to(dt), c, s), (q, k, c.to(dt), s.to(dt))):
        with pytest.raises(ValueError, match="float32"):
            apply_rotary_pos_emb(*args)


def test_graph_llama_rope_from_fused_qkv_is_eager_bits(span_calls):
    import opencann

    class Rope(nn.Module):
        def forward(self, y, cos, sin):
            B, S, _ = y.shape
            q, k, _v = y.split([768, 256, 256], -1)
            q = q.view(B, S, 12, 64).transpose(1, 2)
            k = k.view(B, S, 4, 64).transpose(1, 2)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    g = torch.Generator().manual_seed(5)
    m = Rope().eval()
    mk = lambda: (torch.randn(1, 32, 1280, generator=g), torch.randn(1, 32, 64, generator=g),  # noqa: E731
                  torch.randn(1, 32, 64, generator=g))
    cm = opencann.compile(m, mk())
    for _ in range(2):
        xs = mk()
        got = cm(*xs)
        with torch.no_grad():
            ref = m(*xs)
        for a, b in zip(got, ref):
            assert _bits(a, b)
    assert span_calls[0] == 2


# ---- faults found -------------------------------------------------------------------

def test_nan_partner_keeps_eager_positions_and_other_bits():
    """A NaN in the second half reaches its partner through the negation: NaN at eager's
    positions, every other bit eager's; only the NaN's sign is left to LLVM (module
    docstring: a + (-b)·s is compiled as a - b·s)."""
    q = torch.randn(1, 12, 32, 64)
    k = torch.randn(1, 4, 32, 64)
    q[0, 0, 0, 40] = float("nan")            # partner of d = 8 in the first half
    c, s = torch.randn(32, 64), torch.randn(32, 64)
    got = apply_rotary_pos_emb(q, k, c, s)
    ref = _eager(q, k, c, s)[0]
    assert torch.equal(got[0].isnan(), ref.isnan()) and got[0][0, 0, 0, 8].isnan()
    assert _bits(got[0], ref, canon_nan=True)


def test_strided_out_overlapping_input_beyond_numel():
    B, S, Nq, Nk, D = 1, 32, 12, 4, 64
    F = torch.randn(B, S, (Nq + 2 * Nk) * D)
    q = torch.randn(B, Nq, S, D)
    k = F[:, 20:21, :Nk * D].view(B, 1, Nk, D).transpose(1, 2).expand(B, Nk, S, D)
    c, s = torch.randn(S, D), torch.randn(S, D)
    e = _eager(q, k.clone(), c, s)
    out = (F[..., :Nq * D].view(B, S, Nq, D).transpose(1, 2), torch.empty(B, S, Nk, D).transpose(1, 2))
    got = apply_rotary_pos_emb(q, k, c, s, out=out)
    assert _bits(got[0], e[0]) and _bits(got[1], e[1])


def test_out_pair_with_none_is_value_error():
    q, k = torch.randn(1, 12, 32, 64), torch.randn(1, 4, 32, 64)
    c, s = torch.randn(32, 64), torch.randn(32, 64)
    with pytest.raises(ValueError, match=r"^apply_rotary_pos_emb: out must be a \(query, key\) "
                                         r"pair of tensors, got \['Tensor', None\]; pass both"):
        apply_rotary_pos_emb(q, k, c, s, out=(torch.empty(q.shape), None))
