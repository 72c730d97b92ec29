"""User rules and user ops (issue #16 item 4): ``opencann.register_fusion`` traces a
pattern and a replacement written as torch functions; ``opencann.register_op`` makes a
torch custom op an opencann op with a kernel per device and a cost. The rule fires (in
the report under its name), can be switched off (``disable``, fusion switch file), its
custom kernel runs and matches eager; a rule whose replacement breaks the graph is
stopped with one line naming it."""
import json

import pytest
import torch

import opencann
from opencann.ir import GraphError
from opencann.engine.options import read_fusion_switch

G = torch.Generator().manual_seed(0)
CALLS = {"cpu": 0}


@torch.library.custom_op("opencann_test::add_relu", mutates_args=())
def add_relu(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.relu(x + y)


def _add_relu_cpu(x, y):
    CALLS["cpu"] += 1
    return torch.relu(x + y)


opencann.register_op("TestAddRelu", add_relu, kernels={"cpu": _add_relu_cpu},
                     infer=lambda x, y: torch.empty_like(x), flops_per_elem=2)


class AddRelu(torch.nn.Module):
    def forward(self, a, b):
        return torch.relu(a + b) * 2.0


def _pattern(x, y):
    return torch.relu(x + y)


@pytest.fixture
def rule():
    r = opencann.register_fusion("user_add_relu", _pattern,
                                 lambda x, y: torch.ops.opencann_test.add_relu(x, y),
                                 (torch.randn(4), torch.randn(4)), section="UBFusion")
    yield r
    opencann.extend.unregister_fusion("user_add_relu")


def inputs():
    a, b = torch.randn(2, 5, generator=G), torch.randn(2, 5, generator=G)
    a[0, 0], b[1, 1] = float("nan"), float("inf")
    return a, b


def test_user_rule_fires_runs_the_custom_kernel_and_matches_eager(rule):
    a, b = inputs()
    cm = opencann.compile(AddRelu(), (a, b), options={"verify": True})
    assert [x["pass"] for x in cm.report.applied] == ["user_add_relu"]
    assert cm.report.op_counts_after.get("TestAddRelu") == 1
    assert "user_add_relu" in [p.name for p in cm.report.passes]
    before = CALLS["cpu"]
    for _ in range(2):
        torch.testing.assert_close(cm(a, b), AddRelu()(a, b), rtol=0, atol=0, equal_nan=True)
    assert CALLS["cpu"] == before + 2


def test_user_rule_is_switched_off_by_name_and_by_the_switch_file(rule, tmp_path):
    a, b = inputs()
    cm = opencann.compile(AddRelu(), (a, b), options={"disable": ["user_add_relu"]})
    assert "TestAddRelu" not in cm.report.op_counts_after
    sw = tmp_path / "sw.json"
    sw.write_text(json.dumps({"Switch": {"UBFusion": {"user_add_relu": "off"}}}))
    off, _ = read_fusion_switch(str(sw))
    assert off == ["user_add_relu"]
    sw.write_text(json.dumps({"Switch": {"UBFusion": {"ALL": "off"}}}))
    assert "user_add_relu" in read_fusion_switch(str(sw))[0]


def test_user_rule_does_not_apply_when_an_inner_value_is_read_elsewhere(rule):
    class Shared(torch.nn.Module):
        def forward(self, a, b):
            s = a + b
            return torch.relu(s), s * 3.0
    a, b = inputs()
    cm = opencann.compile(Shared(), (a, b))
    assert [(s["pass"], s["reason"]) for s in cm.report.skipped if s["pass"] == "user_add_relu"] \
        == [("user_add_relu", "%2 (Add) is read outside the pattern: fusing would compute it twice")]


def test_a_rule_that_breaks_the_graph_is_stopped_with_its_name():
    opencann.register_fusion("user_bad_dtype", _pattern, lambda x, y: torch.relu(x + y).half(),
                             (torch.randn(4), torch.randn(4)))
    try:
        with pytest.raises(GraphError) as e:
            opencann.compile(AddRelu(), inputs())
        msg = str(e.value)
        assert "\n" not in msg and "fusion rule 'user_bad_dtype'" in msg
        assert "float16[2, 5] where the pattern gave float32[2, 5]" in msg
    finally:
        opencann.extend.unregister_fusion("user_bad_dtype")


def test_a_rule_with_a_wrong_shape_is_stopped_with_its_name():
    opencann.register_fusion("user_bad_shape", _pattern, lambda x, y: torch.relu(x + y).sum(-1),
                             (torch.randn(4), torch.randn(4)))
    try:
        with pytest.raises(GraphError, match="fusion rule 'user_bad_shape' broke the graph"):
            opencann.compile(AddRelu(), inputs())
    finally:
        opencann.extend.unregister_fusion("user_bad_shape")


def test_register_fusion_refuses_bad_rules():
    with pytest.raises(ValueError, match="taken by a pass"):
        opencann.register_fusion("fuse_silu", _pattern, _pattern, (torch.randn(4), torch.randn(4)))
    with pytest.raises(ValueError, match="does not use input"):
        opencann.register_fusion("r", lambda x, y: torch.relu(x), _pattern,
                                 (torch.randn(4), torch.randn(4)))
    with pytest.raises(TypeError, match="not a torch op"):
        opencann.register_op("NotAnOp", lambda x: x)


class _MaxBoth(torch.nn.Module):
    def forward(self, x):
        v, i = torch.max(x, -1)
        return v * 2.0, i + 1


class _ArgMax(torch.nn.Module):
    def forward(self, x):
        return x.argmax(-1) + 1


def _special_rows():
    x = torch.randn(3, 5, generator=G)
    x[1, 2] = float("inf")
    return x


@pytest.mark.parametrize("pattern,replacement,model", [
    (lambda x: torch.max(x, -1)[1], lambda x: torch.argmax(x, -1), _MaxBoth()),   # pattern: output 1
    (lambda x: x.argmax(-1), lambda x: torch.max(x, -1)[1], _ArgMax()),            # replacement: output 1
], ids=["pattern_output_1", "replacement_output_1"])
def test_user_rule_on_a_second_output_replaces_that_output(pattern, replacement, model):
    """A rule whose pattern or replacement ends in output k > 0 of a multi-output op
    replaces that output (not output 0): compiled equals eager, twice, independent."""
    opencann.register_fusion("user_second_output", pattern, replacement, (torch.randn(3, 5),))
    try:
        x = _special_rows()
        cm = opencann.compile(model, (x,), options={"verify": True})
        assert [a for a in cm.report.applied if a["pass"] == "user_second_output"]
        for inp in (x, torch.randn(3, 5, generator=G)):
            first = cm(inp)
            keep = [t.clone() for t in (first if isinstance(first, tuple) else (first,))]
            want = model(inp)
            for g, w in zip(keep, want if isinstance(want, tuple) else (want,)):
                assert g.dtype == w.dtype and torch.equal(g, w)
            again = cm(inp)
            for g, k in zip(again if isinstance(again, tuple) else (again,), keep):
                assert torch.equal(g, k)
    finally:
        opencann.extend.unregister_fusion("user_second_output")


class _TimesTwoFloat(torch.nn.Module):
    def forward(self, x):
        return x * 2.0


class _PlusNegZero(torch.nn.Module):
    def forward(self, x):
        return x + (-0.0)


@pytest.mark.parametrize("pattern,replacement,model,x", [
    (lambda x: x * 2, lambda x: x + x, _TimesTwoFloat(), torch.arange(1, 5)),
    (lambda x: x + 0.0, lambda x: torch.relu(x) - torch.relu(-x) + 0.0, _PlusNegZero(),
     torch.tensor([-0.0, 1.5, -2.0])),
], ids=["int_literal_vs_float", "zero_vs_negative_zero"])
def test_user_rule_literals_match_only_the_same_type_and_sign(pattern, replacement, model, x):
    """Pattern literals equal graph literals only as the same type (2 ≠ 2.0: they promote
    differently) and the same sign of zero (x + 0.0 turns -0.0 into 0.0, x + -0.0 not)."""
    opencann.register_fusion("user_literal", pattern, replacement, (x,))
    try:
        cm = opencann.compile(model, (x,))
        assert not [a for a in cm.report.applied if a["pass"] == "user_literal"]
        for _ in range(2):
            got, want = cm(x), model(x)
            assert got.dtype == want.dtype and torch.equal(got, want)
            assert torch.equal(got.signbit(), want.signbit())
    finally:
        opencann.extend.unregister_fusion("user_literal")


def test_rules_registered_from_another_thread_while_compiling():
    """The rule table is read (a compile's pipeline) while another thread registers and
    unregisters rules: no 'dictionary changed size during iteration', one winner per name."""
    import threading

    from opencann.passes.fusion import user_rule
    pat = opencann.extend._trace(lambda x: torch.relu(x) * 3.0, (torch.randn(4),), "pattern")
    rules = [user_rule.FusionRule(f"user_thread_{i}", pat, pat) for i in range(40)]
    stop, errors = threading.Event(), []

    def churn():
        while not stop.is_set():
            for r in rules:
                user_rule.register_rule(r)
            for r in rules:
                user_rule.unregister_rule(r.name)

    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(2000):
            try:
                user_rule.user_passes()
            except RuntimeError as e:
                errors.append(str(e))
                break
    finally:
        stop.set()
        t.join()
    assert not errors
    wins = []

    def register_same():
        try:
            wins.append(user_rule.register_rule(rules[0]))
        except ValueError:
            pass
    threads = [threading.Thread(target=register_same) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    user_rule.unregister_rule(rules[0].name)
    assert len(wins) == 1


def test_a_rule_registered_twice_is_refused_and_unregistered_by_the_top_level_name():
    xs = (torch.randn(4), torch.randn(4))
    opencann.register_fusion("twice_rule", _pattern, _pattern, xs)
    try:
        with pytest.raises(ValueError, match=r"opencann.unregister_fusion\(name\)"):
            opencann.register_fusion("twice_rule", _pattern, _pattern, xs)
    finally:
        opencann.unregister_fusion("twice_rule")
    opencann.register_fusion("twice_rule", _pattern, _pattern, xs)   # the name is free again
    opencann.unregister_fusion("twice_rule")
    with pytest.raises(KeyError):
        opencann.unregister_fusion("twice_rule")
