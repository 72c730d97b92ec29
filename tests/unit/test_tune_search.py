"""`opencann.tools.tune_search`'s steps on made-up timings (no compile): the timing step
keeps the fastest of fp32, the node's choice and one candidate higher (int8 -> bf16),
a lower one only when `TIME_MARGIN` faster, and the gate's own choice comes back when it
is `TIME_MARGIN` faster end to end; under a user metric the lowest candidate that can run
a node is given (never one whose ``applies`` refused it)."""
import pytest

from opencann.tools.tune import CANDIDATES, TIME_MARGIN, NodeChoice, _Search
from opencann.tools.tune_gate import Verdict

CANDS = [CANDIDATES[c] for c in ("fp32", "bf16", "int8")]


class FakeBuilder:
    """``node_times``: per node, the seconds of the precision ``options`` give it
    (``times[node][precision]``), as `_Builder.node_times` charges them."""

    def __init__(self, times, boundary=0.0):
        self.times, self.calls, self.boundary, self.raced = times, [], boundary, []

    def call_ms(self, options):
        """The sum of the nodes' times, plus ``boundary`` per node whose precision differs
        from the one before it (what a mix costs between nodes)."""
        per = options.get("node_precision") or {}
        ps = [per.get(n, "fp32") for n in self.times]
        return sum(self.times[n][p] for n, p in zip(self.times, ps)) \
            + self.boundary * sum(a != b for a, b in zip(ps, ps[1:]))

    def race(self, a, b):
        self.raced.append((dict(a.get("node_precision") or {}), dict(b.get("node_precision") or {})))
        return self.call_ms(a), self.call_ms(b)

    def node_times(self, options, names):
        per = options.get("node_precision") or {}
        self.calls.append(dict(per))
        return {n: self.times[n][per.get(n, "fp32")] for n in names}


def _search(times, own=None, boundary=0.0):
    nodes = {n: NodeChoice(n, "MatMulV2", own=dict((own or {}).get(n, {}))) for n in times}
    return _Search(None, (), nodes, CANDS, FakeBuilder(times, boundary))


@pytest.mark.parametrize("t, want", [
    ({"fp32": 10.0, "bf16": 5.0, "int8": 6.0}, "bf16"),     # int8 slower than bf16
    ({"fp32": 10.0, "bf16": 5.0, "int8": 4.9}, "bf16"),     # int8 not 5% under bf16
    ({"fp32": 10.0, "bf16": 5.0, "int8": 3.0}, "int8"),
    ({"fp32": 10.0, "bf16": 12.0, "int8": 9.0}, "int8"),    # bf16 slower than fp32, int8 not
    ({"fp32": 10.0, "bf16": 11.0, "int8": 9.8}, "fp32"),
])
def test_timing_keeps_the_fastest_of_fp32_the_choice_and_one_higher(t, want):
    s = _search({"a": t})
    s.by_gate(False)
    assert s.choice["a"] == "int8"
    s.drop_slow()
    assert s.choice["a"] == want
    assert s.nodes["a"].seconds == t   # every precision tried is reported
    why = s.nodes["a"].why
    if want == "int8":
        assert why == ""
    else:
        assert why.startswith("timing: int8") and f"{TIME_MARGIN:.0%} under {want}'s" in why, why


@pytest.mark.parametrize("missing, want, note", [
    ("fp32", "int8", "no time measured for it in fp32"),     # int8 5% under bf16: kept
    ("int8", "int8", "no time measured for it in int8"),     # its own choice unmeasured: kept
    ("bf16", "fp32", "no time measured for it in bf16"),     # int8 slower than fp32
])
def test_a_precision_with_no_measured_time_is_left_out_and_named(missing, want, note):
    """A node with nothing measured in a precision (no compiled node did its work) has no
    time there, not 0.0 s: that precision is left out of the comparison and the reason
    says so; a node whose own choice went unmeasured keeps it."""
    t = {"fp32": 10.0, "bf16": 5.0, "int8": 4.0} if want == "int8" else {"fp32": 10.0, "bf16": 5.0, "int8": 12.0}
    s = _search({"a": {**t, missing: None}, "b": {"fp32": 10.0, "bf16": 5.0, "int8": 4.0}})
    s.by_gate(False)
    s.drop_slow()
    assert s.choice == {"a": want, "b": "int8"}
    assert missing not in s.nodes["a"].seconds and all(v > 0 for v in s.nodes["a"].seconds.values())
    why = s.nodes["a"].why
    assert note in why and " 0.0 us" not in why, why
    assert (f"{want} kept" in why) == (want == "int8"), why
    assert s.nodes["b"].why == ""


def test_one_higher_skips_a_candidate_the_node_failed():
    """A node whose bf16 own error failed the gate goes from int8 to fp32, never bf16."""
    bad = Verdict(False, "error_ratio", "3% of elements above 0.01 relative error")
    s = _search({"a": {"fp32": 10.0, "bf16": 1.0, "int8": 12.0}}, own={"a": {"bf16": bad}})
    s.by_gate(False)
    assert s.next_higher("a") == "fp32"
    s.drop_slow()
    assert s.choice["a"] == "fp32" and "bf16" not in s.nodes["a"].seconds
    assert len(s.builder.calls) == 2   # no third compile: nothing to try between


def test_a_user_metric_gives_the_lowest_candidate_that_can_run_the_node():
    """With a user metric every node goes lowest, but not to a candidate whose ``applies``
    refused it (int8 of an attention: bf16), while a failed own error no longer holds."""
    cannot = Verdict(False, "applies", "int8 runs convolutions and linears only")
    failed = Verdict(False, "error_ratio", "3% of elements above 0.01 relative error")
    times = {"attn": {"fp32": 1.0, "bf16": 1.0, "int8": 1.0}, "fc": {"fp32": 1.0, "bf16": 1.0, "int8": 1.0}}
    s = _search(times, own={"attn": {"int8": cannot, "bf16": failed}, "fc": {"int8": failed}})
    s.by_gate(True)
    assert s.choice == {"attn": "bf16", "fc": "int8"}
    s2 = _search(times, own={"attn": {"int8": cannot, "bf16": failed}, "fc": {"int8": failed}})
    s2.by_gate(False)
    assert s2.choice == {"attn": "fp32", "fc": "bf16"}
    assert "int8 own error" in s2.nodes["attn"].why and "bf16 own error" in s2.nodes["attn"].why


@pytest.mark.parametrize("low_ms,high_ms,ok,moved", [
    (10.0, 9.0, True, True),       # bf16 10% faster end to end: the int8 nodes go to bf16
    (10.0, 9.8, True, False),      # not 5% faster: int8 stays
    (10.0, 9.0, False, False),     # faster but its outputs fail: int8 stays
])
def test_end_to_end_race_against_one_candidate_higher(monkeypatch, low_ms, high_ms, ok, moved):
    """`raise_lowest`: the int8 nodes moved to bf16 together and the two graphs raced; a
    bf16 node and an int8 node whose bf16 own error failed (next higher: fp32) stay."""
    import opencann.engine
    import opencann.tools.tune_search as t
    bad = Verdict(False, "cosine", "cosine 0.5 <= 0.99")
    s = _search({n: {"fp32": 1.0, "bf16": 1.0, "int8": 1.0} for n in "abc"}, own={"c": {"bf16": bad}})
    s.choice = {"a": "int8", "b": "bf16", "c": "int8"}
    s.compiled = "low graph"
    opts = []
    monkeypatch.setattr(opencann.engine, "compile_module", lambda m, a, d, o: opts.append(o) or "high graph")
    monkeypatch.setattr(t, "_race", lambda f, g: (low_ms, high_ms))
    monkeypatch.setattr(t, "_outputs_ok", lambda m, d, b, c, outs: (ok, "" if ok else "cosine"))
    s.builder.device = "cpu"
    s.raise_lowest([()], "msprobe", [])
    assert opts and {k: v for k, v in opts[0]["node_precision"].items() if v == "bf16"} == {"a": "bf16", "b": "bf16"}
    assert opts[0]["node_precision"].get("c") == "int8"     # its bf16 failed: not moved to fp32
    want = "bf16" if moved else "int8"
    assert s.choice == {"a": want, "b": "bf16", "c": "int8"}
    assert s.compiled == ("high graph" if moved else "low graph")
    assert ("end to end: int8 for 1 node(s) took 10.00 ms" in s.nodes["a"].why) == moved


def test_the_gates_choice_comes_back_when_the_timed_mix_is_slower_end_to_end():
    """Per node, b's bf16 looks 5% faster than its int8, but the mix pays for its
    boundaries: end to end all-int8 is faster, so it comes back with its reasons; with
    free boundaries the timed mix stays. The race runs only when timing changed the
    choice."""
    times = {"a": {"fp32": 10.0, "bf16": 5.0, "int8": 3.0},
             "b": {"fp32": 10.0, "bf16": 2.0, "int8": 3.0},
             "c": {"fp32": 10.0, "bf16": 5.0, "int8": 3.0}}
    s = _search(times, boundary=1.0)
    s.by_gate(False)
    s.drop_slow()
    assert s.choice == {"a": "int8", "b": "int8", "c": "int8"}
    assert [s.nodes[n].why for n in times] == ["", "", ""]
    assert s.builder.raced == [({"a": "int8", "b": "int8", "c": "int8"}, {"a": "int8", "b": "bf16", "c": "int8"})]
    free = _search(times, boundary=0.0)
    free.by_gate(False)
    free.drop_slow()
    assert free.choice == {"a": "int8", "b": "bf16", "c": "int8"}
    assert free.nodes["b"].why.startswith("timing: int8")
    same = _search({"a": times["a"]}, boundary=1.0)
    same.by_gate(False)
    same.drop_slow()
    assert same.choice == {"a": "int8"} and same.builder.raced == []


def test_race_runs_rounds_until_a_second_of_calls_and_keeps_the_least(monkeypatch):
    import opencann.tools.tune_search as ts
    clock = [0.0]
    monkeypatch.setattr(ts.time, "perf_counter", lambda: clock[0])
    calls = {"a": 0, "b": 0}

    def fn(name, ms):
        def run():
            calls[name] += 1
            clock[0] += ms[min(calls[name] - 1, len(ms) - 1)] / 1e3
        return run
    # 30 ms and 40 ms calls: 1 s of timed calls takes 15 rounds (more than the minimum of 5)
    a_ms, b_ms = ts._race(fn("a", [30.0, 30.0, 25.0, 30.0]), fn("b", [40.0, 41.0, 39.0, 40.0]))
    assert (a_ms, b_ms) == (pytest.approx(25.0), pytest.approx(39.0))
    assert calls["a"] == calls["b"] == 1 + 15          # a warm-up call each, then the rounds
    # slow calls: the minimum number of rounds; fast ones: at most END_TO_END_MAX_ROUNDS
    for ms, rounds in ((500.0, ts.END_TO_END_ROUNDS), (0.1, ts.END_TO_END_MAX_ROUNDS)):
        calls.update(a=0, b=0)
        ts._race(fn("a", [ms]), fn("b", [ms]))
        assert calls["a"] == calls["b"] == 1 + rounds
