"""Training through torch.compile(backend="opencann") where a gradient op skips outputs
(its ``output_mask``): a BatchNorm that is the network's first layer (the input needs no
gradient), frozen affine parameters, only some parameters requiring gradients. Loss,
every parameter gradient and BatchNorm's running statistics match eager (fp32).

ATen's meta kernel of ``native_batch_norm_backward`` returns grad_input whatever the
mask, while its CPU kernel returns none: the compiled backward must not bind it."""
import copy

import pytest
import torch

from opencann.dynamo import COMPILED_GRAPHS


def _first_bn(dim: int, affine: bool = True) -> torch.nn.Module:
    """BatchNorm{dim}d(4) then a Linear / Conv2d: the BatchNorm reads the graph input."""
    torch.manual_seed(0)
    if dim == 1:
        return torch.nn.Sequential(torch.nn.BatchNorm1d(4, affine=affine), torch.nn.Linear(4, 3))
    return torch.nn.Sequential(torch.nn.BatchNorm2d(4, affine=affine), torch.nn.Conv2d(4, 3, 3),
                               torch.nn.ReLU())


def _x(dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(5, 4, generator=g) if dim == 1 else torch.randn(2, 4, 6, 6, generator=g)


def _step_matches_eager(model: torch.nn.Module, x: torch.Tensor, dynamic=False) -> None:
    """One training step (loss = mean(out**2)) of ``model`` compiled by opencann against
    an eager copy: the loss, each parameter's gradient (None where eager's is None) and
    each buffer (running statistics) agree; a backward graph was compiled."""
    ref = copy.deepcopy(model)
    n0 = len(COMPILED_GRAPHS)
    cm = torch.compile(model, backend="opencann", dynamic=dynamic)
    loss = cm(x).square().mean()
    loss.backward()
    ref_loss = ref(x).square().mean()
    ref_loss.backward()
    assert any("training graph: backward" in r.notes for r in COMPILED_GRAPHS[n0:])
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        assert torch.allclose(b.float(), c.float(), rtol=1e-5, atol=1e-6), name


@pytest.mark.parametrize("dynamic", [False, True, None], ids=["static", "dynamic", "auto"])
@pytest.mark.parametrize("dim", [1, 2])
def test_batchnorm_first_layer_trains(dim, dynamic):
    """BatchNorm on the graph input (no input gradient: output_mask [False, True, True])."""
    _step_matches_eager(_first_bn(dim).train(), _x(dim), dynamic)


@pytest.mark.parametrize("dim", [1, 2])
def test_batchnorm_first_layer_some_params_frozen(dim):
    """Only BatchNorm's bias and the next layer's weight need gradients: every output of
    BatchNormGrad but grad_bias is masked off."""
    m = _first_bn(dim).train()
    m[0].weight.requires_grad_(False)
    m[1].bias.requires_grad_(False)
    _step_matches_eager(m, _x(dim))


@pytest.mark.parametrize("dim", [1, 2])
def test_batchnorm_first_layer_eval_mode(dim):
    """Eval-mode BatchNorm first (running statistics, train=False backward) with
    gradients for its affine parameters."""
    m = _first_bn(dim)
    m[0].running_mean.uniform_(-1, 1)
    m[0].running_var.uniform_(0.5, 2)
    _step_matches_eager(m.eval(), _x(dim))


@pytest.mark.parametrize("dim", [1, 2])
def test_frozen_batchnorm_affine_inside(dim):
    """A BatchNorm with frozen affine parameters (or none) between trained layers:
    BatchNormGrad computes grad_input only (output_mask [True, False, False])."""
    torch.manual_seed(0)
    if dim == 1:
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 3))
    else:
        m = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 1), torch.nn.BatchNorm2d(4), torch.nn.Conv2d(4, 3, 3))
    m[1].weight.requires_grad_(False)
    m[1].bias.requires_grad_(False)
    _step_matches_eager(m.train(), _x(dim))


@pytest.mark.parametrize("dim", [1, 2])
def test_batchnorm_first_layer_without_affine(dim):
    """BatchNorm(affine=False) on the graph input: no gradient flows into it at all."""
    _step_matches_eager(_first_bn(dim, affine=False).train(), _x(dim))
