"""How many threads one launch of an opencann numba kernel gets
(`opencann.ops.kernels.numba_cache.launch_threads`): torch's intra-op count, or the
calling thread alone below ATen's grain or on an oversubscribed host (other processes'
runnable threads, the host's running count less this process's own running threads,
plus the team exceed the CPUs). The count is recorded in numba's per-thread setting at each launch; results never
depend on it (the decode GEMV and DecodeAttention bit for bit at 1 and 2 threads, NaN/Inf
rows included, against eager to fp32 rounding), from several threads at once too while the
verdict flips."""
import threading

import numba
import pytest
import torch

from opencann.ops.kernels import numba_cache as nc
from opencann.ops.kernels.decode_attention_cpu import decode_attention
from opencann.ops.kernels.gemv_cpu import gemv, pack_weight

two_threads = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2,
                                 reason="needs numba's pool of 2 threads or more")


@pytest.fixture
def threads2():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@two_threads
def test_small_work_and_an_oversubscribed_host_run_on_the_calling_thread(threads2, monkeypatch):
    monkeypatch.setattr(nc, "oversubscribed", lambda: False)
    assert nc.launch_threads(nc.GRAIN - 1) == 1
    assert nc.launch_threads(nc.GRAIN) == 2
    monkeypatch.setattr(nc, "oversubscribed", lambda: True)
    assert nc.launch_threads(10 * nc.GRAIN) == 1
    monkeypatch.setattr(nc, "oversubscribed", lambda: False)
    torch.set_num_threads(1)
    assert nc.launch_threads(10 * nc.GRAIN) == 1
    torch.set_num_threads(2)
    with nc.launch(nc.GRAIN * 4):                 # the choice is numba's setting for this thread
        assert numba.get_num_threads() == 2
    with nc.launch(8):
        assert numba.get_num_threads() == 1


@pytest.fixture
def host(monkeypatch):
    """A 2-CPU host with a 2-thread team and no reading yet, whose clock and thread counts
    the test sets: ``host(now=..., run=...)`` returns the dict (``now``, ``run``, ``own``)
    that `oversubscribed` reads."""
    monkeypatch.setattr(nc, "_cpus", lambda: 2)
    monkeypatch.setattr(nc, "torch_threads", lambda: 2)
    for k, v in (("t", 0.0), ("others", None), ("verdict", False)):
        monkeypatch.setattr(nc._Load, k, v)
    clock = {"now": 0.0, "run": 0.0, "own": 2}
    monkeypatch.setattr(nc.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(nc, "runnable_threads", lambda: clock["run"])
    monkeypatch.setattr(nc, "own_running_threads", lambda: clock["own"])

    def start(now: float, run: float) -> dict:
        clock.update(now=now, run=run)
        return clock
    return start


def test_the_verdict_counts_other_processes_only(host, monkeypatch):
    """others = the host's runnable threads less this process's own running ones read at
    the same instant (an OpenMP worker spinning after a torch kernel is ours), averaged
    over LOAD_TAU_S; a team of T threads is refused when others + T > CPUs (+ 0.5)."""
    clock = host(now=100.0, run=2.0)
    assert nc.oversubscribed() is False           # the 2 running threads are our team
    assert nc._Load.others == 0.0
    clock.update(now=100.1, run=9.0)
    assert nc.oversubscribed() is False           # within LOAD_SAMPLE_S: the kept verdict
    for i in range(1, 40):                        # 7 other threads for 20 s: refused
        clock.update(now=100.0 + i * 0.5, run=9.0, own=2)
        nc.oversubscribed()
        if i == 2:                                # ... within a second
            assert nc._Load.verdict is True
    assert nc._Load.verdict is True and 6.5 < nc._Load.others <= 7.0
    for i in range(40, 80):                       # alone again, serial (1 busy thread)
        clock.update(now=100.0 + i * 0.5, run=1.0, own=1)
        nc.oversubscribed()
    assert nc._Load.verdict is False and abs(nc._Load.others) < 0.2   # 7·exp(-20 s / 5 s)
    clock.update(now=1000.0, run=1.0, own=None)   # no procfs for our own: the reader counts
    assert nc.oversubscribed() is False
    monkeypatch.setattr(nc, "runnable_threads", lambda: None)
    clock.update(now=2000.0)
    assert nc.oversubscribed() is False           # nothing to read: never refused


def test_one_stray_runnable_thread_at_the_first_reading_is_no_load(host):
    """A fresh process's first reading weighs as one sample of the average, not as the
    average: one other runnable thread caught at that instant (a worker of ours changing
    state between the two reads, a kernel thread) does not put the first seconds' kernels
    on one thread; the same thread staying runnable does, within the average's time."""
    clock = host(now=50.0, run=3.0)
    assert nc.oversubscribed() is False and nc._Load.others < 0.1
    for i in range(1, 8):                          # then quiet: never refused
        clock.update(now=50.0 + i * 0.5, run=2.0)
        assert nc.oversubscribed() is False
    for i in range(8, 60):                         # one other thread for good: refused in time
        clock.update(now=50.0 + i * 0.5, run=3.0)
        nc.oversubscribed()
    assert nc._Load.verdict is True and nc._Load.others > 0.9


def test_own_running_threads_counts_the_reader():
    n = nc.own_running_threads()
    assert n is None or n >= 1


def test_runnable_threads_reads_the_host():
    n = nc.runnable_threads()
    assert n is None or n >= 1                    # this thread runs while it reads


def _eager_attention(q, k, v, lengths, scale):
    outs = []
    for b in range(q.shape[0]):
        n = int(lengths[b])
        rep = q.shape[1] // k.shape[1]
        kk = k[b:b + 1, :, :n].repeat_interleave(rep, 1)
        vv = v[b:b + 1, :, :n].repeat_interleave(rep, 1)
        outs.append(torch.nn.functional.scaled_dot_product_attention(q[b:b + 1], kk, vv, scale=scale))
    return torch.cat(outs)


def _same(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 300, generator=g)
    w = torch.randn(700, 300, generator=g)      # 4·300·700 elements: above the grain
    x[1, 7] = float("nan")
    x[2, 9] = float("inf")
    q = torch.randn(2, 8, 1, 64, generator=g)
    k = torch.randn(2, 2, 600, 64, generator=g)
    v = torch.randn(2, 2, 600, 64, generator=g)
    k[0, 1, 500] = float("inf")                 # a live +inf score: row 0's group 1 is NaN
    v[1, 0, 599] = float("nan")                 # past row 1's length: never read
    lengths = torch.tensor([517, 333])
    return x, w, q, k, v, lengths


@two_threads
def test_results_do_not_depend_on_the_launch_count(threads2, monkeypatch):
    x, w, q, k, v, lengths = _cases()
    w_nk = pack_weight(w)
    runs = {}
    for verdict in (False, True):
        monkeypatch.setattr(nc, "oversubscribed", lambda v=verdict: v)
        assert nc.launch_threads(x.numel() * 700) == (1 if verdict else 2)
        runs[verdict] = (gemv(x, w_nk), decode_attention(q, k, v, lengths, 0.125))
    for a, b in zip(runs[False], runs[True]):
        assert _same(a, b)
    y, att = runs[True]
    ref = torch.nn.functional.linear(x, w)
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
    fin = ref.isfinite()
    assert ((y - ref).abs()[fin].max() / ref.abs()[fin].max()).item() < 1e-5
    aref = _eager_attention(q, k, v, lengths, 0.125)
    assert torch.equal(att.isnan(), aref.isnan()) and att[0, 4:].isnan().all()
    torch.testing.assert_close(att.nan_to_num(), aref.nan_to_num(), rtol=1e-5, atol=1e-5)


@two_threads
def test_concurrent_launches_while_the_verdict_flips(threads2, monkeypatch):
    x, w, q, k, v, lengths = _cases()
    w_nk = pack_weight(w)
    monkeypatch.setattr(nc, "oversubscribed", lambda: False)
    want = (gemv(x, w_nk), decode_attention(q, k, v, lengths, 0.125))
    flips = iter(range(10 ** 6))
    monkeypatch.setattr(nc, "oversubscribed", lambda: next(flips) % 2 == 0)
    errors, got = [], []
    start = threading.Barrier(4)

    def work():
        try:
            start.wait()
            for _ in range(6):
                got.append((gemv(x, w_nk), decode_attention(q, k, v, lengths, 0.125)))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not errors and len(got) == 24
    assert all(_same(a, want[0]) and _same(b, want[1]) for a, b in got)


def test_starting_numba_keeps_the_callers_torch_thread_count():
    """numba's omp layer sets the calling thread's OpenMP count to its pool size when it
    starts; a fresh process that set torch.set_num_threads(1) keeps 1 through the first
    numba kernel (compile, bind and call of a Linear, whose GEMV is numba's) and the next
    eager op runs one-threaded."""
    import subprocess
    import sys
    code = ("import torch\ntorch.set_num_threads(1)\nimport opencann\n"
            "m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Softmax(-1)).eval()\n"
            "cm = opencann.compile(m, (torch.randn(1, 3),))\ncm(torch.randn(1, 3))\n"
            "print(torch.get_num_threads())\n")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("OMP_NUM_THREADS",)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "1", out.stdout
