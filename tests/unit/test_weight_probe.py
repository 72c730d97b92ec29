"""`opencann.ops.weight_probe.probe_bytes`: the bytes standing for a weight's values in
the keys of shared packed copies and merged weights (a write through ``.data`` keeps the
version counter, not the probe)."""
import torch

from opencann.ops.weight_probe import SAMPLE, SMALL_BYTES, probe_bytes


def test_small_tensors_are_probed_whole_large_ones_at_both_ends():
    small = torch.randn(8, 16)
    assert probe_bytes(small) == small.numpy().tobytes()
    big = torch.randn(128, 64)                                # 32 KiB > SMALL_BYTES
    assert big.numel() * 4 > SMALL_BYTES
    flat = big.view(-1)
    assert probe_bytes(big) == torch.cat([flat[:SAMPLE], flat[-SAMPLE:]]).numpy().tobytes()


def test_a_transposed_view_is_read_in_its_storage_order():
    w = torch.randn(64, 128)
    assert probe_bytes(w.t()) == probe_bytes(w)
    h = torch.randn(128, 128).to(torch.bfloat16)              # any dtype: raw bytes
    assert probe_bytes(h.t()) == probe_bytes(h) and len(probe_bytes(h)) == 2 * SAMPLE * 2


def test_a_write_through_data_changes_the_probe_not_the_version():
    w = torch.nn.Parameter(torch.randn(256, 64))
    before, version = probe_bytes(w.t()), w._version
    w.data.mul_(2.0)
    assert w._version == version and probe_bytes(w.t()) != before
    g = torch.randn(8, 256)[:, ::2]                           # gapped: still probed
    assert probe_bytes(g) == g.contiguous().numpy().tobytes()
    assert probe_bytes(torch.empty(0, 3)) == b""
