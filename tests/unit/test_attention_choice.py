"""ScaledDotProductAttention's CPU kernel choice (`opencann.ops.kernels.attention_cpu`):
torch's SDPA or bmm + softmax + bmm, raced per shape at bind time. Each kernel matches
eager SDPA (values, NaN/Inf positions, fully masked rows, bool and float masks, broadcast
masks, transposed-head views, a second call, output independence); uncovered calls stay
on SDPA; the race picks the faster; model files keep the choice and fall back where the
kernel is missing; a dynamic model chooses per shape."""
import pytest
import torch

import opencann
from opencann.engine.dynamic import pin_kernel_choices
from opencann.ir.specialise import specialise
from opencann.ops.kernels import attention_cpu
from helpers import ForcedGemmChoice

F = torch.nn.functional
NINF, INF, NAN = float("-inf"), float("inf"), float("nan")


class Attn(torch.nn.Module):
    """SDPA on [B, S, H, D] inputs seen as [B, H, S, D] (transposed heads, as BERT)."""

    def __init__(self, transposed=True, **kw):
        super().__init__()
        self.transposed, self.kw = transposed, kw

    def forward(self, q, k, v, mask=None):
        if self.transposed:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.kw)


def _kernels(cm):
    return [n.meta.get("kernel") for n in cm.graph.nodes if n.op == "ScaledDotProductAttention"]

RACE_ON = {"enable": ["attention_kernel_choice"]}


def _compile(model, args, **kw):
    """opencann.compile with the (off by default) attention kernel race switched on."""
    return opencann.compile(model, args, options=dict(RACE_ON), **kw)


def test_the_race_is_off_by_default(monkeypatch):
    monkeypatch.setattr(attention_cpu, "ATTENTION_CHOICES", {})
    g = torch.Generator().manual_seed(11)
    q, k, v = _qkv(g)
    cm = opencann.compile(Attn(), (q, k, v))
    assert _kernels(cm) == ["sdpa"] and attention_cpu.ATTENTION_CHOICES == {}
    entry = [p for p in cm.report.passes if p.name == "attention_kernel_choice"]
    assert entry and not entry[0].enabled
    _check_calls(cm, Attn(), [(q, k, v)])



def _same(out, ref, tol=1e-5):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    assert torch.equal(out[torch.isinf(ref)], ref[torch.isinf(ref)])
    fin = torch.isfinite(ref)
    assert fin.any()
    assert ((out[fin] - ref[fin]).abs().max() / ref[fin].abs().max()).item() < tol


B, S, H, D = 2, 12, 3, 8


def _qkv(g, sk=S):
    return (torch.randn(B, S, H, D, generator=g), torch.randn(B, sk, H, D, generator=g),
            torch.randn(B, sk, H, D, generator=g))


def _case(name, g):
    """(q, k, v, mask) of case ``name``: q, k, v [B, S, H, D] (transposed in the model)."""
    q, k, v = _qkv(g)
    mask = None
    if name == "float_key_mask":
        mask = torch.randn(B, 1, 1, S, generator=g)
    elif name == "float_full_mask":
        mask = torch.randn(B, 1, S, S, generator=g)
    elif name == "bool_key_mask":
        mask = torch.rand(B, 1, 1, S, generator=g) > 0.3
        mask[..., 0] = True
    elif name == "bool_full_mask":
        mask = torch.rand(B, 1, S, S, generator=g) > 0.3
    elif name == "nan_qkv":
        q[0, 2, 1, 3], k[1, 4, 0, 1], v[0, 5, 2, 0] = NAN, NAN, NAN
    elif name == "inf_v":
        v[1, 3, 1, 2] = INF
    elif name == "neg_inf_mask_column":
        mask = torch.zeros(B, 1, 1, S)
        mask[..., 4] = NINF
    elif name == "pos_inf_mask_column":
        mask = torch.zeros(B, 1, 1, S)
        mask[0, ..., 2] = INF
    elif name == "fully_masked_rows_float":
        mask = torch.randn(B, 1, S, S, generator=g)
        mask[0, 0, 3, :] = NINF
        mask[1] = NINF
    elif name == "fully_masked_rows_bool":
        mask = torch.rand(B, 1, S, S, generator=g) > 0.3
        mask[0, 0, 5, :] = False
    elif name == "fully_masked_row_nan_v":
        mask = torch.zeros(B, 1, S, S)
        mask[0, 0, 5, :] = NINF
        v[0, 2, 1, 1] = NAN
    elif name == "neg_inf_score_row":       # q -inf against positive keys: an all -inf row
        k = k.abs() + 0.1
        q[0, 4, 1, :] = NINF
    elif name == "finfo_min_rows":          # transformers' padding value, not -inf
        mask = torch.zeros(B, 1, 1, S)
        mask[1, ..., :] = torch.finfo(torch.float32).min
    return q, k, v, mask


CASES = ["plain", "float_key_mask", "float_full_mask", "bool_key_mask", "bool_full_mask",
         "nan_qkv", "inf_v", "neg_inf_mask_column", "pos_inf_mask_column",
         "fully_masked_rows_float", "fully_masked_rows_bool", "fully_masked_row_nan_v",
         "neg_inf_score_row", "finfo_min_rows"]


def _check_calls(cm, model, args_list):
    for args in args_list:
        with torch.no_grad():
            ref = model(*args)
        out = cm(*args)
        _same(out, ref)
        again = cm(*args)
        assert torch.equal(again.nan_to_num(), out.nan_to_num())    # same bits again
        out.add_(1)                                                  # outputs are the caller's
        assert not torch.equal(again.nan_to_num(), out.nan_to_num())


@pytest.mark.parametrize("kernel", attention_cpu.ATTENTION_KERNELS)
@pytest.mark.parametrize("case", CASES)
def test_each_kernel_matches_eager_sdpa(kernel, case, monkeypatch):
    monkeypatch.setattr(attention_cpu, "ATTENTION_CHOICES", ForcedGemmChoice(kernel))
    g = torch.Generator().manual_seed(CASES.index(case))
    q, k, v, mask = _case(case, g)
    args = (q, k, v) if mask is None else (q, k, v, mask)
    model = Attn()
    cm = _compile(model, args)
    assert _kernels(cm) == [kernel]
    _check_calls(cm, model, [args, tuple(a.clone() for a in args)])


@pytest.mark.parametrize("kernel", attention_cpu.ATTENTION_KERNELS)
def test_contiguous_heads_explicit_scale_and_longer_keys(kernel, monkeypatch):
    monkeypatch.setattr(attention_cpu, "ATTENTION_CHOICES", ForcedGemmChoice(kernel))
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, H, S, D, generator=g)
    k, v = torch.randn(B, H, 20, D, generator=g), torch.randn(B, H, 20, 5, generator=g)
    mask = torch.randn(1, H, S, 20, generator=g)
    model = Attn(transposed=False, scale=0.3)
    cm = _compile(model, (q, k, v, mask))
    assert _kernels(cm) == [kernel]
    _check_calls(cm, model, [(q, k, v, mask)])


@pytest.mark.parametrize("kw,dtype,why", [
    ({"is_causal": True}, torch.float32, "is_causal"),
    ({"enable_gqa": True}, torch.float32, "enable_gqa"),
    ({}, torch.bfloat16, "float32"),
    ({}, torch.float16, "float32"),
    ({}, torch.float64, "float32"),
])
def test_uncovered_calls_stay_on_sdpa(kw, dtype, why, monkeypatch):
    monkeypatch.setattr(attention_cpu, "ATTENTION_CHOICES", ForcedGemmChoice("bmm_softmax"))
    g = torch.Generator().manual_seed(3)
    q, k, v = (t.to(dtype) for t in _qkv(g))
    model = Attn(**kw)
    cm = _compile(model, (q, k, v))
    assert _kernels(cm) == ["sdpa"]
    node = next(n for n in cm.graph.nodes if n.op == "ScaledDotProductAttention")
    assert why in attention_cpu.uncovered(node, [v.desc for v in node.inputs])
    with torch.no_grad():
        ref = model(q, k, v)
    assert torch.equal(cm(q, k, v), ref)


def test_scores_over_the_bound_stay_on_sdpa(monkeypatch):
    monkeypatch.setattr(attention_cpu, "ATTENTION_CHOICES", ForcedGemmChoice("bmm_softmax"))
    monkeypatch.setattr(attention_cpu, "SCORES_BOUND_BYTES", H * S * S * 4 - 1)
    g = torch.Generator().manual_seed(4)
    q, k, v = _qkv(g)
    cm = _compile(Attn(), (q, k, v))
    assert _kernels(cm) == ["sdpa"]
    _check_calls(cm, Attn(), [(q, k, v)])


def test_the_race_picks_the_faster_kernel_and_prefers_sdpa_on_a_tie():
    import time

    def slow():
        time.sleep(0.002)

    def fast():
        pass
    assert attention_cpu.race({"sdpa": slow, "bmm_softmax": fast}, "sdpa") == "bmm_softmax"
    assert attention_cpu.race({"sdpa": fast, "bmm_softmax": slow}, "sdpa") == "sdpa"
    assert attention_cpu.race({"sdpa": fast, "bmm_softmax": fast}, "sdpa", margin=0.0) == "sdpa"
    assert attention_cpu.race({"sdpa": fast}, "sdpa") == "sdpa"
    calls = []

    def lucky():            # fastest once (a burst of load on the other), slow otherwise
        calls.append(1)
        if len(calls) != 2:
            time.sleep(0.003)

    def steady():
        time.sleep(0.001)
    assert attention_cpu.race({"sdpa": steady, "bmm_softmax": lucky}, "sdpa") == "sdpa"


def test_a_real_race_records_a_kernel_once_per_shape(monkeypatch):
    monkeypatch.setattr(attention_cpu, "ATTENTION_CHOICES", {})
    g = torch.Generator().manual_seed(5)
    q, k, v = _qkv(g)
    cm = _compile(Attn(), (q, k, v))
    assert _kernels(cm)[0] in attention_cpu.ATTENTION_KERNELS
    assert len(attention_cpu.ATTENTION_CHOICES) == 1
    _compile(Attn(), (q, k, v))
    assert len(attention_cpu.ATTENTION_CHOICES) == 1          # cached, not measured again
    _check_calls(cm, Attn(), [(q, k, v)])


def test_model_file_keeps_the_choice_and_falls_back_where_it_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(attention_cpu, "ATTENTION_CHOICES", ForcedGemmChoice("bmm_softmax"))
    g = torch.Generator().manual_seed(6)
    q, k, v, mask = _case("bool_key_mask", g)
    cm = _compile(Attn(), (q, k, v, mask))
    path = str(tmp_path / "attn.ocm")
    opencann.save(cm, path)
    monkeypatch.setattr(attention_cpu, "ATTENTION_CHOICES", ForcedGemmChoice("sdpa"))
    loaded = opencann.load(path)
    assert _kernels(loaded) == ["bmm_softmax"]               # the file's choice, not the cache's
    assert torch.equal(loaded(q, k, v, mask), cm(q, k, v, mask))
    monkeypatch.setattr(attention_cpu, "bmm_softmax_available", lambda: False)
    plain = opencann.load(path)
    assert _kernels(plain) == ["sdpa"]
    _check_calls(plain, Attn(), [(q, k, v, mask)])


def test_a_dynamic_model_chooses_per_shape(monkeypatch):
    monkeypatch.setattr(attention_cpu, "ATTENTION_CHOICES", {})
    g = torch.Generator().manual_seed(8)
    q, k, v = _qkv(g)
    model = Attn()
    spec = {0: "batch", 1: "seq"}
    cm = _compile(model, (q, k, v), dynamic_shapes={"q": spec, "k": spec, "v": spec},
                          dim_ranges={"batch": (1, 4), "seq": (2, 64)})
    for b, s in ((1, 9), (3, 33), (2, 5)):
        args = tuple(torch.randn(b, s, H, D, generator=g) for _ in range(3))
        _check_calls(cm, model, [args])
    assert len(attention_cpu.ATTENTION_CHOICES) >= 3          # one race per shape
    bound = specialise(cm.graph, dict(zip(cm.binder.order, (3, 7))))
    for n in bound.nodes:
        if n.op == "ScaledDotProductAttention":
            n.meta["kernel"] = "bmm_softmax"
    pin_kernel_choices(cm.graph, bound)
    assert all("kernel" not in n.meta for n in cm.graph.nodes if n.op == "ScaledDotProductAttention")


@pytest.mark.parametrize("kernel", attention_cpu.ATTENTION_KERNELS)
def test_minilm_with_padding_matches_eager(kernel, monkeypatch):
    """The real all-MiniLM-L6-v2 (bool [B, 1, S, S] masks from transformers' SDPA path,
    transposed heads) with every attention node on ``kernel``."""
    zoo = pytest.importorskip("opencann.zoo")
    try:
        zm = zoo.minilm(2, 24)
    except (RuntimeError, OSError) as e:
        pytest.skip(str(e))
    monkeypatch.setattr(attention_cpu, "ATTENTION_CHOICES", ForcedGemmChoice(kernel))
    ids, mask = zm.example_inputs
    mask = mask.clone()
    mask[1, 15:] = 0                                     # a padded sequence
    cm = _compile(zm.model, (ids, mask))
    assert set(_kernels(cm)) == {kernel} and len(_kernels(cm)) == 6
    with torch.no_grad():
        ref = zm.model(ids, mask)[0]
    out = cm(ids, mask)
    out = out[0] if not torch.is_tensor(out) else out
    _same(out, ref, tol=1e-4)
