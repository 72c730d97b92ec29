"""Chip descriptions for the virtual NPU: `NpuSpec`, three presets, and `load_spec`.

An `NpuSpec` is the set of numbers the vnpu cost model and layout rules need about an
Ascend-style chip (DaVinci AI cores): how many Cube and Vector cores, their clock, the
Cube and Vector throughput, the on-core buffer sizes (L0A/L0B/L0C/L1/Unified Buffer),
L2, HBM, and the fixed costs of launching a kernel.  Every number carries its source in
``spec.sources[field]``; numbers without a primary source say ``"estimate: ..."``.

Sources used below (short keys in the per-field strings):

* [HC31]  H. Liao, J. Tu, J. Xia, X. Zhou, "DaVinci: A Scalable Architecture for Neural
  Network Computing", Hot Chips 31 (2019).
* [HPCA21] H. Liao et al., "Ascend: a Scalable and Unified Architecture for Ubiquitous
  Deep Neural Network Computing", HPCA 2021.
* [INI-910B] CANN platform configuration ``platform_config/Ascend910B2.ini`` (sections
  ``[SoCInfo]``, ``[AICoreSpec]``, ``[AICoreMemoryRates]``) as quoted in public Ascend
  kernel repositories; the B1/B2 files list ai_core_cnt=24, vector_core_cnt=48, the B3
  file 20/40.
* [A2-ND] Ascend C Matmul API docs for Atlas A2 training / 800I A2 inference products (ND input
  format for A/B, on-the-fly ND->NZ in the GM->L1 copy; supported dtypes), and torch_npu's
  ``FormatHelper``/``npu_format_cast`` notes that A2 keeps matmul weights ND.
* [MM-910B] public torch_npu ``torch.mm`` loop measurements on 910B2 quoted in opencann issue 17
  (fp16 98 / 251 / 315 / 305 / 275 TFLOPS at M=N=K=1024 / 2048 / 4096 / 8192 / 10240; fp32 ~1/4).
* [GE-310-STUB] the Ascend310 platform-info stub in GE's public unit tests (ai_core freq 680 MHz,
  l2 read/write rates 128/64 B/cycle), as quoted in opencann issue 17.
* [PTO-JIT] CANN pto-isa demos/torch_jit/flash_atten/README.md (cannmirror/pto-isa @ defdb75f,
  2026-03-07), warm per-call benchmark table on 910B2 (S0=128, one core, aarch64 host); the
  same tag as in ``opencann.devices.vnpu.calibration``.
* [FIXPIPE-A2] Ascend C API reference, ``Fixpipe`` (Atlas A2 training / 800I A2 inference
  products): ``FixpipeParamsV220.quantPre`` QuantMode_t F322F16 / DEQF16 / VDEQF16 / REQ8 /
  VREQ8 (deq_scale scalar or per channel, from L1) and ``reluEn``, applied while L0C is
  written to GM.
* [TA-70B] TorchAir's Llama2-70B reference on 8 Atlas 800I A2 cards (Ascend/torchair
  npu_tuned_model/llm/llama/README.md @ 433f5a2a), the tag of ``opencann.devices.vnpu.calibration``.

No dependency beyond the standard library: ``tomllib`` (Python >= 3.11) reads TOML.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

__all__ = ["NpuSpec", "CAPABILITY_DOCS", "LINK_DOCS", "ascend910", "ascend910b", "ascend310", "PRESETS", "get_preset", "load_spec"]

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# Field name -> (unit, one-line meaning).  Used for printing and for error messages.
FIELD_DOCS: dict[str, tuple[str, str]] = {
    "name": ("", "chip name"),
    "cube_cores": ("cores", "AI cores with a Cube unit (AIC)"),
    "vector_cores": ("cores", "Vector units (AIV); equal to cube_cores where each AI core has both"),
    "clock_ghz": ("GHz", "AI core clock"),
    "cube_macs_per_cycle": ("MAC/cycle/core", "fp16 Cube throughput (16x16x16 = 4096)"),
    "vector_bytes_per_cycle": ("B/cycle/vector unit", "Vector unit width"),
    "l0a_bytes": ("B", "L0A buffer (left Cube operand) per core"),
    "l0b_bytes": ("B", "L0B buffer (right Cube operand) per core"),
    "l0c_bytes": ("B", "L0C buffer (Cube accumulator) per core"),
    "l1_bytes": ("B", "L1 buffer per core"),
    "ub_bytes": ("B", "Unified Buffer (Vector operand buffer) per vector unit"),
    "l2_bytes": ("B", "on-chip L2 shared by all cores"),
    "hbm_bytes": ("B", "device memory capacity"),
    "hbm_gbps": ("GB/s", "device memory bandwidth (10^9 B/s)"),
    "gm_read_bytes_per_cycle": ("B/cycle/core", "one core's GM(L2)->L1/UB read rate (MTE2)"),
    "gm_write_bytes_per_cycle": ("B/cycle/core", "one core's L0C/UB->GM(L2) write rate"),
    "kernel_launch_us": ("us", "device-side cost to start one kernel on the cores"),
    "op_dispatch_us": ("us", "host-side cost of one eager framework op call (tiling + launch)"),
}

_NUMERIC_FIELDS = [f for f in FIELD_DOCS if f != "name"]

# Plausible ranges (inclusive) for any accelerator, far wider than real chips: a value
# outside is a typo or a unit mistake (MHz for GHz), and would print absurd estimates.
_RANGES: dict[str, tuple[float, float]] = {
    "cube_cores": (1, 1e5), "vector_cores": (1, 1e5), "clock_ghz": (0.01, 100),
    "cube_macs_per_cycle": (1, 1e7), "vector_bytes_per_cycle": (1, 1e6),
    **{k: (256, 1 << 30) for k in ("l0a_bytes", "l0b_bytes", "l0c_bytes", "l1_bytes", "ub_bytes")},
    "l2_bytes": (1024, 1 << 40), "hbm_bytes": (1 << 20, 1 << 50), "hbm_gbps": (0.1, 1e6),
    "gm_read_bytes_per_cycle": (0.1, 1e5), "gm_write_bytes_per_cycle": (0.1, 1e5),
    "kernel_launch_us": (1e-6, 1e6), "op_dispatch_us": (1e-6, 1e6),
}
# Capabilities (not numbers): optional in spec files, default = the Atlas training / inference
# (Ascend 910 / 310) behaviour.  name -> (type, meaning)
CAPABILITY_DOCS: dict[str, tuple[type, str]] = {
    "cube_nd_direct": (bool, "the Cube loads ND operands and converts them to fractals while loading "
                             "(no TransData around matmuls)"),
    "cube_dtypes": (tuple, "operand dtypes the Cube takes natively; other floats are cast to float16"),
    "cube_fp32_fraction": (float, "fp32 Cube throughput as a fraction of fp16 (where float32 is in cube_dtypes)"),
    "fixpipe_quant": (bool, "the FixPipe dequantizes the Cube's int32 result on its way out of L0C (per-channel "
                            "deq_scale, to fp16, or requantized to int8): AscendDequant (+ AscendQuant) fused "
                            "into the int8 Cube op"),
}

# Chip-to-chip link (HCCS) figures: optional, None = no link data (a multi-card estimate then
# asks for them).  name -> (unit, meaning)
LINK_DOCS: dict[str, tuple[str, str]] = {
    "hccs_gbps": ("GB/s", "HCCS bandwidth of one chip-to-chip link, one direction (10^9 B/s)"),
    "hccs_latency_us": ("us", "time of one step of an HCCL collective (link hop + synchronisation)"),
}

_INT_FIELDS = {
    "cube_cores", "vector_cores", "cube_macs_per_cycle", "vector_bytes_per_cycle",
    "l0a_bytes", "l0b_bytes", "l0c_bytes", "l1_bytes", "ub_bytes", "l2_bytes", "hbm_bytes",
}


@dataclass(frozen=True)
class NpuSpec:
    """Numbers describing one Ascend-style NPU (units in `FIELD_DOCS`).

    Derived quantities are properties: `cube_flops_per_cycle` (2 * MACs),
    `peak_cube_tflops(dtype)`, `vector_elems_per_cycle(dtype)`, `aiv_per_aic`.
    ``sources`` maps every numeric field to where its value comes from; a value
    without a primary source starts with ``"estimate:"``.  ``print(spec.describe())``
    shows the table.
    """

    name: str
    cube_cores: int
    vector_cores: int
    clock_ghz: float
    cube_macs_per_cycle: int
    vector_bytes_per_cycle: int
    l0a_bytes: int
    l0b_bytes: int
    l0c_bytes: int
    l1_bytes: int
    ub_bytes: int
    l2_bytes: int
    hbm_bytes: int
    hbm_gbps: float
    gm_read_bytes_per_cycle: float
    gm_write_bytes_per_cycle: float
    kernel_launch_us: float
    op_dispatch_us: float
    cube_nd_direct: bool = False
    cube_dtypes: tuple = ("float16", "int8")
    cube_fp32_fraction: float = 0.5
    fixpipe_quant: bool = False
    hccs_gbps: float | None = None
    hccs_latency_us: float | None = None
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _validate(dataclasses.asdict(self), origin=f"NpuSpec {self.name!r}")

    # -- derived -------------------------------------------------------------------
    @property
    def cube_flops_per_cycle(self) -> int:
        """fp16 FLOP per cycle per core (one MAC = 2 FLOP)."""
        return 2 * self.cube_macs_per_cycle

    @property
    def aiv_per_aic(self) -> float:
        """Vector units serving one Cube core (2 on 910B's split AIC/AIV design, else 1)."""
        return self.vector_cores / self.cube_cores

    def peak_cube_tflops(self, dtype_bytes: int = 2) -> float:
        """Peak Cube TFLOP/s for an element size in bytes (2: fp16/bf16, 1: int8, 4: fp32).

        The Cube consumes one 16 x k0 by k0 x 16 fractal pair per cycle with
        k0 = 32 B / element size ([HC31]: 16x16x16 fp16, 16x32x16 int8).  fp32: where the
        Cube takes fp32 (``"float32" in cube_dtypes``) ``cube_fp32_fraction`` of the fp16
        rate (910B: 1/4, measured [MM-910B]); elsewhere GE casts fp32 operands to fp16, so
        the fp16 rate applies.
        """
        fp16 = 2 * self.cube_macs_per_cycle * self.cube_cores * self.clock_ghz * 1e9 / 1e12
        if dtype_bytes == 4:
            return fp16 * self.cube_fp32_fraction if "float32" in self.cube_dtypes else fp16
        return fp16 * (2 // dtype_bytes if dtype_bytes < 2 else 1)

    def vector_elems_per_cycle(self, dtype_bytes: int) -> float:
        """Elements one vector unit processes per cycle for an element size in bytes."""
        return self.vector_bytes_per_cycle / dtype_bytes

    def describe(self) -> str:
        """A printable table: field, value, unit, source."""
        rows = [f"NpuSpec {self.name}"]
        for f in _NUMERIC_FIELDS:
            unit, _ = FIELD_DOCS[f]
            rows.append(f"  {f:26s} {getattr(self, f)!s:>14} {unit:20s} {self.sources.get(f, '(no source)')}")
        for f, (unit, _) in LINK_DOCS.items():
            if getattr(self, f) is not None:
                rows.append(f"  {f:26s} {getattr(self, f)!s:>14} {unit:20s} {self.sources.get(f, '(no source)')}")
        rows.append(f"  {'peak fp16 Cube':26s} {self.peak_cube_tflops(2):>14.1f} {'TFLOP/s':20s} derived")
        return "\n".join(rows)

    def replace(self, **changes: Any) -> "NpuSpec":
        """A copy with some fields changed; changed fields get source 'user override'."""
        src = dict(self.sources)
        for k in changes:
            if k != "sources":
                src[k] = "user override"
        changes.setdefault("sources", src)
        return dataclasses.replace(self, **changes)


def _validate(values: Mapping[str, Any], origin: str) -> None:
    """Check presence, type and positivity of every field; raise ValueError naming the fix."""
    for key in FIELD_DOCS:
        if key not in values:
            unit, meaning = FIELD_DOCS[key]
            raise ValueError(f"{origin}: missing key '{key}' ({meaning}, {unit}); add it, e.g. `{key} = ...`")
    if not isinstance(values["name"], str) or not values["name"]:
        raise ValueError(f"{origin}: key 'name' must be a non-empty string")
    for key in _NUMERIC_FIELDS:
        v = values[key]
        unit, meaning = FIELD_DOCS[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{origin}: key '{key}' ({meaning}) must be a number in {unit}, got {v!r}")
        if key in _INT_FIELDS and not float(v).is_integer():
            raise ValueError(f"{origin}: key '{key}' ({meaning}) must be a whole number of {unit}, got {v!r}")
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"{origin}: key '{key}' ({meaning}) must be a positive number in {unit}, "
                             f"got {v!r}; give the chip's value (> 0)")
        lo, hi = _RANGES[key]
        if not lo <= v <= hi:
            raise ValueError(f"{origin}: key '{key}' ({meaning}) is {v!r} {unit}, outside the plausible "
                             f"range {lo:g}..{hi:g} {unit}; give the chip's value in {unit}")
    for key, (typ, meaning) in CAPABILITY_DOCS.items():
        if key not in values:
            continue
        v = values[key]
        ok = (isinstance(v, bool) if typ is bool else
              isinstance(v, (tuple, list)) and all(isinstance(d, str) for d in v) if typ is tuple else
              isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1)
        if not ok:
            want = {bool: "true or false", tuple: "a list of dtype names, e.g. [\"float16\", \"int8\"]",
                    float: "a number in (0, 1]"}[typ]
            raise ValueError(f"{origin}: key '{key}' ({meaning}) must be {want}, got {v!r}")
    for key, (unit, meaning) in LINK_DOCS.items():
        v = values.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                              or not 0 < v <= 1e6):
            raise ValueError(f"{origin}: key '{key}' ({meaning}) must be a positive number in {unit}, got {v!r}")
    if values["vector_cores"] < values["cube_cores"]:
        raise ValueError(f"{origin}: 'vector_cores' ({values['vector_cores']}) is smaller than 'cube_cores' "
                         f"({values['cube_cores']}); every Cube core needs at least one Vector unit")


# ----------------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------------

_HC31_BUFFERS = "[HC31] DaVinci Max core buffer sizes"

ascend910 = NpuSpec(
    name="ascend910",
    cube_cores=32, vector_cores=32, clock_ghz=1.0,
    cube_macs_per_cycle=4096, vector_bytes_per_cycle=256,
    l0a_bytes=64 * KiB, l0b_bytes=64 * KiB, l0c_bytes=256 * KiB, l1_bytes=1 * MiB, ub_bytes=256 * KiB,
    l2_bytes=32 * MiB, hbm_bytes=32 * GiB, hbm_gbps=1200.0,
    gm_read_bytes_per_cycle=64.0, gm_write_bytes_per_cycle=64.0,
    kernel_launch_us=5.0, op_dispatch_us=70.0,
    sources={
        "cube_nd_direct": "[HC31] DaVinci Cube reads fractal (NZ / FRACTAL_Z) operands from L0A/L0B; "
                          "GE inserts TransData to them",
        "cube_dtypes": "[HC31] Cube unit fp16 and int8 only: GE casts fp32 to fp16 (precision_mode "
                       "force_fp16 / allow_fp32_to_fp16)",
        "cube_fp32_fraction": "unused: no fp32 Cube",
        "fixpipe_quant": "[HC31] DaVinci v100: the Cube result leaves L0C for the Unified Buffer; AscendDequant "
                         "/ AscendQuant run on the Vector unit (separate kernels here)",
        "cube_cores": "[HC31] Ascend 910: 32 DaVinci Max AI cores (each with Cube and Vector units)",
        "vector_cores": "[HC31] one Vector unit per DaVinci core",
        "clock_ghz": "estimate: 256 TFLOPS fp16 peak [HC31] / (32 cores x 8192 FLOP/cycle) = 0.98 GHz, rounded",
        "cube_macs_per_cycle": "[HC31] Cube unit 16x16x16 fp16 MACs per cycle",
        "vector_bytes_per_cycle": "[HC31] Vector unit 2048 bit wide",
        "l0a_bytes": _HC31_BUFFERS, "l0b_bytes": _HC31_BUFFERS, "l0c_bytes": _HC31_BUFFERS,
        "l1_bytes": _HC31_BUFFERS, "ub_bytes": _HC31_BUFFERS,
        "l2_bytes": "[HC31] Ascend 910 on-chip L2 buffer 32 MB",
        "hbm_bytes": "[HC31] 4 HBM2 stacks, 32 GB",
        "hbm_gbps": "[HC31] HBM2 bandwidth 1.2 TB/s",
        "gm_read_bytes_per_cycle": "estimate: 64 B/cycle per core (no public per-core MTE2 rate for 910)",
        "gm_write_bytes_per_cycle": "estimate: 64 B/cycle per core (no public per-core write rate for 910)",
        "kernel_launch_us": "estimate: taken equal to the 910B value (see ascend910b)",
        "op_dispatch_us": "estimate: taken equal to the 910B value (see ascend910b)",
    },
)

_INI = "[INI-910B]"
ascend910b = NpuSpec(
    name="ascend910b",
    cube_cores=24, vector_cores=48, clock_ghz=1.8,
    cube_macs_per_cycle=4096, vector_bytes_per_cycle=256,
    l0a_bytes=64 * KiB, l0b_bytes=64 * KiB, l0c_bytes=128 * KiB, l1_bytes=512 * KiB, ub_bytes=192 * KiB,
    l2_bytes=192 * MiB, hbm_bytes=64 * GiB, hbm_gbps=1600.0,
    gm_read_bytes_per_cycle=110.0, gm_write_bytes_per_cycle=86.0,
    kernel_launch_us=5.0, op_dispatch_us=70.0,
    cube_nd_direct=True, cube_dtypes=("float16", "bfloat16", "float32", "int8"), cube_fp32_fraction=0.25,
    fixpipe_quant=True,
    hccs_gbps=56.0, hccs_latency_us=26.0,
    sources={
        "fixpipe_quant": "[FIXPIPE-A2] Ascend C Fixpipe on Atlas A2: L0C int32 -> GM with quantPre DEQF16 / "
                         "VDEQF16 (scalar / per-channel deq_scale, to fp16) or REQ8 / VREQ8 (requantized to "
                         "int8) and an optional ReLU, no Vector pass; GE fuses Conv + AscendDequant "
                         "(+ AscendQuant) into the Cube op",
        "hccs_gbps": "estimate: the commonly quoted Atlas 800 A2 figure, 8 NPUs in a full HCCS mesh, 7 links of "
                     "56 GB/s per NPU (392 GB/s); no primary source in the stored corpus",
        "hccs_latency_us": "estimate (FITTED): set so that Llama2-70B decode on 8 cards at batch 1 matches [TA-70B] "
                           "(opencann.devices.vnpu.calibration, the fitted LLM row); small HCCL all-reduces on a "
                           "mesh are latency-bound, and no public per-step latency was found",
        "cube_nd_direct": "[A2-ND] Atlas A2 (910B) MatMul reads ND from GM; the ND->NZ conversion happens in "
                          "the MTE2 load (Nd2Nz), so GE inserts no TransData around MatMul/BatchMatMul",
        "cube_dtypes": "[A2-ND] Ascend C Matmul on Atlas A2 takes half, bfloat16, float (as HF32/fp32) and int8",
        "cube_fp32_fraction": "[MM-910B] public torch.mm loop measurements on 910B2: fp32 ~1/4 of fp16 TFLOPS",
        "cube_cores": f"{_INI} ai_core_cnt=24 / cube_core_cnt=24 (910B1/B2 class; 910B3 has 20)",
        "vector_cores": f"{_INI} vector_core_cnt=48, split AIC/AIV design (910B3 has 40)",
        "clock_ghz": f"{_INI} cube_freq=1800 (MHz)",
        "cube_macs_per_cycle": f"{_INI} cube_m_size=cube_n_size=cube_k_size=16",
        "vector_bytes_per_cycle": f"{_INI} vec_calc_size=128 (fp16 elements per cycle = 256 B)",
        "l0a_bytes": f"{_INI} l0_a_size=65536", "l0b_bytes": f"{_INI} l0_b_size=65536",
        "l0c_bytes": f"{_INI} l0_c_size=131072", "l1_bytes": f"{_INI} l1_size=524288",
        "ub_bytes": f"{_INI} ub_size=196608",
        "l2_bytes": f"{_INI} l2_size=201326592",
        "hbm_bytes": f"{_INI} memory_size (64 GB HBM2e)",
        "hbm_gbps": "estimate: 1.6 TB/s, public 910B figure; the ini's ddr_rate=32 B/cycle/core x 24 x 1.8 GHz "
                    "gives 1.38 TB/s of the same order",
        "gm_read_bytes_per_cycle": f"{_INI} [AICoreMemoryRates] l2_read_rate=110 (quoted for 910B1, assumed for B2)",
        "gm_write_bytes_per_cycle": f"{_INI} [AICoreMemoryRates] l2_write_rate=86 (quoted for 910B1, assumed for B2)",
        "kernel_launch_us": "estimate: [PTO-JIT] single-core FlashAttention times 38.3 us (S1=4096) and 68.8 us "
                            "(S1=8192) extrapolate to ~7.8 us at S1=0, which includes pipeline fill; ~5 us left "
                            "for the launch itself",
        "op_dispatch_us": "estimate: [PTO-JIT] torch_npu npu_fused_attention takes a flat 70-76 us for S0=128, "
                          "S1=1K..8K on 910B2, i.e. host-side per-op cost when the device work is small",
    },
)

ascend310 = NpuSpec(
    name="ascend310",
    cube_cores=2, vector_cores=2, clock_ghz=0.5,
    cube_macs_per_cycle=4096, vector_bytes_per_cycle=256,
    l0a_bytes=64 * KiB, l0b_bytes=64 * KiB, l0c_bytes=256 * KiB, l1_bytes=1 * MiB, ub_bytes=256 * KiB,
    l2_bytes=8 * MiB, hbm_bytes=8 * GiB, hbm_gbps=59.7,
    gm_read_bytes_per_cycle=174.0, gm_write_bytes_per_cycle=87.0,
    kernel_launch_us=10.0, op_dispatch_us=100.0,
    sources={
        "cube_nd_direct": "[HC31] DaVinci Cube reads fractal (NZ / FRACTAL_Z) operands from L0A/L0B; "
                          "GE inserts TransData to them",
        "cube_dtypes": "[HC31] Cube unit fp16 and int8 only: GE casts fp32 to fp16 (precision_mode "
                       "force_fp16 / allow_fp32_to_fp16)",
        "cube_fp32_fraction": "unused: no fp32 Cube",
        "fixpipe_quant": "[HC31] DaVinci v100: the Cube result leaves L0C for the Unified Buffer; AscendDequant "
                         "/ AscendQuant run on the Vector unit (separate kernels here)",
        "cube_cores": "[HC31] Ascend 310: 2 DaVinci AI cores",
        "vector_cores": "[HC31] one Vector unit per DaVinci core",
        "clock_ghz": "estimate: 8 TFLOPS fp16 peak (Huawei Ascend 310 product brief) / (2 cores x 8192 FLOP/cycle)"
                     " = 0.49 GHz",
        "cube_macs_per_cycle": "[HC31] Cube unit 16x16x16 fp16 MACs per cycle",
        "vector_bytes_per_cycle": "[HC31] Vector unit 2048 bit wide",
        "l0a_bytes": "estimate: DaVinci Max sizes [HC31] assumed for 310",
        "l0b_bytes": "estimate: DaVinci Max sizes [HC31] assumed for 310",
        "l0c_bytes": "estimate: DaVinci Max sizes [HC31] assumed for 310",
        "l1_bytes": "estimate: DaVinci Max sizes [HC31] assumed for 310",
        "ub_bytes": "estimate: DaVinci Max sizes [HC31] assumed for 310",
        "l2_bytes": "estimate: 8 MB on-chip buffer (Ascend 310 product brief)",
        "hbm_bytes": "estimate: 8 GB LPDDR4X on Atlas 200 boards",
        "hbm_gbps": "estimate: LPDDR4X 2 x 64 bit at 3733 MT/s = 59.7 GB/s nominal (the cost model derates "
                    "every preset by HBM_EFFICIENCY)",
        "gm_read_bytes_per_cycle": "[GE-310-STUB] l2_read_rate 128 B/cycle at the stub's 680 MHz = 87 GB/s per "
                                   "core, expressed at this preset's 0.5 GHz clock (the clock follows the 8 TFLOPS "
                                   "product peak; the stub's 680 MHz would give 11.1 TFLOPS)",
        "gm_write_bytes_per_cycle": "[GE-310-STUB] l2_write_rate 64 B/cycle at 680 MHz = 43.5 GB/s per core, "
                                    "expressed at 0.5 GHz",
        "kernel_launch_us": "estimate: twice the 910B value (slower embedded host CPU)",
        "op_dispatch_us": "estimate: larger than 910B for the slower embedded host CPU",
    },
)

PRESETS: dict[str, NpuSpec] = {s.name: s for s in (ascend910, ascend910b, ascend310)}


def get_preset(name: str) -> NpuSpec:
    """Return the preset called `name` ('ascend910', 'ascend910b', 'ascend310').

    Raises ValueError listing the known names when `name` is unknown.
    """
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown NPU preset {name!r}; known presets: {', '.join(sorted(PRESETS))}, "
                         f"or give a spec file to load_spec()") from None


def _read_spec_file(p: Path) -> dict:
    """The top-level table of the JSON/TOML spec file ``p`` (see `load_spec` for the errors)."""
    if not p.exists():
        raise FileNotFoundError(f"spec file {p} does not exist")
    if p.is_dir():
        raise ValueError(f"spec file {p} is a directory; give a .json or .toml file in it")
    suffix = p.suffix.lower()
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{p}: not UTF-8 text (byte {e.start}: {e.reason}); save the spec file "
                         "as UTF-8 JSON or TOML") from None
    try:
        if suffix == ".json":
            data = json.loads(text)
        elif suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                raise ValueError(f"{p}: reading TOML needs Python >= 3.11 (tomllib); use a .json spec file") from None
            data = tomllib.loads(text)
        else:
            raise ValueError(f"{p}: unknown spec file type {suffix!r}; use .json or .toml")
    except (json.JSONDecodeError, ValueError) as e:
        if isinstance(e, ValueError) and str(e).startswith(str(p)):
            raise
        raise ValueError(f"{p}: cannot parse spec file: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{p}: the spec file must hold a table/object of fields at top level")
    return data


def load_spec(path: str | Path) -> NpuSpec:
    """Read an `NpuSpec` from a JSON (``.json``) or TOML (``.toml``) file.

    The file holds the `NpuSpec` fields at top level (see `FIELD_DOCS` for names and
    units) and optionally ``base = "<preset>"`` to start from a preset and override only
    some fields, and a ``[sources]`` table (field -> source string).  Fields given without
    a source are recorded as ``"user spec file <path>"``.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: a directory, not UTF-8, unknown suffix, unreadable JSON/TOML, an
            unknown key, a missing key, or a non-positive / non-numeric / implausible value
            (outside `_RANGES`); the message names the file, the key and the fix.
    """
    p = Path(path)
    data = dict(_read_spec_file(p))
    user_sources = data.pop("sources", {}) or {}
    if not isinstance(user_sources, dict):
        raise ValueError(f"{p}: key 'sources' must be a table mapping field names to source strings")
    base_name = data.pop("base", None)
    for key in list(data) + list(user_sources):
        if key not in FIELD_DOCS and key not in CAPABILITY_DOCS and key not in LINK_DOCS:
            raise ValueError(f"{p}: unknown key '{key}'; valid keys are {', '.join(FIELD_DOCS)}, "
                             f"{', '.join(CAPABILITY_DOCS)}, {', '.join(LINK_DOCS)}, 'base', 'sources'; "
                             "remove it or fix its spelling")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if base_name is not None:
        base = get_preset(str(base_name))
        values = {f: getattr(base, f) for f in (*FIELD_DOCS, *CAPABILITY_DOCS, *LINK_DOCS)}
        sources = dict(base.sources)
    values.update(data)
    for key in data:
        sources[key] = f"user spec file {p}"
    sources.update({k: str(v) for k, v in user_sources.items()})
    _validate(values, origin=str(p))
    for key in _INT_FIELDS:
        values[key] = int(values[key])
    if "cube_dtypes" in values:
        values["cube_dtypes"] = tuple(values["cube_dtypes"])
    return NpuSpec(**values, sources=sources)
