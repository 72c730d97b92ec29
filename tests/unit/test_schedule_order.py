"""Memory-aware op order (schedule stage, `opencann.passes.schedule_order`): the planned
peak of live bytes (the memory plan's lower bound) is never above the capture order's,
strictly lower where capture order keeps a value alive needlessly, with eager's values;
the model of the plan agrees with `plan_memory`; the exact search agrees with brute
force; the option ``memory_aware_order=False`` keeps the capture order."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import opencann
from opencann.ir import DataType, Graph, TensorDesc, TensorRef
from opencann.passes import plan_memory
from opencann.passes.schedule_order import (PeakModel, dfs_order, exact_order, list_order,
                                            lower_bound, memory_aware_order, order_edges)

G = torch.Generator().manual_seed(0)
SHAPES = [(4, 8), (16, 8), (64, 8)]


class Branches(torch.nn.Module):
    """relu(x) is computed first in capture order and read last: it stays alive while
    the other branch holds two values (3 buffers); run that branch first: 2."""

    def forward(self, x):
        a = torch.relu(x)
        b = torch.sigmoid(x) * torch.tanh(x)
        return (a * b).sum(dim=1)


def _plan(cm):
    return cm.report.memory["lower_bound_bytes"], cm.report.memory["arena_bytes"]


def _schedule_note(cm):
    return next(p.note for p in cm.report.passes if p.name == "schedule")


def test_branches_peak_strictly_lower_with_eager_values():
    x = torch.randn(64, 64, generator=G)
    on = opencann.compile(Branches(), (x,))
    off = opencann.compile(Branches(), (x,), options={"memory_aware_order": False})
    s = 64 * 64 * 4
    assert _plan(off) == (3 * s, 3 * s)
    assert _plan(on) == (2 * s, 2 * s)
    assert f"{3 * s} -> {2 * s} B" in _schedule_note(on)
    assert [a["pass"] for a in on.report.applied if a["pass"] == "schedule"] == ["schedule"]
    first = None
    for _ in range(2):                       # a second call, NaN positions kept
        x = torch.randn(64, 64, generator=G)
        x[3, 5] = float("nan")
        out = on(x)
        torch.testing.assert_close(out, Branches()(x), equal_nan=True)
        assert torch.isnan(out[3])
        if first is None:
            first, kept = out, out.clone()
    torch.testing.assert_close(first, kept, equal_nan=True)   # results stay the caller's


def test_dynamic_shapes_get_the_order_per_concrete_shape():
    """The symbolic graph has no sizes: the order is searched at the first concrete shape
    planned (the example's) and kept for the others, whose lower bound is that order's."""
    x = torch.randn(8, 64, generator=G)
    kw = dict(dynamic_shapes={"x": {0: "batch"}}, dim_ranges={"batch": (1, 64)})
    on = opencann.compile(Branches(), (x,), **kw)
    off = opencann.compile(Branches(), (x,), options={"memory_aware_order": False}, **kw)
    assert _schedule_note(on) == "symbolic shapes: capture order"
    for b in (8, 16):                      # the example's plan and one built on a call
        x = torch.randn(b, 64, generator=G)
        torch.testing.assert_close(on(x), Branches()(x))
        off(x)
    peaks = [[p["lower_bound_bytes"] for p in cm.report.dynamic["plans"]] for cm in (on, off)]
    assert peaks == [[2 * 8 * 256, 2 * 16 * 256], [3 * 8 * 256, 3 * 16 * 256]]


def test_option_off_keeps_capture_order_and_is_validated():
    x = torch.randn(64, 64, generator=G)
    off = opencann.compile(Branches(), (x,), options={"memory_aware_order": False})
    assert [n.name for n in off.graph.nodes] == ["relu", "sigmoid", "tanh", "mul", "mul_1", "sum_1"]
    assert _schedule_note(off) == ""
    with pytest.raises(ValueError, match="memory_aware_order.*True or False"):
        opencann.compile(Branches(), (x,), options={"memory_aware_order": "yes"})


def test_nothing_better_keeps_capture_order():
    """A chain has one order: the note says so and the graph is untouched."""
    x = torch.randn(8, 8, generator=G)
    cm = opencann.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                              torch.nn.Linear(8, 8)), (x,))
    assert "capture order" in _schedule_note(cm)
    assert not [a for a in cm.report.applied if a["pass"] == "schedule"]


class RandomBranches(torch.nn.Module):
    """As `Branches`, with a random op in each branch: running the second branch first
    lowers the peak, but its randn_like must still draw after rand_like."""

    def forward(self, x):
        a = torch.rand_like(x) + x
        c = torch.sigmoid(x) * torch.tanh(x) * torch.randn_like(x)
        return (a * c).sum(1)


def test_random_nodes_keep_their_order_and_eagers_values():
    x = torch.randn(64, 64, generator=G)
    cm = opencann.compile(RandomBranches(), (x,))
    names = [n.name for n in cm.graph.nodes]
    assert names.index("rand_like") < names.index("randn_like")
    assert names[0] != "rand_like"                         # reordered nonetheless
    assert "-> 32768 B" in _schedule_note(cm)
    for seed in (3, 4):                                    # a second call
        x = torch.randn(64, 64, generator=G)
        torch.manual_seed(seed)
        got = cm(x)
        torch.manual_seed(seed)
        torch.testing.assert_close(got, RandomBranches()(x))


class SmallNet(torch.nn.Module):
    """Residual CNN block plus a two-head attention-like branch: branchy, small."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3, padding=1)
        self.skip = torch.nn.Conv2d(4, 8, 1)
        self.q, self.k = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        y = torch.relu(self.c2(torch.relu(self.c1(x))) + self.skip(x))
        t = y.flatten(2).transpose(1, 2)
        att = torch.softmax(self.q(t) @ self.k(t).transpose(1, 2), -1)
        return att @ t, torch.sigmoid(y) * torch.tanh(y)


@pytest.mark.parametrize("copy_out", [False, True])
def test_small_models_never_above_capture_order(copy_out):
    x = torch.randn(2, 4, 8, 8, generator=G)
    m = SmallNet().eval()
    on = opencann.compile(m, (x,), options={"copy_out": copy_out})
    off = opencann.compile(m, (x,), options={"copy_out": copy_out, "memory_aware_order": False})
    assert _plan(on)[0] <= _plan(off)[0] and _plan(on)[1] <= _plan(off)[1]
    for _ in range(2):
        x = torch.randn(2, 4, 8, 8, generator=G)
        for got, want in zip(on(x), m(x)):
            torch.testing.assert_close(got, want)


@pytest.mark.heavy
@pytest.mark.parametrize("name,kw", [("minilm", {"seq": 16}),
                                     pytest.param("bert-base", {"seq": 16}, marks=pytest.mark.full),
                                     pytest.param("gpt2", {"seq": 16}, marks=pytest.mark.full),
                                     pytest.param("resnet50", {"size": 64}, marks=pytest.mark.full)])
def test_zoo_never_above_capture_order(name, kw):
    from opencann import zoo
    zm = zoo.get(name, **kw)
    on = opencann.compile(zm.model, zm.example_inputs, options={"copy_out": True})
    off = opencann.compile(zm.model, zm.example_inputs,
                           options={"copy_out": True, "memory_aware_order": False})
    assert _plan(on)[0] <= _plan(off)[0] and _plan(on)[1] <= _plan(off)[1]


# ---- random small DAGs: the model is the plan's figure; exact search = brute force ----

@st.composite
def dags(draw, max_nodes=7):
    """An IR graph of elementwise nodes (unary/binary, output shapes drawn from SHAPES so
    buffers differ in size; in place only where shapes match) and graph outputs."""
    n = draw(st.integers(1, max_nodes))
    g = Graph("dag")
    vals = [g.add_input(TensorDesc(SHAPES[0], DataType.FLOAT), "x")]
    for i in range(n):
        binary = draw(st.booleans()) and len(vals) > 1
        ins = draw(st.lists(st.sampled_from(vals), min_size=2 if binary else 1,
                            max_size=2 if binary else 1, unique=True))
        op = draw(st.sampled_from(["Add", "Mul"] if binary else ["Relu", "Sigmoid", "Neg"]))
        shape = draw(st.sampled_from([ins[0].desc.shape] + SHAPES))
        attrs = {"self": TensorRef(0), **({"other": TensorRef(1)} if binary else {})}
        vals.append(g.create_node(op, ins, attrs, [TensorDesc(shape, DataType.FLOAT)],
                                  f"n{i}").output)
    outs = draw(st.lists(st.sampled_from(vals[1:]), min_size=1, max_size=3, unique=True))
    g.outputs = outs
    # some nodes write in place into input 0 (as ConvAddAct does), where they are its
    # last reader in capture order: every other reader must stay ahead of them
    nodes = list(g.nodes)
    for k, n in enumerate(nodes):
        x = n.inputs[0]
        if (draw(st.booleans()) and x.producer is not None and x not in outs
                and "inplace_input" not in x.producer.attrs
                and x.desc.shape == n.output.desc.shape
                and all(nodes.index(u) <= k for u in x.users)):
            n.attrs["inplace_input"] = 0
    return g


def test_in_place_writers_order_edges():
    """x -> a = Relu(x); b = Neg(a); w = Sigmoid(a) writing into a; out = w * b: Neg
    must run before the writer although it feeds the writer nothing."""
    g = Graph("writer")
    x = g.add_input(TensorDesc((4, 8), DataType.FLOAT), "x")
    one = {"self": TensorRef(0)}
    a = g.create_node("Relu", [x], one, [x.desc], "a").output
    w = g.create_node("Sigmoid", [a], {**one, "inplace_input": 0}, [x.desc], "w")
    b = g.create_node("Neg", [a], one, [x.desc], "b").output
    g.reorder([a.producer, b.producer, w])
    g.outputs = [g.create_node("Mul", [w.output, b], {**one, "other": TensorRef(1)},
                               [x.desc], "out").output]
    assert [(p.name, q.name) for p, q in order_edges(g)] == [("b", "w")]
    m = PeakModel(g)
    assert all(m.index[p] < m.index[w] for p in (a.producer, b.producer))
    assert {tuple(o) for o in _topo_orders(m)} == {(0, 1, 2, 3)}


def _topo_orders(m, done=(), seen=frozenset()):
    if len(done) == len(m.nodes):
        yield list(done)
        return
    for i in range(len(m.nodes)):
        if i not in seen and all(p in seen for p in m.preds[i]):
            yield from _topo_orders(m, done + (i,), seen | {i})


@settings(max_examples=60, deadline=None)
@given(dags(), st.randoms(use_true_random=False))
def test_model_is_the_plans_lower_bound_in_any_order(g, rnd):
    m = PeakModel(g)
    orders = list(_topo_orders(m))
    for order in [list(range(len(m.nodes))), rnd.choice(orders), list_order(m), dfs_order(m)]:
        g.reorder([m.nodes[i] for i in order])
        assert m.peak(order) == plan_memory(g).lower_bound
    g.reorder(m.nodes)


@settings(max_examples=80, deadline=None)
@given(dags())
def test_exact_search_agrees_with_brute_force(g):
    """The plan's own figure (`PeakModel.peak`, = `plan_memory`'s lower bound above),
    minimised over every topological order, is what the exact search returns."""
    m = PeakModel(g)
    best = min(m.peak(o) for o in _topo_orders(m))
    peak, order = exact_order(m, budget=10 ** 6)
    assert peak == best == m.peak(order)
    assert sorted(order) == list(range(len(m.nodes)))
    assert exact_order(m, bound=best, budget=10 ** 6) is None   # nothing below the optimum
    assert lower_bound(m) <= best


@settings(max_examples=60, deadline=None)
@given(dags())
def test_chosen_order_never_above_capture_order(g):
    capture = list(g.nodes)
    before = plan_memory(g)
    c = memory_aware_order(g)
    assert list(g.nodes) == capture                  # the graph is left in its order
    g.reorder(c.order)
    after = plan_memory(g)
    assert after.lower_bound <= before.lower_bound and after.arena_bytes <= before.arena_bytes
    assert (c.method == "capture") == (c.order == capture)
    if c.note:                                       # fewer than two nodes
        assert len(capture) < 2 and c.order == capture
    else:
        assert (c.before, c.after) == (before.lower_bound, after.lower_bound)
