"""Calibration of the vnpu cost model against published measurements (opencann issue 17).

`calibration_table()` returns one dict per anchor: ``workload``, ``preset``, ``source``,
``published`` and ``estimate`` (same unit, given in ``unit``), ``ratio`` = estimate /
published (> 1: the model is optimistic), ``band`` (allowed |ratio - 1|: 0.25, 0.35 for
figures marked ``weak``), ``within_band``, ``fitted`` (the anchor set a fitted constant, so its
ratio checks nothing), ``known_miss`` and ``note``.  Workloads are costed with the
cost-model functions only (no compile), so the table is cheap and pins the model:

* GEMM: `matmul_cost` per call from an eager loop (`eager_time_us`), TFLOP/s;
* FlashAttention forward: `flash_attention_cost` per eager call, TFLOP/s, and device time against the
  hand-written kernel on all cores and on one core (its L2 contention term, FA_L2_CONTENTION, is
  fitted to the all-core S = 8K time and checked against every other FlashAttention anchor);
* ResNet-101/152 inference as an offline model (ATC .om): the sum of its kernels
  (`conv2d_cost` with GE's fused bias/ReLU/residual-Add epilogue, pooling, FC), images/s.

Sources (keys used in ``source``):
[MM-910B] public torch_npu torch.mm loop measurements on Ascend 910B2 quoted in issue 17;
[FA-910B] torch_npu FlashAttention forward (B=1, N=1, S_q=S_k, d=128, fp16) in the "910B2 Multi-Core
  Comparison" table of CANN pto-isa kernels/manual/common/flash_atten/README.md (hw-native-sys/pto-isa
  @ a977dd11, 2026-04-30): 58.461 / 70.801 / 118.302 / 353.147 / 1118.462 / 3646.173 us at S = 1K..32K;
[PTO-FA] the hand-written PTO kernel's full-device times in the same table: 20.960 / 32.461 / 88.902 /
  292.626 / 909.058 / 3262.645 us; its launcher (fa_performance_kernel.cpp, LaunchTFA) also launches an
  empty warm-up kernel on 24 cores and three SDMA L2 prefetches per call;
[PTO-JIT] the hand-written PTO kernel of pto-isa demos/torch_jit/flash_atten/README.md (cannmirror/pto-isa
  @ defdb75f, 2026-03-07), warm per-call times (10 warm-up + 50 timed calls in a stream), S0=128, one
  core: 19.200 / 23.420 / 38.317 / 68.778 us (aarch64 host) and 16.54 / 23.98 / 40.94 / 72.14 us (x86_64)
  at S1 = 1K..8K.  The single-core table of kernels/manual/common/flash_atten/README.md (42.08 / 51.44 /
  43.80 / 74.54 us) is one cold launch timed by in-kernel counters (main.cpp) and is not used; nor are
  [PTO-JIT]'s multi-core rows (S0 = 256..2048): its benchmark then allocated the whole S, P and P-fp32
  matrices in GM (fa_benchmark.py @ 1fb190ca), which makes them HBM write-back bound, not FIFO work;
[MZ-310] Ascend ModelZoo ResNet-101 / ResNet-152 ONNX -> om inference guides, one Ascend 310;
[MAMF-910B] torch_npu bf16 ``torch.mm`` TFLOP/s of four trials of a maximum-achievable-matmul-FLOPS search on
  an Ascend910B2C (gameofdimension/gpu_benchmark @ 1103b99a, README sample output, torch 2.4; each trial the
  fastest of 100 event-timed calls after 50 warm-ups, npu-mamf-finder.py @ a1fcad22): 291.58 / 272.60 /
  301.26 / 317.32.  The script's "N" is the shared (reduction) dimension and "K" the output columns
  (A = randn(M, N), B = randn(N, K)), so the trials are M x N_out x K = 6912 x 2048 x 16384,
  2304 x 1536 x 5120, 6144 x 2816 x 17920, 14336 x 4096 x 4096 (best of the search 322.5, shape not given);
[PTO-GEMM] CANN pto-isa commit d9ef6d02 (hw-native-sys/pto-isa, 2026-05-20, "Add PTO-DSL GEMM kernel for
  A2/A3"), its performance table on Ascend 910B2, fp16 in / fp16 out: ``torch.matmul`` (torch_npu) and the
  hand-written PTO-DSL kernel, each the mean of 20 event-timed calls after 5 warm-ups, every call on fresh
  operands (kernels/python/gemm/run.py: 25 distinct A/B pairs, so A and B come from HBM).
[TA-7B] TorchAir's Llama2-7B reference (Ascend/torchair npu_tuned_model/llm/llama/reduce-overhead/README.md
  @ 91863657): one Atlas 800I A2 card (arm host), fp16, batch 4, prompt padded to 1024, 1024 new tokens, KV
  cache preallocated at max_position_embeddings = 4096: prefill (first step) 207 ms eager / 208 ms graph
  (max-autotune), decode (mean of the later steps) 27.8 ms eager / 18.6 ms graph;
[TA-70B] TorchAir's Llama2-70B reference (Ascend/torchair npu_tuned_model/llm/llama/README.md @ 433f5a2a),
  8 Atlas 800I A2 cards (deepspeed tensor parallelism, arm host), fp16, same prompt / new tokens, graph mode:
  prefill 175 / 565 / 1101 / 2357 / 4895 / 7253 ms and decode 34.6 / 35.1 / 35.5 / 38.1 / 42.5 / 46.4 ms at
  batch 1 / 4 / 8 / 16 / 32 / 48; eager at batch 4: prefill 610 ms, decode 110 ms.  (An older revision of the
  same README, @ 18b6477f, gives 35.9 .. 48.6 ms decode.)  The LLM rows are built by
  `opencann.tools.estimate_llm.llm_calibration_table` (they need the step graphs, above this layer).
Also used as evidence, not as anchors: kernels/manual/a2a3/gemm_performance/README.md (same repository),
  the manual GEMM on an Atlas A3 (24 cores, fp16 in / fp32 out) with its per-pipe busy ratios.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

from .cost_model import (conv2d_cost, eager_time_us, flash_attention_cost, matmul_cost, reduction_cost)
from .presets import NpuSpec, ascend310, ascend910b

__all__ = ["calibration_table", "calibration_row", "TORCHAIR_LLAMA2", "resnet_inference_us", "render_markdown", "PTO_SINGLE_CORE_US",
           "BEST_HANDWRITTEN_SINGLE_CORE_US", "BEST_HANDWRITTEN_ALL_CORE_US", "handwritten_all_core_estimate_us",
           "BEST_PUBLISHED_GEMM_TFLOPS", "GEMM_TORCH_NPU_910B2", "GEMM_PTO_DSL_910B2", "gemm_estimate_tflops"]

BAND, WEAK_BAND = 0.25, 0.35


def resnet_inference_us(depths: Sequence[int], batch: int, spec: NpuSpec = ascend310, dtype: str = "float16",
                        size: int = 224) -> float:
    """Device time (µs) of one ResNet-v1.5 bottleneck forward (torchvision layout; depths
    e.g. (3, 4, 23, 3) for ResNet-101) at `batch` as an offline model: every conv with its
    BatchNorm folded and GE's fused epilogue (bias + ReLU, or bias + residual Add + ReLU),
    the max pool, the global average pool and the FC, each one kernel (launch included).
    Raises ValueError on batch < 1."""
    if batch < 1:
        raise ValueError(f"resnet_inference_us: batch must be >= 1, got {batch}")
    total = 0.0

    def conv(cin: int, h: int, cout: int, k: int, s: int, p: int, epi: tuple) -> int:
        nonlocal total
        total += conv2d_cost(batch, cin, h, h, cout, k, s, p, dtype, spec, epilogue=epi).time_us
        return (h + 2 * p - k) // s + 1

    h = conv(3, size, 64, 7, 2, 3, ("bias", "relu"))
    total += reduction_cost(batch * 64 * h * h, batch * 64 * (h // 2) ** 2, dtype, "max", spec).time_us
    h //= 2
    cin = 64
    for i, (n, w) in enumerate(zip(depths, (64, 128, 256, 512))):
        for b in range(n):
            s = 2 if b == 0 and i > 0 else 1
            if b == 0:
                conv(cin, h, 4 * w, 1, s, 0, ("bias",))                  # downsample branch
            conv(cin, h, w, 1, 1, 0, ("bias", "relu"))
            h2 = conv(w, h, w, 3, s, 1, ("bias", "relu"))
            conv(w, h2, 4 * w, 1, 1, 0, ("bias", "add", "relu"))
            h, cin = h2, 4 * w
    total += reduction_cost(batch * cin * h * h, batch * cin, dtype, "add", spec).time_us
    total += matmul_cost(batch, 1000, cin, 1, dtype, spec, epilogue=("bias",)).time_us
    return total


def gemm_estimate_tflops(m: int, n: int, k: int, dtype: str = "float16", spec: NpuSpec = ascend910b) -> float:
    """Estimated TFLOP/s of C[M, N] = A[M, K] @ B[K, N] called in an eager loop: `matmul_cost`
    per call as `eager_time_us` (the slower of host dispatch and device time), as the published
    torch.mm / torch.matmul loops time it.  Raises ValueError on sizes < 1."""
    c = matmul_cost(m, n, k, 1, dtype, spec)
    return c.useful_flops / eager_time_us(c, spec) / 1e6


def _fa_tflops(s: int, spec: NpuSpec) -> float:
    c = flash_attention_cost(1, 1, s, s, 128, "float16", spec=spec)
    return c.useful_flops / eager_time_us(c, spec) / 1e6


_GEMM_FP16 = {1024: 98.0, 2048: 251.0, 4096: 315.0, 8192: 305.0, 10240: 275.0}
_GEMM_BF16_MAMF = {(6912, 2048, 16384): 291.58, (2304, 1536, 5120): 272.60, (6144, 2816, 17920): 301.26,
                   (14336, 4096, 4096): 317.32}
"""[MAMF-910B] (M, N, K) of C[M, N] = A[M, K] @ B[K, N] -> TFLOP/s, bf16."""
GEMM_TORCH_NPU_910B2 = {(512, 1536, 2048): 162.74, (2048, 1024, 2048): 207.73, (3072, 3072, 3072): 298.55,
                        (4096, 4096, 4096): 307.17, (5632, 1536, 6144): 300.22, (6144, 6144, 6144): 315.82,
                        (8192, 4096, 4096): 325.04, (16384, 4096, 4096): 321.04, (4096, 16384, 16384): 286.94}
"""[PTO-GEMM] torch.matmul on 910B2, (M, N, K) -> TFLOP/s, fp16 (the table gives M x K x N)."""
GEMM_PTO_DSL_910B2 = {(512, 1536, 2048): 91.15, (2048, 1024, 2048): 186.95, (3072, 3072, 3072): 270.89,
                      (4096, 4096, 4096): 292.28, (5632, 1536, 6144): 278.67, (6144, 6144, 6144): 309.11,
                      (8192, 4096, 4096): 302.82, (16384, 4096, 4096): 305.06, (4096, 16384, 16384): 248.82}
"""[PTO-GEMM] the hand-written PTO-DSL GEMM on 910B2, same shapes and timing; slower than torch.matmul at
every shape, so never the best published kernel."""


def _best_published_gemm() -> Dict[tuple, float]:
    best: Dict[tuple, float] = {}
    for src in ({("float16", n, n, n): t for n, t in _GEMM_FP16.items()},
                {("bfloat16", *mnk): t for mnk, t in _GEMM_BF16_MAMF.items()},
                {("float16", *mnk): t for mnk, t in GEMM_TORCH_NPU_910B2.items()},
                {("float16", *mnk): t for mnk, t in GEMM_PTO_DSL_910B2.items()}):
        for key, t in src.items():
            best[key] = max(t, best.get(key, 0.0))
    return best


BEST_PUBLISHED_GEMM_TFLOPS = _best_published_gemm()
"""(dtype, M, N, K) -> the fastest published 910B2 GEMM for that work, TFLOP/s: the maximum over [MM-910B],
[MAMF-910B] and [PTO-GEMM] (library and hand-written).  No estimate may be faster (tests pin it).  The fp32
row of the table is not in it: its figure is the "fp32 ~1/4 of fp16" statement, not a timing."""
_FA = {1024: 58.461, 2048: 70.801, 4096: 118.302, 8192: 353.147, 16384: 1118.462, 32768: 3646.173}   # us
_PTO_FULL_US = {1024: 20.960, 2048: 32.461, 4096: 88.902, 8192: 292.626, 16384: 909.058, 32768: 3262.645}
PTO_SINGLE_CORE_US = {1024: 19.200, 2048: 23.420, 4096: 38.317, 8192: 68.778}
"""[PTO-JIT] aarch64 table: S0=128 on one core, per call, at S1 = 1K..8K (us)."""
BEST_HANDWRITTEN_SINGLE_CORE_US = {1024: 16.54, 2048: 23.420, 4096: 38.317, 8192: 68.778}
"""The fastest published hand-written kernel for S0=128, d=128, fp16 on one 910B2 core: the minimum of
[PTO-JIT]'s aarch64 and x86_64 tables (us).  No estimate may be faster (tests pin it)."""
BEST_HANDWRITTEN_ALL_CORE_US = dict(_PTO_FULL_US)
"""The fastest published hand-written kernel for B=1, N=1, S_q=S_k=S, d=128, fp16 on a whole 910B2,
per call (us): [PTO-FA], the only published one (torch_npu is slower at every S).  No estimate may
be faster (tests pin it)."""
_RESNET = {("ResNet-101", 1): 247.9, ("ResNet-101", 16): 401.0, ("ResNet-152", 1): 180.1, ("ResNet-152", 16): 291.0}
_DEPTHS = {"ResNet-101": (3, 4, 23, 3), "ResNet-152": (3, 8, 36, 3)}

_FA_NOTE = ("not matched: torch_npu is slower than the hand-written PTO kernel on the same chip by 1.12-1.33x "
            "at S >= 4K [PTO-FA]; the rest is torch_npu's implementation, not a hardware rate")
_FA_IN_NOTE = ("in band out of sample: the L2 contention term is fitted to [PTO-FA] S=8K only; torch_npu is "
               "{:.2f}x slower than the hand-written kernel here")
_PTO_8K_NOTE = ("FITTED: this anchor sets FA_L2_CONTENTION (ratio just under 1 by construction); per key block the "
                "8K run is 1.25x slower than the same kernel at 4K/16K/32K, so matching it makes those 0.78-0.87")
_PTO_NOTE = "time incl. the launcher's warm-up kernel; out of sample for FA_L2_CONTENTION"


def _row(workload: str, preset: str, source: str, unit: str, published: float, estimate: float, weak: bool,
         note: str = "", known_miss: bool = False, fitted: bool = False) -> Dict[str, Any]:
    band = WEAK_BAND if weak else BAND
    ratio = estimate / published
    return {"workload": workload, "preset": preset, "source": source, "unit": unit, "published": published,
            "estimate": estimate, "ratio": ratio, "band": band, "within_band": abs(ratio - 1) <= band,
            "weak": weak, "known_miss": known_miss, "fitted": fitted, "note": note}


def calibration_row(workload: str, preset: str, source: str, unit: str, published: float, estimate: float,
                    weak: bool = False, note: str = "", known_miss: bool = False,
                    fitted: bool = False) -> Dict[str, Any]:
    """One calibration row (the dict `calibration_table` returns), for tables built above this layer
    (`opencann.tools.estimate_llm.llm_calibration_table`)."""
    return _row(workload, preset, source, unit, published, estimate, weak, note, known_miss, fitted)


TORCHAIR_LLAMA2: List[Dict[str, Any]] = [
    *[{"model": "llama2-7b", "cards": 1, "batch": 4, "step": step, "mode": mode, "ms": ms, "source": "[TA-7B]"}
      for step, mode, ms in (("prefill", "graph", 208.0), ("decode", "graph", 18.6), ("prefill", "eager", 207.0),
                             ("decode", "eager", 27.8))],
    *[{"model": "llama2-70b", "cards": 8, "batch": b, "step": "decode", "mode": "graph", "ms": ms, "source": "[TA-70B]"}
      for b, ms in ((1, 34.6), (4, 35.1), (8, 35.5), (16, 38.1), (32, 42.5), (48, 46.4))],
    *[{"model": "llama2-70b", "cards": 8, "batch": b, "step": "prefill", "mode": "graph", "ms": ms, "source": "[TA-70B]"}
      for b, ms in ((1, 175.0), (48, 7253.0))],
    {"model": "llama2-70b", "cards": 8, "batch": 4, "step": "decode", "mode": "eager", "ms": 110.0, "source": "[TA-70B]"},
]
"""Published TorchAir Llama2 step times on Atlas 800I A2 (fp16, prompt 1024, KV cache 4096), ms: [TA-7B], [TA-70B]."""


def handwritten_all_core_estimate_us(s: int, spec: NpuSpec = ascend910b) -> float:
    """Estimated per-call time (us) of [PTO-FA]'s measurement at S_q = S_k = `s` (B=1, N=1, d=128,
    fp16): `flash_attention_cost` device time plus the launcher's empty warm-up kernel (one
    `kernel_launch_us`).  Raises ValueError on s < 1."""
    return flash_attention_cost(1, 1, s, s, 128, "float16", spec=spec).time_us + spec.kernel_launch_us


def calibration_table() -> List[Dict[str, Any]]:
    """One dict per anchor (see the module docstring); rows with ``known_miss`` are out of
    band for a stated reason (``note``); rows with ``fitted`` set a fitted constant (the GEMM fp32
    row sets ``cube_fp32_fraction``, the all-core FlashAttention S=8K row ``FA_L2_CONTENTION``)."""
    rows: List[Dict[str, Any]] = []
    for n, pub in _GEMM_FP16.items():
        rows.append(_row(f"GEMM fp16 M=N=K={n}, torch.mm loop", "ascend910b", "[MM-910B]", "TFLOP/s", pub,
                         gemm_estimate_tflops(n, n, n, "float16"), weak=False,
                         note="dispatch-bound (22 us/call)" if n == 1024 else ""))
    rows.append(_row("GEMM fp32 M=N=K=4096, torch.mm loop", "ascend910b", "[MM-910B] (fp32 ~1/4 of fp16)",
                     "TFLOP/s", _GEMM_FP16[4096] / 4, gemm_estimate_tflops(4096, 4096, 4096, "float32"), weak=True,
                     note="fitted, not checked: this figure sets cube_fp32_fraction = 1/4", fitted=True))
    for (m, n, k), pub in _GEMM_BF16_MAMF.items():
        rows.append(_row(f"GEMM bf16 M={m} N={n} K={k}, torch.mm best of 100 calls (search trial)", "ascend910b",
                         "[MAMF-910B]", "TFLOP/s", pub, gemm_estimate_tflops(m, n, k, "bfloat16"), weak=False,
                         note="910B2C; out of sample"))
    for (m, n, k), pub in GEMM_TORCH_NPU_910B2.items():
        rows.append(_row(f"GEMM fp16 M={m} N={n} K={k}, torch.matmul, fresh operands", "ascend910b",
                         "[PTO-GEMM]", "TFLOP/s", pub, gemm_estimate_tflops(m, n, k), weak=False,
                         note="out of sample; mean of 20 calls"))
    for s, pub_us in _FA.items():
        pub = 4.0 * s * s * 128 / pub_us / 1e6
        est = _fa_tflops(s, ascend910b)
        miss = abs(est / pub - 1) > BAND
        note = _FA_NOTE if miss else (_FA_IN_NOTE.format(pub_us / _PTO_FULL_US[s]) if s >= 4096 else "")
        rows.append(_row(f"FlashAttention fwd S={s} d=128 fp16, per call", "ascend910b", "[FA-910B]", "TFLOP/s",
                         pub, est, weak=False, note=note, known_miss=miss))
    for s, pub_us in _PTO_FULL_US.items():
        est_us = handwritten_all_core_estimate_us(s)
        rows.append(_row(f"FlashAttention fwd S={s} d=128, all cores (hand-written PTO kernel)", "ascend910b",
                         "[PTO-FA]", "calls/s", 1e6 / pub_us, 1e6 / est_us, weak=False,
                         note=_PTO_8K_NOTE if s == 8192 else _PTO_NOTE, fitted=s == 8192))
    for s1, pub in PTO_SINGLE_CORE_US.items():
        c = flash_attention_cost(1, 1, 128, s1, 128, spec=ascend910b)
        # time anchor: ratio as throughput (published time / estimated time) so > 1 is optimistic
        rows.append(_row(f"FlashAttention single core S0=128 S1={s1} d=128 (hand-written PTO kernel)",
                         "ascend910b", "[PTO-JIT]", "calls/ms", 1e3 / pub, 1e3 / c.time_us, weak=False,
                         note="per call, warm"))
    for (name, batch), pub in _RESNET.items():
        est = batch / (resnet_inference_us(_DEPTHS[name], batch, ascend310) * 1e-6)
        rows.append(_row(f"{name} inference bs{batch} fp16 (om)", "ascend310", "[MZ-310]", "images/s", pub, est,
                         weak=False, note="conv + fused epilogue per kernel; 310 L2 rates from GE's stub"))
    return rows


def render_markdown(rows: List[Dict[str, Any]] | None = None) -> str:
    """The table as Markdown (the body of docs/guide/vnpu.md's calibration section)."""
    rows = calibration_table() if rows is None else rows
    out = ["| workload | preset | source | unit | published | estimate | ratio | band | within |",
           "|---|---|---|---|---:|---:|---:|---:|:---:|"]
    for r in rows:
        mark = "yes" if r["within_band"] else ("**no** (known)" if r["known_miss"] else "**no**")
        mark += " (fitted)" if r.get("fitted") else ""
        out.append(f"| {r['workload']} | {r['preset']} | {r['source']} | {r['unit']} | {r['published']:.1f} | "
                   f"{r['estimate']:.1f} | {r['ratio']:.2f} | ±{r['band']:.0%} | {mark} |")
    return "\n".join(out)
