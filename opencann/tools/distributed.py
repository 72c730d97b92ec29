"""Data-parallel training helpers: backend names, process-group set-up from torchrun's
environment, and DDP wrapping of a compiled model.

CANN's collective library is HCCL; scripts migrated from Ascend ask for
``backend="hccl"``. Here ``"hccl"`` maps to the collective library of the device at
hand: gloo on CPU, nccl on CUDA. Gradient all-reduce is torch's
``DistributedDataParallel`` (a well-kept implementation beats our own). Source: PyTorch
"torch.distributed" and "torchrun" docs (env vars RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT); Ascend "torch_npu distributed training" guide (hccl).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

BACKENDS = ("hccl", "gloo", "nccl")


def backend_for(name: str = "hccl", device: str = "cpu") -> str:
    """The torch.distributed backend for ``name`` on ``device``: "hccl" → "gloo" on CPU,
    "nccl" on CUDA; "gloo"/"nccl" are passed through. Raises ValueError for another
    name, or nccl on a CPU device."""
    name = name.lower()
    dev = device.split(":")[0]
    if name not in BACKENDS:
        raise ValueError(f"unknown distributed backend {name!r}; use one of {list(BACKENDS)}")
    if name == "hccl":
        return "nccl" if dev == "cuda" else "gloo"
    if name == "nccl" and dev != "cuda":
        raise ValueError("nccl needs CUDA devices; on CPU use backend 'gloo' (or 'hccl', "
                         "which maps to gloo here)")
    return name


def init_process_group(backend: str = "hccl", device: str = "cpu", rank: Optional[int] = None,
                       world_size: Optional[int] = None, timeout_s: float = 300.0) -> int:
    """Initialise the default process group from torchrun's environment (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT) unless ``rank``/``world_size`` are given.
    Returns this process's rank. Idempotent. Raises RuntimeError naming the missing
    variable when the environment is incomplete."""
    if dist.is_initialized():
        return dist.get_rank()
    rank = int(os.environ["RANK"]) if rank is None and "RANK" in os.environ else rank
    if world_size is None and "WORLD_SIZE" in os.environ:
        world_size = int(os.environ["WORLD_SIZE"])
    missing = [k for k, v in (("RANK", rank), ("WORLD_SIZE", world_size)) if v is None]
    missing += [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"distributed set-up needs {missing}: launch with torchrun, or set "
                           "them (MASTER_ADDR=127.0.0.1, MASTER_PORT=<free port>)")
    import datetime
    dist.init_process_group(backend_for(backend, device), rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return rank


def wrap_ddp(model: torch.nn.Module, compile_backend=None, device: str = "cpu", **ddp_kwargs):
    """Wrap ``model`` in DistributedDataParallel, then (if ``compile_backend`` is given,
    e.g. the opencann training backend) compile it with ``torch.compile``; dynamo's
    DDP optimizer splits the graph at bucket boundaries so all-reduce overlaps backward.
    Raises RuntimeError when no process group is initialised."""
    if not dist.is_initialized():
        raise RuntimeError("no process group: call opencann.tools.distributed."
                           "init_process_group() first")
    ids = None if device.split(":")[0] == "cpu" else [torch.device(device).index or 0]
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, **ddp_kwargs)
    if compile_backend is None:
        return ddp
    return torch.compile(ddp, backend=compile_backend)
