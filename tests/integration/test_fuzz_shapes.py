"""`opencann.tools.fuzz_shapes`: shape-generic torch.compile programs called at three
sizes against eager (#26 item 10). Seed 16 is the campaign's finding (two ceil-mode
pools then a narrow by a third: a floor-division size evaluated in floats came out one
short); the generator is deterministic and its programs are valid at every size."""
from helpers import run_cli
from opencann.tools.fuzz_shapes import check_shape_program, generate_shape_program


def test_campaign_finding_seed16_matches_eager():
    prog = generate_shape_program(16)
    assert [s for s in prog.steps] == ["pool_ceil", "pool_ceil", "narrow"]
    assert check_shape_program(prog) == []


def test_generation_is_deterministic_and_programs_run_at_every_size():
    a, b = generate_shape_program(5), generate_shape_program(5)
    assert a.source() == b.source() and len(set(a.sizes)) == 3
    for seed in (1, 2):
        assert check_shape_program(generate_shape_program(seed)) == []


def test_cli_runs_shape_programs(capsys):
    # in-process (`run_cli`); `python -m opencann.cli` itself: tests/integration/test_cli_errors.py
    rc, out, err = run_cli(["fuzz", "--backend", "dynamo_shapes", "--cases", "2", "--seed", "16"], capsys)
    assert rc == 0, out + "\n".join(err)
    assert "runs per backend {'dynamo_shapes': 2}" in out
