"""Training through the graph engine: forward and backward graphs compiled by opencann
give the gradients of eager training (fp32, relative max|a-b|/max|ref| < 1e-5).

Parameters whose exact gradient is zero (BERT's attention key bias: softmax is
invariant to a per-row shift) are compared against the largest gradient's scale."""
import copy

import pytest
import torch

from opencann.dynamo import COMPILED_GRAPHS
from opencann.dynamo.training import make_training_backend, opencann_training_backend
from opencann.dynamo.partition import last_partition_report


def _grad_errors(model, ref):
    scale = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    errs = {}
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:
            continue
        denom = max(q.grad.abs().max().item(), 1e-3 * scale)
        errs[name] = (p.grad - q.grad).abs().max().item() / denom
    return errs


def _cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.GELU(),
        torch.nn.Flatten(), torch.nn.Linear(16 * 4 * 4, 10))


@pytest.mark.parametrize("budget", [None, 0.9], ids=["min_cut", "budget"])
def test_cnn_gradients_match_eager(budget):
    model = _cnn().train()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
    n = len(COMPILED_GRAPHS)
    cm = torch.compile(model, backend=make_training_backend(memory_budget=budget)
                       if budget else opencann_training_backend)
    torch.nn.functional.cross_entropy(cm(x), y).backward()
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    errs = _grad_errors(model, ref)
    assert max(errs.values()) < 1e-5, errs
    # BatchNorm's running statistics were updated as in eager
    assert torch.allclose(model[1].running_mean, ref[1].running_mean, atol=1e-6)
    assert not torch.equal(ref[1].running_mean, torch.zeros(8))
    roles = [r.notes for r in COMPILED_GRAPHS[n:]]
    assert any("training graph: forward" in x for x in roles)
    assert any("training graph: backward" in x for x in roles)
    rep = last_partition_report()
    assert rep["peak"] <= rep["peak_without_recompute"]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_small_bert_gradients_match_eager(attn):
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    cfg = BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                     intermediate_size=128, vocab_size=500, max_position_embeddings=64,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     attn_implementation=attn)
    model = BertModel(cfg).train()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 500, (4, 16), generator=g)
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[0, 10:] = 0
    w = torch.randn(4, 16, 64, generator=g)
    cm = torch.compile(model, backend=opencann_training_backend)
    out = cm(input_ids=ids, attention_mask=mask).last_hidden_state
    (out * w).sum().backward()
    (ref(input_ids=ids, attention_mask=mask).last_hidden_state * w).sum().backward()
    errs = _grad_errors(model, ref)
    assert max(errs.values()) < 1e-5, sorted(errs.items(), key=lambda t: -t[1])[:3]


def test_training_loop_matches_eager_over_steps():
    model = _cnn().train()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    cm = torch.compile(model, backend=opencann_training_backend)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
        for m, o in ((cm, opt), (ref, ropt)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p - q).abs().max() / q.abs().max() < 1e-5


def test_backend_name_routes_training_and_passes_options():
    """torch.compile(backend="opencann") in training mode compiles forward and backward;
    options={"memory_budget": ...} reaches the recomputation pass."""
    model = _cnn().train()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
    n = len(COMPILED_GRAPHS)
    cm = torch.compile(model, backend="opencann", options={"memory_budget": 0.9})
    torch.nn.functional.cross_entropy(cm(x), y).backward()
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    assert max(_grad_errors(model, ref).values()) < 1e-5
    roles = " ".join(" ".join(r.notes) for r in COMPILED_GRAPHS[n:])
    assert "training graph: forward" in roles and "training graph: backward" in roles
    assert last_partition_report()["memory_budget"] == 0.9


def _compiled_matches_eager(model, x, autocast=None, tol=1e-5):
    """One compiled training step against eager (optionally under autocast); asserts that
    opencann compiled a backward graph and that input and parameter gradients match."""
    ref = copy.deepcopy(model)
    n0 = len(COMPILED_GRAPHS)
    cm = torch.compile(model, backend="opencann", dynamic=False)
    grads = []
    for m, f in ((model, cm), (ref, ref)):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            out = f(xi)
        out.float().square().mean().backward()
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
    assert any("training graph: backward" in r.notes for r in COMPILED_GRAPHS[n0:])
    for a, b in zip(*grads):
        assert (a is None) == (b is None)
        if b is not None:
            assert ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() <= tol


def test_eval_batchnorm_with_gradients():
    """Eval-mode BatchNorm under autograd (frozen statistics, input gradients): its CPU
    kernel returns empty saved statistics where ATen's meta kernel says [C]."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
    m[1].running_mean.uniform_(-1, 1)
    m[1].running_var.uniform_(0.5, 2)
    _compiled_matches_eager(m.eval(), torch.randn(2, 3, 8, 8))


def test_layernorm_on_bf16_under_autocast():
    """Linear → LayerNorm under bf16 autocast: LayerNorm's mean/rstd keep the bf16 input's
    dtype on CPU (fp32 per ATen's meta kernel)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    _compiled_matches_eager(m, torch.randn(4, 16), autocast=torch.bfloat16, tol=1e-2)


@pytest.mark.parametrize("affine", ["none", "weight_only"])
def test_layernorm_without_affine_parameters(affine):
    """A gradient op that skips outputs (LayerNormGrad with no weight/bias: output_mask
    False) compiles with those outputs absent, as does the first convolution's unneeded
    input gradient."""
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(16, elementwise_affine=affine != "none", bias=False)
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), ln, torch.nn.Linear(16, 4))
    _compiled_matches_eager(m, torch.randn(4, 16))
    c = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    ref = copy.deepcopy(c)
    x = torch.randn(2, 3, 8, 8)
    torch.compile(c, backend="opencann", dynamic=False)(x).sum().backward()
    ref(x).sum().backward()
    assert torch.allclose(c[0].weight.grad, ref[0].weight.grad, rtol=1e-5, atol=1e-6)
