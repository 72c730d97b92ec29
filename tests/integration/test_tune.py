"""opencann.tune: the msprobe gate on constructed errors, a layer that must stay fp32 kept
and named, a user metric, the choice kept through a model file, CANN keep_dtype /
modify_mixlist files through atc, per-node precision options, CLI one-liners."""
from __future__ import annotations

import json

import pytest
import torch

import opencann
from helpers import run_cli
from opencann.tools.compare import compare
from opencann.tools.tune import CANDIDATES, Candidate, tune
from opencann.tools.tune_gate import msprobe_gate

FACTORY = '''
import torch
class M(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.a = torch.nn.Linear(64, 64); s.b = torch.nn.Linear(64, 64); s.c = torch.nn.Linear(64, 16)
        with torch.no_grad():   # b's rows sum to zero: its input's offset of 1000 cancels
            s.b.weight -= s.b.weight.mean(dim=1, keepdim=True)
    def forward(s, x):
        h = torch.relu(s.a(x))
        return s.c(s.b(h * 0.5 + 1000.0))
def make():
    torch.manual_seed(0)
    return M().eval(), (torch.randn(16, 64),)
'''


def _factory(folder):
    p = folder / "m.py"
    p.write_text(FACTORY)
    ns: dict = {}
    exec(compile(FACTORY, str(p), "exec"), ns)
    model, inputs = ns["make"]()
    return str(p), model, inputs


@pytest.fixture
def factory(tmp_path):
    return _factory(tmp_path)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """(factory, ``tune(model, (x,), timing=False)``): one search shared by the tests that
    only read its result (each tune compiles every candidate's graph: ~2 s)."""
    fac = _factory(tmp_path_factory.mktemp("tuned"))
    _, model, (x,) = fac
    return fac, tune(model, (x,), timing=False)


# -- the gate ------------------------------------------------------------------------------
def test_gate_rules_on_constructed_errors():
    torch.manual_seed(0)
    e = torch.randn(1000) + 3.0
    # max abs error below 0.001 passes even with many relative errors
    v = msprobe_gate(e + 5e-4, e, torch.bfloat16)
    assert v.passed and v.rule == "max_abs"
    # cosine <= 0.99 fails first
    v = msprobe_gate(torch.randn(1000), e, torch.bfloat16)
    assert not v.passed and v.rule == "cosine" and "<= 0.99" in v.detail
    # 2% of elements 5% off: fails bf16's 1%-above-1% rule, high cosine
    a = e.clone()
    a[:20] *= 1.05
    v = msprobe_gate(a, e, torch.bfloat16)
    assert not v.passed and v.rule == "error_ratio" and v.cosine > 0.99
    # 0.5% of elements 5% off: passes bf16, fails fp32's 0.1%-above-0.1%
    a = e.clone()
    a[:5] *= 1.05
    assert msprobe_gate(a, e, torch.bfloat16).passed
    v = msprobe_gate(a, e, torch.float32)
    assert not v.passed and v.rule == "error_ratio"
    # NaN where eager has none fails
    a = e.clone()
    a[3] = float("nan")
    assert msprobe_gate(a, e, torch.bfloat16).rule == "nan_inf"
    # the error ratio is taken against the same-input reference when given
    assert msprobe_gate(a := e * 1.02, e, torch.bfloat16, same_input=a).passed


# -- the search ----------------------------------------------------------------------------
def test_layer_with_huge_inputs_is_kept_and_named(tuned):
    (_, model, (x,)), res = tuned
    assert res.precision["addmm_1"] == "fp32"            # b: its input's 1000 offset
    assert "own error: cosine" in res.kept["addmm_1"]
    assert res.precision["addmm_2"] == "bf16"            # c: an ordinary layer
    assert set(res.keep_dtype()) == {n for n, p in res.precision.items() if p == "fp32"}
    y = res.compiled(x)
    with torch.no_grad():
        ref = model(x)
    cos = torch.nn.functional.cosine_similarity(y.flatten().double(), ref.flatten().double(), 0)
    assert cos > 0.99 and y.dtype == torch.float32
    assert torch.equal(res.compiled(x), y)               # a second call
    assert res.compiled.report.precision["nodes"]["addmm_1"]["precision"] == "fp32"
    assert res.speedup > 0 and "kept addmm_1" in res.summary()


def test_deterministic_without_timing(tuned):
    (_, model, (x,)), a = tuned          # the default seed, searched a second time
    b = tune(model, (x,), timing=False)
    assert a.precision == b.precision and a.kept == b.kept


@pytest.mark.parametrize("answer, shown", [(0.5, "float"), (None, "NoneType"),
                                           (torch.ones(3, dtype=torch.bool), r"Tensor of shape \(3,\)")])
def test_a_metric_not_answering_a_bool_is_one_line(factory, answer, shown):
    """A score or a many-element tensor is no verdict: its truth would be an accident."""
    _, model, (x,) = factory

    def score(actual, expected):
        return answer
    with pytest.raises(TypeError, match=rf"^tune: the budget metric 'score' returned {shown}; "
                                        r"it must return a bool"):
        tune(model, (x,), budget=score, timing=False)


def test_a_metric_raising_keeps_its_error_and_says_where(factory):
    """The user's own exception comes through as raised (type, message, traceback), with
    a note naming the metric and the data item it was judging."""
    _, model, (x,) = factory

    def strict(actual, expected):
        raise KeyError("no such output")
    with pytest.raises(KeyError, match="no such output") as info:
        tune(model, (x,), data=[(x,), (x + 1,)], budget=strict, timing=False)
    assert info.value.__notes__ == ["tune: raised by the budget metric 'strict' judging data item 0 "
                                    "(a candidate's outputs against eager's); fix the metric or the data"]


@pytest.mark.parametrize("answer", [True, torch.tensor(True), torch.tensor([False])])
def test_bool_like_metric_answers_are_taken(factory, answer):
    _, model, (x,) = factory
    res = tune(model, (x,), budget=lambda a, e: answer, timing=False)
    assert set(res.precision.values()) == ({"bf16"} if bool(answer) else {"fp32"})


@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
def test_inputs_giving_no_finite_output_are_refused(factory, fill):
    """On NaN-only (or Inf-only) inputs every rule passes vacuously: tune and compare refuse
    them in one line instead of approving every lowering."""
    _, model, (x,) = factory
    bad = torch.full_like(x, fill)
    with pytest.raises(ValueError, match=r"^the model's eager outputs on these inputs have no finite "
                                         r"value \(output 0, \(16, 16\), is all NaN/Inf\)"):
        tune(model, (bad,), timing=False)
    with pytest.raises(ValueError, match=r"^the model's eager outputs on data item 1 have no finite value"):
        tune(model, (x,), data=[(x,), (bad,)], timing=False)
    with pytest.raises(ValueError, match=r"^the model's eager outputs on data item 1 have no finite value"):
        tune(model, (x,), data=[(x,), (bad,)], budget=lambda a, e: True, timing=False)  # a user metric
    with pytest.raises(ValueError, match=r"^the model's eager outputs on these inputs have no finite"):
        compare(model, (bad,), options={"precision_mode": "allow_mix_precision_bf16"})
    partly = x.clone()
    partly[0, 0] = float("nan")   # a NaN position among finite values is judged, not refused
    assert compare(model, (partly,)).outputs


def test_user_metric_replaces_the_gate(factory):
    _, model, (x,) = factory
    calls = []

    def always(actual, expected):
        calls.append(1)
        return True
    res = tune(model, (x,), budget=always, data=[(x,), (torch.randn(16, 64),)], timing=False)
    assert all(p == "bf16" for p in res.precision.values())   # the metric accepts all-low
    assert len(calls) == 2 and res.budget == "always"
    assert not res.nodes["addmm_1"].own["bf16"].passed        # own error still measured

    def strict(actual, expected):
        return bool((actual - expected).abs().max() < 1e-4)
    res = tune(model, (x,), budget=strict, timing=False)
    assert all(p == "fp32" for p in res.precision.values())
    assert all("outputs: strict rejected" in w for w in res.kept.values())


def test_candidate_interface_plugs_in_another_precision(factory):
    _, model, (x,) = factory
    seen = []

    def apply(options, nodes):
        seen.append(tuple(nodes))
        return CANDIDATES["bf16"].options(options, nodes)
    mine = Candidate("mine", torch.bfloat16, apply=apply, emulate=CANDIDATES["bf16"].emulate)
    res = tune(model, (x,), candidates=("fp32", "bf16", mine), timing=False)
    assert res.precision["addmm_2"] == "mine" and seen
    assert "mine own error" in res.kept["addmm_1"] and "bf16 own error" in res.kept["addmm_1"]


@pytest.mark.parametrize("kw, msg", [
    (dict(candidates="bf16"), "list of precisions"),
    (dict(candidates=("bf16", "fp32")), "must start with 'fp32'"),
    (dict(candidates=("fp32", "int4")), "unknown candidate precision 'int4'"),
    (dict(budget="cosine"), "budget takes 'msprobe' or a callable"),
    (dict(data=torch.randn(2)), "data takes a non-empty list"),
    (dict(time_budget_s=0), "time_budget_s takes a positive"),
    (dict(data=[(torch.randn(3, 4),)]), r"data item 0 is \(float32\[3, 4\]\) but example_inputs are "
                                         r"\(float32\[2, 4\]\)"),
])
def test_bad_arguments_are_one_line(kw, msg):
    with pytest.raises(ValueError, match=msg) as e:
        tune(torch.nn.Linear(4, 4), (torch.randn(2, 4),), **kw)
    assert "\n" not in str(e.value)


def test_a_model_that_is_no_module_is_one_line():
    with pytest.raises(TypeError, match="tune takes a torch.nn.Module, got function") as e:
        tune(lambda x: x * 2, (torch.randn(2, 4),))
    assert "\n" not in str(e.value)


# -- per-node options ----------------------------------------------------------------------
def test_unknown_node_name_lists_near_matches(factory):
    _, model, (x,) = factory
    with pytest.raises(ValueError, match=r"no node named 'addm_1'.*near matches: addmm_1") as e:
        opencann.compile(model, (x,), options={"keep_dtype": ["addm_1"]})
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="'node_precision': 'addmm' -> 'int3'"):
        opencann.compile(model, (x,), options={"node_precision": {"addmm": "int3"}})


def test_node_names_are_stable_and_keep_dtype_holds_a_node(factory):
    _, model, (x,) = factory
    a = opencann.compile(model, (x,), options={"precision_mode": "allow_mix_precision_bf16",
                                                "keep_dtype": ["addmm_1"]})
    b = opencann.compile(model, (x,), options={"node_precision": {"addmm": "bf16", "addmm_2": "bf16"}})
    dt = {n.name: n.outputs[0].desc.dtype.value for n in a.graph.nodes}
    assert dt["addmm_1_none"] == "float32" and dt["addmm_2_none"] == "bfloat16"
    assert [n.name for n in a.graph.nodes] == [n.name for n in b.graph.nodes]
    assert torch.equal(a(x), b(x))


# -- files ---------------------------------------------------------------------------------
def test_choice_survives_save_and_load(tuned, tmp_path):
    (_, model, (x,)), res = tuned
    path = str(tmp_path / "t.ocm")
    opencann.save(res.compiled, path)
    loaded = opencann.load(path)
    assert loaded.report.precision["nodes"]["addmm_1"]["why"] == res.kept["addmm_1"]
    assert torch.equal(loaded(x), res.compiled(x))


def test_keep_dtype_and_mixlist_round_trip_through_atc(tuned, tmp_path, capsys):
    (path, model, (x,)), res = tuned
    keep, mix = str(tmp_path / "keep.txt"), str(tmp_path / "mix.json")
    res.export(keep_dtype=keep, modify_mixlist=mix)
    assert open(keep).read().split() == res.keep_dtype()
    assert set(json.load(open(mix))) == {"black-list", "white-list"}
    out = str(tmp_path / "a.ocm")
    rc, stdout, err = run_cli(["atc", "--model", f"{path}:make", "--output", out,
                               "--precision_mode", "allow_mix_precision_bf16",
                               "--keep_dtype", keep, "--modify_mixlist", mix], capsys)
    assert rc == 0, err
    assert torch.equal(opencann.load(out)(x), res.compiled(x))
    # a mixlist keeping MatMulV2 in fp32 keeps every matmul
    (tmp_path / "black.json").write_text('{"black-list": {"to-add": ["MatMulV2"]}}')
    rc, _, err = run_cli(["atc", "--model", f"{path}:make", "--output", out, "--precision_mode",
                          "allow_mix_precision_bf16", "--modify_mixlist",
                          str(tmp_path / "black.json")], capsys)
    assert rc == 0, err
    g = opencann.load(out).graph
    assert all(n.outputs[0].desc.dtype.value == "float32" for n in g.nodes)


# -- command line --------------------------------------------------------------------------
@pytest.mark.parametrize("argv, msg", [
    (["tune", "m.onnx"], "tune takes a PyTorch model"),
    (["tune", "resnet50", "--budget", "cosine"], "--budget takes msprobe or file.py:metric"),
    (["tune", "resnet50", "--budget", "nope.py:f"], "nope.py does not exist"),
    (["tune", "nosuchzoo"], "unknown zoo model"),
    (["atc", "--model", "x.py:make", "--output", "o", "--precision_mode", "fp8"],
     "unknown precision_mode 'fp8'"),
    (["atc", "--model", "{p}:make", "--output", "o", "--keep_dtype", "missing.txt"],
     "--keep_dtype missing.txt: no such file"),
    (["atc", "--model", "{p}:make", "--output", "o", "--modify_mixlist", "{bad}"],
     "gray-list is not taken"),
])
def test_cli_bad_input_is_one_line(argv, msg, capsys, tmp_path, factory, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text('{"gray-list": {"to-add": ["Relu"]}}')
    argv = [a.format(p=factory[0], bad=bad) for a in argv]
    rc, _, err = run_cli(argv, capsys)
    assert rc == 2 and len(err) == 1 and msg in err[0], err


@pytest.mark.parametrize("body, msg", [
    ("return None", "the budget metric 'metric' returned NoneType; it must return a bool"),
    ("return 1 / 0", "--budget {m}:metric raised ZeroDivisionError: division by zero at {m}:2"),
])
def test_cli_tune_bad_user_metric_is_one_line(body, msg, factory, tmp_path, capsys):
    """A --budget metric that raises or answers no bool: one error line, not a traceback."""
    m = tmp_path / "metric.py"
    m.write_text(f"def metric(actual, expected):\n    {body}\n")
    rc, _, err = run_cli(["tune", f"{factory[0]}:make", "--no-timing", "--budget", f"{m}:metric"],
                         capsys)
    assert rc == 2 and len(err) == 1 and msg.format(m=m) in err[0], err


def test_cli_tune_writes_its_files(factory, tmp_path, capsys):
    path, model, (x,) = factory
    out, keep = str(tmp_path / "t.ocm"), str(tmp_path / "k.txt")
    rc, stdout, err = run_cli(["tune", f"{path}:make", "--no-timing", "--out", out,
                               "--keep-dtype-out", keep], capsys)
    assert rc == 0, err
    assert "addmm_1" in stdout and "own error" in stdout
    assert "addmm_1" in open(keep).read().split()
    assert opencann.load(out).report.precision["nodes"]["addmm_1"]["precision"] == "fp32"


def test_timing_step_charges_each_node_its_time(factory):
    _, model, (x,) = factory
    res = tune(model, (x,), reps=1)
    for n, c in res.nodes.items():
        assert c.seconds["fp32"] > 0, n
        if c.precision == "fp32" and c.why.startswith("timing"):
            assert c.seconds["bf16"] > 0 and "incl. casts" in c.why
    assert res.precision["addmm_1"] == "fp32"      # the gate's decision stands
    assert res.fp32_ms > 0 and res.tuned_ms > 0


class _Qkv(torch.nn.Module):
    """Three sibling Linears on one input (attention's Q, K and V: fusion merges them into
    one GEMM, whose time is charged to the first) and an output Linear."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(64, 64) for _ in range(3))
        self.o = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.o(torch.relu(self.q(x)) * self.k(x) + self.v(x))


def test_merged_siblings_are_decided_together_and_never_slower_than_fp32():
    torch.manual_seed(0)
    m = _Qkv().eval()
    x = torch.randn(32, 64)
    r = tune(m, x, time_budget_s=60)
    q, k, v = (n for n in r.nodes.values() if n.reads and n.reads == next(
        iter(r.nodes.values())).reads)
    assert q.precision == k.precision == v.precision, r.summary()
    assert r.tuned_ms <= r.fp32_ms or all(n.precision == "fp32" for n in r.nodes.values())
    torch.testing.assert_close(r.compiled(x), m(x), rtol=0.05, atol=0.05)


class _ResidualConv(torch.nn.Module):
    """conv-ReLU, then a residual conv: conv + add + relu, which fusion makes one
    ConvAddAct named ``convolution_1_1_add_relu`` (the residual conv is ``convolution_1``)."""

    def __init__(self):
        super().__init__()
        self.c, self.c2 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.c(x))
        return torch.relu(y + self.c2(y))


@pytest.mark.parametrize("candidates", [("fp32", "bf16"), ("fp32", "bf16", "int8")])
def test_a_residual_conv_is_charged_its_fused_nodes_time(candidates):
    """The ConvAddAct's time goes to the conv it was formed from (its record of the nodes it
    replaced, not its name): every precision timed for each conv has a time, and no reason
    compares with 0.0 us."""
    from opencann.tools.tune_search import _charge
    torch.manual_seed(0)
    m, x = _ResidualConv().eval(), torch.randn(2, 3, 16, 16)
    charged = _charge(opencann.compile(m, (x,)).graph, ["convolution", "convolution_1"])
    assert charged == {"convolution_relu": {"convolution": 1.0},
                       "convolution_1_1_add_relu": {"convolution_1": 1.0}}, charged
    res = tune(m, (x,), candidates=candidates, reps=1)
    for n in ("convolution", "convolution_1"):
        c = res.nodes[n]
        assert c.seconds.get("fp32", 0) > 0 and len(c.seconds) >= 2, (n, c.seconds)
        assert all(t > 0 for t in c.seconds.values()) and " 0.0 us" not in c.why, (n, c.why)
        assert "no time measured" not in c.why, c.why
    with torch.no_grad():
        ref = m(x)
    y = res.compiled(x)
    assert torch.nn.functional.cosine_similarity(y.flatten().double(), ref.flatten().double(), 0) > 0.99


def test_the_speedup_race_calls_both_models_alike(monkeypatch):
    """The race behind ``res.speedup`` (and the drop to all-fp32) calls the all-fp32 and the
    tuned compiled models the same way, ``CompiledModel.__call__`` with its call-time
    checks, the same number of times: neither side skips what the other pays."""
    import opencann.tools.tune_search as ts
    from opencann.engine.compiled_model import CompiledModel
    from opencann.runtime import Executor
    entered, depth = [], [0]

    def spy(cls, name):
        orig = getattr(cls, name)

        def wrapped(self, *a, **k):
            if depth[0] == 0:
                entered.append((name, id(self)))
            depth[0] += 1
            try:
                return orig(self, *a, **k)
            finally:
                depth[0] -= 1
        monkeypatch.setattr(cls, name, wrapped)
    spy(CompiledModel, "__call__")
    spy(Executor, "run")
    races, race = [], ts._race

    def recorded(a, b):
        calls = {0: [], 1: []}

        def side(i, fn):
            def run():
                entered.clear()
                fn()
                calls[i].append(entered[0])
            return run
        out = race(side(0, a), side(1, b))
        races.append(calls)
        return out
    monkeypatch.setattr(ts, "_race", recorded)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    x = torch.randn(16, 32)
    res = tune(m, x, reps=1)
    fp32, tuned = races[-1][0], races[-1][1]
    assert len(fp32) == len(tuned) > ts.END_TO_END_ROUNDS
    assert {e[0] for e in fp32} == {e[0] for e in tuned} == {"__call__"}, (fp32[:1], tuned[:1])
    assert len({e[1] for e in fp32}) == len({e[1] for e in tuned}) == 1 and fp32[0][1] != tuned[0][1]
    assert res.tuned_ms > 0 and res.speedup == pytest.approx(res.fp32_ms / res.tuned_ms)
    with torch.no_grad():
        torch.testing.assert_close(res.compiled(x), m(x), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("comments", [False, True])
def test_an_empty_keep_dtype_file_round_trips_through_atc(comments, tmp_path, capsys):
    """Every node lowered: tune's keep_dtype file holds no name (keep no node) and its
    mixlist keeps no op type in fp32; ``opencann atc`` takes both (blank and ``#`` lines
    too) and builds the tuned graph."""
    from opencann.tools.precision_files import read_keep_dtype, read_mixlist
    path = tmp_path / "lin.py"
    path.write_text("import torch\ndef make():\n    torch.manual_seed(0)\n    return torch.nn.Sequential("
                    "torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)).eval(), "
                    "(torch.randn(16, 64),)\n")
    ns: dict = {}
    exec(path.read_text(), ns)
    model, (x,) = ns["make"]()
    res = tune(model, (x,), timing=False)
    assert res.keep_dtype() == [] and set(res.precision.values()) == {"bf16"}, res.summary()
    keep, mix = str(tmp_path / "keep.txt"), str(tmp_path / "mix.json")
    res.export(keep_dtype=keep, modify_mixlist=mix)
    assert open(keep).read() == "" and read_keep_dtype(keep) == []
    assert read_mixlist(mix) == ([], ["MatMulV2"])
    if comments:
        (tmp_path / "keep.txt").write_text("# kept in fp32 by opencann tune: none\n\n")
    out = str(tmp_path / "a.ocm")
    rc, _, err = run_cli(["atc", "--model", f"{path}:make", "--output", out, "--precision_mode",
                          "allow_mix_precision_bf16", "--keep_dtype", keep, "--modify_mixlist", mix], capsys)
    assert rc == 0, err
    y = opencann.load(out)(x)
    assert torch.equal(y, res.compiled(x))
    with torch.no_grad():
        torch.testing.assert_close(y, model(x), rtol=0.05, atol=0.05)


# -- int8 as a candidate -------------------------------------------------------------------
class ConvMlp(torch.nn.Module):
    """conv-BN-ReLU, conv + residual, global mean, Linear-GELU-Linear, and a product of
    two activations (bmm: no constant weight, so no int8)."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.c2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.fc1, self.fc2 = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)

    def forward(self, x):
        y = torch.relu(self.bn(self.c1(x)))
        y = torch.relu(self.c2(y) + y)
        h = self.fc2(torch.nn.functional.gelu(self.fc1(y.mean((2, 3)))))
        return torch.bmm(h.unsqueeze(2), h.unsqueeze(1))


def test_int8_candidate_quantizes_convs_and_linears_and_saves(tmp_path):
    torch.manual_seed(0)
    model = ConvMlp().eval()
    g = torch.Generator().manual_seed(1)
    cal = [(torch.randn(2, 3, 12, 12, generator=g),) for _ in range(3)]
    x = cal[0][0]
    res = tune(model, (x,), candidates=("fp32", "bf16", "int8"), calibration=cal, timing=False)
    p = res.precision
    assert [p[n] for n in ("convolution", "convolution_1", "addmm", "addmm_1")] == ["int8"] * 4, p
    assert p["bmm"] == "bf16" and res.nodes["bmm"].own["int8"].rule == "applies"
    assert "constant weight" in res.nodes["bmm"].own["int8"].detail or "convolutions and linears" \
        in res.nodes["bmm"].own["int8"].detail
    ops = res.compiled.report.op_counts_after
    assert ops.get("QuantConvBiasAct", 0) + ops.get("QuantConvAddAct", 0) == 2 and ops.get("QuantLinearAct") == 2
    y = res.compiled(x)
    with torch.no_grad():
        ref = model(x)
    cos = torch.nn.functional.cosine_similarity(y.flatten().double(), ref.flatten().double(), 0)
    assert cos > 0.99 and y.dtype == torch.float32
    y2 = res.compiled(x)
    assert torch.equal(y2, y) and y2.data_ptr() != y.data_ptr()
    path = str(tmp_path / "t.ocm")
    opencann.save(res.compiled, path)
    loaded = opencann.load(path)
    assert torch.equal(loaded(x), y)
    assert loaded.report.precision["nodes"]["addmm"]["precision"] == "int8"
    assert "int8" in res.summary()


def test_int8_left_out_by_the_pass_says_why():
    """Calibration batches that are NaN everywhere give no layer a record: each int8 choice
    the pass could not run is kept with the pass's own reason, not only 'left it'."""
    torch.manual_seed(0)
    model = ConvMlp().eval()
    x = torch.randn(2, 3, 12, 12)
    cal = [(torch.full_like(x, float("nan")),)]
    res = tune(model, (x,), candidates=("fp32", "int8"), calibration=cal, timing=False)
    for n in ("convolution", "convolution_1", "addmm", "addmm_1"):
        assert res.precision[n] == "fp32", res.summary()
        assert "no calibration record" in res.kept[n] and "finite value" in res.kept[n], res.kept[n]


def test_int8_gate_failure_falls_back_to_the_next_candidate(factory):
    """b's input is h*0.5 + 1000: one uint8 step (~4) is larger than its signal, so int8
    fails the cosine rule, and bf16 too: fp32, both reasons named. Without bf16 among the
    candidates a and c run int8 with fp32 activations; with it an int8 Linear reads and
    writes bf16 as a bf16 one does, so the +1000 after a computes in bf16 and a is kept
    for what its reader loses ("outputs"), going up one candidate at a time."""
    _, model, (x,) = factory
    res = tune(model, (x,), candidates=("fp32", "int8"), timing=False)
    assert res.precision == {"addmm": "int8", "addmm_1": "fp32", "addmm_2": "int8"}, res.summary()
    assert "int8 own error: cosine" in res.kept["addmm_1"]
    assert res.compiled.report.op_counts_after.get("QuantLinearAct") == 2
    res = tune(model, (x,), candidates=("fp32", "bf16", "int8"), timing=False)
    assert res.precision["addmm_1"] == "fp32"
    assert "int8 own error: cosine" in res.kept["addmm_1"] and "bf16 own error" in res.kept["addmm_1"]
    assert res.precision["addmm"] == "fp32" and "outputs" in res.kept["addmm"] and "in bf16" in res.kept["addmm"]
    assert res.precision["addmm_2"] in ("int8", "bf16")


class _MergedQkv(torch.nn.Module):
    """Q, K and V Linears without activations on one input: fusion merges them into one
    GEMM (named after Q, sliced per sibling)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(64, 64) for _ in range(3))
        self.o = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.o(self.q(x) * self.k(x) + self.v(x))


def test_int8_of_merged_siblings_is_reported_for_each_of_them():
    """The merged Q/K/V GEMM runs int8: K and V are int8 too, not 'left in fp32'."""
    torch.manual_seed(0)
    m, x = _MergedQkv().eval(), torch.randn(32, 64)
    res = tune(m, x, candidates=("fp32", "bf16", "int8"), timing=False)
    assert set(res.precision.values()) == {"int8"} and not res.kept, res.summary()
    ops = res.compiled.report.op_counts_after
    assert ops.get("QuantLinearAct") == 2 and ops.get("StridedSlice") == 3, ops
    y, y2 = res.compiled(x), res.compiled(x)
    with torch.no_grad():
        ref = m(x)
    cos = torch.nn.functional.cosine_similarity(y.flatten().double(), ref.flatten().double(), 0)
    assert cos > 0.99 and torch.equal(y, y2) and y.data_ptr() != y2.data_ptr()


def test_int8_linears_sit_in_the_bf16_graph_without_casts():
    """With bf16 among the candidates an int8 Linear reads and writes bf16 as its bf16
    neighbours do: its AscendQuant (or the norm before it) reads bf16, no Cast to fp32 feeds
    it and none follows it; its own error is judged on bf16-rounded operands."""
    torch.manual_seed(0)
    m, x = _MergedQkv().eval(), torch.randn(32, 64)
    res = tune(m, x, candidates=("fp32", "bf16", "int8"), timing=False)
    assert set(res.precision.values()) == {"int8"}, res.summary()
    g = res.compiled.graph
    lins = [n for n in g.nodes if n.op == "QuantLinearAct"]
    assert len(lins) == 2
    for q in (n for n in g.nodes if n.op == "AscendQuant"):
        assert q.inputs[0].desc.dtype.torch == torch.bfloat16
    for n in lins:
        x_in = n.inputs[n.attrs["mat1"].index].producer
        assert x_in is None or x_in.op != "Cast" or x_in.outputs[0].desc.dtype.torch != torch.float32
        assert n.outputs[0].desc.dtype.torch in (torch.bfloat16, torch.uint8, torch.float32)
    y = res.compiled(x)
    with torch.no_grad():
        ref = m(x)
    cos = torch.nn.functional.cosine_similarity(y.flatten().double(), ref.flatten().double(), 0)
    assert cos > 0.99 and torch.equal(res.compiled(x), y)


def test_int8_left_by_the_pass_reports_what_ran():
    """A Linear + tanh (no oneDNN int8 post-op in a bf16 graph): given int8 by the search,
    left by ``quantize_int8`` in bf16, and reported as bf16 (what runs), not fp32."""
    class LinTanh(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out = torch.nn.Linear(32, 32), torch.nn.Linear(32, 8)

        def forward(self, x):
            return self.out(torch.tanh(self.fc(x)))
    torch.manual_seed(0)
    m, x = LinTanh().eval(), torch.randn(16, 32)
    res = tune(m, x, candidates=("fp32", "bf16", "int8"), timing=False)
    fused = res.compiled.report.op_counts_after
    if fused.get("QuantLinearAct") == 2:
        pytest.skip("tanh is not fused into the linear here")
    assert res.precision["addmm"] == "bf16" and "left it in bf16" in res.kept["addmm"], res.summary()
    assert res.precision["addmm_1"] == "int8"
    with torch.no_grad():
        ref = m(x)
    y = res.compiled(x)
    assert torch.nn.functional.cosine_similarity(y.flatten().double(), ref.flatten().double(), 0) > 0.99


def test_a_calibration_batch_of_another_shape_is_one_line_naming_it():
    """tune's int8 calibration runs the fp32 compile of the example inputs' shapes: a batch
    of another shape (or a NumPy array) is one ValueError line naming that batch, not the
    call's advice to recompile; the same model then tunes with batches of the right shape."""
    torch.manual_seed(0)
    m, x = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval(), torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"^calibration batch 1: .*float32\[3, 8\].*give batches like the example inputs") as e:
        tune(m, x, candidates=("fp32", "int8"), calibration=[torch.randn(2, 8), torch.randn(3, 8)], timing=False)
    assert "\n" not in str(e.value) and "recompile" not in str(e.value)
    with pytest.raises(ValueError, match=r"^calibration batch 0: .*got ndarray; give batches like"):
        tune(m, x, candidates=("fp32", "int8"), calibration=[x.numpy()], timing=False)
    res = tune(m, x, candidates=("fp32", "int8"), calibration=[torch.randn(2, 8), torch.randn(2, 8)], timing=False)
    with torch.no_grad():
        ref = m(x)
    assert torch.nn.functional.cosine_similarity(res.compiled(x).flatten().double(), ref.flatten().double(), 0) > 0.99


def test_an_empty_calibration_list_is_one_line_and_one_batch_is_taken():
    """``calibration=[]`` (an empty data loader) is refused as ``opencann.quantize`` refuses
    it, where it silently calibrated on the example inputs; a lone tensor is one batch, a
    generator of batches is read once."""
    torch.manual_seed(0)
    m, x = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval(), torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"^calibration takes a non-empty list of batches") as e:
        tune(m, x, candidates=("fp32", "int8"), calibration=[], timing=False)
    assert "\n" not in str(e.value)
    with torch.no_grad():
        ref = m(x)
    for cal in (torch.randn(2, 8), (torch.randn(2, 8) for _ in range(2))):
        res = tune(m, x, candidates=("fp32", "int8"), calibration=cal, timing=False)
        assert set(res.options["quant_config"]["layers"]) == {"addmm_relu", "addmm_1_none"}
        assert torch.nn.functional.cosine_similarity(res.compiled(x).flatten().double(),
                                                     ref.flatten().double(), 0) > 0.99


def test_tune_gives_back_the_callers_training_flags():
    """tune searches on eval-mode outputs, then gives every submodule its ``training`` flag
    back (it left the caller's model in eval mode); the tuned model is the eval one."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.5),
                            torch.nn.Linear(16, 4))
    m[1].eval()
    flags = [s.training for s in m.modules()]
    x = torch.randn(4, 8)
    res = tune(m, x, candidates=("fp32", "int8"), timing=False)
    assert [s.training for s in m.modules()] == flags == [True, True, False, True, True]
    m.eval()
    with torch.no_grad():
        ref = m(x)
    assert torch.nn.functional.cosine_similarity(res.compiled(x).flatten().double(), ref.flatten().double(), 0) > 0.99


_CONV_MLP_FILE = """import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.fc1, self.fc2 = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)
    def forward(self, x):
        y = torch.relu(self.c1(x))
        return self.fc2(torch.nn.functional.gelu(self.fc1(y.mean((2, 3)))))
def make():
    torch.manual_seed(0)
    return M().eval(), (torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(1)),)
"""


def test_int8_choices_export_and_atc_builds_the_tuned_graph(tmp_path, capsys):
    """The keep_dtype and mixlist files cannot say int8; the quant_config file names the
    int8 layers with their records, and ``opencann atc --quant_config`` builds the tuned
    graph again, bit for bit; written by ``opencann tune --quant-config-out`` too."""
    from opencann.tools.precision_files import read_quant_config
    path = tmp_path / "cm.py"
    path.write_text(_CONV_MLP_FILE)
    ns: dict = {}
    exec(path.read_text(), ns)
    model, (x,) = ns["make"]()
    res = tune(model, (x,), candidates=("fp32", "int8"), timing=False)
    assert "int8" in res.precision.values(), res.summary()
    keep, q = str(tmp_path / "keep.txt"), str(tmp_path / "q.json")
    res.export(keep_dtype=keep, quant_config=q)
    cfg = read_quant_config(q)
    assert set(cfg["layers"]) and cfg == json.loads(json.dumps(res.quant_config()))
    out = str(tmp_path / "a.ocm")
    rc, _, err = run_cli(["atc", "--model", f"{path}:make", "--output", out, "--keep_dtype", keep,
                          "--quant_config", q], capsys)
    assert rc == 0, err
    loaded = opencann.load(out)
    ops = loaded.report.op_counts_after
    assert ops.get("QuantLinearAct", 0) + ops.get("QuantConvBiasAct", 0) == \
        sum(p == "int8" for p in res.precision.values())
    assert torch.equal(loaded(x), res.compiled(x))
    # with bf16 in the search: the linears run int8 on bf16 (node_precision), the
    # convolution int8 from fp32; the mixlist keeps Conv2D out of the bf16 lowering
    mixed = tune(model, (x,), candidates=("fp32", "bf16", "int8"), timing=False)
    assert mixed.precision["convolution"] == "int8", mixed.summary()
    mix = str(tmp_path / "mix.json")
    mixed.export(keep_dtype=keep, modify_mixlist=mix, quant_config=q)
    assert "Conv2D" in mixed.mixlist()[0]
    rc, _, err = run_cli(["atc", "--model", f"{path}:make", "--output", out, "--precision_mode",
                          "allow_mix_precision_bf16", "--keep_dtype", keep, "--modify_mixlist", mix,
                          "--quant_config", q], capsys)
    assert rc == 0, err
    again = opencann.load(out)
    assert again.report.op_counts_after == mixed.compiled.report.op_counts_after
    assert torch.equal(again(x), mixed.compiled(x))
    q2 = str(tmp_path / "q2.json")
    rc, _, err = run_cli(["tune", f"{path}:make", "--candidates", "fp32,int8", "--no-timing",
                          "--quant-config-out", q2], capsys)
    assert rc == 0, err
    assert set(read_quant_config(q2)["layers"]) == set(cfg["layers"])


@pytest.mark.parametrize("text,says", [
    (None, "no such file"),
    ("{not json", "not JSON"),
    ('{"layers": {"fc": {"scale_d": -1, "offset_d": 3}}}', "scale_d"),
    ('{"layers": {}, "skip_layer": []}', "option 'quant_config' has no key 'skip_layer' (it takes layers, skip_layers"),
])
def test_quant_config_file_errors_are_one_line(tmp_path, capsys, text, says):
    from opencann.tools.precision_files import read_quant_config
    q = tmp_path / "q.json"
    if text is not None:
        q.write_text(text)
    with pytest.raises(ValueError) as e:
        read_quant_config(str(q))
    assert says in str(e.value) and str(q) in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "cm.py").write_text(_CONV_MLP_FILE)
    rc, _, err = run_cli(["atc", "--model", f"{tmp_path / 'cm.py'}:make", "--output", str(tmp_path / "a.ocm"),
                          "--quant_config", str(q)], capsys)
    assert rc != 0 and len(err) == 1 and says in err[0] and err[0].startswith("error: --quant_config")
