"""Differential fuzzing of ``torch.compile(backend="opencann")`` across input sizes: random
shape-generic programs whose sizes come from arithmetic on the input's shape, each
called at three sizes and compared with eager PyTorch.

    from opencann.tools.fuzz_shapes import generate_shape_program, run_shape_fuzz
    print(generate_shape_program(3).source())
    res = run_shape_fuzz(cases=50)        # a `opencann.tools.fuzz.FuzzResult`

A program is a chain of steps over one 4-D float tensor ``h`` (N, C, H, W) drawn from
`SHAPE_STEPS`: ``F.interpolate`` by a scale factor (0.5 / 0.75 / 1.5 / 2 / 3.7) or to a
computed size (``H // 2``, ``int(W * 0.5)``, ``math.ceil(H / 3)``, another tensor's size) in
nearest / bilinear / bicubic / area modes, slicing, ``narrow`` and ``split`` by computed
sizes, ``view`` and ``reshape`` with computed sizes, ceil-mode pooling, and elementwise
steps between them. The first call (size S1) compiles a static graph; the second
(S2) makes dynamo recompile with symbolic sizes; the third (S3) reuses or recompiles
it: every call is checked against eager (`opencann.tools.fuzz` ``_compare``: shape,
dtype, values, NaN/±Inf positions), twice, on inputs holding NaN. Backend name:
``dynamo_shapes`` (`Failure.backend`); a program eager refuses at one of its sizes is
skipped. Seeded ``random.Random``: a seed is a repro.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch

from .fuzz import Failure, FuzzResult, _compare, _quiet, _tuple

BACKEND = "dynamo_shapes"


def _interp_scale(rng: random.Random) -> str:
    mode = rng.choice(["nearest", "bilinear", "bicubic", "area", "nearest-exact"])
    f = rng.choice([0.5, 0.75, 1.5, 2, 2.0, 3.7])
    ac = f", align_corners={rng.choice([False, True])}" if mode in ("bilinear", "bicubic") else ""
    rsf = ", recompute_scale_factor=True" if rng.random() < 0.3 else ""
    return f"h = F.interpolate(h, scale_factor={f!r}, mode={mode!r}{ac}{rsf})"


def _interp_size(rng: random.Random) -> str:
    mode = rng.choice(["nearest", "bilinear", "bicubic", "area"])
    size = rng.choice(["(max(1, h.shape[-2] // 2), max(1, h.shape[-1] // 2))",
                       "(int(h.shape[-2] * 1.5), int(h.shape[-1] * 0.5) + 1)",
                       "(math.ceil(h.shape[-2] / 3), math.floor(h.shape[-1] * 1.25))",
                       "x.shape[-2:]", "(h.shape[-2] * 2, h.shape[-1])"])
    ac = f", align_corners={rng.choice([False, True])}" if mode in ("bilinear", "bicubic") else ""
    return f"h = F.interpolate(h, size={size}, mode={mode!r}{ac})"


SHAPE_STEPS: List[Tuple[str, Callable[[random.Random], str]]] = [
    ("interpolate_scale", _interp_scale),
    ("interpolate_size", _interp_size),
    ("slice_float", lambda r: "h = h[..., : max(1, int(h.shape[-1] * %r))]" % r.choice([0.5, 0.7, 0.34])),
    ("slice_ceil", lambda r: "h = h[..., : math.ceil(h.shape[-2] / 2), :]"),
    ("narrow", lambda r: "h = h.narrow(-1, 0, max(1, h.shape[-1] // 3)) * 2"),
    ("split", lambda r: "h = torch.split(h, [h.shape[-1] // 2 + 1, h.shape[-1] - h.shape[-1] // 2 - 1], -1)[%d]"
     % r.randint(0, 1)),
    ("view", lambda r: "h = h.reshape(h.shape[0], h.shape[1], -1)[..., : h.shape[-2] * max(1, h.shape[-1] // 2)]"
     ".view(h.shape[0], h.shape[1], h.shape[-2], max(1, h.shape[-1] // 2))"),
    ("pool_ceil", lambda r: "h = F.%s(h, 2, 2, ceil_mode=True)" % r.choice(["max_pool2d", "avg_pool2d"])),
    ("elementwise", lambda r: r.choice(["h = torch.tanh(h) * 1.5", "h = h * 2 + 1", "h = torch.sigmoid(h) - h",
                                        "h = torch.relu(h) + h.mean(-1, keepdim=True)"])),
    ("back_to_input", lambda r: "h = F.interpolate(h, size=x.shape[-2:], mode='nearest') + x"),
]


@dataclass
class ShapeProgram:
    """A shape-generic program: its seed, step lines and the three input sizes (H = W)."""
    seed: int
    lines: List[str]
    sizes: Tuple[int, int, int]
    channels: int = 2
    steps: List[str] = field(default_factory=list)

    def source(self) -> str:
        """Standalone Python: imports, class M and make_inputs(size, seed)."""
        body = "\n".join(f"        {ln}" for ln in self.lines)
        return (
            "import math\nimport torch\nimport torch.nn.functional as F\n\n\n"
            "class M(torch.nn.Module):\n    def forward(self, x):\n        h = x\n"
            f"{body}\n        return h\n\n\n"
            "def make_inputs(size, seed=0):\n"
            "    g = torch.Generator().manual_seed(seed)\n"
            f"    x = torch.randn(1, {self.channels}, size, size + 1, generator=g)\n"
            "    x.view(-1)[::11] = float('nan')\n"
            "    return (x,)\n"
            f"\n\nSIZES = {self.sizes}\n")

    def ops(self) -> List[str]:
        """The step names, in order (for summaries)."""
        return list(self.steps)

    def namespace(self) -> dict:
        """The globals of `source` executed (``M``, ``make_inputs``, ``SIZES``)."""
        ns: dict = {}
        exec(compile(self.source(), f"<shape program {self.seed}>", "exec"), ns)  # noqa: S102
        return ns


def generate_shape_program(seed: int, max_steps: int = 4) -> ShapeProgram:
    """A random shape-generic program from ``seed`` (same seed, same program)."""
    rng = random.Random(seed)
    n = rng.randint(1, max_steps)
    picks = [rng.choice(SHAPE_STEPS) for _ in range(n)]
    lines = [make(rng) for _, make in picks]
    s1 = rng.randint(6, 12)
    sizes = (s1, s1 + rng.randint(1, 6), s1 + rng.randint(7, 14))
    return ShapeProgram(seed, lines, sizes, rng.randint(1, 3), [name for name, _ in picks])


def check_shape_program(prog: ShapeProgram, tol: float = 1e-4) -> Optional[List[Failure]]:
    """Call ``torch.compile(M(), backend="opencann")`` at ``prog.sizes`` (twice each) and
    compare with eager; the failures (backend ``dynamo_shapes``), [] when all pass, None
    when eager raises at one of the sizes (an invalid program)."""
    ns = prog.namespace()
    m = ns["M"]().eval()
    inputs = [ns["make_inputs"](s, seed=i) for i, s in enumerate(prog.sizes)]
    with _quiet(), torch.no_grad():
        try:
            refs = [_tuple(m(*[t.clone() for t in ins])) for ins in inputs]
        except Exception:  # noqa: BLE001 - eager refused: not a valid program
            return None
        torch._dynamo.reset()
        cm = torch.compile(m, backend="opencann")
        fails: List[Failure] = []
        for k, (ins, ref) in enumerate(zip(inputs, refs)):
            for call in (1, 2):
                try:
                    got = _tuple(cm(*[t.clone() for t in ins]))
                except Exception as e:  # noqa: BLE001 - the backend raised: the finding
                    msg = (str(e).strip().splitlines() or [""])[0][:300]
                    if "raised:" in msg or not msg:
                        lines = [ln for ln in str(e).splitlines() if ln.strip()]
                        msg = " ".join(lines[:2])[:300]
                    return [Failure(BACKEND, "error", f"size {prog.sizes[k]} call {call}: "
                                    f"{type(e).__name__}: {msg}")]
                for i, (o, r) in enumerate(zip(got, ref)):
                    bad = _compare(o, r, tol, f"size {prog.sizes[k]} call {call} output {i}")
                    if bad:
                        fails.append(Failure(BACKEND, bad[0], bad[1]))
        return fails[:1]


def run_shape_fuzz(cases: int = 50, seed: int = 0, max_steps: int = 4,
                   progress: Optional[Callable[[str], None]] = None) -> FuzzResult:
    """Generate ``cases`` shape programs from seeds ``seed..seed+cases-1`` and check each
    (`check_shape_program`); failures are kept with their program (``source()`` is the
    repro)."""
    res = FuzzResult()
    t0 = time.perf_counter()
    for case in range(seed, seed + cases):
        prog = generate_shape_program(case, max_steps)
        res.cases += 1
        res.runs[BACKEND] = res.runs.get(BACKEND, 0) + 1
        got = check_shape_program(prog)
        if got is None:
            res.invalid += 1
            continue
        for f in got:
            res.failures.append((f, prog, ""))
            if progress:
                progress(f"seed {case}: {f}")
    res.seconds = time.perf_counter() - t0
    return res


__all__ = ["BACKEND", "SHAPE_STEPS", "ShapeProgram", "check_shape_program",
           "generate_shape_program", "run_shape_fuzz"]
