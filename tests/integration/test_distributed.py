"""Data-parallel training with gloo on 2 local processes launched by torchrun:
parameters stay identical across ranks and match single-process training on the same
global batch."""
import os
import socket
import subprocess
import sys

import pytest
import torch

from opencann.tools.distributed import backend_for, init_process_group
from helpers import REPO

ROOT = str(REPO)
pytestmark = pytest.mark.serial          # two torchrun processes: alone on the CPUs
sys.path.insert(0, os.path.join(ROOT, "examples"))
from ddp_train import STEPS, model_and_data  # noqa: E402


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
    """Launched as users launch it (torchrun). gloo's teardown intermittently hung or
    aborted when the peer had exited (the example now leaves with os._exit after a
    barrier); as a guard, a launch that hangs or dies by a signal is retried once on a
    new port, and a second hang fails with the launcher's output rather than blocking CI."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", "0",
           os.path.join(ROOT, "examples", "ddp_train.py"), "--out", str(tmp_path)]
    cmd += ["--compiled"] if compiled else []
    for attempt in range(2):
        cmd[cmd.index("--master-port") + 1] = str(_free_port())
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
        except subprocess.TimeoutExpired as e:
            if attempt == 1:
                pytest.fail(f"torchrun did not finish in 120 s twice: {e.stderr!s:.2000}")
            continue
        # a rank killed by a signal (gloo teardown, seen once as SIGABRT) gets one retry
        if res.returncode == 0 or "exitcode: -" not in res.stderr:
            break
    assert res.returncode == 0, res.stderr[-3000:]
    r0, r1 = torch.load(tmp_path / "r0.pt"), torch.load(tmp_path / "r1.pt")
    model, xs, ys = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs[s]), ys[s]).backward()
        opt.step()
    for a, b, ref in zip(r0, r1, model.parameters()):
        assert torch.equal(a, b)
        assert (a - ref).abs().max() / ref.abs().max() < 1e-5
