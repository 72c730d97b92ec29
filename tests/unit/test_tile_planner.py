"""Tile planner: FlashAttention Algorithm 1 rule, target constraints, fit check."""
import math

import pytest
import torch

from opencann.ops.flash_attention import BUFFER_PRESETS, cpu_l2, cuda_smem, plan_tiles
from opencann.ops.flash_attention.planner import working_set_bytes


@pytest.mark.parametrize("target", ["cpu", "triton", "cube"])
@pytest.mark.parametrize("buf", [BUFFER_PRESETS["ascend910b_ub"], BUFFER_PRESETS["ascend910_ub"],
                                 BUFFER_PRESETS["h100_smem"], 2 * 1024 * 1024])
@pytest.mark.parametrize("d", [64, 128])
def test_plan_fits_and_respects_target(target, buf, d):
    p = plan_tiles(buf, d, torch.float16, target=target)
    assert p.working_set_bytes == working_set_bytes(p.block_q, p.block_k, d, 2, 4)
    assert p.working_set_bytes <= buf
    for blk in (p.block_q, p.block_k):
        assert blk >= 16 and blk % 16 == 0
        if target == "triton":
            assert blk & (blk - 1) == 0
    # never above the Algorithm 1 starting point (except the cpu preference for B_r)
    bc0 = math.ceil(buf // 2 / (4 * d))
    assert p.block_k <= bc0
    assert "Algorithm 1" in p.explain()


def test_algorithm1_values_when_they_fit():
    # M = 65536 fp32 elements, d = 64: B_c = 256, B_r = 64; working set fits 256 KiB.
    p = plan_tiles(256 * 1024, 64, torch.float32, target="cube")
    assert (p.block_q, p.block_k) == (64, 256)
    assert "fits" in p.explain()


def test_shrinks_until_fit_and_explains():
    p = plan_tiles(192 * 1024, 128, torch.float16, target="cube")
    assert "halve" in p.explain()
    assert p.working_set_bytes <= 192 * 1024


def test_sequence_caps_blocks():
    p = plan_tiles(2 * 1024 * 1024, 64, torch.float32, seq_q=20, seq_k=37, target="triton")
    assert (p.block_q, p.block_k) == (32, 64)


def test_errors():
    with pytest.raises(ValueError, match="target"):
        plan_tiles(1024, 64, target="tpu")
    with pytest.raises(ValueError, match="cannot hold"):
        plan_tiles(1024, 64)


def test_hardware_readers():
    size, src = cpu_l2()
    assert size > 0 and src
    smem, src = cuda_smem()
    assert smem > 0 and src
