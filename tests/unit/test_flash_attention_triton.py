"""Triton FlashAttention kernels checked against the float64 reference on CPU through
the Triton interpreter (no GPU in CI).

triton reads TRITON_INTERPRET when a kernel is decorated (``triton.jit`` checks
``knobs.runtime.interpret`` at decoration time), i.e. when ``triton_kernels`` is first
imported. To keep the setting out of the rest of the pytest process, the checks run in
one subprocess with the variable set; it prints the errors as JSON and the tests
assert on them. Relative error = max|a - b| / max|ref|.
"""
import json
import os
import subprocess
import sys

import pytest

from helpers import REPO

pytest.importorskip("triton")

CASES = [
    # name, B, H, Hk, Sq, Sk, D, causal, mask kind, dtype
    ("plain_tails", 1, 2, 2, 37, 53, 16, False, None, "float32"),
    ("gqa_causal_tl_bool", 2, 4, 2, 40, 29, 24, True, "bool", "float32"),
    ("mqa_causal_br_float", 1, 4, 1, 21, 45, 16, "bottom_right", "float", "float32"),
    ("br_sq_gt_sk_fully_masked", 1, 2, 1, 50, 20, 16, "bottom_right", None, "float32"),
    ("fp16", 1, 2, 1, 33, 33, 32, True, "float", "float16"),
]

SCRIPT = r"""
import json, sys, torch, zlib
from opencann.ops.flash_attention import flash_attention, attention_reference
from opencann.ops.flash_attention import triton_kernels  # noqa: F401 (interpreted)
cases = json.loads(sys.argv[1])
res = {}
for name, B, H, Hk, Sq, Sk, D, causal, mk, dt in cases:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) % 1000)
    dtype = getattr(torch, dt)
    q = torch.randn(B, H, Sq, D, generator=g).to(dtype)
    k = torch.randn(B, Hk, Sk, D, generator=g).to(dtype)
    v = torch.randn(B, Hk, Sk, D, generator=g).to(dtype)
    mask = None
    if mk == "bool":
        mask = torch.rand(1, H, Sq, Sk, generator=g) > 0.3
    elif mk == "float":
        mask = torch.randn(B, 1, 1, Sk, generator=g)
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = flash_attention(qq, kk, vv, attn_mask=mask, causal=causal, backend="triton", tiles=(16, 16))
    do = torch.randn(out.shape, generator=g).to(dtype)
    out.backward(do)
    rq, rk, rv = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(rq, rk, rv, attn_mask=mask, causal=causal)
    ref.backward(do.double())
    err = lambda a, b: ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    res[name] = {"out": err(out, ref), "dq": err(qq.grad, rq.grad), "dk": err(kk.grad, rk.grad),
                 "dv": err(vv.grad, rv.grad),
                 "nan": bool(torch.isnan(out).any() or torch.isnan(qq.grad).any()
                             or torch.isnan(kk.grad).any() or torch.isnan(vv.grad).any())}
print("RESULT" + json.dumps(res))
"""


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = str(REPO)
    p = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], env=env, cwd=root,
                       capture_output=True, text=True, timeout=600)
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT")]
    assert p.returncode == 0 and lines, f"triton interpreter run failed:\n{p.stdout}\n{p.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT"):])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_triton_matches_reference(results, case):
    r = results[case[0]]
    tol_o, tol_g = (1e-5, 1e-4) if case[-1] == "float32" else (1e-2, 1e-2)
    assert not r["nan"]
    assert r["out"] < tol_o, r
    for g in ("dq", "dk", "dv"):
        assert r[g] < tol_g, (g, r)
