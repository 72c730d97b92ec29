"""Can torch's oneDNN Graph fuser (LLGA, TorchScript) cut the per-op
overhead of opencann's int8 ResNet-50? Three measurements, one process each:

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/llga_int8.py --probe
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/llga_int8.py --chain 4 --rounds 200
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/llga_int8.py --model --batch 1 --rounds 15

``--probe`` traces ``quantize → dequantize → conv2d(dequantized int8 weight) → relu →
quantize → dequantize`` (the reference-quantized pattern oneDNN Graph's int8 recipe
fuses: its Dequantize / Quantize ops) with LLGA on, freezes it, and prints which ops went
into oneDNN Graph partitions (``prim::oneDNNFusionGroup``) and which stayed TorchScript
ops. torch's fuser (torch/csrc/jit/codegen/onednn/graph_helper.cpp) maps no
quantize / dequantize op and admits only fp32 / bf16 tensors, so the int8 ops stay
outside and the partition is an fp32 convolution.

``--chain N`` times a chain of N convolution + ReLU layers (1×1 64→64 on a 2×2 image by
default: oneDNN's own work is ~1 µs, so a call is its fixed cost) four ways, interleaved:
LLGA fp32 (one partition per convolution + ReLU), LLGA with the int8 Q/DQ ops between
(what an int8 trace gives on torch 2.13), torch's ``mkldnn._convolution_pointwise``
(opencann's fp32 kernel) and ``onednn.qconv2d_pointwise`` uint8 → uint8 (opencann's int8
kernel after ``fuse_requant``). Prints µs per call and per layer (least and median), and
each way's call less oneDNN's primitives (``ONEDNN_VERBOSE``'s primitive exec times, least
sum over 20 calls; a partition's own line, which holds its primitives, is left out): the
fixed cost per layer.

``--model`` times ResNet-50 (the zoo's, seeded random weights, a real image) per call:
opencann int8 (``opencann.quantize`` calibrated as ``bench/precision.py``), opencann fp32
(``opencann.compile``: the same convolutions as LLGA fp32, one torch op call each), LLGA fp32
(frozen trace, conv-BN folded by ``torch.jit.freeze``), the int8 trace (BatchNorm folded
into each convolution, per-tensor uint8 Q/DQ of every convolution's input at its
calibrated range, per-channel int8 weights dequantized in the graph), the same with the
dequantized weights as fp32 constants (no weight dequantize per call), and eager fp32;
least and median over ``--rounds`` interleaved rounds, ms, and each row's cosine to eager;
then for opencann int8 / fp32 and LLGA fp32, over 15 calls with ``ONEDNN_VERBOSE`` on, each
call's time less the sum of its own primitives' exec times (least and median): the cost
outside oneDNN's primitives, which an LLGA int8 path would shrink (an upper bound: it
includes writing the verbose lines).
``--keep-bn``: the int8 traces keep BatchNorm unfolded (torch 2.13's partitions then take
0.1-0.5 s each and grow slower call after call). Every LLGA row computes in fp32: on this
torch the int8 ops cannot enter a partition.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
warnings.filterwarnings("ignore", message=".*quantize.*deprecated.*")
warnings.filterwarnings("ignore", message=".*quantized tensor.*")


def _llga_freeze(module: torch.nn.Module, x: torch.Tensor) -> torch.jit.ScriptModule:
    """``module`` traced on ``x`` and frozen with oneDNN Graph fusion on, run 3 times (the
    profiling executor fuses on the second run)."""
    torch.jit.enable_onednn_fusion(True)
    with torch.no_grad():
        t = torch.jit.freeze(torch.jit.trace(module.eval(), x, check_trace=False))
        for _ in range(3):
            t(x)
    return t


def _qdq(x: torch.Tensor, step: float, zp: int) -> torch.Tensor:
    return torch.quantize_per_tensor(x, step, zp, torch.quint8).dequantize()


class QDQConv(torch.nn.Module):
    """A Conv2d as the reference-quantized pattern: uint8 Q/DQ of its input (per-tensor,
    the step and zero point given), its weight int8 per output channel (symmetric,
    max|w| / 127) dequantized in the graph, then the fp32 convolution."""

    def __init__(self, conv: torch.nn.Conv2d, step: float, zp: int, const_weight: bool = False):
        super().__init__()
        w = conv.weight.detach()
        s = (w.abs().amax((1, 2, 3)) / 127).clamp_min(1e-12)
        self.wq = torch.quantize_per_channel(w, s.double(), torch.zeros(len(s), dtype=torch.long), 0, torch.qint8)
        self.const_weight = const_weight
        if const_weight:       # the int8 weight's values as an fp32 constant: no dequantize in the trace
            self.wq = torch.nn.Parameter(self.wq.dequantize(), requires_grad=False)
        self.bias = conv.bias
        self.args = (conv.stride, conv.padding, conv.dilation, conv.groups)
        self.step, self.zp = step, zp

    def forward(self, x):
        w = self.wq if self.const_weight else self.wq.dequantize()
        return F.conv2d(_qdq(x, self.step, self.zp), w, self.bias, *self.args)


def probe() -> List[str]:
    """The optimized TorchScript graph of one int8 conv + ReLU layer with LLGA on: which
    ops each oneDNN Graph partition holds, and which stayed outside."""
    conv = torch.nn.Conv2d(16, 16, 3, padding=1)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c = QDQConv(conv, 0.05, 128)

        def forward(self, x):
            return _qdq(torch.relu(self.c(x)), 0.05, 0)

    _llga_freeze(Layer(), torch.randn(1, 16, 8, 8))
    inside, out = _partitions()
    return [f"oneDNN Graph partitions: {inside}", f"TorchScript ops outside them: {out}"]


def _partitions():
    """([ops of each oneDNN Graph partition], [TorchScript ops outside them]) of the last
    executed optimized graph."""
    out, inside = [], []

    def visit(nodes):
        for n in nodes:
            k = n.kind()
            if k.startswith("prim::oneDNNFusionGroup"):
                inside.append([m.kind() for m in n.g("Subgraph").nodes() if m.kind() != "prim::Constant"])
            elif k == "prim::If":
                visit(next(n.blocks()).nodes())       # the fused branch (the other: the fallback)
            elif k not in ("prim::Constant", "prim::GetAttr"):
                out.append(k)
    visit(torch.jit.last_executed_optimized_graph().nodes())
    return inside, out


def _timed(fns: Dict[str, Callable], rounds: int, inner: int) -> Dict[str, List[float]]:
    """Seconds per call of each function, ``rounds`` interleaved rounds of ``inner`` calls."""
    res: Dict[str, List[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                f()
            res[k].append((time.perf_counter() - t0) / inner)
    return res


def chain(n: int, c: int, hw: int, k: int, rounds: int) -> Dict[str, List[float]]:
    """The four ways of running ``n`` conv (c→c, k×k, 'same' padding) + ReLU layers on a
    [1, c, hw, hw] channels-last input (module docstring); seconds per call."""
    torch.manual_seed(0)
    convs = [torch.nn.Conv2d(c, c, k, padding=k // 2) for _ in range(n)]
    x = torch.randn(1, c, hw, hw).contiguous(memory_format=torch.channels_last)

    class Fp32(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cs = torch.nn.ModuleList(convs)

        def forward(self, x):
            for cv in self.cs:
                x = torch.relu(cv(x))
            return x

    class Int8(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cs = torch.nn.ModuleList(QDQConv(cv, 0.05, 0) for cv in convs)

        def forward(self, x):
            for cv in self.cs:
                x = torch.relu(cv(x))
            return x

    llga_fp32 = _llga_freeze(Fp32(), x)
    print(f"  LLGA fp32 chain: {len(_partitions()[0])} partitions")
    llga_q = _llga_freeze(Int8(), x)
    pw = torch.ops.mkldnn._convolution_pointwise
    st, pad, dil = [1, 1], [k // 2] * 2, [1, 1]
    wf = [torch.ops.mkldnn._reorder_convolution_weight(cv.weight.detach(), pad, st, dil, 1, list(x.shape))
          for cv in convs]
    bs = [cv.bias.detach() for cv in convs]
    xq = torch.quantize_per_tensor(x, 0.05, 128, torch.quint8).int_repr().contiguous(memory_format=torch.channels_last)
    zp = torch.zeros(c, dtype=torch.long)
    packs, scales = [], []
    for cv in convs:
        w = cv.weight.detach()
        s = (w.abs().amax((1, 2, 3)) / 127).clamp_min(1e-12)
        wq = torch.quantize_per_channel(w, s.double(), zp, 0, torch.qint8).int_repr()
        packs.append(torch.ops.onednn.qconv_prepack(wq, s, 0.05, 128, st, pad, dil, 1, list(x.shape)))
        scales.append(s)
    qconv = torch.ops.onednn.qconv2d_pointwise

    def eager_fp32():
        y = x
        for w, b in zip(wf, bs):
            y = pw(y, w, b, pad, st, dil, 1, "relu", [], "")
        return y

    def int8_ops():
        y = xq
        for p, s, b in zip(packs, scales, bs):
            y = qconv(y, 0.05, 128, p, s, zp, b, st, pad, dil, 1, 0.05, 128, torch.uint8, "relu", [], "")
        return y

    fns = {"LLGA fp32": lambda: llga_fp32(x), "LLGA int8 trace (Q/DQ outside)": lambda: llga_q(x),
           "mkldnn._convolution_pointwise fp32": eager_fp32, "onednn.qconv2d_pointwise u8->u8": int8_ops}
    with torch.no_grad():
        res = _timed(fns, rounds, 20)
        from conv_account import _verbose_exec_ms
        for k, f in fns.items():    # oneDNN's primitives (not its graph partitions' lines): least sum of 20 calls
            ex = min(sum(e[3] for e in run if not e[0].isdigit()) for run in _verbose_exec_ms(f, 20)) * 1e3
            print(f"  {k}: oneDNN exec {ex:.1f} us per call; the call less it {min(res[k]) * 1e6 - ex:.1f} us, "
                  f"{(min(res[k]) * 1e6 - ex) / n:.1f} per layer")
    return res


def model(batch: int, rounds: int, keep_bn: bool = False) -> Dict[str, List[float]]:
    """ResNet-50 per call (module docstring); seconds per call. ``keep_bn``: the int8
    traces keep BatchNorm after each convolution instead of folding it."""
    import opencann
    from opencann.tools.quantize import create_quant_config
    from precision import calibration_for, inputs_for
    zm = inputs_for("resnet50", batch)
    m, x = zm.model, zm.example_inputs[0]
    q = opencann.quantize(m, calibration_for(zm), config=create_quant_config())
    c = opencann.compile(m, (x,))
    llga_fp32 = _llga_freeze(_Pooled(m), x)
    inside, _ = _partitions()
    print(f"  LLGA fp32: {len(inside)} partitions, {sum(map(len, inside))} ops in them")
    ranges = _conv_input_ranges(m, calibration_for(zm))
    llga_q = _llga_freeze(_qdq_model(m, ranges, keep_bn=keep_bn), x)
    inside, out = _partitions()
    print(f"  LLGA int8 trace: {len(inside)} partitions, {len(out)} TorchScript ops outside them")
    llga_qc = _llga_freeze(_qdq_model(m, ranges, const_weight=True, keep_bn=keep_bn), x)
    rows = {"opencann int8 (opencann.quantize)": lambda: q(x).pooler_output,
            "opencann fp32 (opencann.compile)": lambda: c(x).pooler_output, "LLGA fp32": lambda: llga_fp32(x),
            "LLGA int8 trace (Q/DQ outside partitions)": lambda: llga_q(x),
            "LLGA int8 trace, weights as fp32 constants": lambda: llga_qc(x),
            "eager fp32": lambda: m(x).pooler_output}
    with torch.no_grad():
        ref = m(x).pooler_output
        for name, f in rows.items():
            cos = F.cosine_similarity(f().flatten().double(), ref.flatten().double(), dim=0)
            print(f"  {name}: cosine to eager fp32 {float(cos):.5f}")
        res = _timed(rows, rounds, 1)
        from conv_account import _verbose_exec_ms
        for k in ("opencann int8 (opencann.quantize)", "opencann fp32 (opencann.compile)", "LLGA fp32"):
            secs: List[float] = []

            def timed(f=rows[k]):
                t0 = time.perf_counter()
                f()
                secs.append(time.perf_counter() - t0)
            prims = [[e for e in run if not e[0].isdigit()] for run in _verbose_exec_ms(timed, 15)]
            outside = [t * 1e3 - sum(e[3] for e in run) for t, run in zip(secs, prims)]
            print(f"  {k}: {len(prims[-1])} oneDNN primitives, {min(sum(e[3] for e in r) for r in prims):.1f} ms "
                  f"(least of 15 calls); a call less its own primitives: least {min(outside):.1f} ms, "
                  f"median {statistics.median(outside):.1f}")
    return res


def _conv_input_ranges(m: torch.nn.Module, batches: List[tuple]) -> Dict[str, tuple]:
    """{Conv2d module name: (min, max)} of its input over the calibration batches."""
    ranges: Dict[str, tuple] = {}

    def hook(name):
        def record(mod, args):
            lo, hi = ranges.get(name, (0.0, 0.0))
            ranges[name] = (min(lo, float(args[0].min())), max(hi, float(args[0].max())))
        return record
    hooks = [mod.register_forward_pre_hook(hook(name)) for name, mod in m.named_modules()
             if isinstance(mod, torch.nn.Conv2d)]
    with torch.no_grad():
        for (xc,) in batches:
            m(xc)
    for h in hooks:
        h.remove()
    return ranges


class _Pooled(torch.nn.Module):
    """A transformers ResNetModel returning its pooled output only (traceable)."""

    def __init__(self, m: torch.nn.Module):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m(x).pooler_output


def _qdq_model(m: torch.nn.Module, ranges: Dict[str, tuple], const_weight: bool = False,
               keep_bn: bool = False) -> torch.nn.Module:
    """A copy of ``m`` with each BatchNorm folded into its convolution (as opencann and
    oneDNN Graph's int8 recipe do before quantizing) and its Conv2d modules `QDQConv` at
    their observed input range (uint8, opencann's calibration rule), returning the pooled
    output."""
    import copy
    from torch.nn.utils.fusion import fuse_conv_bn_eval
    mq = copy.deepcopy(m)
    for name, (lo, hi) in ranges.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = mq.get_submodule(parent_name) if parent_name else mq
        conv = getattr(parent, leaf)
        if not keep_bn and isinstance(getattr(parent, "normalization", None), torch.nn.BatchNorm2d):
            conv = fuse_conv_bn_eval(conv, parent.normalization)
            parent.normalization = torch.nn.Identity()
        step = max(hi - lo, 1e-8) / 255.0
        setattr(parent, leaf, QDQConv(conv, step, int(round(-lo / step)), const_weight))
    return _Pooled(mq)


def _report(res: Dict[str, List[float]], unit: float, per: int = 1) -> None:
    """One Markdown row per item: least and median over the rounds (and per layer)."""
    for k, v in res.items():
        lo, med = min(v) * unit, statistics.median(v) * unit
        tail = f"; per layer {lo / per:.1f} / {med / per:.1f}" if per > 1 else ""
        print(f"| {k} | {lo:.1f} | {med:.1f}{tail} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probe", action="store_true")
    ap.add_argument("--chain", type=int, default=0, help="layers in the conv + ReLU chain")
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--hw", type=int, default=2)
    ap.add_argument("--kernel", type=int, default=1)
    ap.add_argument("--model", action="store_true")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--keep-bn", action="store_true", help="the int8 traces keep BatchNorm unfolded")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    if args.probe:
        print("\n".join(probe()))
    if args.chain:
        res = chain(args.chain, args.channels, args.hw, args.kernel, args.rounds)
        print(f"{args.chain} x (conv {args.channels}->{args.channels} {args.kernel}x{args.kernel} at "
              f"{args.hw}x{args.hw} + ReLU), {args.threads} threads, {args.rounds} rounds of 20 calls, "
              f"load {load0:.2f} -> {os.getloadavg()[0]:.2f}; us per call, least / median")
        _report(res, 1e6, args.chain)
    if args.model:
        res = model(args.batch, args.rounds, args.keep_bn)
        print(f"ResNet-50 batch {args.batch}, {args.threads} threads, {args.rounds} rounds, load {load0:.2f} -> "
              f"{os.getloadavg()[0]:.2f}; ms per call, least / median")
        _report(res, 1e3)


if __name__ == "__main__":
    main()
