"""Gradient parity of compiled training on the zoo's full-size models (issue #5: within
1e-5 of eager, fp32), without and with a memory budget. Small batch and sequence/image
sizes keep CI time down; the graphs are the full models."""
import copy

import pytest
import torch

from opencann import zoo
from opencann.dynamo.training import make_training_backend
from opencann.dynamo.partition import last_partition_report

# every zoo case is marked full (make test-all): make test trains the CNNs, the residual CNN
# and the small BERT of tests/integration/test_training.py through the same backend
CASES = [pytest.param("minilm", dict(batch=2, seq=32), 0.5, marks=pytest.mark.full, id="minilm"),
         pytest.param("bert-base", dict(batch=2, seq=32), 0.5, marks=pytest.mark.full,
                      id="bert-base"),
         pytest.param("gpt2", dict(batch=2, seq=32), None, marks=pytest.mark.full, id="gpt2"),
         pytest.param("resnet50", dict(batch=2, size=64), 0.5, marks=pytest.mark.full,
                      id="resnet50")]   # make test: tests/integration/test_training.py's CNNs


def _loss(model, inputs):
    out = model(*inputs)
    h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return h.float().pow(2).mean()


@pytest.mark.parametrize("name,kw,budget", CASES)
def test_zoo_gradients_match_eager(name, kw, budget):
    # exactness at 1e-5 needs one thread count for both runs: the first convolutions'
    # weight gradients (BatchNorm's zero-mean gradient, summed over every pixel) move by
    # 1e-2 between eager at 1 and at 2 threads (tests/conftest.py restores the count)
    zm = zoo.get(name, **kw)
    model = zm.model.train()
    for mod in model.modules():  # dropout's random masks differ between the two runs
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    ref = copy.deepcopy(model)
    # GPT-2's spelled-out tanh GELU: fuse_gelu_tanh replaces it by ATen's kernel, which
    # rounds differently (<= 2.4e-7 absolute); in eager alone that swap moves GPT-2's
    # gradients by 2.9e-4 of their max (h.0.mlp.c_fc.weight), so this exactness check of
    # the training machinery keeps eager's formula (the fusion is tested against eager in
    # tests/unit/test_pattern_fusions.py)
    opts = {"disable": ["fuse_gelu_tanh"]} if name == "gpt2" else {}
    compiled = torch.compile(model, backend=make_training_backend(memory_budget=budget, **opts),
                             dynamic=False)
    loss = _loss(compiled, zm.example_inputs)
    loss.backward()
    ref_loss = _loss(ref, zm.example_inputs)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    n = 0
    for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:  # unused by the loss (BERT's pooler): None in eager, and None or
            # zeros through AOTAutograd, which gives every graph output a tangent
            assert p.grad is None or not p.grad.any(), pname
            continue
        err = ((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)).item()
        assert err < 1e-5, f"{pname}: relative gradient error {err:.2e}"
        n += 1
    assert n > 50
    rep = last_partition_report()
    if budget is not None:
        assert rep["peak"] <= budget * rep["peak_without_recompute"]
        assert rep["recompute_flops"] > 0
    for b, rb in zip(model.buffers(), ref.buffers()):
        assert torch.equal(b, rb) or torch.allclose(b.float(), rb.float(), atol=1e-6)
