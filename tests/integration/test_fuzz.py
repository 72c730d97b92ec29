"""Differential fuzzing in the test suite: random small programs (ops, views, in-place ops,
dtypes, NaN/Inf/denormal inputs, several and aliasing outputs) through opencann.compile,
vnpu and torch.compile, each checked against eager (values, NaN positions, metadata,
input mutation, second-call integrity, output independence, threads, weights).

Fixed seeds; a failure prints its minimal repro. The long run: ``opencann fuzz --cases
10000 --backend all --out fuzz_failures/`` (docs/guide/migration.md)."""
import pytest
import torch

from opencann.tools.fuzz import (CHECKS, Failure, check_module, check_program, generate,
                                 repro_source, run_fuzz, shrink)
from opencann.tools.fuzz_ops import OPS, op_table

# (backend, first seed, programs): torch.compile costs most per program, so fewer of it.
# make test runs the first quarter of programs of each campaign (the same seeds); the whole campaigns
# are marked full (make test-all).
CAMPAIGNS = [("opencann", 0, 100), ("vnpu", 1000, 50), ("dynamo", 2000, 150)]
SAMPLED = [(b, s, n // 4) for b, s, n in CAMPAIGNS]


@pytest.mark.parametrize("backend,seed,cases", SAMPLED, ids=[c[0] for c in SAMPLED])
def test_fuzz_matches_eager(backend, seed, cases):
    _campaign(backend, seed, cases)


@pytest.mark.full
@pytest.mark.parametrize("backend,seed,cases", CAMPAIGNS, ids=[c[0] for c in CAMPAIGNS])
def test_fuzz_full_campaign_matches_eager(backend, seed, cases):
    _campaign(backend, seed, cases)


def _campaign(backend, seed, cases):
    res = run_fuzz(cases=cases, seed=seed, backends=[backend], shrink_budget=25, max_shrinks=3)
    assert res.runs.get(backend) == cases
    msg = [res.summary()] + [repro_source(p, f) for f, p, _ in res.failures[:3]]
    assert not res.failures, "\n\n".join(msg)


def test_same_seed_same_program_and_standalone_source():
    a, b = generate(7), generate(7)
    assert a.source() == b.source() and a.steps
    ns = {}
    exec(compile(a.source(), "<fuzz>", "exec"), ns)   # the repro defines M and make_inputs
    outs = ns["M"]().eval()(*ns["make_inputs"](0))
    assert isinstance(outs, tuple) and all(isinstance(o, torch.Tensor) for o in outs)
    assert generate(8).source() != a.source()


def test_every_group_generates():
    groups = {o.group for o in OPS}
    for g in groups:
        progs = [generate(s, kinds=[g, "data"]) for s in range(25)]
        assert any(s.group == g for p in progs for s in p.steps), g


def test_filters_reject_unknown_names():
    with pytest.raises(ValueError, match="unknown fuzz op"):
        op_table(["no_such_op"])
    with pytest.raises(ValueError, match="unknown fuzz kind"):
        op_table(None, ["no_such_kind"])
    with pytest.raises(ValueError, match="unknown fuzz backend"):
        run_fuzz(cases=1, backends=["tpu"])
    with pytest.raises(ValueError, match="unknown fuzz check"):
        run_fuzz(cases=1, checks=["speed"])


def test_checks_catch_a_wrong_backend(monkeypatch):
    """The checks themselves: a backend that returns a wrong value, shares an output
    buffer across calls and ignores input mutation is reported for each."""
    import opencann.tools.fuzz as fz

    class Bad:
        def __init__(self, m):
            self.m, self.buf = m, None

        def __call__(self, x):
            y = self.m(x.clone())[0]
            if self.buf is None:
                self.buf = torch.empty_like(y)
            self.buf.copy_(y + (y.abs().max() * 1e-2))   # wrong value, reused buffer
            return (self.buf,)

    monkeypatch.setattr(fz, "_build", lambda backend, m, example: Bad(m))

    class M(torch.nn.Module):
        def forward(self, x):
            x.mul_(2)
            return (x + 1,)

    got = {f.check for f in check_module(M, lambda s: (torch.randn(3, 4, generator=torch.Generator().manual_seed(s)),),
                                         "opencann", checks=list(CHECKS))}
    assert {"values", "input-mutation", "second-call"} <= got


def test_shrink_drops_steps_unrelated_to_the_failure(monkeypatch):
    """Shrinking against a fake check (fails while the program contains a sigmoid)."""
    import opencann.tools.fuzz as fz
    prog = next(p for p in (generate(s, ops=["sigmoid", "add", "mul", "view"]) for s in range(50))
                if len(p.steps) >= 5 and any(s.op == "sigmoid" for s in p.steps))

    def fake(p, backend, checks=None):
        return [Failure(backend, "values", "x")] if any(s.op == "sigmoid" for s in p.steps) else []
    monkeypatch.setattr(fz, "check_program", fake)
    small = shrink(prog, Failure("opencann", "values", "x"))
    assert any(s.op == "sigmoid" for s in small.steps)
    assert len(small.steps) < len(prog.steps) and len(small.outputs) == 1


def test_invalid_program_is_not_a_failure():
    from dataclasses import replace
    p = generate(3)
    broken = replace(p, steps=p.steps + [type(p.steps[0])("undefined_name + 1", [], ["vz"], "x", "x")],
                     outputs=["vz"])
    assert check_program(broken, "opencann") is None
