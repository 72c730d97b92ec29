"""The `Schedule` artifact is read: memory planning and kernel binding follow the order
the schedule stage produced (`apply_schedule`), not the order the graph happened to be in.
A schedule that reverses two independent nodes gives a plan and an executor in that
order, with eager's values; a schedule that does not fit the graph is one clear error."""
import pytest
import torch

from opencann.engine import BindKernels, run_pipeline
from opencann.ir import DataType, Graph, Schedule, TensorDesc, TensorRef
from opencann.passes import MemoryPlanning, Pass, PassManager, SingleStreamSchedule

G = torch.Generator().manual_seed(0)


def _graph():
    """x → a = Relu(x), b = Sigmoid(x) (independent) → c = Mul(a, b) → d = Neg(c)."""
    g = Graph("two_branches")
    x = g.add_input(TensorDesc((4, 8), DataType.FLOAT), "x")

    def node(op, ins, name):
        attrs = {"self": TensorRef(0), **({"other": TensorRef(1)} if len(ins) == 2 else {})}
        return g.create_node(op, ins, attrs, [x.desc], name).output

    a, b = node("Relu", [x], "a"), node("Sigmoid", [x], "b")
    g.outputs = [node("Neg", [node("Mul", [a, b], "c")], "d")]
    return g


def _eager(x):
    return -(torch.relu(x) * torch.sigmoid(x))


class SwapTwo(Pass):
    """A schedule stage that swaps two nodes in the schedule only (the graph is left in
    its order): what follows must take the order from the artifact."""

    name, stage = "swap_schedule", "schedule"

    def __init__(self, first: str, second: str):
        self.pair = (first, second)

    def run(self, graph, ctx):
        order = [n.name for n in graph.nodes]
        i, j = (order.index(n) for n in self.pair)
        order[i], order[j] = order[j], order[i]
        ctx.artifacts["schedule"] = Schedule(order, {n: 0 for n in order})
        return 1


def _compile(*passes):
    g = _graph()
    ctx = run_pipeline(g, "cpu", None, None, PassManager([*passes, MemoryPlanning(), BindKernels()]))
    return g, ctx.artifacts["memory_plan"], ctx.artifacts["executor"]


def _step(plan, g, name):
    v = next(n for n in g.nodes if n.name == name).output
    return plan.buffers[plan.value_buffer[v.id]].start


def test_plan_and_executor_follow_a_schedule_that_reverses_two_independent_nodes():
    g0, plan0, _ = _compile(SingleStreamSchedule())
    assert [n.name for n in g0.nodes] == ["a", "b", "c", "d"]
    assert (_step(plan0, g0, "a"), _step(plan0, g0, "b")) == (0, 1)

    g, plan, ex = _compile(SwapTwo("a", "b"))
    assert [n.name for n in g.nodes] == ["b", "a", "c", "d"]          # the scheduled order
    assert (_step(plan, g, "b"), _step(plan, g, "a")) == (0, 1)        # planned in it
    ran = []
    outs = []
    for k in range(2):                                                 # a second call too
        x = torch.randn(4, 8, generator=G)
        x[1, 3] = float("nan")
        ran.clear()
        (y,) = ex.run_observed([x], lambda node, _: ran.append(node.name))
        assert ran == ["b", "a", "c", "d"]                             # bound in it
        (out,) = ex.run([x])
        torch.testing.assert_close(out, _eager(x), equal_nan=True)
        torch.testing.assert_close(y, _eager(x), equal_nan=True)
        assert torch.isnan(out[1, 3])
        outs.append((out, out.clone()))
    for out, kept in outs:                                             # outputs independent
        torch.testing.assert_close(out, kept, equal_nan=True)


def test_a_schedule_that_breaks_a_dependency_is_refused():
    with pytest.raises(ValueError, match=r"the schedule does not fit graph two_branches: order "
                                         r"puts c before b, which produces its input"):
        _compile(SwapTwo("b", "c"))


def test_a_stale_schedule_is_refused():
    class Stale(SwapTwo):
        def run(self, graph, ctx):
            ctx.artifacts["schedule"] = Schedule(["a", "b", "gone", "d"], {})
            return 0

    with pytest.raises(ValueError, match=r"the schedule names \['gone'\] that graph two_branches "
                                         r"does not have"):
        _compile(Stale("a", "b"))
