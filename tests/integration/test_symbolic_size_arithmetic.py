"""torch.compile(backend="opencann") on models whose sizes come from float arithmetic on
input shapes (#26 item 5): ``F.interpolate(size=other.shape[-2:])`` (FPN / U-Net
decoders), ``scale_factor`` 0.5 / 1.5 / 2 / 3.7 in nearest, bilinear and bicubic modes,
``size=(H // 2, W // 2)``, a ViT position-embedding bicubic resize, slicing by
``int(W * 0.5)``, ``math.ceil``, ``min``/``max`` and powers of sizes, ceil-mode pooling,
narrow/split/view by computed sizes. Each model runs at three input sizes (the second
makes dynamo recompile with symbolic sizes, the third must reuse that graph), twice per
size, against eager PyTorch: values, NaN positions, output independence, the number of
compiles, and no graph run eagerly."""
import math

import pytest
import torch
import torch.nn.functional as F

import opencann  # noqa: F401  (registers the backend)
from opencann.dynamo import eager_fallbacks, recompiles


def _nan_input(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x.view(-1)[:: 7] = float("nan")   # NaN positions must follow eager's
    return x


class UpToOther(torch.nn.Module):
    """An FPN / U-Net decoder step: upsample the coarse map to the skip's size."""

    def __init__(self, mode):
        super().__init__()
        self.mode = mode

    def forward(self, x, skip):
        kw = {} if self.mode == "nearest" else {"align_corners": False}
        return F.interpolate(x, size=skip.shape[-2:], mode=self.mode, **kw) + skip


class Scale(torch.nn.Module):
    def __init__(self, factor, mode):
        super().__init__()
        self.factor, self.mode = factor, mode

    def forward(self, x):
        kw = {} if self.mode == "nearest" else {"align_corners": False}
        return F.interpolate(x, scale_factor=self.factor, mode=self.mode, **kw)


class Half(torch.nn.Module):
    def forward(self, x):
        h, w = x.shape[-2:]
        return F.interpolate(x, size=(h // 2, w // 2), mode="bilinear", align_corners=False)


class PosEmbed(torch.nn.Module):
    """ViT position embeddings resized (bicubic) to the patch grid of the input."""

    def __init__(self):
        super().__init__()
        self.pos = torch.nn.Parameter(torch.randn(1, 8, 4, 4))

    def forward(self, x):
        h, w = x.shape[-2:]
        return x + F.interpolate(self.pos, size=(h, w), mode="bicubic", align_corners=False)


class SliceHalf(torch.nn.Module):
    def forward(self, x):
        w = x.shape[-1]
        return x[..., : int(w * 0.5)] * 2


class SizeMath(torch.nn.Module):
    """Sizes from math.ceil of a true division, min/max of sizes and a power."""

    def forward(self, x):
        h, w = x.shape[-2:]
        a = x[..., : math.ceil(h / 3), : max(w // 2, min(h, 3))]
        k = int(math.sqrt(w) ** 2 / w * 2)   # 2, through floats
        return a.sum(-1, keepdim=True) + x[..., :k].sum(-1, keepdim=True)[..., : a.shape[-2], :]


class PoolCeil(torch.nn.Module):
    def forward(self, x):
        return F.max_pool2d(x, 3, 2, ceil_mode=True) + F.avg_pool2d(x, 3, 2, ceil_mode=True)


class SplitNarrow(torch.nn.Module):
    def forward(self, x):
        w = x.shape[-1]
        a, b = torch.split(x, [w // 3, w - w // 3], dim=-1)
        c = x.narrow(-2, 1, x.shape[-2] // 2)
        return a.sum(-1), b.amax(-1), c.mean(-2)


class ViewComputed(torch.nn.Module):
    def forward(self, x):
        n, c, h, w = x.shape
        y = x.reshape(n, c, -1)[..., : h * (w // 2)].view(n, c, h, w // 2)
        return y.reshape(n, c * h, w // 2).flatten(1)


def _two(s):
    return (_nan_input(1, 3, s // 2, s // 2), _nan_input(1, 3, s, s, seed=1))


def _one(s):
    return (_nan_input(1, 3, s, s),)


CASES = {
    **{f"to_other_{m}": (lambda m=m: UpToOther(m), _two) for m in ("nearest", "bilinear", "bicubic")},
    **{f"scale_{f}_{m}": (lambda f=f, m=m: Scale(f, m), _one)
       for f in (0.5, 1.5, 2, 3.7) for m in ("nearest", "bilinear", "bicubic")},
    "half": (Half, _one),
    "pos_embed": (PosEmbed, lambda s: (_nan_input(1, 8, s, s),)),
    "slice_int_w_half": (SliceHalf, _one),
    "size_math": (SizeMath, _one),
    "pool_ceil_mode": (PoolCeil, _one),
    "split_narrow": (SplitNarrow, _one),
    "view_computed": (ViewComputed, _one),
}
SIZES = (8, 13, 18)   # even, odd, even


def _check(eager, got):
    eager = eager if isinstance(eager, tuple) else (eager,)
    got = got if isinstance(got, tuple) else (got,)
    assert len(eager) == len(got)
    for e, g in zip(eager, got):
        assert g.shape == e.shape and g.dtype == e.dtype
        assert torch.equal(torch.isnan(g), torch.isnan(e)), "NaN positions differ from eager"
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, equal_nan=True)
    return got


@pytest.mark.parametrize("name", sorted(CASES))
def test_symbolic_size_arithmetic_matches_eager(name):
    make, inputs = CASES[name]
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make().eval()
    before, n0 = len(eager_fallbacks()), recompiles(model)["compiles"]   # counts are per code
    compiled = torch.compile(model, backend="opencann")
    with torch.no_grad():
        for s in SIZES:
            args = inputs(s)
            eager = model(*args)
            first = _check(eager, compiled(*args))
            kept = [t.clone() for t in first]
            _check(eager, compiled(*args))                   # a second call
            for k, t in zip(kept, first):                    # outputs are independent
                assert torch.equal(torch.isnan(k), torch.isnan(t))
                torch.testing.assert_close(k, t, equal_nan=True, rtol=0, atol=0)
    rec = recompiles(model)
    assert rec["compiles"] - n0 == 2, rec   # static, then one symbolic graph for all sizes
    assert rec["recompiles"][-1]["dynamic"], rec
    assert eager_fallbacks()[before:] == []
