"""Threads sharing one bound kernel (threads calling one compiled model share its bound
kernels): the memo of the last call's tensors and views (`bind_gemv`,
`bind_decode_attention_update`, `bind_add_rms_norm`) is read once per call, so a thread
that found its own tensors there runs its own views even when another thread's call
replaces the memo in between. The interleaving is forced (a trace runs the other
thread's whole call at the line that uses the memo); by chance it happened about once in
12000 calls of 4 threads with a 1 us switch interval, leaving the first thread's output
unwritten."""
import sys
import threading

import torch
from helpers import run_threads

from opencann.ir import DataType, TensorDesc
import opencann.ops.kernels.add_rms_norm_cpu as arn
import opencann.ops.kernels.decode_attention_cpu as dac
import opencann.ops.kernels.gemv_cpu as gc


def _line(module, text: str) -> int:
    lines = [i for i, line in enumerate(open(module.__file__), 1) if text in line]
    assert len(lines) == 1, (module.__name__, text, lines)
    return lines[0]


def _call_with_other_at(module, text: str, call, other) -> None:
    """``call()``, running ``other()`` to completion in a second thread when ``call``
    reaches the line of ``module`` containing ``text`` (inside a function ``run``)."""
    lineno, fired = _line(module, text), []

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == lineno and not fired:
            fired.append(1)
            t = threading.Thread(target=other)
            t.start()
            t.join()
        return local

    def glob(frame, event, arg):
        return local if (frame.f_code.co_filename == module.__file__
                         and frame.f_code.co_name == "run") else None
    sys.settrace(glob)
    try:
        call()
    finally:
        sys.settrace(None)
    assert fired, "the memo line was not reached: the second call did not take the memo"


def _same_bits(a, b):
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_gemv_runs_its_own_views_when_another_thread_replaces_the_memo():
    g = torch.Generator().manual_seed(0)
    run = gc.bind_gemv(torch.randn(16, 40, generator=g), 1)
    (xa, xb), (oa, ob) = (torch.randn(2, 1, 40, generator=g).unbind(0),
                          (torch.empty(1, 16), torch.empty(1, 16)))
    run(xa, None, oa)
    want_a = oa.clone()
    run(xb, None, ob)
    want_b = ob.clone()
    run(xa, None, oa)                  # the memo holds a's tensors
    oa.fill_(float("nan"))
    ob.fill_(float("nan"))
    _call_with_other_at(gc, "_call(m[4], m[5], lock)", lambda: run(xa, None, oa),
                        lambda: run(xb, None, ob))
    _same_bits(oa, want_a)
    _same_bits(ob, want_b)


def _decode_operands(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 1, 8, 8, generator=g),
            torch.randn(1, 1, 8, 8, generator=g), torch.randn(1, 1, 1, 8, generator=g),
            torch.randn(1, 1, 1, 8, generator=g), torch.tensor([3]), torch.tensor([4])]


def test_decode_attention_update_runs_its_own_views_when_another_thread_replaces_the_memo():
    F, I = DataType.FLOAT, DataType.INT64
    descs = [TensorDesc(s, F) for s in ((1, 2, 1, 8), (1, 1, 8, 8), (1, 1, 8, 8), (1, 1, 1, 8),
                                        (1, 1, 1, 8))] + [TensorDesc((1,), I)] * 2
    run = dac.bind_decode_attention_update(*descs, 0.5)
    a, b = _decode_operands(1), _decode_operands(2)
    oa, ob = torch.empty(1, 2, 1, 8), torch.empty(1, 2, 1, 8)
    run(*a, out=oa)
    want_a = oa.clone()
    run(*b, out=ob)
    want_b = ob.clone()
    run(*a, out=oa)
    oa.fill_(float("nan"))
    ob.fill_(float("nan"))
    _call_with_other_at(dac, "fn, args = m[2], m[3]", lambda: run(*a, out=oa),
                        lambda: run(*b, out=ob))
    _same_bits(oa, want_a)
    _same_bits(ob, want_b)


def test_add_rms_norm_runs_its_own_views_when_another_thread_replaces_the_memo():
    d = TensorDesc((1, 24), DataType.FLOAT)
    run = arn.bind_add_rms_norm(d, d, TensorDesc((24,), DataType.FLOAT), 1e-6)
    g = torch.Generator().manual_seed(3)
    a = [torch.randn(1, 24, generator=g), torch.randn(1, 24, generator=g), torch.rand(24, generator=g)]
    b = [torch.randn(1, 24, generator=g), torch.randn(1, 24, generator=g), a[2]]
    outs = {k: (torch.empty(1, 24), torch.empty(1, 24)) for k in "ab"}
    run(*a, out=outs["a"])
    want_a = [t.clone() for t in outs["a"]]
    run(*b, out=outs["b"])
    want_b = [t.clone() for t in outs["b"]]
    run(*a, out=outs["a"])
    for t in outs["a"] + outs["b"]:
        t.fill_(float("nan"))
    _call_with_other_at(arn, "m[6](*m[7])", lambda: run(*a, out=outs["a"]),
                        lambda: run(*b, out=outs["b"]))
    for got, want in zip(outs["a"] + outs["b"], want_a + want_b):
        _same_bits(got, want)


def test_threads_calling_one_bound_gemv_each_get_their_own_result():
    """Unforced: 4 threads x 300 calls over their own tensors with a short switch
    interval, every result its own (float64 reference)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(24, 48, generator=g)
    run = gc.bind_gemv(w, 2)
    bad = []

    def worker(i):
        x = torch.randn(2, 48, generator=torch.Generator().manual_seed(100 + i))
        out = torch.empty(2, 24)
        want = (x.double() @ w.double().T).float()
        for _ in range(300):
            out.fill_(float("nan"))
            run(x, None, out)
            if not torch.allclose(out, want, rtol=1e-5, atol=1e-5):
                bad.append(i)
    run_threads([(worker, (i,)) for i in range(4)])
    assert bad == []
