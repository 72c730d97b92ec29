"""Weights changed after compiling: torch.compile(backend="opencann") re-freezes after
every kind of write (load_state_dict, .data, set_, fused and unfused optimizer steps,
BatchNorm statistics of a train-mode forward, writes torch does not count in
``_version``) and follows eager; opencann.compile refuses the call with one line naming
the tensor and the fix. Parameters written in forward are one clear error or eager's."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opencann
from helpers import assert_close


def _x(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) + 0.5
    flat = x.view(-1)
    flat[1] = float("nan")
    if flat.numel() > 5:
        flat[3], flat[5] = float("inf"), -0.0
    return x


def _x_inf(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) + 0.25
    x.view(-1)[5] = float("nan")
    x.view(-1)[11] = float("inf")
    return x


class _FrozenM(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.l = nn.Linear(64, 5)
        self.register_buffer("np", torch.randn(5), persistent=False)

    def forward(self, x):
        return self.l(F.relu(self.bn(self.c(x))).flatten(1)) + self.np


def _other():
    torch.manual_seed(7)
    return _FrozenM().eval()


_CHANGES = {
    "load_state_dict": lambda m: m.load_state_dict(_other().state_dict()),
    "load_state_dict_assign": lambda m: m.load_state_dict(_other().state_dict(), assign=True),
    "half_then_float": lambda m: (m.half(), m.float(), m.c.weight.mul_(2)),
    "data_twice": lambda m: [setattr(m.c.weight, "data", torch.full((4, 3, 3, 3), v)) for v in (0.5, 0.25)],
    "register_buffer_again": lambda m: m.register_buffer("np", torch.full((5,), 3.0), persistent=False),
    "param_set_": lambda m: m.l.bias.set_(torch.full((5,), -2.0)),
    "bn_stat_replaced": lambda m: setattr(m.bn, "running_mean", torch.full((4,), 0.5)),
}


@pytest.mark.parametrize("case", sorted(_CHANGES))
def test_freezing_sees_weight_changes(case):
    """A frozen graph gives eager's value after each kind of weight change."""
    torch.manual_seed(0)
    m = _FrozenM().eval()
    m.bn.running_var.uniform_(0.5, 2)
    x = _x_inf(2, 3, 4, 4)
    torch._dynamo.reset()
    cm = torch.compile(m, backend="opencann")
    with torch.no_grad():
        torch.testing.assert_close(cm(x), m(x), equal_nan=True)
        _CHANGES[case](m)
        torch.testing.assert_close(cm(x), m(x), equal_nan=True)
        torch.testing.assert_close(cm(x), m(x), equal_nan=True)


# == B7-1 / B7-2: frozen weights that torch changes without bumping a version counter =====
# torch.compile(backend="opencann") freezes parameters and buffers of inference graphs and
# re-freezes when a tensor's version counter moves. Two everyday writes do not move it:
# fused optimizer kernels (_fused_adam_/_fused_sgd_ on CPU) and BatchNorm's running
# statistics updated by an eager train-mode forward (native_batch_norm's schema does not
# mark running_mean/var as written). The compiled model then keeps the old values.

def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


_OPTIMIZERS = {
    "adam_fused": lambda p: torch.optim.Adam(p, lr=0.1, fused=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.1, fused=True),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.1, fused=True),
}


@pytest.mark.parametrize("opt", sorted(_OPTIMIZERS))
def test_frozen_weights_follow_a_fused_optimizer_step(opt):
    m = _mlp()
    x = _x(5, 6).nan_to_num()
    tm = torch.compile(m, backend="opencann")
    with torch.no_grad():
        tm(x)                                   # frozen inference graph
    o = _OPTIMIZERS[opt](m.parameters())
    m(x).sum().backward()
    o.step()
    with torch.no_grad():
        assert_close(tm(x), m(x), strides=True, signed_zeros=True)


@pytest.mark.parametrize("opt", sorted(_OPTIMIZERS))
def test_opencann_compile_refuses_weights_changed_by_a_fused_optimizer_step(opt):
    """README: weights modified in place after compiling (an optimizer step) are one
    error naming the fix (recompile); a plain Adam step gets it, a fused one does not."""
    m = _mlp()
    x = _x(5, 6).nan_to_num()
    cm = opencann.compile(m, (x,))
    o = _OPTIMIZERS[opt](m.parameters())
    m(x).sum().backward()
    o.step()
    with pytest.raises(ValueError, match="modified in place after compiling"):
        with torch.no_grad():
            cm(x)


def test_opencann_compile_refuses_weights_changed_by_an_optimizer_step():
    m = _mlp()
    x = _x(5, 6).nan_to_num()
    cm = opencann.compile(m, (x,))
    o = torch.optim.Adam(m.parameters(), lr=0.1)
    m(x).sum().backward()
    o.step()
    with pytest.raises(ValueError, match="modified in place after compiling"):
        with torch.no_grad():
            cm(x)


@pytest.mark.parametrize("opt", ["adam", "sgd_foreach"])
def test_frozen_weights_follow_an_unfused_optimizer_step(opt):
    m = _mlp()
    x = _x(5, 6).nan_to_num()
    tm = torch.compile(m, backend="opencann")
    with torch.no_grad():
        tm(x)
    o = (torch.optim.Adam(m.parameters(), lr=0.1) if opt == "adam"
         else torch.optim.SGD(m.parameters(), lr=0.1, foreach=True))
    m(x).sum().backward()
    o.step()
    with torch.no_grad():
        assert_close(tm(x), m(x), strides=True, signed_zeros=True)


def _bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).eval()


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_frozen_batchnorm_follows_an_eager_train_mode_forward(grad):
    """Train (or recalibrate BatchNorm) with the eager module, evaluate with the compiled
    one: eager's eval output uses the updated running statistics."""
    m = _bn_model()
    x, xt = _x(5, 6).nan_to_num(), torch.randn(16, 6) * 3 + 1
    tm = torch.compile(m, backend="opencann")
    with torch.no_grad():
        tm(x)
    m.train()
    with torch.set_grad_enabled(grad):
        m(xt)                                    # updates running_mean / running_var
    m.eval()
    with torch.no_grad():
        assert_close(tm(x), m(x), strides=True, signed_zeros=True)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_frozen_batchnorm_follows_a_compiled_train_mode_forward(grad):
    m = _bn_model()
    x, xt = _x(5, 6).nan_to_num(), torch.randn(16, 6) * 3 + 1
    tm = torch.compile(m, backend="opencann")
    with torch.no_grad():
        tm(x)
    m.train()
    with torch.set_grad_enabled(grad):
        tm(xt)
    m.eval()
    with torch.no_grad():
        assert_close(tm(x), m(x), strides=True, signed_zeros=True)


# B7-1 / B7-2 siblings: every write torch does not count in ``_version`` is followed by
# torch.compile (re-frozen) and refused by opencann.compile (one line naming the tensor).

class _BigBn(nn.Module):
    """A weight over the watch's whole-compare size (64x128 float32 = 32 KiB) and
    functional BatchNorm statistics (no num_batches_tracked to bump)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(128, 64)
        self.register_buffer("rm", torch.randn(64) * 0.1)
        self.register_buffer("rv", torch.rand(64) + 0.5)

    def forward(self, x):
        return F.batch_norm(self.lin(x), self.rm, self.rv, training=self.training)


def _functional_bn_train_forward(m):
    m.train()
    m(torch.randn(16, 128) * 2 + 1)
    m.eval()


_UNSEEN_WRITES = {
    "data_copy_big_weight": lambda m: m.lin.weight.data.copy_(torch.randn(64, 128)),
    "data_mul_small_bias": lambda m: m.lin.bias.data.mul_(-3),
    "data_normal_big_weight": lambda m: m.lin.weight.data.normal_(),
    "numpy_write_buffer": lambda m: m.rv.numpy().__setitem__(slice(None), 2.5),
    "functional_batch_norm_train_forward": _functional_bn_train_forward,
    "fused_sgd_step": lambda m: (m(torch.randn(4, 128)).sum().backward(),
                                 torch.optim.SGD(m.parameters(), lr=0.5, fused=True).step()),
    "fused_adamw_step_on_bias_only": lambda m: (
        m(torch.randn(4, 128)).sum().backward(),
        torch.optim.AdamW([m.lin.bias], lr=0.5, fused=True).step()),
}


@pytest.mark.parametrize("write", sorted(_UNSEEN_WRITES))
def test_torch_compile_follows_writes_without_version_bump(write):
    m = _BigBn().eval()
    x = torch.randn(5, 128)
    tm = torch.compile(m, backend="opencann")
    with torch.no_grad():
        assert_close(tm(x), m(x), strides=True, signed_zeros=True)
    _UNSEEN_WRITES[write](m)
    with torch.no_grad():
        ref = m(x)
        assert_close(tm(x), ref, strides=True, signed_zeros=True)
        assert_close(tm(x), ref, strides=True, signed_zeros=True)                       # and stays right (frozen again)


@pytest.mark.parametrize("write", sorted(_UNSEEN_WRITES))
def test_opencann_compile_refuses_after_writes_without_version_bump(write):
    m = _BigBn().eval()
    x = torch.randn(5, 128)
    with torch.no_grad():
        cm = opencann.compile(m, (x,))
        assert_close(cm(x), m(x), strides=True, signed_zeros=True)
    _UNSEEN_WRITES[write](m)
    with torch.no_grad(), pytest.raises(ValueError, match=r"^parameter or buffer '(lin\.|r[mv])"
                                                          r".*Recompile after changing weights$"):
        cm(x)


def test_opencann_compile_refuses_after_data_rebinding():
    m = _BigBn().eval()
    x = torch.randn(5, 128)
    with torch.no_grad():
        cm = opencann.compile(m, (x,))
        m.lin.weight.data = torch.randn(64, 128)
        with pytest.raises(ValueError, match="'lin.weight' was given new storage"):
            cm(x)


@pytest.mark.parametrize("how", ["new_parameter", "load_state_dict_assign", "new_submodule"])
def test_opencann_compile_refuses_after_a_frozen_tensor_was_replaced(how):
    m = _BigBn().eval()
    x = torch.randn(5, 128)
    with torch.no_grad():
        cm = opencann.compile(m, (x,))
        if how == "new_parameter":
            m.lin.weight = nn.Parameter(torch.randn(64, 128))
        elif how == "load_state_dict_assign":
            m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True)
        else:
            m.lin = nn.Linear(128, 64)
        with pytest.raises(ValueError, match=r"^parameter or buffer '(lin\.|r[mv]).*' was "
                                             r"replaced \(.*after compiling"):
            cm(x)


def test_opencann_compile_keeps_working_after_the_module_is_deleted():
    m = _BigBn().eval()
    x = torch.randn(5, 128)
    with torch.no_grad():
        cm, ref = opencann.compile(m, (x,)), m(x)
    del m
    import gc
    gc.collect()
    assert_close(cm(x), ref, strides=True, signed_zeros=True)


def test_an_unrelated_optimizer_step_leaves_compiled_models_alone():
    m, other = _BigBn().eval(), nn.Linear(3, 3)
    x = torch.randn(5, 128)
    with torch.no_grad():
        cm = opencann.compile(m, (x,))
    other(torch.randn(2, 3)).sum().backward()
    torch.optim.Adam(other.parameters(), fused=True).step()
    torch.optim.Adam(m.parameters(), fused=True).step()     # no gradients: writes nothing
    with torch.no_grad():
        assert_close(cm(x), m(x), strides=True, signed_zeros=True)


# == B7-8: a model that writes into a parameter in forward compiles, then every call fails
# with an internal pytree error (`leaves` has length 2 ...) instead of one clear error.
# Buffers get "the model mutates its buffer ..." at compile time; parameters do not
# (Embedding(max_norm=...) renorms its weight in forward; EMA-style `p.mul_` under
# no_grad). torch.compile follows eager.

class _ParamWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        with torch.no_grad():
            self.w.mul_(0.5)
        return x * self.w


class _ParamViewWrite(nn.Module):
    """Writes a slice of a nested module's parameter (through a view) and a buffer."""

    def __init__(self, buffer_too: bool = False):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.buffer_too = buffer_too
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight[:, ::2].clamp_(-0.1, 0.1)
        if self.buffer_too:
            self.count.add_(1)
        return self.lin(x)


class _ParamCopy(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        with torch.no_grad():
            self.w.copy_(x.mean(0))
        return x + self.w


def _param_writers():
    torch.manual_seed(0)
    return {"mul_under_no_grad": (_ParamWrite(), (torch.randn(3, 4),), "w"),
            "embedding_max_norm": (nn.Embedding(10, 4, max_norm=1.0),
                                   (torch.randint(0, 10, (3, 4)),), "weight"),
            "nested_view_clamp": (_ParamViewWrite(), (torch.randn(3, 4),), "lin.weight"),
            "with_buffer_write": (_ParamViewWrite(True), (torch.randn(3, 4),), "lin.weight"),
            "copy_from_input": (_ParamCopy(), (torch.randn(3, 4),), "w")}


@pytest.mark.parametrize("case", ["mul_under_no_grad", "embedding_max_norm",
                                  "nested_view_clamp", "with_buffer_write", "copy_from_input"])
def test_parameter_written_in_forward_is_one_clear_error_or_follows_eager(case):
    m, ins, pname = _param_writers()[case]
    em = copy.deepcopy(m)
    try:
        cm = opencann.compile(m, ins)
        with torch.no_grad():
            got = [cm(*ins) for _ in range(2)]
    except Exception as e:  # noqa: BLE001 - a refusal must name the parameter and the fix
        msg = str(e)
        assert len(msg.splitlines()) == 1 and "parameter" in msg and "torch.compile" in msg, msg
        assert pname in msg or "buffer" in msg, msg
        assert_close(list(m.parameters()), list(em.parameters()), strides=True, signed_zeros=True)   # compiling wrote nothing
        return
    with torch.no_grad():
        ref = [em(*ins) for _ in range(2)]
    assert_close(got, ref, strides=True, signed_zeros=True)
    assert_close(list(m.parameters()), list(em.parameters()), strides=True, signed_zeros=True)


@pytest.mark.parametrize("case", ["mul_under_no_grad", "embedding_max_norm",
                                  "nested_view_clamp", "copy_from_input"])
def test_torch_compile_follows_a_parameter_written_in_forward(case):
    m, ins, _ = _param_writers()[case]
    em = copy.deepcopy(m)
    tm = torch.compile(m, backend="opencann")
    with torch.no_grad():
        for _ in range(2):
            assert_close(tm(*ins), em(*ins), strides=True, signed_zeros=True)
    assert_close(list(m.parameters()), list(em.parameters()), strides=True, signed_zeros=True)


def test_swaps_that_are_undone_do_not_count_as_replacing_weights():
    """torch.func.functional_call, a second opencann.compile and torch.compile of the same
    module swap its tensors and put them back: the first compiled model keeps working."""
    m = _BigBn().eval()
    x = torch.randn(5, 128)
    with torch.no_grad():
        cm, ref = opencann.compile(m, (x,)), m(x)
        torch.func.functional_call(m, {k: v * 2 for k, v in m.state_dict().items()}, (x,))
        opencann.compile(m, (x,))
        torch.compile(m, backend="opencann")(x)
        assert_close(cm(x), ref, strides=True, signed_zeros=True)


def test_shared_weights_are_the_module_memory_and_a_change_is_still_refused():
    """Option share_weights: the compiled model holds the module's weight memory (no
    snapshot), and a change to the module is refused at the next call as before."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 4)).eval()
    x = _x(3, 8)
    cm = opencann.compile(m, (x,), options={"share_weights": True})
    with torch.no_grad():
        assert_close(cm(x), m(x))
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    assert {c.const.untyped_storage().data_ptr() for c in cm.graph.constants} == params
    assert any("weights shared with the module" in r.note for r in cm.report.passes
               if r.name == "bind_kernels")
    with torch.no_grad():
        m[0].weight.mul_(2)
    with pytest.raises(ValueError, match=r"0\.weight.*modified in place.*Recompile"):
        cm(x)
