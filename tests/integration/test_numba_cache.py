"""numba caches opencann's kernels (FlashAttention's, AddLayerNorm's: ``cache=True``) in
the user cache directory, never in the package (`opencann.ops.kernels.numba_cache`), so a
read-only install works: a cached kernel's call in a fresh process on a copy of the
package made unwritable (the bf16 ReLU's, which compiles in a second where
FlashAttention's forward takes 10-25 s: every cached kernel goes through the same
`numba_cache.njit`, and `test_every_cached_kernel_uses_the_user_cache_dir` checks
FlashAttention's locators), its result checked against eager."""
import os
import pathlib
import shutil
import stat
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = r"""
import torch
from opencann.ops.kernels.relu_numba import relu_
g = torch.Generator().manual_seed(0)
x = torch.randn(4, 40, generator=g).to(torch.bfloat16)
x[0, :3] = torch.tensor([float("nan"), -0.0, float("-inf")])
for _ in range(2):
    ref = torch.relu(x)
    out = relu_(x.clone())
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
print("ok")
"""

def _read_only(root: pathlib.Path) -> None:
    for p in [root, *root.rglob("*")]:
        mode = p.stat().st_mode
        p.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def _writable(root: pathlib.Path) -> None:
    for p in [root, *root.rglob("*")]:
        p.chmod(p.stat().st_mode | stat.S_IWUSR)


@pytest.mark.heavy   # a fresh process on a copy of the package (~5 s)
def test_kernels_cache_in_the_user_cache_dir_on_a_read_only_install(tmp_path):
    pkg = tmp_path / "site" / "opencann"
    shutil.copytree(REPO / "opencann", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    _read_only(pkg)
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME")}
    env.update(PYTHONPATH=str(tmp_path / "site"), OPENCANN_CACHE_DIR=str(cache),
               PYTHONDONTWRITEBYTECODE="1")
    try:
        r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                           text=True, timeout=900, cwd=tmp_path)
        assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
        cached = sorted(p.name for p in (cache / "numba").rglob("*.nbi"))
        assert any(n.startswith("relu_numba.") for n in cached), cached
        in_package = [str(p) for p in pkg.rglob("*") if p.suffix in (".nbi", ".nbc")]
        assert in_package == []
    finally:
        _writable(pkg)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    from opencann.ops.kernels.numba_cache import cache_dir
    monkeypatch.setenv("OPENCANN_CACHE_DIR", str(tmp_path / "oc"))
    assert cache_dir() == str(tmp_path / "oc" / "numba")
    monkeypatch.delenv("OPENCANN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == str(tmp_path / "xdg" / "opencann" / "numba")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "opencann", "numba")


def test_every_cached_kernel_uses_the_user_cache_dir():
    """Every numba dispatcher of opencann's that caches (FlashAttention's module-level
    kernels, AddLayerNorm's built on first use) locates its cache under `cache_dir` (or
    under ``NUMBA_CACHE_DIR`` when the user set it), not in the package."""
    from numba.core.caching import NullCache
    from numba.core.registry import CPUDispatcher
    from opencann.ops.flash_attention import cpu as fa
    from opencann.ops.kernels import add_layer_norm
    from opencann.ops.kernels.numba_cache import cache_dir
    kernels = [d for d in vars(fa).values() if isinstance(d, CPUDispatcher)]
    kernels.append(add_layer_norm._compiled())
    cached = [d for d in kernels if not isinstance(d._cache, NullCache)]
    assert len(cached) >= 8, [d.__name__ for d in kernels]
    root = os.environ.get("NUMBA_CACHE_DIR") or cache_dir()
    for d in cached:
        assert d._cache.cache_path.startswith(root), (d.__name__, d._cache.cache_path)
        assert not d._cache.cache_path.startswith(str(REPO / "opencann")), d.__name__


def test_a_cached_kernel_is_stamped_with_every_kernel_source(tmp_path):
    """numba stamps a cached kernel with its own file only; opencann's locators add a
    digest of every source under opencann/ops, so a changed intrinsic (gemv_tile's
    register tile, used by gemv_cpu's kernels) or inlined helper recompiles what uses it."""
    from opencann.ops.kernels import gemv_cpu
    from opencann.ops.kernels.numba_cache import kernel_sources_stamp
    stamp = gemv_cpu._gemv_blocks_kernel._cache._impl.locator.get_source_stamp()
    assert stamp[-1] == kernel_sources_stamp() and len(stamp) == 2
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub" / "tile.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not a source\n")
    before = kernel_sources_stamp(str(tmp_path))
    (tmp_path / "notes.txt").write_text("still not a source\n")
    kernel_sources_stamp.cache_clear()
    assert kernel_sources_stamp(str(tmp_path)) == before
    (tmp_path / "sub" / "tile.py").write_text("y = 20\n")     # a dependency changes
    kernel_sources_stamp.cache_clear()
    assert kernel_sources_stamp(str(tmp_path)) != before
