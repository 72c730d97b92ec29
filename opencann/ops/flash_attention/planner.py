"""Tile planner: choose the query block B_r and key/value block B_c from the size of
the on-chip buffer that holds one attention tile's working set.

Rule (FlashAttention, Dao et al. 2022, arXiv:2205.14135, Algorithm 1, line 1):
``B_c = ceil(M / (4 d))``, ``B_r = min(B_c, d)`` with ``M`` the buffer size in
elements. Then the target's constraints are applied, and the real working set
(Q tile, K and V tiles, S/P tile, O accumulator, m and l vectors) is checked against
the buffer and the blocks shrink until it fits. Every step is recorded in
``TilePlan.explain()``.

Buffer sizes (``BUFFER_PRESETS``, bytes), with sources:

* ``ascend910b_ub`` = 192 KiB: Unified Buffer per AI Core of the Ascend 910B
  (Atlas A2), as given in Huawei's Ascend C documentation (hardware specs table of the
  "Ascend C programming guide", CANN 7/8) and used by the open Ascend C FlashAttention
  samples. **Default for the Ascend target.**
* ``ascend910_ub`` = 256 KiB: Unified Buffer of the DaVinci AI Core in the first
  Ascend 910, from the DaVinci architecture papers (Liao et al., "DaVinci: A Scalable
  Architecture for Neural Network Computing", Hot Chips 31, 2019; Liao et al.,
  HPCA 2021 "Ascend: a Scalable and Unified Architecture ...").
* ``ascend_ub_quoted_1_5mb`` = 1.5 MiB: a figure quoted for the Unified Buffer in some
  articles and blog posts. We could not verify it against a Huawei document; it may
  count several buffers (L1 + UB) or another chip. Kept only for comparison, never a
  default.
* ``h100_smem`` / ``h200_smem`` = 228 KiB shared memory per SM (NVIDIA Hopper tuning
  guide, "Shared memory capacity per SM is 228 KB"; H200 is the same GH100 die).
* ``a100_smem`` = 164 KiB (NVIDIA Ampere tuning guide, up to 164 KB per SM).
* ``cpu_l2()``: this CPU's L2 cache, a fact of the cpu device (``opencann.devices.cpu``:
  read from ``/sys/devices/system/cpu/cpu0/cache/index*/{level,size}``; fallback 1 MiB).
* ``cuda_smem()``: ``torch.cuda.get_device_properties(i).shared_memory_per_multiprocessor``
  when CUDA is available, else the H100 preset.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ...devices.cpu import CPU_L2_FALLBACK, cpu_l2  # noqa: F401  (the CPU's L2: a cpu device fact)

KIB = 1024
BUFFER_PRESETS = {
    "ascend910b_ub": 192 * KIB,   # Huawei Ascend C docs, 910B (Atlas A2) UB per AI Core
    "ascend910_ub": 256 * KIB,    # DaVinci papers (Hot Chips 2019, HPCA 2021): 910 UB
    "ascend_ub_quoted_1_5mb": 1536 * KIB,  # quoted in articles; unverified, not a default
    "h100_smem": 228 * KIB,       # NVIDIA Hopper tuning guide: 228 KB shared memory / SM
    "h200_smem": 228 * KIB,       # same GH100 SM as H100
    "a100_smem": 164 * KIB,       # NVIDIA Ampere tuning guide: 164 KB shared memory / SM
}

# Target constraints: (quantum the blocks are rounded down to, powers of two only,
# preferred minimum block_q). "cube": Ascend Cube unit fractals are 16x16 (fp16);
# "triton": tl.arange needs powers of two, tensor-core MMA needs >= 16;
# "cpu": multiples of 16 (AVX-512 width in fp32) and block_q >= 128 when it fits,
# because sgemm with M < 128 rows ran ~25% slower on the 2-core build machine.
TARGETS = {
    "cube": (16, False, 16),
    "triton": (16, True, 16),
    "cpu": (16, False, 128),
}


def cuda_smem(device=None) -> tuple[int, str]:
    """(bytes, source) of shared memory per SM of a CUDA device, or the H100 preset."""
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(device or 0)
        smem = getattr(p, "shared_memory_per_multiprocessor", None)
        if smem:
            return int(smem), f"torch.cuda.get_device_properties: {p.name}"
    return BUFFER_PRESETS["h100_smem"], "no CUDA device; H100 preset 228 KiB"


@dataclass
class TilePlan:
    """A tile choice: ``block_q`` (B_r rows of Q), ``block_k`` (B_c rows of K/V),
    ``working_set_bytes`` of one tile step, ``buffer_bytes`` it must fit in."""
    block_q: int
    block_k: int
    working_set_bytes: int
    buffer_bytes: int
    target: str = "cpu"
    steps: list = field(default_factory=list, repr=False)
    occupancy: dict = field(default_factory=dict, repr=False)   # buffer -> (bytes used, capacity)

    def explain(self) -> str:
        """The steps of the choice, one per line."""
        head = (f"TilePlan(block_q={self.block_q}, block_k={self.block_k}, working set "
                f"{self.working_set_bytes} B of {self.buffer_bytes} B buffer, target={self.target})")
        return "\n".join([head] + [f"  {i + 1}. {s}" for i, s in enumerate(self.steps)])


def working_set_bytes(block_q, block_k, head_dim, in_bytes, acc_bytes=4) -> int:
    """Bytes of one tile step: Q (B_r x d) + K, V (B_c x d each) in the input dtype;
    S/P (B_r x B_c), O accumulator (B_r x d), m and l (B_r each) in the accumulation dtype."""
    return ((block_q + 2 * block_k) * head_dim * in_bytes
            + (block_q * block_k + block_q * head_dim + 2 * block_q) * acc_bytes)


def _round(x, quantum, pow2):
    if pow2:
        return 1 << max(int(math.floor(math.log2(max(x, 1)))), 0)
    return (x // quantum) * quantum


def _ceil_to(x, quantum, pow2):
    if pow2:
        return 1 << max(math.ceil(math.log2(max(x, 1))), 0)
    return -(-x // quantum) * quantum


def _fit_buffer(br: int, bc: int, head_dim: int, in_b: int, acc_b: int, buffer_bytes: int,
                quantum: int, pow2: bool, steps: list) -> tuple:
    """Halve the larger block (B_c first on a tie) until the working set fits
    ``buffer_bytes``, logging each step in ``steps``. Returns (B_r, B_c, working set
    bytes). Raises ValueError when quantum x quantum tiles do not fit."""
    ws = working_set_bytes(br, bc, head_dim, in_b, acc_b)
    while ws > buffer_bytes:
        if bc >= br and bc > quantum:
            nb = max(_round(bc // 2, quantum, pow2), quantum)
            steps.append(f"working set {ws} B > {buffer_bytes} B: halve B_c {bc} -> {nb}")
            bc = nb
        elif br > quantum:
            nb = max(_round(br // 2, quantum, pow2), quantum)
            steps.append(f"working set {ws} B > {buffer_bytes} B: halve B_r {br} -> {nb}")
            br = nb
        else:
            raise ValueError(
                f"a buffer of {buffer_bytes} B cannot hold even {quantum}x{quantum} tiles "
                f"at head_dim {head_dim} ({ws} B needed); use a larger buffer or smaller head_dim")
        ws = working_set_bytes(br, bc, head_dim, in_b, acc_b)
    return br, bc, ws


def plan_tiles(buffer_bytes: int, head_dim: int, dtype=torch.float32, *, seq_q=None,
               seq_k=None, target: str = "cpu", acc_dtype=torch.float32) -> TilePlan:
    """Choose (B_r, B_c) for FlashAttention tiles.

    buffer_bytes: on-chip buffer capacity in bytes (see ``BUFFER_PRESETS``, ``cpu_l2``,
    ``cuda_smem``); head_dim: d; dtype: dtype of the Q/K/V tiles in the buffer;
    seq_q/seq_k: optional sequence lengths (blocks never exceed them, rounded up to the
    target's quantum); target: "cpu", "triton" or "cube"; acc_dtype: dtype of S/P, O,
    m, l. Source: Dao et al. 2022, arXiv:2205.14135, Algorithm 1.

    Raises ValueError for an unknown target, non-positive sizes, or a buffer too small
    for even 16 x 16 tiles.
    """
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; use one of {sorted(TARGETS)}")
    if buffer_bytes <= 0 or head_dim <= 0:
        raise ValueError(f"buffer_bytes ({buffer_bytes}) and head_dim ({head_dim}) must be > 0")
    quantum, pow2, pref_q = TARGETS[target]
    in_b = torch.empty((), dtype=dtype).element_size()
    acc_b = torch.empty((), dtype=acc_dtype).element_size()
    M = buffer_bytes // in_b
    steps = []
    bc = math.ceil(M / (4 * head_dim))
    br = min(bc, head_dim)
    steps.append(f"Algorithm 1: M = {buffer_bytes} B / {in_b} B = {M} elements; "
                 f"B_c = ceil(M / 4d) = {bc}, B_r = min(B_c, d) = {br}")
    if br < pref_q <= bc:
        steps.append(f"target {target}: raise B_r to the preferred minimum {pref_q}")
        br = pref_q
    rbr, rbc = max(_round(br, quantum, pow2), quantum), max(_round(bc, quantum, pow2), quantum)
    kind = "powers of two" if pow2 else f"multiples of {quantum}"
    steps.append(f"target {target}: round down to {kind}, at least {quantum}: "
                 f"B_r {br} -> {rbr}, B_c {bc} -> {rbc}")
    br, bc = rbr, rbc
    for name, seq in (("q", seq_q), ("k", seq_k)):
        if seq is None:
            continue
        cap = max(_ceil_to(seq, quantum, pow2), quantum)
        cur = br if name == "q" else bc
        if cur > cap:
            steps.append(f"seq_{name} = {seq}: cap block_{name} {cur} -> {cap}")
            if name == "q":
                br = cap
            else:
                bc = cap
    br, bc, ws = _fit_buffer(br, bc, head_dim, in_b, acc_b, buffer_bytes, quantum, pow2, steps)
    steps.append(f"working set: Q {br}x{head_dim} + K,V 2x{bc}x{head_dim} at {in_b} B, "
                 f"S/P {br}x{bc} + O {br}x{head_dim} + m,l 2x{br} at {acc_b} B = {ws} B "
                 f"<= {buffer_bytes} B: fits")
    return TilePlan(br, bc, ws, buffer_bytes, target, steps)


NPU_BUFFERS = ("ub", "l1", "l0a", "l0b", "l0c")


def npu_capacity(spec) -> dict:
    """Bytes of each on-chip buffer of a vnpu preset (`NpuSpec`): ``ub``, ``l1``, ``l0a``,
    ``l0b``, ``l0c`` (per AI core; sources in the preset's ``sources``)."""
    return {b: int(getattr(spec, f"{b}_bytes")) for b in NPU_BUFFERS}


def plan_npu_tiles(spec, head_dim: int, dtype=torch.float16, *, seq_q=None, seq_k=None) -> TilePlan:
    """(B_r, B_c) for the vnpu's tiled FlashAttention on preset ``spec`` (an `NpuSpec`).

    Start from Algorithm 1 on the preset's Unified Buffer (`plan_tiles`, target "cube":
    multiples of the 16-row fractal), then halve the larger block until one tile step fits
    every buffer of the AI core: L1 (Q, K, V, P), L0A / L0B (the Cube's operands), L0C
    (the fp32 accumulator) and UB (the Vector side), each as
    `opencann.devices.vnpu.attention_kernels.tile_occupancy` counts it, which is also what
    the kernel checks at run time. ``occupancy`` gives (bytes used, capacity) per buffer.
    Raises ValueError when even 16 x 16 tiles do not fit (names the buffer)."""
    from ...devices.vnpu.attention_kernels import tile_occupancy
    cap = npu_capacity(spec)
    plan = plan_tiles(cap["ub"], head_dim, dtype, seq_q=seq_q, seq_k=seq_k, target="cube")
    br, bc, steps = plan.block_q, plan.block_k, list(plan.steps)
    while True:
        occ = tile_occupancy(br, bc, head_dim, dtype)
        over = [b for b in NPU_BUFFERS if occ[b] > cap[b]]
        if not over:
            break
        b = over[0]
        if bc >= br and bc > 16:
            steps.append(f"{b.upper()} {occ[b]} B > {cap[b]} B: halve B_c {bc} -> {max(bc // 2 // 16 * 16, 16)}")
            bc = max(bc // 2 // 16 * 16, 16)
        elif br > 16:
            steps.append(f"{b.upper()} {occ[b]} B > {cap[b]} B: halve B_r {br} -> {max(br // 2 // 16 * 16, 16)}")
            br = max(br // 2 // 16 * 16, 16)
        else:
            raise ValueError(f"vnpu preset {spec.name}: {b.upper()} ({cap[b]} B) cannot hold a 16x16 FlashAttention "
                             f"tile at head_dim {head_dim} ({occ[b]} B); use a smaller head_dim")
    steps.append("fits " + ", ".join(f"{b.upper()} {occ[b]}/{cap[b]} B" for b in NPU_BUFFERS))
    return TilePlan(br, bc, occ["ub"], cap["ub"], "cube", steps, {b: (occ[b], cap[b]) for b in NPU_BUFFERS})
