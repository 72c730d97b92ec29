"""Mixed precision keeps the meaning of values a cast to fp16 / bf16 would change (#26
item 3): transformers' additive attention mask of ``finfo(float32).min`` (fully and
partly masked rows, through SDPA and through an explicit masked_fill + softmax), an
epsilon of 1e-12, a scale of 1e5 beyond fp16's range. Compared with eager fp32 within
the precision mode's tolerance, on cpu and vnpu, twice per model; the ops kept in fp32
are named in the precision pass's note."""
import pytest
import torch
import torch.nn.functional as F

import opencann

MODES = [("allow_mix_precision", 1e-2), ("allow_mix_precision_bf16", 4e-2)]
DEVICES = ["cpu", "vnpu"]
MIN32 = torch.finfo(torch.float32).min


class SdpaMasked(torch.nn.Module):
    """BERT-style self-attention with the extended mask transformers builds."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x, m):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        mask = (1.0 - m[:, None, None, :].to(x.dtype)) * MIN32
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class FillMasked(torch.nn.Module):
    """Scores masked with masked_fill(finfo.min), then softmax and a matmul."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(16, 16)

    def forward(self, x, m):
        s = self.q(x) @ x.transpose(1, 2)
        s = s.masked_fill(m[:, None, :] == 0, MIN32)
        return s.softmax(-1) @ x


class TinyEps(torch.nn.Module):
    """A sign-like normalisation whose epsilon (1e-12) is 0 in fp16; rows of zeros."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        with torch.no_grad():
            self.lin.weight[:4] = 0
            self.lin.bias[:4] = 0

    def forward(self, x, m):
        d = self.lin(x)
        return d / (d.abs() + 1e-12) + m.sum()


class BigScale(torch.nn.Module):
    """Multiplying by 1e5 (beyond fp16's 65504) and dividing back."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x, m):
        return self.lin(x) * 1e5 / 1e5 + m.sum()


def _inputs():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16)
    m = torch.ones(3, 5)
    m[1] = 0          # a fully masked sequence
    m[0, 3:] = 0      # a partly masked one
    return x, m


@pytest.mark.parametrize("model_cls", [SdpaMasked, FillMasked, TinyEps, BigScale])
@pytest.mark.parametrize("mode,tol", MODES)
@pytest.mark.parametrize("device", DEVICES)
def test_values_keep_their_meaning_under_mixed_precision(model_cls, mode, tol, device):
    torch.manual_seed(0)
    model = model_cls().eval()
    x, m = _inputs()
    ref = model(x, m)
    cm = opencann.compile(model, (x, m), device=device, options={"precision_mode": mode})
    for _ in range(2):
        out = cm(x, m)
        assert out.dtype == ref.dtype and out.shape == ref.shape
        assert torch.isfinite(out).all(), "a value lost its meaning in the cast"
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        assert err < tol, err


@pytest.mark.parametrize("model_cls,op", [(FillMasked, "overflows torch.float16 to -inf"), (TinyEps, "flushes to 0"),
                                          (BigScale, "overflows")])
def test_kept_ops_are_named_in_the_note(model_cls, op):
    x, m = _inputs()
    cm = opencann.compile(model_cls().eval(), (x, m), options={"precision_mode": "allow_mix_precision"})
    note = next(p.note for p in cm.report.passes if p.name == "precision")
    assert "kept in fp32" in note and op in note, note


def test_sdpa_mask_stays_fp32_while_attention_is_lowered():
    x, m = _inputs()
    cm = opencann.compile(SdpaMasked().eval(), (x, m), options={"precision_mode": "allow_mix_precision"})
    (att,) = [n for n in cm.graph.nodes if n.op == "ScaledDotProductAttention"]
    dts = [v.desc.dtype.value for v in att.inputs]
    assert dts[:3] == ["float16"] * 3 and dts[3] == "float32", dts
