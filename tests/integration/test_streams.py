"""Several streams (compile option ``streams``, issue #15): stream assignment with events,
the happens-before memory plan and its verifier, the concurrent runtime and its trace.

Random branchy models (a random spec of elementwise, matmul and view nodes) are run on
1, 2 and 3 streams as scheduled, and on random stream assignments of the same graph (any
assignment of a valid order is a valid schedule): every plan passes `check_plan` and
every result matches eager's, NaN positions included, on a second call too, with outputs
independent of each other and of the next call."""
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import opencann
from opencann.ir.liveness import HappensBefore
from opencann.ops import graph_happens_before
from opencann.passes.memory import plan_memory
from opencann.passes.memory_check import check_plan
from opencann.passes.schedule import multi_stream_schedule
from opencann.runtime import Executor, ExecutorPool
from opencann.runtime.executor import ExecutionError

D = 16
OPS = ("relu", "sigmoid", "tanh", "neg", "add", "mul", "sub", "mm", "tview")
BINARY = ("add", "mul", "sub")


class SpecModel(torch.nn.Module):
    """Node k applies ``spec[k] = (op, i, j)`` to earlier values (0 is the input, node
    k's result is value k + 1); returns the values no node reads, and ``extra``."""

    def __init__(self, spec, extra=()):
        super().__init__()
        self.spec, self.extra = spec, tuple(extra)
        g = torch.Generator().manual_seed(len(spec))
        self.w = torch.nn.Parameter(torch.randn(D, D, generator=g) / 4, requires_grad=False)

    def forward(self, x):
        vals = [x]
        for op, i, j in self.spec:
            a, b = vals[i], vals[j]
            if op == "mm":
                y = a @ self.w
            elif op == "tview":  # a view (transpose) read by a kernel
                y = (a.view(-1, 4, 4).transpose(1, 2) * 2).reshape(a.shape)
            elif op in BINARY:
                y = getattr(torch, op)(a, b)
            else:
                y = getattr(torch, op)(a)
            vals.append(y)
        used = {i for _, i, _ in self.spec} | {j for op, _, j in self.spec if op in BINARY}
        outs = [v for k, v in enumerate(vals[1:], 1) if k not in used]
        return tuple(outs) + tuple(vals[k] for k in self.extra if 0 < k < len(vals))


@st.composite
def specs(draw):
    n = draw(st.integers(3, 9))
    spec = []
    for k in range(n):
        op = draw(st.sampled_from(OPS))
        spec.append((op, draw(st.integers(0, k)), draw(st.integers(0, k))))
    extra = draw(st.lists(st.integers(1, n), max_size=2))
    return spec, extra


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, D, generator=g)
    x[x.abs() < 0.05] = 0.5                      # non-zero
    x[1, seed % D] = float("nan")
    return x


def _check_runs(run, model, seed):
    """Two calls with different inputs match eager (NaN positions too); the first call's
    outputs are unchanged by the second and share no memory with each other."""
    kept = []
    for k in range(2):
        x = _inputs(seed + k)
        want = model(x)
        want = (want,) if isinstance(want, torch.Tensor) else want
        got = run(x)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)
        kept.append((got, [g.clone() for g in got], want))
    got, copies, _ = kept[0]
    for g, c in zip(got, copies):
        torch.testing.assert_close(g, c, equal_nan=True, rtol=0, atol=0)
    ptrs = [g.untyped_storage().data_ptr() for g in got if g.numel()]
    eager_ptrs = [w.untyped_storage().data_ptr() for w in kept[0][2] if w.numel()]
    assert len(set(ptrs)) == len(set(eager_ptrs))


def _rebind(graph, streams):
    """Plan and bind ``graph`` with node k on ``streams[k]`` (any assignment of a valid
    order is a valid schedule); the plan must pass the verifier."""
    for n, s in zip(graph.nodes, streams):
        n.stream = s
    plan = plan_memory(graph)
    check_plan(graph, plan)
    return Executor(graph, plan), plan


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs(), st.lists(st.integers(0, 2), min_size=40, max_size=40), st.integers(0, 1000),
       st.lists(st.floats(1e-6, 1e-2), min_size=40, max_size=40))
def test_random_dags_on_1_2_3_streams_and_random_assignments_match_eager(spec_extra, assign, seed,
                                                                         times):
    """Streams by the cost model, by arbitrary node times (as measured ones may be) and
    by random assignment: every plan passes the verifier and every result matches."""
    spec, extra = spec_extra
    model = SpecModel(spec, extra).eval()
    cm = opencann.compile(model, (_inputs(seed),), options={"verify": True})
    check_plan(cm.graph, cm.plan)
    _check_runs(lambda x: cm(x), model, seed)
    g = cm.graph
    outs_of = lambda ex: (lambda x: ex.run([x]))  # noqa: E731
    for nstreams in (2, 3):
        for seconds in (None, {n.name: times[k % len(times)] for k, n in enumerate(g.nodes)}):
            multi_stream_schedule(g, nstreams, seconds)
            ex, _ = _rebind(g, [n.stream for n in g.nodes])
            _check_runs(outs_of(ex), model, seed)
    ex, _ = _rebind(g, [assign[k % len(assign)] for k in range(len(g.nodes))])
    _check_runs(outs_of(ex), model, seed)
    _check_runs(outs_of(ex.clone()), model, seed + 7)


def _branchy():
    """Four independent branches of elementwise work joined at the end."""
    class M(torch.nn.Module):
        def forward(self, x):
            a = torch.sigmoid(torch.relu(x) * 3)
            b = torch.tanh(x - 1) + 2
            c = torch.exp(-x.abs()) * x
            d = torch.neg(x) * torch.sigmoid(x)
            return (a + b) * (c - d), a
    return M().eval()


def test_compile_option_streams_schedules_branches_with_events_and_reports_them():
    x = _inputs(3)
    m = _branchy()
    cm1 = opencann.compile(m, (x,))
    cm2 = opencann.compile(m, (x,), options={"streams": 2, "verify": True,
                                             "stream_costs": "model"})  # deterministic
    st2 = cm2.report.streams
    assert st2["streams"] == 2 and sum(st2["nodes_per_stream"]) == len(cm2.graph.nodes)
    assert 0 < st2["events"] <= st2["cross_stream_dependences"]
    assert "streams: 2" in cm2.report.summary()
    assert "streams" not in cm1.report.to_dict() and "streams:" not in cm1.report.summary()
    check_plan(cm2.graph, cm2.plan)
    _check_runs(lambda t: cm2(t), m, 3)
    print(f"arena bytes: 1 stream {cm1.plan.arena_bytes}, 2 streams {cm2.plan.arena_bytes}")
    assert cm2.plan.arena_bytes >= cm1.plan.arena_bytes


def test_streams_1_generates_the_single_stream_code():
    x = _inputs(4)
    m = _branchy()
    a = opencann.compile(m, (x,))
    b = opencann.compile(m, (x,), options={"streams": 1})
    assert a.executor._src == b.executor._src
    assert "_go" not in a.executor._src and "def _run(inputs):" in a.executor._src
    assert all(n.stream == 0 for n in a.graph.nodes)
    assert a.report.to_dict().keys() == b.report.to_dict().keys()


def test_option_streams_takes_a_positive_int():
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="option 'streams' takes a positive int"):
            opencann.compile(_branchy(), (_inputs(0),), options={"streams": bad})


def test_events_are_the_transitive_reduction_over_stream_order():
    # step: 0 s0, 1 s1 <- 0, 2 s1 <- 0 (implied by 1's wait), 3 s0 <- 1, 2 (2 implies 1),
    # 4 s2 <- 0, 3 (3 implies 0), 5 s0 <- 4
    hb = HappensBefore([0, 1, 1, 0, 2, 0], [(0, 1), (0, 2), (1, 3), (2, 3), (0, 4), (3, 4), (4, 5)])
    assert hb.events == [(0, 1), (2, 3), (3, 4), (4, 5)]
    assert hb.before(0, 5) and hb.before(1, 4) and not hb.before(1, 2 - 2) and not hb.before(3, 3)
    assert not HappensBefore([0, 1], []).before(0, 1)       # no dependence: concurrent
    assert HappensBefore([0, 0], []).before(0, 1)           # one stream: the order
    with pytest.raises(ValueError, match="does not go forward"):
        HappensBefore([0, 1], [(1, 0)])


def _two_chains():
    """x → a1 = sin(x) → a2 = cat(a1, x) and x → b1 = cos(x) → b2 = cat(b1, x); out =
    a2 + b2. In this order on one stream, cos may take sin's bytes (sin is dead)."""
    class M(torch.nn.Module):
        def forward(self, x):
            a2 = torch.cat([torch.sin(x), x], 1)
            b2 = torch.cat([torch.cos(x), x], 1)
            return a2 + b2
    return M().eval()


def test_verifier_fails_on_a_plan_that_shares_bytes_between_streams():
    x = _inputs(5)
    m = _two_chains()
    cm = opencann.compile(m, (x,))
    g = cm.graph
    assert [n.op for n in g.nodes] == ["Sin", "ConcatD", "Cos", "ConcatD", "Add"]
    # a one-stream plan where cos takes sin's bytes (sin is dead by then): right on one
    # stream...
    plan1 = plan_memory(g)
    sin, cos = (plan1.buffers[plan1.value_buffer[g.nodes[k].output.id]] for k in (0, 2))
    assert sin.size == cos.size and sin.end < cos.start
    end = 0
    for b in plan1.buffers.values():   # every other buffer apart, cos on sin's bytes
        if b is not cos:
            b.offset, end = end, end + b.size
    cos.offset, plan1.arena_bytes = sin.offset, end
    check_plan(g, plan1)
    # ...wrong once the two chains run on two streams
    for k, n in enumerate(g.nodes):
        n.stream = 1 if k < 2 else 0
    with pytest.raises(ValueError, match=r"buffers %\d+ \(made by sin.*\(made by cos.*overlap "
                                         r"but may be live at the same time \(streams \[1\] and \[0\]\)"):
        check_plan(g, plan1)
    plan2 = plan_memory(g)       # planned for two streams: correct by construction
    check_plan(g, plan2)
    assert plan2.arena_bytes > plan1.arena_bytes
    ex = Executor(g, plan2)
    _check_runs(lambda t: ex.run([t]), m, 5)
    # and a plan made wrong by hand fails on one stream too
    for n in g.nodes:
        n.stream = 0
    plan = plan_memory(g)
    bs = sorted(plan.buffers.values(), key=lambda b: b.start)
    bs[-1].offset = bs[-2].offset = 0
    with pytest.raises(ValueError, match="overlap"):
        check_plan(g, plan)


def test_verifier_and_planner_on_an_in_place_write_beside_a_reader_on_another_stream():
    class M(torch.nn.Module):
        def forward(self, x):
            a = torch.sin(x)
            return torch.cos(a) * torch.exp(a)   # exp may overwrite a: cos read it before
    x = _inputs(9)
    m = M().eval()
    g = opencann.compile(m, (x,)).graph
    assert [n.op for n in g.nodes][:3] == ["Sin", "Cos", "Exp"]
    plan1 = plan_memory(g)
    assert [w for w, _ in plan1.inplace][:1] == ["exp"]   # one stream: exp in place into sin
    check_plan(g, plan1)
    g.nodes[1].stream = 1                                 # cos beside exp
    with pytest.raises(ValueError, match=r"exp \(stream 0\) writes in place into buffer %\d+ "
                                         r"while cos \(stream 1\) may still use it"):
        check_plan(g, plan1)
    plan2 = plan_memory(g)
    assert "exp" not in [w for w, _ in plan2.inplace]
    check_plan(g, plan2)
    ex = Executor(g, plan2)
    _check_runs(lambda t: ex.run([t]), m, 9)


def test_an_error_in_one_stream_names_the_node_and_the_next_call_works():
    x = _inputs(6)
    m = _branchy()
    cm = opencann.compile(m, (x,), options={"streams": 3})
    ex = cm.executor
    hb = graph_happens_before(cm.graph)
    assert hb.events
    victim = hb.events[0][0]                # a node other streams wait for
    name = f"K{victim}"
    kernel = ex._glb[name]

    def boom(*a, **k):
        raise RuntimeError("injected failure")
    ex._glb[name] = boom
    box = []
    t = threading.Thread(target=lambda: box.append(_catch(lambda: ex.run([x]))), daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "a stream waiting on the failed one deadlocked"
    node = cm.graph.nodes[victim]
    assert isinstance(box[0], ExecutionError)
    assert f"{node.name} ({node.op})" in str(box[0]) and "injected failure" in str(box[0])
    ex._glb[name] = kernel
    _check_runs(lambda t: ex.run([t]), m, 6)


def _catch(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None


def test_trace_has_one_track_per_stream_and_a_flow_arrow_per_event(tmp_path):
    x = _inputs(7)
    cm = opencann.compile(_branchy(), (x,), options={"streams": 3})
    events = cm.executor.profile([x], str(tmp_path / "t.json"))
    xs = [e for e in events if e["ph"] == "X"]
    nstreams = cm.report.streams["streams"]
    assert {e["tid"] for e in xs} == set(range(nstreams))
    assert len(xs) == len(cm.graph.nodes) and all(e["dur"] >= 0 for e in xs)
    names = [e for e in events if e["ph"] == "M"]
    assert [e["args"]["name"] for e in names] == [f"stream {k}" for k in range(nstreams)]
    s = [e for e in events if e["ph"] == "s"]
    f = [e for e in events if e["ph"] == "f"]
    assert len(s) == len(f) == cm.report.streams["events"] > 0
    assert all(a["id"] == b["id"] and a["tid"] != b["tid"] for a, b in zip(s, f))
    assert (tmp_path / "t.json").stat().st_size > 0


def test_streams_with_an_executor_pool_and_concurrent_calls():
    m = _branchy()
    cm = opencann.compile(m, (_inputs(8),), options={"streams": 2})
    pool = ExecutorPool(cm.executor.clone, size=3, first=cm.executor)
    errors = []

    def call(k):
        try:
            for r in range(3):
                x = _inputs(100 + 10 * k + r)
                for g, w in zip(pool.run([x]), m(x)):
                    torch.testing.assert_close(g, w, equal_nan=True)
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    ts = [threading.Thread(target=call, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors and pool.count <= 3


def test_a_saved_multi_stream_model_loads_with_its_streams_and_events(tmp_path):
    m = _branchy()
    cm = opencann.compile(m, (_inputs(10),), options={"streams": 2})
    opencann.save(cm, str(tmp_path / "m.ocm"))
    lm = opencann.load(str(tmp_path / "m.ocm"))
    assert [n.stream for n in lm.graph.nodes] == [n.stream for n in cm.graph.nodes]
    assert graph_happens_before(lm.graph).events == graph_happens_before(cm.graph).events
    assert "_go(inputs)" in lm.executor._src
    check_plan(lm.graph, lm.plan)
    _check_runs(lambda t: lm(t), m, 10)


def test_check_aliasing_and_observe_run_a_multi_stream_plan_in_order():
    m = _branchy()
    x = _inputs(11)
    cm = opencann.compile(m, (x,), options={"streams": 2, "check_aliasing": True})
    assert "_go" not in cm.executor._src
    _check_runs(lambda t: cm(t), m, 11)
    seen = []
    cm2 = opencann.compile(m, (x,), options={"streams": 2})
    cm2.executor.run_observed([x], lambda node, outs: seen.append(node.name))
    assert seen == [n.name for n in cm2.graph.nodes]


def test_a_write_in_place_waits_for_the_readers_of_the_old_contents():
    """A node declared to write into its input (``inplace_input``, as ConvAddAct) must
    come after every other reader of that memory: a dependence even without data flow."""
    from opencann.ir import DataType, Graph, TensorDesc, TensorRef
    from opencann.ops import ordering_deps
    g = Graph("war")
    x = g.add_input(TensorDesc((4,), DataType.FLOAT), "x")

    def node(op, ins, name, **attrs):
        return g.create_node(op, ins, {"self": TensorRef(0), **attrs}, [x.desc], name).output
    a = node("Relu", [x], "a")
    b = node("Sigmoid", [a], "b")            # reads a
    c = node("Neg", [a], "c", inplace_input=0)  # overwrites a
    g.outputs = [b, c]
    assert ordering_deps(g) == [(0, 1), (0, 2), (1, 2)]
    for n, s in zip(g.nodes, (0, 1, 0)):
        n.stream = s
    assert graph_happens_before(g).events == [(0, 1), (1, 2)]


def test_the_report_says_why_fewer_streams_than_asked():
    class Chain(torch.nn.Module):
        def forward(self, x):
            return torch.relu(torch.sin(x) * 2)
    cm = opencann.compile(Chain(), (_inputs(12),), options={"streams": 3})
    assert cm.report.streams["streams"] == 1 and cm.report.streams["events"] == 0
    note = next(p.note for p in cm.report.passes if p.name == "schedule")
    assert "1 streams of 3 asked: no more branches are worth a stream" in note


def test_dynamic_dims_on_two_streams_plan_each_shape_with_the_streams():
    m = _branchy()
    cm = opencann.compile(m, (torch.randn(4, D),), dynamic_shapes={"x": {0: "batch"}},
                          options={"streams": 2, "verify": True, "stream_costs": "model"})
    assert cm.report.streams["streams"] == 2
    for n in (3, 5):
        x = torch.randn(n, D)
        x[0, 1] = float("nan")
        for g, w in zip(cm(x), m(x)):
            torch.testing.assert_close(g, w, equal_nan=True)


@pytest.mark.parametrize("streams", [1, 2])
def test_verifier_accepts_views_wider_than_their_buffer(streams):
    """An expanded view spans more elements than its base's bytes (stride 0): it lives in
    its base's buffer and is not checked against that buffer's size (regression: a Llama
    config's repeat_kv failed `verify` with "%101 (1024 B) does not fit its buffer")."""
    class Expand(torch.nn.Module):
        def forward(self, x):
            y = torch.sigmoid(x)
            return y[:, None].expand(2, 4, 3, 5).clone() * 2, torch.tanh(x)

    torch.manual_seed(0)
    x = torch.randn(2, 3, 5)
    x[0, 1, 2] = float("nan")
    cm = opencann.compile(Expand(), (x,), options={"verify": True, "streams": streams,
                                                   "copy_out": True})
    check_plan(cm.graph, cm.plan)
    ref = Expand()(x)
    for _ in range(2):
        out = cm(x)
        for o, r in zip(out, ref):
            torch.testing.assert_close(o, r, equal_nan=True)
