"""Audit: does each formula / kernel rewrite keep eager's NaN, ±inf and overflow?

For every fusion that replaces ops by a library kernel or one of ours, compile a small
model holding the pattern and compare the compiled result with eager on rows that hold
one special value (NaN, ±inf, ±3e38, ±1e13, ±1e20) at the head, the vector body or the
tail, plus rows of huge values (a whole row of ±3e38, two 3e38, a row of 1e20), in fp32
and bf16, alone and after a Linear, a second call included. Prints one line per case:
"ok" or the positions where compiled and eager differ in NaN-ness, inf-ness, the inf's
sign or (finite) value beyond rounding.

    PYTHONPATH=$PWD python bench/special_values_audit.py [name-substring ...]
"""
from __future__ import annotations

import math
import sys
import warnings

import torch
import torch.nn.functional as F

import opencann
from opencann.ops.parity.specials import NORM_SPECIALS

NAN, INF = float("nan"), float("inf")
D = 100                                  # 6 AVX-512 fp32 vectors and a tail of 4
SPECIALS = NORM_SPECIALS                 # the norm probes' values (opencann.ops.parity.specials)
PLACES = (0, 37, D - 1)


def _rows(d: int, seed: int):
    """(labels, [R, d] fp32): one special per row at each place, rows of huge values,
    clean rows."""
    g = torch.Generator().manual_seed(seed)
    out, labels = [], []
    for v in SPECIALS:
        for p in (0, d // 2 - 13, d - 1):
            r = torch.randn(d, generator=g)
            r[p] = v
            out.append(r)
            labels.append(f"{v:g}@{p}")
    for v in (3e38, -3e38, 1e20, 1e19):
        out.append(torch.full((d,), v) * (1 + 0.01 * torch.rand(d, generator=g)))
        labels.append(f"row of {v:g}")
    for pair in ((3e38, 3e38), (3e38, -3e38)):
        r = torch.randn(d, generator=g)
        r[[1, d - 2]] = torch.tensor(pair)
        out.append(r)
        labels.append(f"{pair[0]:g},{pair[1]:g}@1,{d - 2}")
    for _ in range(3):
        out.append(torch.randn(d, generator=g))
        labels.append("clean")
    return labels, torch.stack(out)


LABELS, _ = _rows(D, 0)


def rows(d: int = D, seed: int = 0) -> torch.Tensor:
    return _rows(d, seed)[1]


def diff(got: torch.Tensor, want: torch.Tensor) -> str:
    """'' when ``got`` has eager's NaN/inf positions and finite values within rounding of
    eager's (fp32 1e-4, bf16 4e-2 absolute + relative), else which input rows differ and
    how (first example per row)."""
    lowp = got.dtype != torch.float32
    got, want = got.float(), want.float()
    cls = (got.isnan() != want.isnan()) | (got.isinf() != want.isinf()) \
        | (want.isinf() & (got != want))
    tol = 4e-2 if lowp else 1e-4
    val = want.isfinite() & got.isfinite() & ((got - want).abs() > tol + tol * want.abs())
    out = []
    for what, bad in (("NaN/inf", cls), ("value", val)):
        if not bad.any():
            continue
        r = bad.reshape(bad.shape[0], -1).any(-1) if bad.dim() > 1 else bad
        ex = []
        for i in torch.nonzero(r).flatten()[:6].tolist():
            j = torch.nonzero(bad[i].reshape(-1))[0].item()
            w, gt = want[i].reshape(-1)[j].item(), got[i].reshape(-1)[j].item()
            lab = LABELS[i] if i < len(LABELS) and bad.shape[0] == len(LABELS) else f"row {i}"
            ex.append(f"{lab}: eager {w:.4g} got {gt:.4g}")
        out.append(f"{what} differs in {int(r.sum())} rows ({'; '.join(ex)})")
    return " | ".join(out)


# -- the patterns --------------------------------------------------------------------

class Pre(torch.nn.Module):
    """``body(pre(x))``, pre a Linear(D, D) or nothing."""

    def __init__(self, body, linear: bool, d: int = D):
        super().__init__()
        torch.manual_seed(0)
        self.pre = torch.nn.Linear(d, d) if linear else torch.nn.Identity()
        self.g = torch.nn.Parameter(1 + 0.1 * torch.randn(d))
        self.b = torch.nn.Parameter(0.1 * torch.randn(d))
        self.body = body

    def forward(self, x):
        return self.body(self, self.pre(x))


def ln_pow(m, x):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + 1e-5) * m.g + m.b


def ln_var(m, x):
    mu = x.mean(-1, keepdim=True)
    var = x.var(-1, keepdim=True, unbiased=False)
    return (x - mu) * torch.rsqrt(var + 1e-5)


def rms(m, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * m.g


def rms_llama(m, x):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return m.g * h.to(x.dtype)


def nn_layer_norm(m, x):       # for fuse_add_layer_norm: LayerNorm(x + x·0.5)
    return F.layer_norm(x + x * 0.5, (x.shape[-1],), m.g, m.b, 1e-5)


class Gated(torch.nn.Module):
    def __init__(self, spelled: bool, d: int = D):
        super().__init__()
        torch.manual_seed(0)
        self.w1 = torch.nn.Linear(d, 64, bias=False)
        self.w3 = torch.nn.Linear(d, 64, bias=False)
        self.spelled = spelled

    def forward(self, x):
        a = self.w1(x)
        s = a * torch.sigmoid(a) if self.spelled else F.silu(a)
        return s * self.w3(x)


class LinAct(torch.nn.Module):
    def __init__(self, act, d: int = D):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.act = torch.nn.Linear(d, 64), act

    def forward(self, x):
        return self.act(self.lin(x))


class QKV(torch.nn.Module):
    def __init__(self, d: int = D):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = (torch.nn.Linear(d, 32) for _ in range(3))

    def forward(self, x):
        return self.q(x) * 2, self.k(x) + 1, self.v(x)


class Attn(torch.nn.Module):
    """[R, D] rows seen as (1, heads, seq, hd): spelled-out or SDPA, with a float mask."""

    def __init__(self, sdpa: bool, linear: bool, d: int = D):
        super().__init__()
        torch.manual_seed(0)
        self.pre = torch.nn.Linear(d, d) if linear else torch.nn.Identity()
        self.sdpa = sdpa

    def forward(self, x, mask):
        x = self.pre(x)
        r = x.shape[0]
        q = x.reshape(1, 1, r, -1)[..., :50]
        k = x.reshape(1, 1, r, -1)[..., 50:]
        v = k * 0.5
        if self.sdpa:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).reshape(r, -1)
        s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(50)) + mask
        return (torch.softmax(s, -1) @ v).reshape(r, -1)


class ConvBN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4).eval()
        self.bn.running_var.uniform_(0.01, 0.1)    # γ/σ > 1: the fold scales the weights up
        self.bn.running_mean.normal_()

    def forward(self, x):
        return self.bn(self.conv(x))


class ConvAct(torch.nn.Module):
    def __init__(self, act, residual=False):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.act, self.residual = torch.nn.Conv2d(4, 4, 3, padding=1), act, residual

    def forward(self, x):
        y = self.conv(x)
        return self.act(y + x) if self.residual else self.act(y)


class ConvGeluConv(torch.nn.Module):
    """Conv → ·1e38 → GELU → Conv: layout_selection carries NHWC through the GELU, whose
    ATen kernel differs by layout on AVX-512 (eager's contiguous one overflows 1.7e38)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1, self.c2 = torch.nn.Conv2d(4, 4, 1), torch.nn.Conv2d(4, 4, 1)

    def forward(self, x):
        z = F.gelu(self.c1(x) * 1e38)
        return self.c2(z), z


class EW(torch.nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x)


def cases():
    """(name, model, args, options, pass names that should fire)."""
    x = rows()
    for lin in (False, True):
        tag = "after Linear" if lin else "alone"
        yield f"fuse_layer_norm (pow) {tag}", Pre(ln_pow, lin), (x,), {}, ["fuse_layer_norm"]
        yield f"fuse_layer_norm (var, rsqrt) {tag}", Pre(ln_var, lin), (x,), {}, ["fuse_layer_norm"]
        yield f"fuse_rms_norm {tag}", Pre(rms, lin), (x,), {}, ["fuse_rms_norm"]
        yield f"fuse_rms_norm (llama casts) {tag}", Pre(rms_llama, lin), (x,), {}, ["fuse_rms_norm"]
        yield (f"fuse_add_layer_norm {tag}", Pre(nn_layer_norm, lin), (x,),
               {"enable": ["fuse_add_layer_norm"]}, ["fuse_add_layer_norm"])
        mask = torch.zeros(x.shape[0], x.shape[0])
        mask[:, -3:] = -INF
        mask[5, 7] = INF
        mask[6, :] = -INF
        for sdpa in (False, True):
            yield (f"fuse_flash_attention ({'SDPA' if sdpa else 'spelled-out'}) {tag}",
                   Attn(sdpa, lin), (x, mask), {"enable": ["fuse_flash_attention"]},
                   ["fuse_flash_attention"])
    for spelled in (False, True):
        yield (f"fuse_gated_mlp ({'x*sigmoid(x)' if spelled else 'F.silu'})", Gated(spelled),
               (x,), {}, ["fuse_gated_mlp"])
    for name, act in (("relu", F.relu), ("gelu", F.gelu), ("gelu_tanh",
                      lambda t: F.gelu(t, approximate="tanh")), ("silu", F.silu),
                      ("tanh", torch.tanh), ("sigmoid", torch.sigmoid), ("none", lambda t: t)):
        yield f"fuse_linear_act ({name})", LinAct(act), (x,), {}, ["fuse_linear_act"]
    yield "fuse_qkv_linear", QKV(), (x,), {}, ["fuse_qkv_linear"]
    xc = rows(4 * 25).reshape(-1, 4, 5, 5)
    yield "fold_batchnorm", ConvBN(), (xc,), {}, ["fold_batchnorm"]
    for name, act in (("relu", F.relu), ("gelu", F.gelu), ("silu", F.silu), ("tanh", torch.tanh)):
        yield f"fuse_conv_act ({name})", ConvAct(act), (xc,), {}, ["fuse_conv_act"]
    xcl = xc.contiguous(memory_format=torch.channels_last)
    for name, act in (("gelu", F.gelu), ("silu", F.silu)):
        yield f"fuse_conv_act ({name}, channels-last input)", ConvAct(act), (xcl,), {}, \
            ["fuse_conv_act"]
    yield "fuse_conv_add_act (relu)", ConvAct(F.relu, True), (xc,), {}, ["fuse_conv_add_act"]
    xg = torch.randn(8, 4, 5, 5, generator=torch.Generator().manual_seed(2))
    yield "layout_selection (Conv, GELU of 1e38·y)", ConvGeluConv(), (xg,), {}, \
        ["layout_selection"]
    ew = {"enable": ["fuse_elementwise"],
          "disable": ["fuse_rms_norm", "fuse_layer_norm", "fuse_silu"]}
    yield "fuse_elementwise (x*sigmoid(x)+x*x)", EW(lambda t: t * torch.sigmoid(t) + t * t), \
        (x,), ew, ["fuse_elementwise"]
    yield "fuse_elementwise ((x*x).mean(-1))", EW(lambda t: (t * t + 1).mean(-1)), (x,), ew, \
        ["fuse_elementwise"]
    yield "fuse_elementwise ((x+1).sum(-1))", EW(lambda t: (t + 1).sum(-1)), (x,), ew, \
        ["fuse_elementwise"]


def run(name, m, args, options, passes, dtype):
    m = m.to(dtype).eval()
    args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = opencann.compile(m, args, options=dict(options))
    fired = sorted({a["pass"] for a in cm.report.applied} & set(passes))
    skipped = [s["reason"] for s in cm.report.skipped if s["pass"] in passes]
    with torch.no_grad():
        want = m(*args)
        got1 = cm(*args)
        got2 = cm(*args)
    want, got1, got2 = ((w,) if isinstance(w, torch.Tensor) else tuple(w)
                        for w in (want, got1, got2))
    msgs = [diff(g, w) for g, w in zip(got1 + got2, want + want)]
    msg = "; ".join(dict.fromkeys(x for x in msgs if x)) or "ok"
    state = "fired" if fired else ("skipped: " + (skipped[0][:110] if skipped else "?"))
    print(f"{name:48s} {str(dtype)[6:]:9s} [{state}] {msg}", flush=True)


def main(argv):
    for name, m, args, options, passes in cases():
        if argv and not any(a in name for a in argv):
            continue
        for dtype in (torch.float32, torch.bfloat16):
            try:
                run(name, m, args, options, passes, dtype)
            except Exception as e:  # noqa: BLE001 - an audit line, not a crash
                print(f"{name:48s} {str(dtype)[6:]:9s} ERROR {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:150]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
