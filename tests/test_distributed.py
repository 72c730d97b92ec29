"""Data-parallel training with gloo on 2 local processes: parameters stay identical
across ranks and match single-process training on the same global batch."""
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from opencann.tools.distributed import backend_for, init_process_group

STEPS, GLOBAL_BATCH = 3, 8


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, GLOBAL_BATCH, 6, generator=g), torch.randn(STEPS, GLOBAL_BATCH, 3, generator=g)


def _worker(rank, world, port, out_dir, compiled):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from opencann.tools.distributed import wrap_ddp
    init_process_group("hccl")
    model = _model()
    backend = None
    if compiled:
        from opencann.frontend.torch.training import opencann_training_backend
        backend = opencann_training_backend
    ddp = wrap_ddp(model, compile_backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = _data()
    per = GLOBAL_BATCH // world
    for s in range(STEPS):
        opt.zero_grad()
        x, y = xs[s, rank * per:(rank + 1) * per], ys[s, rank * per:(rank + 1) * per]
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    torch.save([p.detach() for p in model.parameters()], os.path.join(out_dir, f"r{rank}.pt"))
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_backend_names():
    assert backend_for("hccl", "cpu") == "gloo"
    assert backend_for("hccl", "cuda:0") == "nccl"
    assert backend_for("gloo") == "gloo"
    with pytest.raises(ValueError, match="unknown distributed backend"):
        backend_for("mpi2")
    with pytest.raises(ValueError, match="nccl needs CUDA"):
        backend_for("nccl", "cpu")


def test_init_needs_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        init_process_group("hccl")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "opencann"])
def test_two_ranks_match_single_process(tmp_path, compiled):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path), compiled), nprocs=2, join=True)
    r0, r1 = torch.load(tmp_path / "r0.pt"), torch.load(tmp_path / "r1.pt")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = _data()
    for s in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs[s]), ys[s]).backward()
        opt.step()
    for a, b, ref in zip(r0, r1, model.parameters()):
        assert torch.equal(a, b)
        assert (a - ref).abs().max() / ref.abs().max() < 1e-5
