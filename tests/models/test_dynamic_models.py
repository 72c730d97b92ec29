"""Dynamic shapes on the issue's models (#12): MiniLM (real weights) and BERT-base
(transformers config, seeded random weights; heavy) at sequence lengths 16, 40, 77, 128,
200 and batches 1..8, through ``opencann.compile(dynamic_shapes=...)`` and through
``torch.compile(backend="opencann")`` with default ``dynamic``, each matching eager
within 1e-4 (a padded text in every batch, a second call, independent outputs); a shape
outside the declared range is one error line; no graph is run eagerly
(`opencann.dynamo.eager_fallbacks` stays empty). A few cells run by default; the full
grid and BERT-base are marked heavy."""
import itertools

import pytest
import torch

import opencann
from opencann import zoo
from opencann.dynamo import COMPILED_GRAPHS, eager_fallbacks, recompiles

SEQS, BATCHES = (16, 40, 77, 128, 200), range(1, 9)
GRID = list(itertools.product(BATCHES, SEQS))
# make test's cells: batch 1, the largest batch and the longest sequence (each a shape that
# plans and races its GEMMs anew); the 40 cells of GRID: the `full` tests below
SAMPLE = [(1, 128), (8, 40), (4, 200)]


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _text(batch, seq, mask=True):
    g = torch.Generator().manual_seed(batch * 1000 + seq)
    ids = torch.randint(1000, 20000, (batch, seq), generator=g)
    if not mask:
        return (ids,)
    m = torch.ones(batch, seq, dtype=torch.int64)
    m[0, seq - seq // 4:] = 0          # a padded text in the batch
    return ids, m


def _check(model, compiled, inputs):
    with torch.no_grad():
        ref = model(*inputs)
        out = compiled(*inputs)
        again = compiled(*inputs)
    for key in ("last_hidden_state", "pooler_output"):
        assert _rel(out[key], ref[key]) < 1e-4, key
        assert _rel(again[key], ref[key]) < 1e-4, key
    assert out.last_hidden_state.data_ptr() != again.last_hidden_state.data_ptr()


@pytest.fixture(autouse=True)
def _no_eager_fallback():
    n = len(eager_fallbacks())
    yield
    assert eager_fallbacks()[n:] == []


def _dynamic(zm, mask=True):
    spec = {"input_ids": {0: "batch", 1: "seq"}}
    if mask:
        spec["attention_mask"] = {0: "batch", 1: "seq"}
    return opencann.compile(zm.model, zm.example_inputs, dynamic_shapes=spec,
                            dim_ranges={"batch": (1, 8), "seq": (2, 512)})


@pytest.fixture(scope="module")
def minilm():
    zm = zoo.minilm(batch=2, seq=16)
    return zm.model, _dynamic(zm)


@pytest.fixture(scope="module")
def bert():
    zm = zoo.bert_base(batch=2, seq=16)
    return zm.model, _dynamic(zm, mask=False)


# -- opencann.compile(dynamic_shapes=...) ---------------------------------------------
@pytest.mark.parametrize("batch,seq", SAMPLE)
def test_minilm_dynamic_compile(minilm, batch, seq):
    model, cm = minilm
    _check(model, cm, _text(batch, seq))


@pytest.mark.heavy
@pytest.mark.full
def test_minilm_dynamic_compile_full_grid(minilm):
    model, cm = minilm
    for batch, seq in GRID:
        _check(model, cm, _text(batch, seq))
    assert cm.plans.misses >= len(GRID) - cm.plans.capacity


@pytest.mark.heavy
@pytest.mark.full   # make test: MiniLM's dynamic compile (the same encoder) above
@pytest.mark.parametrize("batch,seq", SAMPLE + [(5, 77), (2, 16)])
def test_bert_base_dynamic_compile(bert, batch, seq):
    model, cm = bert
    _check(model, cm, _text(batch, seq, mask=False))


@pytest.mark.heavy
@pytest.mark.full
def test_bert_base_dynamic_compile_full_grid(bert):
    model, cm = bert
    for batch, seq in GRID:
        _check(model, cm, _text(batch, seq, mask=False))


@pytest.mark.heavy
@pytest.mark.full   # make test: test_minilm_outside_the_range_is_one_error_line (the same rule)
def test_bert_base_outside_the_range_is_one_error_line(bert):
    _, cm = bert
    for shape, name in (((9, 16), "batch"), ((2, 513), "seq")):
        with pytest.raises(ValueError) as e:
            cm(*_text(*shape, mask=False))
        msg = str(e.value)
        assert "\n" not in msg and f"({name}) is {max(shape) if name == 'seq' else 9}" in msg
        assert "outside the compiled range" in msg and "dim_ranges=" in msg


def test_minilm_outside_the_range_is_one_error_line(minilm):
    _, cm = minilm
    with pytest.raises(ValueError) as e:
        cm(*_text(9, 40))
    assert "\n" not in str(e.value) and "(batch) is 9, outside the compiled range [1, 8]" \
        in str(e.value)


# -- torch.compile(backend="opencann"), default dynamic ------------------------------
def _torch_compile(model, cells, mask=True):
    """Call torch.compile's model at ``cells`` (attention compiled at one length, called
    at others); returns the compile reports made and `recompiles`."""
    before, start = len(COMPILED_GRAPHS), recompiles(model)["compiles"]
    cm = torch.compile(model, backend="opencann")
    for batch, seq in cells:
        _check(model, cm, _text(batch, seq, mask))
    rec = recompiles(model)
    return COMPILED_GRAPHS[before:], rec["compiles"] - start, rec


def test_minilm_torch_compile_default_dynamic():
    model = zoo.minilm(batch=2, seq=16).model
    reports, compiles, rec = _torch_compile(model, [(2, 16), (3, 40), (6, 77)])
    assert compiles == 2 and len(reports) == 2            # one static, one symbolic graph
    assert not reports[0].dynamic and len(reports[1].dynamic["plans"]) == 2
    assert "size mismatch" in rec["recompiles"][-1]["reason"]
    assert rec["recompiles"][-1]["source"] and rec["eager_fallbacks"] == 0


@pytest.mark.heavy
@pytest.mark.full   # make test: test_minilm_torch_compile_default_dynamic
def test_minilm_torch_compile_batch_one_and_sampled_grid():
    model = zoo.minilm(batch=2, seq=16).model
    reports, compiles, _ = _torch_compile(model, [(2, 16), (3, 40)] + SAMPLE + [(5, 77)])
    # dynamo specialises size 1: batch 1 gets a graph of its own (seq symbolic)
    assert compiles <= 4 and all(r.dynamic for r in reports[1:])


@pytest.mark.heavy
@pytest.mark.full
def test_minilm_torch_compile_batch_one_and_full_grid():
    model = zoo.minilm(batch=2, seq=16).model
    reports, compiles, _ = _torch_compile(model, [(2, 16), (3, 40)] + GRID)
    assert compiles <= 4 and all(r.dynamic for r in reports[1:])


@pytest.mark.heavy
@pytest.mark.full   # make test: test_minilm_torch_compile_default_dynamic, the same encoder
def test_bert_base_torch_compile_default_dynamic():
    model = zoo.bert_base(batch=2, seq=16).model
    reports, compiles, rec = _torch_compile(model, [(2, 16), (3, 77), (4, 200), (8, 40)],
                                            mask=False)
    assert compiles == 2 and len(reports[-1].dynamic["plans"]) == 3
    assert rec["eager_fallbacks"] == 0
