"""What a new shape of a dynamic model costs (#12, item 4): no GEMM weight repacked per
shape (a GEMM packed at the first shape runs addmm at the others), one generated source
for every shape (compiled once), values still matching eager."""
import torch

import opencann
from opencann.dynamic import pin_kernel_choices
from opencann.ir.specialise import specialise


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) + x


def _compile():
    torch.manual_seed(0)
    m = MLP().eval()
    cm = opencann.compile(m, (torch.randn(2, 5, 32),),
                          dynamic_shapes={"x": {0: "batch", 1: "seq"}},
                          dim_ranges={"batch": (1, 8), "seq": (2, 64)})
    return m, cm


def test_a_packed_gemm_runs_addmm_at_other_shapes():
    _, cm = _compile()
    bound = specialise(cm.graph, dict(zip(cm.binder.order, (3, 7))))
    gemms = [n for n in bound.nodes if "kernel" in n.meta]
    assert gemms
    for n in gemms:
        n.meta["kernel"] = "mkl_packed"      # as if measured faster at the first shape
    assert pin_kernel_choices(cm.graph, bound) == (len(gemms), len(gemms))
    names = {n.name for n in gemms}
    assert all(n.meta["kernel"] == "addmm" for n in cm.graph.nodes if n.name in names)


def test_every_shape_generates_one_source_and_matches_eager():
    m, cm = _compile()
    for b, t in ((1, 9), (4, 33), (2, 5)):
        x = torch.randn(b, t, 32)
        with torch.no_grad():
            ref = m(x)
        out = cm(x)
        assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5
        assert torch.equal(cm(x), out)                  # a second call
    pools = [cm.plans._pools[k] for k in cm.plans.keys()]
    assert len(pools) == 3
    srcs = {p.first._src for p in pools}
    codes = {id(p.first._code) for p in pools}
    assert len(srcs) == 1 and len(codes) == 1
