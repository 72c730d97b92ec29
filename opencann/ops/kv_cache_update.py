"""The ``KvCacheUpdate`` graph op: the KV cache as graph state, written in place with
scatter-update semantics (Ascend's ``torch_npu.scatter_update_``; torch custom op
``torch.ops.opencann.kv_cache_update``, `opencann.ops.llm_torch`).

Node layout (BNSD, as DecodeAttention reads the cache): inputs cache [B, Hkv, S_max, D],
new [B, Hkv, T, D] (the cache's dtype) and positions [B] (integer: row b writes cache
positions positions[b] .. positions[b] + T - 1; data, not shape, so one graph serves every
position); attrs ``cache``/``new``/``positions`` (TensorRefs). Output 0 is the cache after
the write, in the cache's own memory (``inplace_of={0: "cache"}``): no arena buffer, no
copy. When the cache is a graph input the model declares written (torch.export lists it
as a user-input mutation), the compiled model writes the caller's tensor directly and
skips the copy-back of the new value (TorchAir's ``input_inplace_pass``); readers of the
updated cache (DecodeAttention) read output 0, so they run after the write, and readers
of the old contents are scheduled before it (`opencann.passes.schedule_order.order_edges`).
Kernel: `opencann.ops.kernels.kv_cache_update_cpu.kv_cache_update` (numba, bit-exact
copy); vnpu: `opencann.ops.kernels.vnpu_cost.scatter_update` (memory-bound).
"""
from __future__ import annotations

from typing import Callable, Sequence

from ..ir import Node, TensorDesc, numel
from .kernels import vnpu_cost, vnpu_nd
from . import per_index
from .opdef import Cost, OpDef, OpKind, register


def kv_cache_update_cost(node: Node) -> Cost:
    """No FLOPs; bytes = ``new`` and ``positions`` read + the same number of cache bytes
    written (only the T positions per row are touched, never the whole cache)."""
    new, pos = node.arg("new").desc, node.arg("positions").desc
    moved = numel(new.shape) * new.dtype.itemsize
    return Cost(0, 2 * moved + numel(pos.shape) * pos.dtype.itemsize)


def make_kv_cache_update_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """Kernel factory: ``run(cache, new, positions) -> cache`` (written in place, returned
    itself); raises ValueError on bad shapes, dtypes or positions past the cache (one
    line each, `opencann.ops.kernels.kv_cache_update_cpu.kv_cache_update`)."""
    from .kernels.kv_cache_update_cpu import kv_cache_update
    c, n, p = (node.attrs[k].index for k in ("cache", "new", "positions"))
    if (c, n, p) == (0, 1, 2):
        return kv_cache_update

    def run(*xs):
        return kv_cache_update(xs[c], xs[n], xs[p])
    return run


register(OpDef("KvCacheUpdate", OpKind.DATA, aliases=(("cache",),), inplace_of={0: "cache"},
               cost_fn=kv_cache_update_cost, device_cost={"vnpu": vnpu_cost.scatter_update},
               kernel_factories={"cpu": make_kv_cache_update_kernel, "vnpu": vnpu_nd.make_kv_cache_update},
               custom_op="opencann::kv_cache_update", per_index=per_index.kv_cache_update,
               doc="writes new keys/values into the KV cache in place at per-row positions "
                   "(scatter_update_ semantics; the caller's cache tensor, no copy)"))
