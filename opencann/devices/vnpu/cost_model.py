"""Per-kernel time and memory-traffic estimates for the virtual NPU.

Model (one kernel):

* **Cube**: FLOPs on fractal-padded sizes (M to 16, N to 16, K to k0 = 32 B / element),
  at `NpuSpec.peak_cube_tflops` per core, over the cores the kernel can occupy; work is
  split in base tiles, and a partial last *wave* of tiles costs a full wave.
* **Vector**: element operations x an op-specific cost multiplier, at
  `vector_bytes_per_cycle / element size` elements per cycle per vector unit.
* **MTE** (GM <-> L1/UB data movement): bytes each core moves at the per-core
  `gm_read/write_bytes_per_cycle` rates (the L2 serves re-reads), shared by the busy cores
  (`L2_CONTENTION`) in the Cube kernels and FlashAttention.
* **HBM**: bytes that must come from / go to device memory at `hbm_gbps` x `HBM_EFFICIENCY`.
* Double buffering overlaps the pipelines: ``time = launch + max(cube, vector, mte, hbm)``
  and ``bound`` names the slowest (``"launch"`` when the launch exceeds all of them).  The Cube
  GEMM adds what double buffering cannot hide (see `matmul_cost`): the L0C write-back of a tile
  too big to ping-pong, operand bytes arriving from HBM instead of the L2, and the pipeline's
  first and last operand block.

`eager_time_us` adds the host: in an eager framework the host enqueues ops
asynchronously, so one op costs ``max(op_dispatch_us, device time)`` per call in a loop.

Modelling constants without a primary source are marked "estimate" where defined.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from .presets import NpuSpec, ascend910b

__all__ = [
    "KernelCost", "VECTOR_OP_COST", "DISPATCH_SCALE", "HBM_EFFICIENCY", "CUBE_EFFICIENCY", "cube_k0",
    "dispatch_us", "dtype_bytes", "matmul_cost", "conv2d_cost", "elementwise_cost", "fused_vector_cost",
    "reduction_cost", "softmax_cost", "layernorm_cost", "trans_data_cost", "flash_attention_cost",
    "flash_attention_blocks", "eager_time_us", "FA_910B_MEASURED_TFLOPS", "flash_attention_calibration_table",
]

# Vector cost per element in "simple op" units (add = 1).  Estimates: the Ascend vector
# unit issues one instruction per 256-byte repeat; transcendental functions are either
# multi-cycle instructions (exp, ln) or short instruction sequences (the Ascend C math
# library builds gelu, erf, tanh and sigmoid from exp/div/mul/add).  Counts below are the
# number of such instructions, with exp/ln/div/sqrt taken as 2 units (estimate).
VECTOR_OP_COST: dict[str, float] = {
    "add": 1, "sub": 1, "mul": 1, "neg": 1, "abs": 1, "relu": 1, "max": 1, "min": 1, "cast": 1,
    "copy": 1, "where": 1, "leaky_relu": 2, "clamp": 2,
    "div": 2, "exp": 2, "log": 2, "sqrt": 2, "rsqrt": 2, "reciprocal": 2, "pow": 5,
    "sigmoid": 5,      # exp(-x) (2) + add (1) + div (2)
    "silu": 6,         # sigmoid (5) + mul (1)
    "tanh": 7,         # (e^2x - 1) / (e^2x + 1): mul, exp, sub, add, div
    "gelu": 10,        # tanh form: x^3 (2 mul), fma (2), tanh (7)... less shared subexpressions
    "erf": 10,         # polynomial approximation, ~10 mul/add
    "sin": 8, "cos": 8,
}

# FlashAttention modelling constants (see flash_attention_cost).  Sources:
# [PTO-FA-K] CANN pto-isa, kernels/manual/common/flash_atten/README.md and fa_performance_kernel.cpp
#     (hw-native-sys/pto-isa @ a977dd11, 2026-04-30): the hand-written 910B FlashAttention kernel's
#     structure -- compute_qk (Cube) -> compute_p (Vector) -> compute_pv (Cube) -> compute_gu (Vector),
#     every hand-off staged through GM FIFOs and signalled with FFTS cross-core flags, QK run
#     `qkPreloadNum` = 4 tiles ahead so Cube and Vector overlap in steady state, the QK/PV
#     accumulators ping-ponged in L0C (assign_running_acc_tile), CUBE_S1 = 128.
# [PTO-FA-CM] the same directory's scripts/fa_cost_model.py (hw-native-sys/pto-isa @ 0861d808):
#     Huawei's first-order cycle model of that kernel, with simulator- and board-fitted constants.
FA_SOFTMAX_OPS_PER_SCORE = 2 + 2 + VECTOR_OP_COST["exp"] + 1 + 1
"""Vector ops per attention score in the online softmax (FlashAttention-2 Alg. 1, Dao 2023):
cast fp32 in + scale (2), row max + subtract (2), exp (2), row sum (1), cast to fp16 (1) = 8."""
FA_OUTPUT_OPS_PER_ELEM = 2
"""Vector ops per output element per key block: rescale by exp(m_old - m_new) and add PV (2)."""
FA_SYNC_CYCLES = 220
"""Cycles one AIC <-> AIV hand-off (FFTS flag set + wait) adds to the first block's dependency
chain: [PTO-FA-CM] SIM_LOGICAL_TILE_SYNC_CYCLES = 220 (simulator-calibrated).  In steady state
the QK preload hides it."""
FA_TASK_DISPATCH_CYCLES = 2000
"""Cycles to start one (batch, head, query-block) task on a core: [PTO-FA-CM]
NPU_BLOCK_DISPATCH_CYCLES = 2000 (fitted by the kernel's authors to on-board 910B3 runs)."""
L2_CONTENTION = 0.012
"""FITTED, not sourced: the fraction of one core's GM (L2) read and write rate lost per additional
core streaming at the same time.  A kernel with n busy cores (a FlashAttention wave; a GEMM's
tiles) moves its GM traffic at the platform file's per-core rates divided by
``1 + L2_CONTENTION * (n - 1)`` (1.28 with all 24 cores of 910B busy: 110 -> 86 B/cycle read;
1 on one core).
Form (an assumption with support): the platform file's per-core l2_read_rate / l2_write_rate are
taken as what one core gets alone (the file does not say); [PTO-FA] (README "Summary") finds
multi-core runs of the hand-written kernel "approaching a bandwidth/synchronization limit rather
than scaling linearly with core count", and its 1/2/4/8-core table (same work per core, one cold
launch each) loses normalized throughput as cores are added (S1 = 8192: 172.9 / 171.4 / 149.3 /
120.0 TFLOPS).  No public figure gives the 910B L2 bandwidth under load, so the magnitude is fitted
to ONE anchor: the all-core [PTO-FA] time at S = 8K (0.0116 makes it exact; rounded up so the
estimate is not faster).  Checked out of sample against the other all-core times (S = 1K..32K:
estimate / published throughput 0.78-0.94), torch_npu per call (0.84-1.22), one core (unchanged),
and independently by the hand-written GEMM's pipe profile ([PTO-GEMM-A3]: 24 cores loading
(128 + 256) x K fp16 per 128 x 256 tile, its GM -> L1 pipe busy 90.9% / 95.2% of 206.7 / 1506 us
at 3072^3 / 6144^3, i.e. 84 / 88 B/cycle per core while busy, against the model's 86).  Applied to
FlashAttention and to the Cube GEMM (matmul, conv)."""
FA_L2_CONTENTION = L2_CONTENTION
"""`L2_CONTENTION` under its first name (it was fitted for FlashAttention)."""


_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float": 4, "half": 2, "int8": 1, "uint8": 1,
                "int16": 2, "int32": 4, "int64": 8, "float64": 8, "bool": 1}


def dtype_bytes(dtype: Any) -> int:
    """Element size in bytes of a dtype given as torch.dtype, name, or int (bytes).

    Raises ValueError for an unknown dtype.
    """
    if isinstance(dtype, int):
        return dtype
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[name]


@dataclass(frozen=True)
class KernelCost:
    """Estimated cost of one kernel on the vnpu.

    time_us: device time incl. launch (µs); flops: FLOPs executed incl. fractal padding;
    useful_flops: FLOPs of the unpadded problem; hbm_bytes: device-memory traffic (B);
    bound: 'cube' | 'vector' | 'memory' | 'launch'; breakdown: per-pipeline µs and details.
    """

    op: str
    time_us: float
    flops: float
    useful_flops: float
    hbm_bytes: float
    bound: str
    breakdown: Mapping[str, Any] = field(default_factory=dict)

    @property
    def tflops(self) -> float:
        """Useful TFLOP/s achieved over the device time."""
        return self.useful_flops / (self.time_us * 1e-6) / 1e12 if self.time_us > 0 else 0.0


def _ceil(a: float, b: float) -> int:
    return int(-(-a // b))


def _up(a: int, b: int) -> int:
    return _ceil(a, b) * b


def _waves(tiles: int, cores: int) -> tuple[int, int]:
    """(cores used, waves) for `tiles` equal work items on `cores` cores."""
    tiles = max(1, tiles)
    used = min(cores, tiles)
    return used, _ceil(tiles, used)


def _finish(op: str, spec: NpuSpec, *, cube_us: float, vector_us: float, mte_us: float, hbm_bytes: float,
            flops: float, useful: float, extra: Mapping[str, Any] | None = None) -> KernelCost:
    hbm_us = _hbm_us(spec, hbm_bytes)
    pipes = {"cube": cube_us, "vector": vector_us, "memory": max(mte_us, hbm_us)}
    slowest = max(pipes, key=pipes.get)  # type: ignore[arg-type]
    launch = spec.kernel_launch_us
    bound = "launch" if launch > pipes[slowest] else slowest
    breakdown = {"cube_us": cube_us, "vector_us": vector_us, "mte_us": mte_us, "hbm_us": hbm_us,
                 "launch_us": launch, **(extra or {})}
    return KernelCost(op, launch + pipes[slowest], flops, useful, hbm_bytes, bound, breakdown)


def _cube_rate_per_core(spec: NpuSpec, nbytes: int) -> float:
    """FLOP/s of one Cube core for an element size (see NpuSpec.peak_cube_tflops)."""
    return spec.peak_cube_tflops(nbytes) * 1e12 / spec.cube_cores


def _vector_rate_total(spec: NpuSpec, nbytes: int, units: int | None = None) -> float:
    """Element-ops per second of `units` vector units (all by default)."""
    units = spec.vector_cores if units is None else units
    return spec.vector_elems_per_cycle(nbytes) * units * spec.clock_ghz * 1e9


def _mte_us(spec: NpuSpec, read_bytes: float, write_bytes: float, cores: int) -> float:
    hz = spec.clock_ghz * 1e9
    return max(read_bytes / (spec.gm_read_bytes_per_cycle * cores),
               write_bytes / (spec.gm_write_bytes_per_cycle * cores)) / hz * 1e6


# ----------------------------------------------------------------------------------
# Cube kernels
# ----------------------------------------------------------------------------------

def cube_k0(dtype: Any) -> int:
    """K0 of the Cube's operand fractal (16 x K0 in L0A, K0 x 16 in L0B): 32 B / element
    size (fp16 16, int8 32, fp32 8; [HC31]).  Used for padding inside the kernel cost only;
    stored tensors use `formats.c0_for` (fp32 C0 = 16)."""
    return max(1, 32 // dtype_bytes(dtype))


# GEMM sources: [PTO-GEMM-A3] CANN pto-isa kernels/manual/a2a3/gemm_performance (README.md and
# gemm_performance_kernel.cpp, hw-native-sys/pto-isa @ 3186c381): the hand-written A2/A3 GEMM (base tile
# 128 x 256 x 64, L1 and L0A/L0B double-buffered, ONE fp32 accumulator tile in L0C stored between its MMADs
# with M <-> FIX pipe syncs) and its measured per-pipe busy ratios on a 24-core Atlas A3 (1536^3 .. 7680^3).
# [PTO-GEMM] the same repository @ d9ef6d02: torch.matmul and PTO-DSL GEMM times on 910B2 (calibration.py).
# Tiler candidates (estimate: Ascend C Matmul tilings use base blocks of 16..256 rows/columns
# within L0C, and split K across cores ("multi-core K split") when M x N tiles cannot fill them).
TILE_SIZES = (16, 32, 64, 128, 256)
K_SPLITS = (1, 2, 4, 8)
GEMM_BLOCK_K_BYTES = 128
"""Bytes of K per row in one Cube operand block: baseK = 64 fp16 elements, so a 128 x 64 A block and
a 64 x 256 B block fill the 32 KiB ping-pong halves of L0A / L0B in CANN pto-isa's hand-written A2/A3
GEMM ([PTO-GEMM-A3]: kernels/manual/a2a3/gemm_performance, baseK = 64, hw-native-sys/pto-isa @
3186c381).  The pipeline's ends: the Cube cannot start before the first such block has arrived,
and the kernel cannot end before the last block's MMAD and its write-back."""
HBM_EFFICIENCY = 0.85
"""estimate (derating): fraction of nominal HBM bandwidth a streaming kernel reaches.  No
public Ascend STREAM figure; HBM2/HBM2e devices measure 0.8-0.9 of nominal (BabelStream on
A100 40GB: ~1.4 of 1.56 TB/s).  Applied to `NpuSpec.hbm_gbps`."""
CUBE_EFFICIENCY = 0.9
"""estimate: fraction of the Cube's peak a large, cube-bound tile sequence sustains (L0A/L0B
ping-pong bubbles; a GEMM tile's L0C write-back is costed separately).  Checked against [MM-910B]:
torch.mm fp16 at M=N=K=4096 reaches 315 of 354 TFLOPS (0.89).  With 24 busy cores a fp16 GEMM's
GM loads (96 B/cycle per core at the full Cube rate for a 128 x 256 tile, against 86 available)
bind at about the same fraction, so the fp16 GEMM anchors do not separate the two."""


def _hbm_us(spec: NpuSpec, nbytes: float) -> float:
    return nbytes / (spec.hbm_gbps * HBM_EFFICIENCY * 1e9) * 1e6


def _gemm(op: str, batch: int, m: int, n: int, k: int, e: int, eo: int, spec: NpuSpec,
          a_bytes: float | None = None, epilogue_ops: float = 0.0, epilogue_inputs: int = 0,
          useful: float | None = None) -> KernelCost:
    """The Cube GEMM model shared by matmul and conv (see `matmul_cost`).

    For every candidate tiling (base bm x bn output tile within L0C, K split ks) the time is
    a max of pipelines each non-decreasing in M, N, K and batch (waves x per-tile work, plus
    the pipeline's two ends, `_gemm_candidate`); the kernel takes the fastest candidate, so
    time is monotone in every dimension."""
    k0 = 32 // e
    mp, np_, kp = _up(m, 16), _up(n, 16), _up(k, k0)
    flops = 2.0 * batch * mp * np_ * kp
    useful = 2.0 * batch * m * n * k if useful is None else useful
    a_total = batch * mp * kp * e if a_bytes is None else a_bytes
    g = {"batch": batch, "mp": mp, "np": np_, "kp": kp, "k0": k0, "e": e, "eo": eo, "a_bytes": a_bytes,
         "a_total": a_total, "b_total": batch * kp * np_ * e, "c_total": batch * mp * np_ * eo,
         "rate": _cube_rate_per_core(spec, e) * CUBE_EFFICIENCY / 1e6,          # FLOP per µs per core
         "vec_rate": _vector_rate_total(spec, 4, spec.vector_cores) / 1e6,       # fp32 elem-ops per µs
         "epi_ops": epilogue_ops, "epi_in": epilogue_inputs}
    best = None
    for bm in TILE_SIZES:
        for bn in TILE_SIZES:
            if bm * bn * 4 > spec.l0c_bytes:
                continue
            for ks in K_SPLITS:    # one fixed candidate set for every size: min stays monotone
                cand = _gemm_candidate(g, bm, bn, ks, spec)
                if best is None or cand[0] < best[0]:
                    best = cand
    t, cube, vec, mte, hbm, bm, bn, ks, used, waves, parts = best
    return _finish(op, spec, cube_us=cube, vector_us=vec, mte_us=mte, hbm_bytes=hbm, flops=flops, useful=useful,
                   extra={"cores_used": used, "waves": waves, "tile": (bm, bn), "k_split": ks,
                          "padded_mnk": (mp, np_, kp), "padding_waste": 1 - useful / flops, **parts})


def _gemm_candidate(g: Mapping[str, Any], bm: int, bn: int, ks: int, spec: NpuSpec) -> tuple:
    """(time, cube, vector, mte, hbm bytes, bm, bn, ks, busy cores, waves, breakdown parts) of one
    tiling of the GEMM described by `g` (see `_gemm`); µs and bytes."""
    e, hz, batch, mp, np_ = g["e"], spec.clock_ghz * 1e9, g["batch"], g["mp"], g["np"]
    tm, tn = _ceil(mp, bm), _ceil(np_, bn)
    kper = _up(_ceil(g["kp"], ks), g["k0"])
    tiles = batch * tm * tn * ks
    waves, busy = _ceil(tiles, spec.cube_cores), min(tiles, spec.cube_cores)
    # one core's GM (L2) rates, B per µs, while `busy` cores stream (L2_CONTENTION)
    rd_rate, wr_rate = (r * hz / 1e6 / _l2_contention(busy) for r in
                        (spec.gm_read_bytes_per_cycle, spec.gm_write_bytes_per_cycle))
    wr_b = bm * bn * (4 if ks > 1 else g["eo"])
    # an fp32 accumulator tile too big to ping-pong in L0C: its write-back (fixpipe, L0C -> GM)
    # stalls the Cube before the next tile starts
    drain = wr_b / wr_rate if 2 * bm * bn * 4 > spec.l0c_bytes else 0.0
    cube = waves * (2.0 * bm * bn * kper / g["rate"] + drain)
    # a tile reads its bm rows of A over its K slice (the whole padded A when it has fewer rows);
    # a conv's A (`a_bytes`, its input window) pro rata
    a_tile = (min(bm, mp) * kper * e if g["a_bytes"] is None
              else g["a_total"] / batch * min(bm, mp) / mp / ks)
    # operand bytes from HBM: A and B once, plus the re-reads of a wave-by-wave walk (A once per
    # gn column tiles, B once per gm row tiles) that miss an L2 holding an L2 / (A + B) share of
    # the operands; they reach the cores at the HBM rate, not the L2 rate, and the loads wait
    gm_ = max(1, math.isqrt(spec.cube_cores))
    once = g["a_total"] + g["b_total"]
    rereads = g["a_total"] * _ceil(tn, spec.cube_cores // gm_) + g["b_total"] * _ceil(tm, gm_) - once
    stream = once + rereads * max(0.0, 1.0 - spec.l2_bytes / once)
    miss = max(0.0, _hbm_us(spec, stream) - stream / (rd_rate * busy))
    mte = max(waves * (a_tile + bn * kper * e) / rd_rate + miss, waves * wr_b / wr_rate)
    vec = ((batch * mp * np_ * (ks - 1 + g["epi_ops"])) / g["vec_rate"] if (ks > 1 or g["epi_ops"]) else 0.0)
    hbm = stream + g["c_total"] * (1 + g["epi_in"]) + (2 * ks * batch * mp * np_ * 4 if ks > 1 else 0)
    # the double-buffered pipeline's ends: the Cube waits for the first operand block, and the
    # last block's MMAD and write-back follow the last load (GEMM_BLOCK_K_BYTES)
    kb = min(kper, GEMM_BLOCK_K_BYTES // e)
    first = (min(bm, mp) + bn) * kb * e / rd_rate
    last = 2.0 * bm * bn * kb / g["rate"] + wr_b / wr_rate
    parts = {"drain_us": waves * drain, "first_block_us": first, "last_block_us": last, "hbm_miss_us": miss,
             "operand_hbm_bytes": stream, "l2_contention": _l2_contention(busy)}
    return (max(cube + first, vec, mte + last, _hbm_us(spec, hbm)), cube + first, vec, mte + last, hbm,
            bm, bn, ks, busy, waves, parts)


def matmul_cost(m: int, n: int, k: int, batch: int = 1, dtype: Any = "float16",
                spec: NpuSpec = ascend910b, out_dtype: Any = None, epilogue: Sequence[str] = ()) -> KernelCost:
    """(Batch) matmul C[b] = A[b] (M x K) @ B[b] (K x N) on the Cube.

    FLOPs are counted on fractal-padded sizes: M and N up to multiples of 16, K up to
    `cube_k0` = 32 B / element (the Cube fractal, Liao et al. Hot Chips 31).  A tiler picks,
    among base tiles bm x bn (16..256, fitting L0C in fp32) and K splits (1..8; partial sums
    in fp32 through GM, added by the Vector units), the fastest; per candidate, tiles run in
    waves over the Cube cores and each pipeline is (waves x per-tile work):

    * Cube at CUBE_EFFICIENCY x peak, plus, per tile, the write-back of its fp32 accumulator
      from L0C (fixpipe) when the tile cannot ping-pong in L0C (2 x bm x bn x 4 B > l0c_bytes;
      on 910B a 128 x 256 tile fills the 128 KiB L0C, as in CANN pto-isa's hand-written GEMM,
      which stores each tile between its MMADs): the Cube waits for it;
    * GM reads (each tile reads its rows of A and its B columns) and writes at the per-core
      L2 rates divided by the contention of the busy cores (`L2_CONTENTION`); the operand
      bytes that come from HBM (A and B once; past the L2, the re-reads of a wave-by-wave walk,
      A once per group of column tiles and B once per group of row tiles, in the share
      1 - L2 / (A + B) that the L2 cannot hold) arrive at the HBM rate instead of the L2 rate,
      and the loads wait for them (``hbm_miss_us``);
    * HBM at HBM_EFFICIENCY x nominal for those operand bytes + C (+ K-split partial sums);
    * the pipeline's ends: the Cube waits for the first operand block (GEMM_BLOCK_K_BYTES of K
      per row of A and B), and the last block's MMAD and write-back follow the last load.

    Breakdown keys add ``drain_us``, ``hbm_miss_us``, ``first_block_us``, ``last_block_us``,
    ``operand_hbm_bytes``, ``l2_contention``.  Time is monotone in M, N, K and batch.
    `epilogue`: Vector ops fused after the Cube as GE fuses them ('bias', 'relu', 'add',
    ... keys of VECTOR_OP_COST; 'add' of a residual reads one more C-sized tensor), costed
    on the output with no extra kernel.  fp32: the Cube rate is `NpuSpec.peak_cube_tflops(4)`.
    Units: sizes in elements, times in µs, bytes in B.  Raises ValueError on sizes < 1.
    """
    if min(m, n, k, batch) < 1:
        raise ValueError(f"matmul_cost: sizes must be >= 1, got m={m} n={n} k={k} batch={batch}")
    e = dtype_bytes(dtype)
    eo = dtype_bytes(out_dtype) if out_dtype is not None else (4 if e == 1 else e)
    ops, extra_in = _epilogue(epilogue)
    return _gemm("matmul", batch, m, n, k, e, eo, spec, epilogue_ops=ops, epilogue_inputs=extra_in)


def _epilogue(epilogue: Sequence[str]) -> tuple[float, int]:
    ops, extra = 0.0, 0
    for name in epilogue:
        key = "add" if name == "bias" else name
        if key not in VECTOR_OP_COST:
            raise ValueError(f"unknown epilogue op {name!r}; use 'bias' or one of {', '.join(sorted(VECTOR_OP_COST))}")
        ops += VECTOR_OP_COST[key]
        extra += name == "add"
    return ops, extra


def conv2d_cost(n: int, c_in: int, h: int, w: int, c_out: int, kernel: Sequence[int] | int,
                stride: Sequence[int] | int = 1, padding: Sequence[int] | int = 0,
                dtype: Any = "float16", spec: NpuSpec = ascend910b, epilogue: Sequence[str] = (),
                groups: int = 1, out_dtype: Any = None) -> KernelCost:
    """Conv2d as the Cube runs it: img2col GEMM with M = N*Ho*Wo,
    K = C1*C0*KH*KW (input channels padded to the stored C0, `formats.c0_for`), N = Cout.

    Grouped and depthwise convs (`groups` > 1; `c_in`, `c_out` are the totals): the Cube
    runs GE's grouped FRACTAL_Z (`formats.fz_groups`): G = ceil(groups / e) block-diagonal
    GEMMs of K = Cin_opt*KH*KW, N = Cout_opt (e groups packed per block), so the Cube
    does the zeros of the block diagonal (``flops``) while ``useful_flops`` counts the
    real products only; a depthwise 3x3 conv at C0 = 16 packs 16 channels per block and
    uses 1/16 of the Cube's MACs. CANN runs depthwise convs this way, as a Conv2D with
    groups = C on the Cube (ATC converts DepthwiseConv / ConvolutionDepthwise to
    Convolution with group = num_output: CANN 9.0.0 operator list "Convolution
    (DepthwiseConv, ConvolutionDepthwise)", hiascend.com canncommercial operatorlist_00110;
    aclnnConvDepthwise2d takes a ``cubeMathType``: hicann/ops-nn
    conv/convolution_forward/docs/aclnnConvDepthwise2d.md).

    Same tiler and pipelines as `matmul_cost`; img2col happens in L1 (Liao et al. Hot
    Chips 31), so a row of output tiles reads its input window (the NC1HWC0 input, not
    the KH*KW-times larger patch matrix) and the weights are read once per row of tiles,
    as a matmul's B.  A 1x1 stride-1 conv costs exactly the matmul of the same GEMM.
    `epilogue` as in `matmul_cost` (GE fuses bias + ReLU / residual Add into the conv);
    `out_dtype` as in `matmul_cost` (default: the operand dtype, int32 for int8 operands).
    Raises ValueError on non-positive sizes or an empty output.
    """
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    sh, sw = (stride, stride) if isinstance(stride, int) else stride
    ph, pw = (padding, padding) if isinstance(padding, int) else padding
    ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    if min(n, c_in, h, w, c_out, kh, kw) < 1 or ho < 1 or wo < 1:
        raise ValueError(f"conv2d_cost: invalid sizes n={n} c_in={c_in} h={h} w={w} c_out={c_out} "
                         f"kernel={kh}x{kw} -> output {ho}x{wo}")
    e = dtype_bytes(dtype)
    c0 = 32 if e == 1 else 16                       # stored C0 (formats.c0_for)
    if groups != 1:
        if groups < 1 or c_in % groups or c_out % groups:
            raise ValueError(f"conv2d_cost: groups={groups} must divide c_in={c_in} and c_out={c_out}")
        return _grouped_conv_cost(n, c_in, h, w, c_out, (kh, kw), (ho, wo), (sh, sw), e, c0, groups,
                                  spec, epilogue)
    m, kdim = n * ho * wo, _up(c_in, c0) * kh * kw
    # input bytes a row of tiles needs: the rows of the input its output rows come from
    x_b = n * _up(c_in, c0) * min(h, ho * sh + kh - 1) * min(w, wo * sw + kw - 1) * e
    a_bytes = min(float(x_b), float(_up(m, 16) * _up(kdim, 32 // e) * e))
    ops, extra_in = _epilogue(epilogue)
    useful = 2.0 * n * ho * wo * c_out * c_in * kh * kw
    eo = dtype_bytes(out_dtype) if out_dtype is not None else (4 if e == 1 else e)
    c = _gemm("conv2d", 1, m, c_out, kdim, e, eo, spec, a_bytes=a_bytes, epilogue_ops=ops,
              epilogue_inputs=extra_in, useful=useful)
    return KernelCost("conv2d", c.time_us, c.flops, c.useful_flops, c.hbm_bytes, c.bound,
                      {**c.breakdown, "gemm_mnk": (m, c_out, kdim)})


def _grouped_conv_cost(n: int, c_in: int, h: int, w: int, c_out: int, k: tuple, hw_out: tuple,
                       stride: tuple, e: int, c0: int, groups: int, spec: NpuSpec,
                       epilogue: Sequence[str]) -> KernelCost:
    """`conv2d_cost` for groups > 1: G block-diagonal GEMMs of GE's grouped FRACTAL_Z."""
    from .formats import fz_groups
    (kh, kw), (ho, wo), (sh, _) = k, hw_out, stride
    ev, cin_opt, cout_opt, g_blocks = fz_groups(c_in // groups, c_out // groups, groups, c0)
    m, kdim = n * ho * wo, cin_opt * kh * kw
    x_b = g_blocks * n * cin_opt * min(h, ho * sh + kh - 1) * min(w, wo * stride[1] + kw - 1) * e
    a_bytes = min(float(x_b), float(g_blocks * _up(m, 16) * _up(kdim, 32 // e) * e))
    ops, extra_in = _epilogue(epilogue)
    useful = 2.0 * n * ho * wo * c_out * (c_in // groups) * kh * kw
    c = _gemm("conv2d", g_blocks, m, cout_opt, kdim, e, 4 if e == 1 else e, spec, a_bytes=a_bytes,
              epilogue_ops=ops, epilogue_inputs=extra_in, useful=useful)
    return KernelCost("conv2d", c.time_us, c.flops, c.useful_flops, c.hbm_bytes, c.bound,
                      {**c.breakdown, "gemm_mnk": (m, cout_opt, kdim), "groups": groups,
                       "fz_groups": {"e": ev, "cin_opt": cin_opt, "cout_opt": cout_opt, "blocks": g_blocks}})


# ----------------------------------------------------------------------------------
# Vector kernels
# ----------------------------------------------------------------------------------

def _vector_kernel(op: str, spec: NpuSpec, numel: int, ops_per_elem: float, read_b: float, write_b: float,
                   e: int, flops_per_elem: float) -> KernelCost:
    if numel < 1:
        raise ValueError(f"{op}: numel must be >= 1, got {numel}")
    per_unit = 8192   # elements per vector work item (estimate: a UB-sized chunk)
    used, waves = _waves(_ceil(numel, per_unit), spec.vector_cores)
    vec_us = numel * ops_per_elem / _vector_rate_total(spec, e, used) * 1e6
    mte = _mte_us(spec, read_b, write_b, used)
    return _finish(op, spec, cube_us=0.0, vector_us=vec_us, mte_us=mte, hbm_bytes=read_b + write_b,
                   flops=numel * flops_per_elem, useful=numel * flops_per_elem,
                   extra={"vector_units_used": used, "ops_per_elem": ops_per_elem})


def elementwise_cost(op: str, numel: int, dtype: Any = "float16", n_inputs: int = 1,
                     spec: NpuSpec = ascend910b) -> KernelCost:
    """Elementwise `op` over `numel` (storage, i.e. padded) elements with `n_inputs` inputs.

    Vector cost = numel * VECTOR_OP_COST[op] (estimates, see the table).  Traffic: each
    input read once, the output written once.  Raises ValueError for an unknown op.
    """
    if op not in VECTOR_OP_COST:
        raise ValueError(f"elementwise_cost: unknown op {op!r}; known: {', '.join(sorted(VECTOR_OP_COST))}")
    e = dtype_bytes(dtype)
    return _vector_kernel(f"elementwise.{op}", spec, numel, VECTOR_OP_COST[op], n_inputs * numel * e, numel * e,
                          e, VECTOR_OP_COST[op])


def fused_vector_cost(numel: int, ops_per_elem: float, read_bytes: float, write_bytes: float,
                      dtype: Any = "float16", spec: NpuSpec = ascend910b) -> KernelCost:
    """One Vector kernel running several elementwise ops (and a trailing reduction) over
    `numel` elements at `ops_per_elem` VECTOR_OP_COST units per element, reading its
    inputs (`read_bytes`) and writing its outputs (`write_bytes`) to HBM once: the
    intermediate values stay in the Unified Buffer (GE's UB fusion of Vector ops).
    Raises ValueError on numel < 1."""
    return _vector_kernel("fused_elementwise", spec, numel, ops_per_elem, read_bytes, write_bytes,
                          dtype_bytes(dtype), ops_per_elem)


def reduction_cost(numel_in: int, numel_out: int, dtype: Any = "float16", op: str = "add",
                   spec: NpuSpec = ascend910b) -> KernelCost:
    """Reduction (sum/max/mean...) of `numel_in` elements to `numel_out`: one vector op per
    input element plus one per output (final combine); reads input once, writes output.
    """
    if numel_out < 1 or numel_out > numel_in:
        raise ValueError(f"reduction_cost: need 1 <= numel_out <= numel_in, got {numel_out}, {numel_in}")
    e = dtype_bytes(dtype)
    ops = VECTOR_OP_COST.get(op, 1) * (1 + numel_out / numel_in)
    return _vector_kernel(f"reduce.{op}", spec, numel_in, ops, numel_in * e, numel_out * e, e, 1.0)


def _rows_fit_ub(cols: int, spec: NpuSpec, live_fp32_rows: int = 3) -> bool:
    return cols * 4 * live_fp32_rows * 2 <= spec.ub_bytes   # x2: double buffering


def softmax_cost(rows: int, cols: int, dtype: Any = "float16", spec: NpuSpec = ascend910b) -> KernelCost:
    """Row softmax: cast, max, subtract, exp, sum, divide, cast = 6 + exp units per element.
    One pass over GM when a row fits the Unified Buffer (3 fp32 copies, double-buffered),
    else three reads (max, sum, normalise).
    """
    e = dtype_bytes(dtype)
    ops = 6 + VECTOR_OP_COST["exp"]
    reads = 1 if _rows_fit_ub(cols, spec) else 3
    n = rows * cols
    return _vector_kernel("softmax", spec, n, ops, reads * n * e, n * e, e, 5.0)


def layernorm_cost(rows: int, cols: int, dtype: Any = "float16", spec: NpuSpec = ascend910b) -> KernelCost:
    """LayerNorm over the last dim: mean (1), subtract (1), square (1), sum (1), scale by
    rsqrt (1), gamma (1), beta (1), two casts (2) = 9 units per element; one GM pass when a
    row fits the Unified Buffer, else two.
    """
    e = dtype_bytes(dtype)
    reads = 1 if _rows_fit_ub(cols, spec) else 2
    n = rows * cols
    return _vector_kernel("layernorm", spec, n, 9.0, reads * n * e + 2 * cols * e, n * e, e, 8.0)


def trans_data_cost(numel_src: int, numel_dst: int, dtype: Any = "float16", burst_bytes: int = 32,
                    spec: NpuSpec = ascend910b) -> KernelCost:
    """TransData (format conversion): read the source, transpose 16x16 blocks in the Unified
    Buffer (one vector op per element, the vnchwconv instruction), write the destination.

    `burst_bytes` is the contiguous run the strided side moves (C0 * element size = 32 B for
    NCHW <-> NC1HWC0); MTE efficiency is taken as min(1, burst / 512 B) (estimate: DMA
    bursts shorter than 512 B do not reach full bandwidth).
    """
    e = dtype_bytes(dtype)
    eff = min(1.0, burst_bytes / 512)
    cost = _vector_kernel("trans_data", spec, max(numel_src, numel_dst), 1.0, numel_src * e, numel_dst * e, e, 0.0)
    mte = cost.breakdown["mte_us"] / eff
    return _finish("trans_data", spec, cube_us=0.0, vector_us=cost.breakdown["vector_us"], mte_us=mte,
                   hbm_bytes=cost.hbm_bytes, flops=0.0, useful=0.0, extra={"burst_efficiency": eff})


# ----------------------------------------------------------------------------------
# FlashAttention
# ----------------------------------------------------------------------------------

def flash_attention_blocks(head_dim: int, dtype: Any = "float16", spec: NpuSpec = ascend910b) -> tuple[int, int]:
    """Default (block_q, block_k) of the vnpu FlashAttention kernel, multiples of 16 (the Cube fractal).

    B_r = min(B_c', d) by FlashAttention's rule (Dao et al. 2022, Alg. 1) with B_c' = ceil(M / 4d),
    M the Unified Buffer in elements; B_c = the widest key block whose fp32 score tile S = Q K^T
    fits L0C twice (the Cube accumulates S in L0C and ping-pongs it with the next tile, [PTO-FA-K]):
    2 * B_r * B_c * 4 B <= l0c_bytes, and at most B_c'.  910B fp16, d=128: (128, 128), the
    CUBE_S0 x CUBE_S1 of the hand-written kernel [PTO-FA-K]; d=64: (64, 256).
    """
    m = spec.ub_bytes // dtype_bytes(dtype)
    bc_ub = _ceil(m, 4 * head_dim)
    br = max(16, min(bc_ub, head_dim) // 16 * 16)
    bc = min(bc_ub, spec.l0c_bytes // (2 * 4 * br))
    return br, max(16, bc // 16 * 16)


def _fa_block_cycles(br: int, bc: int, d: int, e: int, spec: NpuSpec, busy: int = 1) -> dict[str, float]:
    """Cycles of one key block of one FlashAttention task on one AI core cluster (1 AIC + its AIVs).

    Stages [PTO-FA-K]: QK (Cube: S = Q K_j^T, read K_j, write S fp32 to GM), P (Vector: read S,
    online softmax, write P fp16), PV (Cube: read V_j and P, write P V_j fp32), GU (Vector: read
    P V_j, rescale and accumulate O in UB).  Each stage alone takes the max of its compute and its
    own GM traffic (double-buffered pipes); `steady` is the per-block time with the stages
    overlapped by the QK preload: the max of Cube work, Vector work, and the cluster's GM reads
    and writes at the per-core L2 rates (`gm_read/write_bytes_per_cycle`, which AIC and AIVs
    share: the platform file's per-core rates, like ddr_rate, are per-core shares of the chip);
    `chain` is one block through the four stages in sequence plus three hand-offs."""
    cube = _cube_rate_per_core(spec, e) * CUBE_EFFICIENCY / (spec.clock_ghz * 1e9)   # FLOP per cycle
    vec = spec.vector_elems_per_cycle(4) * spec.aiv_per_aic
    rd, wr = (r / _fa_l2_contention(busy) for r in (spec.gm_read_bytes_per_cycle, spec.gm_write_bytes_per_cycle))
    s_b, p_b, kv_b, pv_b = br * bc * 4, br * bc * e, bc * d * e, br * d * 4
    qk = max(2.0 * br * bc * d / cube, kv_b / rd, s_b / wr)
    p = max(br * bc * FA_SOFTMAX_OPS_PER_SCORE / vec, s_b / rd, p_b / wr)
    pv = max(2.0 * br * bc * d / cube, (kv_b + p_b) / rd, pv_b / wr)
    gu = max(br * d * FA_OUTPUT_OPS_PER_ELEM / vec, pv_b / rd)
    cube_cyc = 4.0 * br * bc * d / cube
    vec_cyc = (br * bc * FA_SOFTMAX_OPS_PER_SCORE + br * d * FA_OUTPUT_OPS_PER_ELEM) / vec
    rd_cyc = (2 * kv_b + p_b + s_b + pv_b) / rd
    wr_cyc = (s_b + p_b + pv_b) / wr
    edge = FA_TASK_DISPATCH_CYCLES + br * d * e * (1 / rd + 1 / wr)
    return {"cube": cube_cyc, "vector": vec_cyc, "gm_read": rd_cyc, "gm_write": wr_cyc, "edge": edge,
            "steady": max(cube_cyc, vec_cyc, rd_cyc, wr_cyc), "chain": qk + p + pv + gu + 3 * FA_SYNC_CYCLES}


def _l2_contention(busy: int) -> float:
    """Slowdown of one core's GM (L2) traffic while `busy` cores stream at once (L2_CONTENTION)."""
    return 1.0 + L2_CONTENTION * (max(1, busy) - 1)


_fa_l2_contention = _l2_contention


def _fa_device_cycles(tasks: int, used: int, k_blocks: float, shape: tuple, spec: NpuSpec) -> tuple:
    """(device cycles, task cycles and per-block cycles of a full wave) for `tasks` FlashAttention tasks on `used`
    cores: full waves with `used` busy cores, then a last wave with the remaining tasks' cores, each
    task ``edge + chain + (k_blocks - 1) * steady`` at the GM rates of its wave's busy cores.
    Non-decreasing in tasks and k_blocks."""
    full, rest = divmod(tasks, used)

    def task(busy: int) -> tuple:
        blk = _fa_block_cycles(*shape, spec, busy=busy)
        return blk["edge"] + blk["chain"] + (k_blocks - 1) * blk["steady"], blk

    cyc, blk = task(used)
    return full * cyc + (task(rest)[0] if rest else 0.0), cyc, blk


def _fa_hbm(bh: int, seq_q: int, seq_k: int, head_dim: int, e: int, n_qblk: int,
            frac: float, spec: NpuSpec) -> tuple:
    """(HBM bytes, HBM µs) of FlashAttention over ``bh`` (batch x heads), ``e`` bytes per
    element: Q and O once, K and V once per query block (times ``frac``, 0.5 when causal);
    the time counts K and V once when they fit the L2."""
    qo = 2 * bh * seq_q * head_dim * e
    kv_once = 2 * bh * seq_k * head_dim * e
    hbm = qo + kv_once * n_qblk * frac
    return hbm, _hbm_us(spec, qo + (kv_once if kv_once <= spec.l2_bytes else kv_once * n_qblk * frac))


def flash_attention_cost(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, dtype: Any = "float16",
                         block_q: int | None = None, block_k: int | None = None, causal: bool = False,
                         spec: NpuSpec = ascend910b) -> KernelCost:
    """Forward FlashAttention on the split Cube (AIC) / Vector (AIV) design of 910B, as the
    hand-written kernel runs it [PTO-FA-K].

    Tasks: each (batch, head, query block of `block_q` rows) is one task on one AI core cluster
    (an AIC and its aiv_per_aic AIVs, each AIV taking half the rows); tasks run in waves over the
    Cube cores (S=1K, one head, block 128: 8 of 24 cores busy; S=4K: 32 tasks, two waves).
    Per task and key block of `block_k` columns (`_fa_block_cycles`): QK on the Cube -> S to GM
    (fp32) -> softmax on the Vector -> P to GM (fp16) -> PV on the Cube -> PV to GM (fp32) -> rescale
    and accumulate on the Vector; there is no L0C -> UB path on 910B, so every hand-off is GM traffic.
    With the QK preload the stages overlap, so a task takes
    ``dispatch + Q load + chain + (n_blocks - 1) * steady + O store`` cycles: the first block's
    dependency chain (four stages in sequence plus three cross-core hand-offs, FA_SYNC_CYCLES) and
    then one block per `steady` (the slowest of Cube, Vector, GM reads, GM writes of the cluster).
    Device time = launch + the waves' tasks; a wave's GM traffic runs at the per-core rates slowed by
    L2 contention between its busy cores (FA_L2_CONTENTION, fitted: a full 910B wave 1.28x, one core
    1x).  Cube at CUBE_EFFICIENCY x peak; Vector in fp32.

    FLOPs: 4 * S_q * S_k * d per (batch, head) (halved for causal).  HBM bytes: Q and O once, K and
    V re-read once per query block (GM traffic; when K and V fit the L2 the time counts them once;
    the S/P/PV hand-offs stay in L2).  `block_q`/`block_k` default to `flash_attention_blocks`.
    Raises ValueError on non-positive sizes or blocks that are not multiples of 16.
    """
    if min(batch, heads, seq_q, seq_k, head_dim) < 1:
        raise ValueError("flash_attention_cost: batch, heads, seq_q, seq_k, head_dim must be >= 1")
    dbq, dbk = flash_attention_blocks(head_dim, dtype, spec)
    br, bc = block_q or dbq, block_k or dbk
    if br % 16 or bc % 16 or br < 16 or bc < 16:
        raise ValueError(f"flash_attention_cost: block_q={br}, block_k={bc} must be positive multiples of 16 "
                         f"(the Cube fractal size)")
    e, hz, d = dtype_bytes(dtype), spec.clock_ghz * 1e9, _up(head_dim, 16)
    n_qblk = _ceil(seq_q, br)
    k_blocks = max(1.0, _up(seq_k, 16) / bc)        # a partial last block costs its fractal-padded share
    if causal:
        k_blocks = max(1.0, k_blocks * (n_qblk + 1) / (2 * n_qblk))
    tasks = batch * heads * n_qblk
    used, waves = _waves(tasks, spec.cube_cores)
    device_cyc, task_cyc, blk = _fa_device_cycles(tasks, used, k_blocks, (br, bc, d, e), spec)
    device_us = device_cyc / hz * 1e6
    frac = 0.5 if causal else 1.0
    useful = 4.0 * batch * heads * seq_q * seq_k * head_dim * frac
    flops = 4.0 * batch * heads * (n_qblk * br) * _up(seq_k, 16) * d * frac
    hbm, hbm_us = _fa_hbm(batch * heads, seq_q, seq_k, head_dim, e, n_qblk, frac, spec)
    limits = {"cube": blk["cube"], "vector": blk["vector"], "memory": max(blk["gm_read"], blk["gm_write"])}
    bound = "memory" if hbm_us >= device_us else max(limits, key=limits.get)  # type: ignore[arg-type]
    busy = max(device_us, hbm_us)
    if spec.kernel_launch_us > busy:
        bound = "launch"
    us = 1e6 / hz
    breakdown = {
        "block_q": br, "block_k": bc, "query_blocks": tasks, "cores_used": used, "waves": waves,
        "key_blocks_per_task": k_blocks, "block_us": blk["steady"] * us, "chain_us": blk["chain"] * us,
        "task_us": task_cyc * us, "cube_us": waves * k_blocks * blk["cube"] * us,
        "vector_us": waves * k_blocks * blk["vector"] * us,
        "gm_us": waves * k_blocks * max(blk["gm_read"], blk["gm_write"]) * us, "hbm_us": hbm_us,
        "launch_us": spec.kernel_launch_us, "l2_contention": _fa_l2_contention(used),
    }
    return KernelCost("flash_attention", spec.kernel_launch_us + busy, flops, useful, hbm, bound, breakdown)


DISPATCH_SCALE: dict[str, float] = {"flash_attention": 1.0, "matmul": 22.0 / 70.0, "conv2d": 22.0 / 70.0,
                                   "default": 22.0 / 70.0}
"""Host dispatch per op class, as a fraction of `NpuSpec.op_dispatch_us` (the fused-attention
figure, [PTO-FA]: torch_npu npu_fused_attention takes a flat 70-76 us per call for small work).
Matmuls and the rest: a torch.mm loop on 910B2 takes <= 22 us per call when the device work
is small ([MM-910B]: 98 TFLOPS at M=N=K=1024 is 21.9 us per call); other op classes are
assumed to dispatch like torch.mm (estimate)."""


def dispatch_us(op: str, spec: NpuSpec = ascend910b) -> float:
    """Host-side per-call cost of an eager op of class `op` (a `KernelCost.op`, e.g.
    'matmul', 'conv2d', 'flash_attention', 'elementwise.add'), µs."""
    key = op.split(".")[0]
    return spec.op_dispatch_us * DISPATCH_SCALE.get(key, DISPATCH_SCALE["default"])


def eager_time_us(cost: KernelCost, spec: NpuSpec = ascend910b) -> float:
    """Per-call time of the kernel issued from an eager framework loop: the host enqueues
    asynchronously, so the slower of host dispatch (`dispatch_us` of the op's class) and
    device time wins.
    """
    return max(dispatch_us(cost.op, spec), cost.time_us)


# ----------------------------------------------------------------------------------
# Calibration against published measurements
# ----------------------------------------------------------------------------------

FA_910B_MEASURED_TFLOPS: dict[int, float] = {1024: 9.2, 4096: 72.6, 8192: 97.3, 32768: 150.8}
"""FlashAttention forward on Ascend 910B2, head dim 128, batch 1, 1 head, fp16, torch_npu per-call
timing, TFLOP/s with FLOPs = 4 S^2 d: the "910B2 Multi-Core Comparison" table of CANN pto-isa
kernels/manual/common/flash_atten/README.md (hw-native-sys/pto-isa @ a977dd11), as quoted in issue 4."""


def flash_attention_calibration_table(spec: NpuSpec = ascend910b, head_dim: int = 128
                                      ) -> list[tuple[int, float, float, float]]:
    """Rows (S, estimate TFLOP/s, measured TFLOP/s, estimate / measured) for the points in
    `FA_910B_MEASURED_TFLOPS`; the estimate uses `eager_time_us` (the measurements are
    eager per-call timings) and default blocks.
    """
    rows = []
    for s, meas in sorted(FA_910B_MEASURED_TFLOPS.items()):
        c = flash_attention_cost(1, 1, s, s, head_dim, "float16", spec=spec)
        est = c.useful_flops / (eager_time_us(c, spec) * 1e-6) / 1e12
        rows.append((s, est, meas, est / meas))
    return rows


# ----------------------------------------------------------------------------------
# Collectives over HCCS (tensor parallelism)
# ----------------------------------------------------------------------------------

def allreduce_cost(nbytes: float, cards: int, spec: NpuSpec = ascend910b) -> KernelCost:
    """One HCCL all-reduce of ``nbytes`` (B) per card over ``cards`` NPUs in a full HCCS mesh
    (Atlas 800 A2: every pair of the 8 NPUs has its own link): reduce-scatter then all-gather,
    each ONE step in which every card sends a 1/C share to each of the C - 1 others over its own
    link (HCCL's mesh algorithm), so time = launch + 2 · (``hccs_latency_us`` + (nbytes / C) /
    ``hccs_gbps``).  HBM traffic: the buffer read and written twice.  ``cards`` == 1 costs
    nothing (time 0).  Raises ValueError for cards < 1, nbytes < 0, or a spec without the HCCS
    figures (`LINK_DOCS`) when cards > 1."""
    if cards < 1 or nbytes < 0:
        raise ValueError(f"allreduce_cost: cards must be >= 1 and nbytes >= 0, got cards={cards}, nbytes={nbytes}")
    if cards == 1:
        return KernelCost("allreduce", 0.0, 0.0, 0.0, 0.0, "link", {"cards": 1})
    if spec.hccs_gbps is None or spec.hccs_latency_us is None:
        raise ValueError(f"{spec.name} has no HCCS figures for a {cards}-card estimate: give hccs_gbps and "
                         "hccs_latency_us in a spec file (base = \"ascend910b\" has them), or use cards=1")
    step = spec.hccs_latency_us + (nbytes / cards) / (spec.hccs_gbps * 1e3)
    return KernelCost("allreduce", spec.kernel_launch_us + 2 * step, 0.0, 0.0,
                      4.0 * nbytes, "link", {"cards": cards, "step_us": step, "launch_us": spec.kernel_launch_us})


__all__ += ["allreduce_cost"]
