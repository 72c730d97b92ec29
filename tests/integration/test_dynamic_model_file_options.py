"""A saved model with dynamic dims or gears keeps every option it was compiled with: the
loaded model (in a fresh process) plans and, on the vnpu, compiles each new shape with
them, and gives the live model's outputs bit for bit at every shape."""
import subprocess
import sys

import pytest
import torch

import opencann
from opencann.runtime.model_file import read


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        with torch.no_grad():
            self.bn.running_var.uniform_(0.5, 2)
            self.bn.running_mean.uniform_(-1, 1)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3))


CASES = [
    ("vnpu:ascend910b", {"precision_mode": "allow_mix_precision_bf16", "disable": ["fold_batchnorm"]},
     {"dynamic_shapes": {"x": {0: "b"}}}),
    ("vnpu:ascend910b", {"precision_mode": "force_fp16", "dynamic_batch_size": [2, 4]}, {}),
    ("cpu", {"disable": ["fold_batchnorm"], "copy_out": True}, {"dynamic_shapes": {"x": {0: "b"}}}),
]
SHAPES = (3, 4, 2)


def _inputs():
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(b, 3, 8, 8, generator=g) for b in SHAPES]
    xs[0][0, 0, 0, 0] = float("nan")
    return xs


@pytest.mark.parametrize("device,options,kw", CASES)
def test_loaded_equals_live_at_every_shape_in_a_fresh_process(device, options, kw, tmp_path):
    cm = opencann.compile(Net().eval(), (torch.randn(2, 3, 8, 8),), device=device,
                          options=dict(options), **kw)
    path = str(tmp_path / "m.ocm")
    opencann.save(cm, path)
    saved = read(path)["dynamic"]["options"]
    for k, v in options.items():
        if k != "dynamic_batch_size":
            assert saved[k] == v, (k, saved)
    live = [cm(x) for x in _inputs()]
    torch.save(live, tmp_path / "live.pt")
    code = (
        "import sys, torch, opencann\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "g = torch.Generator().manual_seed(7)\n"
        f"xs = [torch.randn(b, 3, 8, 8, generator=g) for b in {SHAPES!r}]\n"
        "xs[0][0, 0, 0, 0] = float('nan')\n"
        f"lm = opencann.load({path!r})\n"
        f"live = torch.load({str(tmp_path / 'live.pt')!r})\n"
        "for x, want in zip(xs, live):\n"
        "    for _ in range(2):\n"
        "        got = lm(x)\n"
        "        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), "
        "want.nan_to_num()), (x.shape, (got - want).abs().max())\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
