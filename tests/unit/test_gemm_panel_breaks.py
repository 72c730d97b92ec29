"""Bad inputs to the panel GEMM's entry points (`gemm_panel_cpu.pack_panels`, `bind_panel`,
`gemm_panel` and the bound call) found by trying to break it: each is one ValueError line
naming the panel GEMM, never a TypeError / AttributeError / RuntimeError from deeper down,
and a column count that does not match the packed weight is refused instead of silently
truncating the result."""
import numpy as np
import pytest
import torch

from opencann.ops.kernels.gemm_panel_cpu import NR, bind_panel, gemm_panel, pack_panels


def _one_line(call, match):
    with pytest.raises(ValueError, match=match) as e:
        call()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("n", [20.0, None, "20", -5, True])
def test_bind_refuses_a_column_count_that_is_not_a_non_negative_int(n):
    packed = pack_panels(torch.randn(20, 8).t()) if n != -5 else pack_panels(torch.randn(0, 8).t())
    _one_line(lambda: bind_panel(packed, 4, n), "gemm_panel: n ")


def test_bind_refuses_fewer_columns_than_the_packed_weight_holds():
    """n = 17 for a weight of 20 columns: the same panel count, but the result would lose
    three columns without a word."""
    w = torch.randn(20, 8)
    _one_line(lambda: bind_panel(pack_panels(w.t()), 4, 17), "gemm_panel: n = 17")
    x = torch.randn(4, 8)
    assert torch.allclose(bind_panel(pack_panels(w.t()), 4, 20)(x), x @ w.t(), atol=1e-5)


def test_rows_must_not_be_a_bool():
    _one_line(lambda: bind_panel(pack_panels(torch.randn(20, 8).t()), True, 20), "rows must be")


@pytest.mark.parametrize("threads", [0, 10 ** 6, "2"])
def test_a_bad_thread_count_names_the_panel_gemm(threads):
    packed = pack_panels(torch.randn(20, 8).t())
    _one_line(lambda: bind_panel(packed, 4, 20, threads), "^gemm_panel: threads must be")
    _one_line(lambda: gemm_panel(torch.randn(4, 8), torch.randn(20, 8), threads=threads),
              "^gemm_panel: threads must be")


def test_a_packed_weight_that_is_not_a_cpu_tensor_without_grad():
    good = pack_panels(torch.randn(20, 8).t())
    for bad in (good.numpy(), torch.empty(good.shape, device="meta")):
        _one_line(lambda: bind_panel(bad, 4, 20), "gemm_panel: the weight must be")
    # a packed weight that requires grad is read as its values (as bind_gemv's weight)
    x = torch.randn(4, 8)
    got = bind_panel(good.clone().requires_grad_(), 4, 20)(x)
    assert torch.equal(got, bind_panel(good, 4, 20)(x))


def test_pack_and_gemm_panel_refuse_what_is_not_a_cpu_tensor():
    _one_line(lambda: pack_panels(np.zeros((8, 4), np.float32)), "gemm_panel: the weight must be")
    _one_line(lambda: pack_panels(torch.empty(8, 4, device="meta")), "gemm_panel: the weight must be")
    _one_line(lambda: gemm_panel(np.zeros((4, 8), np.float32), torch.randn(20, 8)), "gemm_panel: x must be")
    _one_line(lambda: gemm_panel(torch.randn(4, 8), np.zeros((20, 8), np.float32)), "gemm_panel: x must be")


def test_a_bound_call_refuses_an_out_or_x_it_cannot_write_or_read():
    run = bind_panel(pack_panels(torch.randn(20, 8).t()), 4, 20)
    _one_line(lambda: run(torch.randn(4, 8), None, torch.zeros(4, 20, requires_grad=True)),
              "gemm_panel: out must be")
    _one_line(lambda: run(torch.empty(4, 8, device="meta")), "gemm_panel: x must be")
    assert NR in (16, 32)


@pytest.mark.parametrize("change", ["x_t_", "x_as_strided_", "out_as_strided_"])
@pytest.mark.parametrize("kernel", ["panel", "gemv"])
def test_a_tensor_restrided_in_place_is_not_the_last_calls_layout(change, kernel):
    """The bound call (`gemv_cpu.bind_rows_kernel`, shared by the GEMV and the panel GEMM)
    reuses the last call's NumPy views when it gets the same x and out over the same
    memory: a square x transposed in place, or an x / out given other strides by
    ``as_strided_``, is the same object at the same address but another layout."""
    from opencann.ops.kernels.gemv_cpu import bind_gemv, pack_weight
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(20, 16, generator=g), torch.randn(16, 16, generator=g)
    run = bind_panel(pack_panels(w.t()), 16, 20) if kernel == "panel" else bind_gemv(pack_weight(w), 16)
    out = torch.zeros(16, 20)
    run(x, None, out)
    run(x, None, out)                                    # the second call: the last call's views
    if change == "x_t_":
        x.t_()
    elif change == "x_as_strided_":
        x.as_strided_((16, 16), (1, 16))
    else:
        out.as_strided_((16, 20), (1, 16))
    run(x, None, out)
    assert torch.allclose(out, torch.nn.functional.linear(x, w), atol=1e-4)
