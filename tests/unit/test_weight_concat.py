"""`opencann.ops.weight_concat`: `concat_view` is ``torch.cat`` as a view exactly when the
parts are adjacent blocks of one storage (and None otherwise); `concatenate_in_place`
lays sibling weights out as one concatenation, each ``p.data`` a view of its block, in
both layouts, without changing values, shapes, identity, version counters or grad
flags, and copies nothing when the layout is there already; the old pages of an mmapped
checkpoint are given back."""
import mmap
import sys

import pytest
import torch

from opencann.ops.weight_concat import concat_view, concatenate_in_place


def _params(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def test_adjacent_blocks_are_a_view_and_anything_else_is_none():
    base = torch.randn(10, 6)
    view = concat_view([base[0:3], base[3:4], base[4:10]], 0)
    assert view is not None and view.data_ptr() == base.data_ptr() and torch.equal(view, base)
    cols = torch.randn(4, 12)
    v = concat_view([cols[:, 0:5], cols[:, 5:12]], 1)
    assert v is not None and torch.equal(v, cols) and v.is_contiguous()
    assert concat_view([base[0:3], base[4:10]], 0) is None              # a gap
    assert concat_view([base[3:6], base[0:3]], 0) is None               # out of order
    assert concat_view([base[0:3], torch.randn(7, 6)], 0) is None       # two storages
    assert concat_view([base[0:3, :5], base[3:6, :5]], 0) is None       # not contiguous together
    assert concat_view([base[0:3]], 0) is None                          # one part
    assert concat_view([base[0:3], base[3:6].double()], 0) is None      # dtypes differ
    assert concat_view([cols[:, 0:5], cols[:, 5:12]], 0) is None        # wrong dim
    # a view never reaches past its storage, and carries no autograd history
    p = torch.nn.Parameter(torch.randn(4, 3))
    assert concat_view([p[0:2], p[2:4]], 0).requires_grad is False


@pytest.mark.parametrize("row_major", [False, True])
def test_weights_laid_out_once_keep_values_shapes_identity_and_versions(row_major):
    ws = _params((8, 5), (4, 5), (4, 5))
    ws[1].requires_grad_(False)
    before = [w.detach().clone() for w in ws]
    ids = [id(w) for w in ws]
    with torch.no_grad():
        ws[2].mul_(1.0)      # a version of its own, kept
    versions = [w._version for w in ws]
    cat = concatenate_in_place(ws, row_major=row_major)
    assert [id(w) for w in ws] == ids and [w._version for w in ws] == versions
    assert [w.requires_grad for w in ws] == [True, False, True]
    for w, b in zip(ws, before):
        assert torch.equal(w, b) and w.shape == b.shape
        assert w.untyped_storage().data_ptr() == cat.untyped_storage().data_ptr()
    assert cat.is_contiguous()
    if row_major:
        assert cat.shape == (5, 16) and torch.equal(cat, torch.cat([b.t() for b in before], 1))
        assert ws[1].stride() == (1, 16) and not ws[0].is_contiguous()
    else:
        assert cat.shape == (16, 5) and torch.equal(cat, torch.cat(before, 0))
        assert all(w.is_contiguous() for w in ws)
    # laid out already: the same memory comes back, nothing copied
    again = concatenate_in_place(ws, row_major=row_major)
    assert again.data_ptr() == cat.data_ptr() and torch.equal(again, cat)
    # an in-place change of one weight bumps its version only, and is the concatenation's
    with torch.no_grad():
        ws[1].mul_(2)
    assert ws[1]._version == versions[1] + 1 and ws[0]._version == versions[0]
    assert torch.equal(ws[1], 2 * before[1]) and torch.equal(ws[0], before[0])
    block = cat[:, 8:12].t() if row_major else cat[8:12]
    assert torch.equal(block, 2 * before[1])


def test_biases_and_eager_linear_are_unchanged():
    torch.manual_seed(0)
    lins = [torch.nn.Linear(6, n) for n in (6, 3, 3)]
    x = torch.randn(2, 6)
    want = [lin(x) for lin in lins]
    concatenate_in_place([lin.weight for lin in lins])
    b = concatenate_in_place([lin.bias for lin in lins])
    assert b.shape == (12,) and lins[2].bias.data_ptr() == b.data_ptr() + 9 * 4
    for lin, w in zip(lins, want):
        assert torch.equal(lin(x), w)


@pytest.mark.parametrize("ts, match", [
    ([torch.randn(3, 4)], r"^concatenate_in_place takes two or more sibling weights, got 1$"),
    ([torch.randn(3, 4), torch.randn(3, 4).double()], r"^concatenate_in_place takes sibling Linear "
     r"weights \[n_i, k\] or biases \[n_i\] of one dtype, got .*$"),
    ([torch.randn(2, 3, 4), torch.randn(2, 3, 4)], r"^concatenate_in_place takes sibling Linear"),
])
def test_bad_input_is_one_line(ts, match):
    with pytest.raises(ValueError, match=match):
        concatenate_in_place(ts)


def _mapping_rss_kib(path) -> int:
    """Resident KiB of this process's mappings of ``path`` (/proc/self/smaps)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5 and ":" not in line.split()[0]:
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                rss += int(line.split()[1])
    return rss


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps, madvise")
def test_the_pages_of_an_mmapped_checkpoint_are_given_back(tmp_path):
    """Weights viewing a privately mapped file (transformers' safetensors loading) keep
    the file's pages resident while the mapping lives; laid out once, the old pages are
    given back (MADV_DONTNEED) and the values are the file's."""
    path = tmp_path / "weights.bin"
    data = torch.randn(3 * 128 * 128, generator=torch.Generator().manual_seed(3))
    path.write_bytes(data.numpy().tobytes())
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE)
    ws = [torch.nn.Parameter(torch.frombuffer(mm, dtype=torch.float32, count=128 * 128,
                                              offset=i * 128 * 128 * 4).view(128, 128))
          for i in range(3)]
    assert float(sum(w.detach().sum() for w in ws)) == pytest.approx(float(data.sum()), rel=1e-4)
    assert ws[0].data_ptr() != 0 and _mapping_rss_kib(path) >= 3 * 64
    cat = concatenate_in_place(ws)
    assert _mapping_rss_kib(path) == 0
    assert torch.equal(cat, data.view(384, 128)) and torch.equal(ws[2], data[2 * 16384:].view(128, 128))
    # a weight someone still holds keeps its pages
    keep = [torch.nn.Parameter(torch.frombuffer(mm, dtype=torch.float32, count=128 * 128,
                                                offset=i * 128 * 128 * 4).view(128, 128))
            for i in range(2)]
    held = keep[0].detach()
    assert float(held.sum() + keep[1].detach().sum()) != 0.0
    before = _mapping_rss_kib(path)   # the kernel's fault-around may map neighbours too
    concatenate_in_place(keep)
    after = _mapping_rss_kib(path)
    # the free weight's 64 KiB are given back; the held one's stay
    assert after == before - 64 and after >= 64 and torch.equal(held, data[:16384].view(128, 128))
    del held
