"""Dynamic loss scaling: overflow skips the step and halves the scale; finite steps grow it."""
import pytest
import torch

from opencann.tools.amp import INIT_SCALE, make_scaler, scaled_step


def _setup(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, torch.randn(16, 8), torch.randn(16, 4)


def test_defaults():
    s = make_scaler()
    assert s.get_scale() == INIT_SCALE == 2.0 ** 16
    assert s.get_growth_factor() == 2.0 and s.get_backoff_factor() == 0.5
    assert s.get_growth_interval() == 2000


def test_overflow_skips_step_and_halves_scale():
    model, opt, x, y = _setup()
    scaler = make_scaler()
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean() * float("inf")  # overflow
    info = scaled_step(loss, opt, scaler, max_norm=1.0)
    assert info["skipped"] == 1.0
    assert info["new_scale"] == info["scale"] * 0.5
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)  # the step was skipped


def test_growth_after_good_steps_and_clipping_in_true_units():
    model, opt, x, y = _setup()
    ref_model, _, _, _ = _setup()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    scaler = make_scaler(growth_interval=3)
    scales = []
    for _ in range(3):
        opt.zero_grad()
        info = scaled_step(((model(x) - y) ** 2).mean(), opt, scaler, max_norm=0.5)
        scales.append(info["new_scale"])
        assert info["skipped"] == 0.0
        ref_opt.zero_grad()
        ((ref_model(x) - y) ** 2).mean().backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5)
        ref_opt.step()
    assert scales == [2.0 ** 16, 2.0 ** 16, 2.0 ** 17]
    for a, b in zip(model.parameters(), ref_model.parameters()):  # unscaled before clipping
        assert (a - b).abs().max() / b.abs().max() < 1e-5


def test_bad_config_and_loss():
    with pytest.raises(ValueError, match="growth_factor"):
        make_scaler(growth_factor=1.0)
    model, opt, x, y = _setup()
    with pytest.raises(ValueError, match="scalar loss"):
        scaled_step(model(x).sum(0), opt, make_scaler())
