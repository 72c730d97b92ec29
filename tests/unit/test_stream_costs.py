"""Stream assignment by measured node times (issue #15, compile option ``stream_costs``).

`assign_streams` weighs nodes by given times (measured at binding by
`Executor.node_seconds`) instead of the FLOPs/bytes cost model: the same times always
give the same streams, a branch the cost model thinks cheap but that is slow gets a
stream of its own, and compiled models on 2 and 3 streams by measured times match eager
(NaN positions, a second call, independent outputs). No test asserts a time."""
import pytest
import torch

import opencann
from opencann.passes.memory_check import check_plan
from opencann.passes.schedule import assign_streams, node_costs, predict_streams

from integration.test_streams import D, SpecModel, _check_runs, _inputs


class FourBranches(torch.nn.Module):
    """Four independent one-node branches of x, joined by adds (and the first one)."""

    def forward(self, x):
        a, b, c, d = torch.sigmoid(x), torch.tanh(x), torch.exp(x), torch.neg(x)
        return (a + b) + (c + d), a


def _graph():
    cm = opencann.compile(FourBranches().eval(), (_inputs(1),),
                          options={"streams": 2, "stream_costs": "model"})
    return cm.graph


def _branch_nodes(g):
    """The four branch nodes (each reads only the input)."""
    return [n for n in g.nodes if all(v in g.inputs for v in n.inputs)]


def test_measured_times_balance_a_graph_the_cost_model_misjudges():
    g = _graph()
    branches = _branch_nodes(g)
    assert len(branches) == 4
    slow = branches[-1]  # last in order: the cost model sees four equal branches
    seconds = {n.name: 1e-5 for n in g.nodes}
    seconds.update({n.name: 1e-3 for n in branches})
    seconds[slow.name] = 3e-3
    streams = assign_streams(g, 2, seconds)
    others = {streams[n.name] for n in branches if n is not slow}
    assert len(others) == 1 and streams[slow.name] not in others  # 3 ms alone vs 3 x 1 ms
    busy, call = predict_streams(g, [streams[n.name] for n in g.nodes], node_costs(g, seconds))
    assert max(busy) < 3.2e-3 and call < 3.2e-3 < sum(busy)
    assert assign_streams(g, 2, dict(seconds)) == streams  # deterministic given the times
    assert assign_streams(g, 2, dict(reversed(list(seconds.items())))) == streams


def test_node_costs_take_given_times_and_fill_in_the_cost_model():
    g = _graph()
    first = g.nodes[0].name
    costs = node_costs(g, {first: 0.5})
    assert costs[0] == 0.5 and all(0 < c < 0.5 for c in costs[1:])
    assert node_costs(g) == node_costs(g, {})


def test_node_seconds_times_every_node_and_leaves_the_executor_as_it_was():
    m = FourBranches().eval()
    x = _inputs(2)
    cm = opencann.compile(m, (x,), options={"streams": 2, "stream_costs": "model"})
    ex = cm.executor
    threads = torch.get_num_threads()
    secs = ex.node_seconds([x], reps=2, threads=1)
    assert set(secs) == {n.name for n in cm.graph.nodes}
    assert all(s > 0 for s in secs.values())
    assert torch.get_num_threads() == threads
    _check_runs(lambda t: cm(t), m, 2)
    with pytest.raises(ValueError, match="reps must be >= 1"):
        ex.node_seconds([x], reps=0)


@pytest.mark.parametrize("streams", [2, 3])
def test_measured_streams_compile_report_and_match_eager(streams):
    spec = [("relu", 0, 0), ("mm", 0, 0), ("tanh", 2, 2), ("sigmoid", 0, 0), ("mul", 1, 4),
            ("mm", 3, 3), ("add", 5, 6), ("neg", 0, 0), ("sub", 7, 8)]
    model = SpecModel(spec, extra=(3,)).eval()
    cm = opencann.compile(model, (_inputs(5),), options={"streams": streams, "verify": True})
    st = cm.report.streams
    assert st["costs"] == "measured"
    assert len(st["predicted_busy_us"]) == st["streams"] == len(st["nodes_per_stream"])
    busy = st["predicted_busy_us"]
    assert max(busy) <= st["predicted_call_us"] + 0.1  # a stream ends after its own work
    assert sum(busy) == pytest.approx(st["estimated_serial_us"], abs=0.1 * len(busy))
    note = next(p.note for p in cm.report.passes if p.name == "bind_kernels")
    assert "by measured node times" in note
    check_plan(cm.graph, cm.plan)
    assert max(n.stream for n in cm.graph.nodes) + 1 == st["streams"]
    _check_runs(lambda t: cm(t), model, 5)


def test_measured_streams_keep_the_rng_state_and_the_thread_count():
    class Noisy(torch.nn.Module):
        def forward(self, x):
            return torch.sigmoid(x) + torch.rand_like(x) * 0, torch.tanh(x) * 2

    threads, after = torch.get_num_threads(), []
    for costs in ("model", "measured"):  # timing draws nothing (compiling itself may)
        torch.manual_seed(3)
        opencann.compile(Noisy().eval(), (torch.ones(3, D),),
                         options={"streams": 2, "stream_costs": costs})
        after.append(torch.get_rng_state())
    assert torch.equal(*after)
    assert torch.get_num_threads() == threads


def test_option_stream_costs_takes_measured_or_model():
    with pytest.raises(ValueError, match="option 'stream_costs' takes 'measured'"):
        opencann.compile(FourBranches(), (_inputs(0),), options={"streams": 2,
                                                                 "stream_costs": "fast"})
    cm = opencann.compile(FourBranches().eval(), (_inputs(0),),
                          options={"streams": 2, "stream_costs": "model"})
    assert cm.report.streams["costs"] == "model"
    assert "measured" not in next(p.note for p in cm.report.passes if p.name == "bind_kernels")


def test_the_calling_thread_runs_stream_0_and_gets_its_thread_count_back():
    """Stream 0 runs on the caller (one thread wake-up fewer per call) with the streams'
    intra-op thread count; an error there releases a stream waiting on its event, is the
    one raised, and the next call works."""
    import threading
    from opencann.runtime.streams import StreamRunner

    r = StreamRunner(2, nevents=1, nslots=2, threads_per_stream=1)
    seen, fail = {}, [True]

    def s0(inputs, slots):
        seen[0] = (threading.get_ident(), torch.get_num_threads())
        if fail[0]:
            raise ValueError("stream 0 failed")
        slots[0] = inputs[0] + 1
        r.events[0].set()

    def s1(inputs, slots):
        seen[1] = threading.get_ident()
        r.wait(0)
        slots[1] = slots[0] * 2

    r.fns = [s0, s1]
    before = torch.get_num_threads()
    with pytest.raises(ValueError, match="stream 0 failed"):
        r.run([torch.ones(2)])
    fail[0] = False
    slots = r.run([torch.ones(2)])
    torch.testing.assert_close(slots[1], torch.full((2,), 4.0))
    assert seen[0] == (threading.get_ident(), 1) and seen[1] != threading.get_ident()
    assert torch.get_num_threads() == before
