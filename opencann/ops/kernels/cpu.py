"""CPU kernels of opencann's fused ops: bind-time factories ``f(node, in_descs, consts)
-> callable(*inputs)`` (an `OpDef`'s ``kernel_factories["cpu"]``).

- `make_conv_kernel` (ConvBiasAct, ConvAddAct): Conv2D (BatchNorm folded into weight and
  bias) + activation as one oneDNN convolution with a fused post-op
  (``torch.ops.mkldnn._convolution_pointwise``) on a weight reordered once to oneDNN's
  blocked layout (``_reorder_convolution_weight``); Conv2D + residual Add (+ ReLU) as
  oneDNN's ``sum`` post-op, written in place into the addend's buffer
  (``_convolution_pointwise_.binary``).
- ReLU is never a oneDNN post-op: every ReLU post-op torch reaches (``relu``,
  ``leaky_relu(0)``, ``hardtanh(0, inf)``: oneDNN's ``max(x, 0)`` and ``clip``; also
  after ``sum``) turns NaN into 0 (an earlier build also clamped +inf to FLT_MAX after
  ``sum``): oneDNN's x64 JIT computes them with ``vmaxps``/``vminps``, and its NaN-keeping
  compare-and-blend ReLU (a non-zero slope) gives slope × -inf = -inf where eager gives 0
  (``bench/conv_account.py --relu-post-ops``). It runs in place after the convolution
  with eager's kernel (in bf16 the same values from `relu_numba`, one integer compare per
  element): 49 passes, 4% of ResNet-50's batch-1 call (docs/performance.md).
  GELU (erf), tanh, sigmoid and swish post-ops match eager's NaN/Inf positions (tested
  in tests/unit/test_nan_semantics.py).
- `make_linear_kernel` (LinearAct): MatMulV2 (addmm) or a bias-free MatMul (mm) with a
  constant weight [+ activation] into the planned buffer, by addmm / mm, oneDNN's inner
  product on a prepacked weight or on the weight as nn.Linear holds it, MKL's packed
  GEMM or the decode GEMV (chosen per shape by measuring at bind time, `gemm_kernel`);
  the activation runs in place on the result (one pass less over the output).
  ``onednn_plain`` is oneDNN's inner product on the weight as nn.Linear holds it ([n, k]
  contiguous, ``w_t``'s transpose: no copy; else the GEMV's [n, k] copy, shared with
  it), which oneDNN's brgemm matmul reads as it is (``wei:ab``, no reorder in
  `ONEDNN_VERBOSE`): the kernel for weights that may not get a blocked copy
  (`copy_allowed`: an LLM's merged Q/K/V and gate/up weights, which the decode GEMV
  reads in that layout). On the 2-core AMD EPYC (Zen 4), least of 15 interleaved calls,
  2 threads, GFLOP/s plain / addmm / blocked: 512x768x4096 203 / 160 / 214,
  512x768x1280 214 / 195 / 216, 64x576x3072 172 / 129 / 197, 16x768x1280 123 / 108 / 180. In bf16 (mixed precision) a constant-weight
  GEMM binds oneDNN's inner product without a race: its native bf16 kernel (avx512_bf16
  / AMX) on the weight cast to bf16 at compile time and reordered once at bind time,
  with GELU (erf / tanh), tanh, sigmoid and SiLU as oneDNN post-ops
  (`BF16_LINEAR_POST`: applied to the result in registers instead of a second pass over
  it; BERT-base's 128x768x3072 GEMM + GELU measured 545 -> 348 us, least of 40
  interleaved calls, loaded 2-core Xeon with AMX); ReLU stays eager's in-place kernel.
  addmm's bf16 GEMM is the same oneDNN kernel on the plain weight, packed again on every
  call: measured slower at every shape tried (1 thread, least of 30 interleaved calls,
  2-core Xeon with AMX): 1.05-1.15x at 64x64x64, 8x256x256, 128x384x384; 1.3-1.6x at
  BERT-base's 128x768x{768, 2304, 3072} and 128x3072x768; 1.5-2x at 1..4 rows of
  768x768, 768x3072 and 4096x4096. A race on a loaded 2-core host at 2 threads picked
  either kernel at random (single calls 10-20x slower than unloaded), so none is run.

Source: oneDNN "Primitive Attributes: Post-ops" (oneapi-src.github.io/oneDNN), the same
kernels PyTorch Inductor uses for CPU freezing (torch/_inductor/fx_passes/mkldnn_fusion.py).
A kernel keeps no per-call state: one bound kernel serves every executor of its graph,
including calls running at once on several threads (``opencann.runtime.pool``).
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ...devices.cpu import best_time_us, mkl_packed_available, onednn_bf16_available, onednn_linear_available
from ...ir import Node, TensorDesc, TensorRef
from ..weight_concat import concat_view
from ..weight_probe import probe_bytes

_ACT_FN: Dict[str, Callable] = {  # in-place activations
    "relu": torch.relu_, "gelu": torch.ops.aten.gelu_, "tanh": torch.tanh_,
    "sigmoid": torch.sigmoid_, "silu": lambda t: torch.nn.functional.silu(t, inplace=True),
    "gelu_tanh": lambda t: torch.ops.aten.gelu_(t, approximate="tanh"),
}
_ONEDNN_ACT = {"none": "none", "relu": "relu", "gelu": "gelu", "tanh": "tanh",
               "sigmoid": "sigmoid", "silu": "swish"}
# LinearAct's act -> (oneDNN post-op, algorithm) fused into the bf16 prepacked inner
# product: those whose NaN/Inf positions match eager's (not ReLU: oneDNN's drops NaN)
BF16_LINEAR_POST = {"gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "tanh": ("tanh", ""),
                    "sigmoid": ("sigmoid", ""), "silu": ("swish", "")}


def _conv_weight(node: Node, x: TensorDesc, w: torch.Tensor) -> torch.Tensor:
    """Reorder the conv weight into oneDNN's blocked layout for this input size, as the
    primitive at the calling thread's intra-op thread count wants it."""
    a = node.attrs
    try:
        return torch.ops.mkldnn._reorder_convolution_weight(
            w, a["padding"], a["stride"], a["dilation"], a["groups"], list(x.shape))
    except (RuntimeError, AttributeError):
        return w


class ThreadPacks:
    """A constant weight packed for oneDNN by ``pack()`` (a zero-argument callable), once
    per intra-op thread count it is run at. oneDNN's brgemm convolutions choose their
    weight blocking by thread count (ResNet-50's 256→1024 1×1 convolutions at 14×14:
    ``Acdb64a`` at 2 threads, ``Acdb48a`` at 1), and a weight packed for another count is
    reordered again on *every* call (``reorder simple:any``, 13–19 ms each there: a model
    compiled at 2 threads and served at 1 ran 1.9× slower, 160 vs 86 ms). `get` returns the
    copy for ``torch.get_num_threads()`` of the calling thread, made on first use (under a
    lock; one copy per count in use). Used by the fp32 convolutions (`ConvWeightPacks`) and
    the int8 ones (``int8_cpu``). Source: oneDNN verbose logs (``ONEDNN_VERBOSE=1``),
    docs/performance.md "Weights packed per thread count"."""

    def __init__(self, pack: Callable[[], torch.Tensor]):
        self._pack = pack
        self._packs: Dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.get()

    def get(self) -> torch.Tensor:
        """The packed weight for the calling thread's ``torch.get_num_threads()``; packs
        on the first call at a new count. Raises what ``pack`` raises."""
        n = torch.get_num_threads()
        p = self._packs.get(n)
        if p is None:
            with self._lock:
                p = self._packs.get(n)
                if p is None:
                    p = self._packs[n] = self._pack()
        return p

    def counts(self) -> List[int]:
        """The thread counts a copy exists for, ascending."""
        return sorted(self._packs)


def ConvWeightPacks(node: Node, x: TensorDesc, w: torch.Tensor) -> ThreadPacks:   # noqa: N802
    """`ThreadPacks` of conv weight ``w`` reordered to oneDNN's blocked layout for ``node``'s
    input ``x`` (an opaque oneDNN tensor, or the plain weight where the reorder is
    unavailable: never raises for a thread count)."""
    return ThreadPacks(lambda: _conv_weight(node, x, w))


def _conv_add_kernel(packs, conv_args: tuple, unary, post, inplace: bool) -> Callable:
    """ConvAddAct's ``run(x, w[, bias], other)``: oneDNN's binary "add" post-op, written
    into ``other`` when ``inplace``; ``packs``: the constant weight's `ConvWeightPacks`
    or None; ``conv_args``: (padding, stride, dilation, groups); ``post``: an in-place
    ReLU or None."""
    pad, stride, dil, groups = conv_args
    f = (torch.ops.mkldnn._convolution_pointwise_.binary if inplace
         else torch.ops.mkldnn._convolution_pointwise.binary)

    def run(x, w, *rest):  # (x, w[, bias], other)
        b, other = (rest[0], rest[1]) if len(rest) == 2 else (None, rest[0])
        wp = w if packs is None else packs.get()
        a, c = (other, x) if inplace else (x, other)
        y = f(a, c, wp, b, pad, stride, dil, groups, "add", None, unary, [], "")
        return y if post is None else post(y)
    return run


def _aten_conv_kernel(node: Node) -> Callable:
    """The ``aten`` conv kernel (`conv_choice`): eager's ``F.conv2d`` (bias included), then
    for ConvAddAct the residual added (into the addend with ``inplace``), then the
    activation in place with eager's kernel. Same signatures as `make_conv_kernel`'s."""
    a = node.attrs
    pad, stride, dil, groups = a["padding"], a["stride"], a["dilation"], a["groups"]
    post = _ACT_FN.get(a["act"])
    conv = torch.nn.functional.conv2d
    if node.op == "ConvAddAct":
        inplace = a.get("inplace", True)

        def run_add(x, w, *rest):  # (x, w[, bias], other)
            b, other = (rest[0], rest[1]) if len(rest) == 2 else (None, rest[0])
            y = conv(x, w, b, stride, pad, dil, groups)
            y = other.add_(y) if inplace else y.add_(other)   # IEEE addition commutes
            return y if post is None else post(y)
        return run_add

    def run(x, w, b=None):
        y = conv(x, w, b, stride, pad, dil, groups)
        return y if post is None else post(y)
    return run


def _relu_for(x: TensorDesc) -> Callable:
    """The in-place ReLU a convolution reading ``x`` runs after oneDNN: `relu_numba.relu_`
    for bf16 (torch's bf16 ``relu_`` converts through fp32), ``torch.relu_`` otherwise."""
    if x.dtype.torch == torch.bfloat16:
        from .relu_numba import relu_   # numba loads on the first bf16 convolution only
        return relu_
    return torch.relu_


def make_conv_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """Bind-time kernel of a ConvBiasAct or ConvAddAct node: one oneDNN convolution
    (``torch.ops.mkldnn._convolution_pointwise``) with the node's activation as a post-op.

    ``node.attrs``: ``padding``, ``stride``, ``dilation`` (pairs), ``groups``, ``act`` (none,
    relu, gelu (erf), tanh, sigmoid, silu) and, for ConvAddAct, ``inplace``. ``in_descs[0]``:
    the NCHW input's description (sizes the weight reorder); ``consts[1]``: the weight
    tensor (O, I/groups, KH, KW) when it is a constant, reordered to oneDNN's blocked
    layout for that input size once per intra-op thread count (`ConvWeightPacks`), else
    None (reordered by oneDNN on every call).
    Returns ``run(x, w[, bias])`` for ConvBiasAct and ``run(x, w[, bias], other)`` for
    ConvAddAct (the sum post-op adds ``other``; with ``inplace`` it writes into ``other``'s
    memory and returns it); the result, in x's dtype, may be channels-last (the executor
    restores eager's strides where they are observed). ReLU runs after the convolution
    with ``torch.relu_`` (bf16: `relu_numba.relu_`, the same values; see the module
    docstring). Raises KeyError for an activation without a oneDNN post-op (the fusion
    passes never make one).

    Small convolutions run eager's NCHW kernel instead where the layout stage chose it
    (``node.meta["kernel"] == "aten"``, saved in model files: the size rule of
    `opencann.ops.kernels.conv_choice`; oneDNN's channels-last kernels cost more below it)."""
    if node.meta.get("kernel") == "aten":
        return _aten_conv_kernel(node)
    a = node.attrs
    w = consts[1]
    # a constant weight is reordered once per thread count; otherwise on every call
    packs = ConvWeightPacks(node, in_descs[0], w) if w is not None else None
    pad, stride, dil, groups = a["padding"], a["stride"], a["dilation"], a["groups"]
    act = _ONEDNN_ACT[a["act"]]
    algorithm = "none" if act == "gelu" else ""   # oneDNN's exact (erf) GELU
    conv = torch.ops.mkldnn._convolution_pointwise
    # oneDNN's ReLU post-op (every variant: relu, leaky_relu(0), hardtanh(0, inf), after
    # sum too) turns NaN into 0; eager's ReLU keeps it. So ReLU runs in place on the
    # convolution's output with eager's kernel (torch.relu_): one more pass over the
    # output, 2.5 ms of a 58-60 ms ResNet-50 batch-1 call (A/B in one process, load 1.7;
    # docs/performance.md "fp32 ResNet-50: where the call goes").
    # In bf16 the pass is `relu_numba.relu_` (one compare per element on the integer
    # bits, eager's values) below 1 M elements: torch's bf16 relu_ converts every element
    # to fp32 and back (ResNet-50 bf16 batch 1: 29.0 -> 27.9 ms median, interleaved, load ~6).
    post = None
    if act == "relu":
        act, post = "none", _relu_for(in_descs[0])

    if node.op == "ConvAddAct":
        return _conv_add_kernel(packs, (pad, stride, dil, groups), None if act == "none" else act,
                                post, a.get("inplace", True))

    if post is not None:
        def run(x, w, b=None):
            return post(conv(x, w if packs is None else packs.get(), b, pad, stride, dil,
                             groups, act, [], algorithm))
        return run

    # oneDNN returns channels-last; where a view reads the result or the caller gets it,
    # the executor brings it back to the traced (eager) strides
    def run(x, w, b=None):
        return conv(x, w if packs is None else packs.get(), b, pad, stride, dil, groups, act,
                    [], algorithm)
    return run


def make_trans_data(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """CPU TransData between NHWC (channels-last strides) and NCHW of one logical 4-D
    tensor (``opencann.passes.layout.cpu_layout``): ``run(x, out=None)`` copies ``x`` into
    ``out`` (its planned buffer, laid out as the node's ``meta["strides"]``) or into a
    fresh tensor with those strides (contiguous when none are recorded). The logical
    shape and dtype do not change; only the element order in memory does."""
    d = node.outputs[0].desc
    shape = tuple(int(s) for s in d.shape)
    st = (node.meta.get("strides") or [None])[0]
    strides = tuple(st) if st is not None else torch.empty(shape, device="meta").stride()
    dtype = d.dtype.torch

    def run(x, out=None):
        if out is None:
            out = torch.empty_strided(shape, strides, dtype=dtype)
        return out.copy_(x)
    return run


# the GEMM kernels a LinearAct may bind (node.meta["kernel"], saved in model files)
GEMM_KERNELS = ("addmm", "addmm_kn", "mkl_packed", "onednn_packed", "onednn_plain", "gemv", "panel")
# operand dtypes whose constant-weight GEMMs are raced (bf16: addmm and oneDNN's only)
LINEAR_DTYPES = (torch.float32, torch.bfloat16)
GEMV_MAX_ROWS = 32  # gemv_cpu.MAX_ROWS (not imported here: that module loads numba)
# (m, k, n, dtype, raced kernels) -> one of GEMM_KERNELS: bind-time choice, measured once
LINEAR_CHOICES: Dict[tuple, str] = {}
_LINEAR_CHOICES_LOCK = threading.Lock()  # one measurement per shape, even when binding races
_MARGIN = 0.97  # a prepacked kernel must be 3% faster than addmm to be chosen (noise guard)
#: at one row the numba GEMV is the kernel to beat, and another is chosen over it only when
#: this much faster (15%): there the kernels stream a weight at about the memory's rate, a
#: single-weight race picks either by a few % from run to run, and a decode step whose
#: GEMMs mix two kernels is slower than one on either alone (Llama-125M decode step, 2-core
#: Xeon: MKL with row-major merged weights 13.8-14.9 ms, the race's mixes 15.3-15.8). The
#: GEMV's register tile (`gemv_tile`) streams faster than MKL's GEMV on one thread (the
#: whole step's CPU time, every GEMM on one kernel: 28.7 against 30.9 ms least,
#: `bench/decode_gemm_kernels.py --batch 1 --threads 1 --cpu-clock`) and on two (the
#: step's weights in turn, `bench/gemv.py --rotation`: 15.7 against 16.3 ms), and where MKL's M = 1 GEMM is slow (13-17
#: GB/s against a GEMV's 46 on the AMD EPYC host of issue #27) by far more
GEMV_ONE_ROW_MARGIN = 0.85
# a GEMM of at most COLD_RACE_ROWS rows whose weight has COLD_RACE_BYTES or more is raced
# with the caches evicted before each timed call: at decode (a few rows) a weight is read
# once per step, after the rest of the model's weights went through the caches, so what
# counts is how fast a kernel streams it from memory; timed hot (the same weight again
# and again, in L2) the ranking differs (on the 2-core Xeon the numba GEMV won hot at
# Llama-125M's 768x768 and lost by 5-10% streaming). There addmm itself is not run where
# addmm_kn races: one GEMM at a time the two read a weight equally fast, yet in a decode
# step, where every weight streams in turn, MKL's GEMV reads the contiguous [k, n] copy
# faster (the whole 12-layer Llama-125M decode step, every GEMM bound to one or the
# other, 10 interleaved rounds: 17.7 -> 16.6 ms, best). At 2 or more rows "evicted"
# means out of the last-level cache too (`cold_scratch_bytes`): a decode step of an LLM
# streams more weights than the shared L3 holds, so each one comes from DRAM; with only
# L2 evicted (32 MiB) the weight came from the 480 MiB L3 of the 2-core Xeon and the
# race picked MKL's GEMM at 8 rows where, from DRAM, the numba GEMV is faster
# (Llama-125M decode step at batch 8, same process: 26.7-33.5 -> 24.2-25.1 ms, least;
# bench/gemv.py --rotation, all 85 weights in turn: 8 rows 21.9 ms GEMV, 27.7 MKL). At
# one row the kernels stream alike and the GEMV is the kernel to beat
# (`GEMV_ONE_ROW_MARGIN`): the L2 eviction is kept there (the last-level one would add
# its size to the peak memory)
COLD_RACE_ROWS, COLD_RACE_BYTES = 16, 1 << 20
# (k, n, dtype) -> the rows the concatenation layout was last decided at (`concat_row_major`)
_CONCAT_ROWS: Dict[tuple, int] = {}
#: a GEMM whose x and result would take more than this is not raced (addmm runs it): the
#: race allocates both, and a plan for a huge shape (a gear that the memory check refuses
#: next) must not fail in an allocation first
RACE_MAX_BYTES = 256 << 20
#: the cold race's eviction write: at least this, the last-level cache's size up to the
#: most (a transient allocation: the process's peak memory grows by it while a decode
#: graph is bound, 480 MiB on the 2-core Xeon whose sysfs reports a 480 MiB L3)
COLD_EVICT_MIN, COLD_EVICT_MAX = 32 << 20, 512 << 20


def cold_scratch_bytes() -> int:
    """Bytes the cold race writes before each timed call: the last-level cache's size
    (`devices.cpu.cpu_last_level_cache`; a shared L3), within [`COLD_EVICT_MIN`,
    `COLD_EVICT_MAX`] (32 MiB where sysfs does not say)."""
    from ...devices.cpu import cpu_last_level_cache
    return min(COLD_EVICT_MAX, max(COLD_EVICT_MIN, cpu_last_level_cache()[0]))


def kn_offered(wt: torch.Tensor, m: int) -> bool:
    """Whether ``addmm_kn`` races for the constant weight ``wt`` [k, n] at ``m`` rows:
    an fp32 weight of `COLD_RACE_BYTES` or more held transposed (not contiguous), at a
    few rows (`COLD_RACE_ROWS`, decode), or at more rows where its [k, n] copy exists
    already (made for a decode graph over the same memory): at 32 and 512 rows MKL's
    GEMM on the transposed weight as held is level with it, so a prefill graph makes no
    copy of its own. Where it races it is the kernel to beat (`_measure_choice`); on
    small weights the copy would cost eager's bits (addmm on the weight as held is
    eager's ``mm``) for no measured gain."""
    return (wt.dtype == torch.float32 and wt.dim() == 2 and not wt.is_contiguous()
            and wt.numel() * wt.element_size() >= COLD_RACE_BYTES
            and (m <= COLD_RACE_ROWS or _live_copy(_KN_PACKED, wt)))


def _evict_caches(scratch: torch.Tensor) -> None:
    """Read ``scratch`` (`cold_scratch_bytes`: more than the caches hold; written once
    when made), so the next call's weight is read from memory, as at decode. A read
    leaves clean lines: writing it instead left the caches full of dirty lines that the
    timed call then paid to write back (a 1-row race's times rose 30-80% after a
    last-level eviction by writing: they ranked the kernels by that, not by their reads)."""
    scratch.max()


def _measure_choice(key: tuple, makers: Dict[str, Callable[[], Callable]], bias, wt,
                    has_bias: bool = True, shape: Optional[tuple] = None) -> str:
    """The fastest of the candidate kernels ``makers`` (name -> a maker returning ``run(b,
    x, w, out)``, packing its weight copy; "addmm" among them) for GEMM shape ``key`` =
    (m, k, n, dtype, raced kernels[, "no bias"]), timed on random data of the weight
    ``wt``'s dtype (``bias``, else zeros, as b; None when not ``has_bias``): three passes,
    in each of which every candidate in turn (the order rotating) is made,
    run once untimed, timed twice (once when cold) and dropped, so that at most one candidate's packed copy
    lives at a time (a copy another graph holds is shared, not made); the least time
    per candidate kept; another kernel is chosen over addmm only when 3% faster (at one
    row the GEMV is the kernel to beat, by `GEMV_ONE_ROW_MARGIN`), the fastest of those
    that are, except that a kernel keeping a copy of the weight (`_copies`) must also be
    3% faster than the fastest that keeps none (at 8 rows the GEMV reading nn.Linear's
    weight and the panel GEMM on its packed copy run within a few % of each other cold,
    `bench/gemm_panel.py`: a tie that a noisy race decided either way had cost a decode
    step 104 MB of packed copies of a 125M Llama's o_proj and down_proj). A
    few-row GEMM of a large weight (`COLD_RACE_ROWS`) is timed with the caches evicted
    before each call (2 or more rows: out of the last-level cache, `cold_scratch_bytes`;
    1 row: `COLD_EVICT_MIN`; without addmm when ``addmm_kn`` races), and where ``addmm_kn``
    races (`kn_offered`) it is the kernel to beat instead of addmm. Cached in
    `LINEAR_CHOICES` (one measurement per shape, even when binding races). The caller
    makes the winner's kernel again (its copy then lives while the kernel does).
    ``shape``: (m, k, n) when ``key`` does not start with them."""
    m, k, n = shape or key[:3]
    if m * (k + n) * wt.element_size() > RACE_MAX_BYTES:   # no race buffers that large
        return "addmm_kn" if "addmm_kn" in makers else "addmm"
    with _LINEAR_CHOICES_LOCK:
        choice = LINEAR_CHOICES.get(key)
        if choice not in makers:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(m, k, generator=g).to(wt.dtype)
            b = (bias if bias is not None else torch.zeros(n, dtype=wt.dtype)) if has_bias else None
            out = torch.empty(m, n, dtype=wt.dtype)
            cold = m <= COLD_RACE_ROWS and k * n * wt.element_size() >= COLD_RACE_BYTES
            kn = "addmm_kn" in makers
            base = "addmm_kn" if kn else "addmm"   # see kn_offered
            if m == 1 and "gemv" in makers:
                base = "gemv"                      # see GEMV_ONE_ROW_MARGIN
            names = [name for name in makers if not (cold and kn and name == "addmm")]
            times = {name: float("inf") for name in names}
            # freed after the race; cold: one timed call per round (an eviction of the
            # last-level cache reads ~16 ms on the 480 MiB L3 of the 2-core Xeon)
            scratch = (torch.ones((cold_scratch_bytes() if m > 1 else COLD_EVICT_MIN) // 4,
                                  dtype=torch.float32) if cold else None)
            for rnd in range(3):
                for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                    run = makers[name]()
                    run(b, x, wt, out)  # warm-up: first-call set-up (oneDNN primitive creation)
                    for _ in range(1 if cold else 2):
                        if scratch is not None:
                            _evict_caches(scratch)
                        times[name] = min(times[name], best_time_us(
                            lambda: run(b, x, wt, out), reps=1, warmup=False))
                    del run   # its packed copy goes with it (unless another kernel holds it)
            choice = LINEAR_CHOICES[key] = _pick(times, base, wt)
    return choice


def _pick(times: Dict[str, float], base: str, wt: torch.Tensor) -> str:
    """The race's winner from each candidate's least time (`_measure_choice`): the fastest
    of those faster than ``base`` by its margin, else ``base``; a kernel keeping a copy of
    ``wt`` only when also 3% faster than the fastest of those that keep none."""
    beat = [(t, name) for name, t in times.items() if name != base and t < (
        GEMV_ONE_ROW_MARGIN if base == "gemv" else _MARGIN) * times[base]]
    choice = min(beat)[1] if beat else base
    free = [(t, name) for t, name in beat if not _copies(name, wt)]
    if free and _copies(choice, wt) and times[choice] >= _MARGIN * min(free)[0]:
        choice = min(free)[1]   # a copy of the weight must buy 3% too
    return choice


def concat_row_major(k: int, n: int, dtype: torch.dtype = torch.float32,
                     rows: Optional[int] = None) -> bool:
    """Whether a concatenation of constant weights into one [k, n] GEMM operand (the
    merged Q/K/V, GatedMLP's gate and up, `concat_weights`) is made row-major (contiguous
    [k, n], which addmm reads as MKL's row-major GEMV: what ``addmm_kn`` runs) rather
    than as the transpose of a contiguous [n, k] (nn.Linear's layout, which the decode
    GEMV reads as it is). The concatenation is the weight's one packed layout
    (`copy_allowed`), so its layout is its decode kernel's: decided by a cold race at
    ``rows`` rows (1..`GEMV_MAX_ROWS`) as `_measure_choice` runs it ("addmm_kn":
    row-major, against "gemv"), on random weights of that shape made one at a time, once
    per (rows, k, n, dtype) (`LINEAR_CHOICES`; at one row the GEMV is the kernel to beat,
    `GEMV_ONE_ROW_MARGIN`). On the 2-core Xeon the numba GEMV's register tile wins at 8
    rows by far (`bench/gemv.py --rotation`, docs/performance.md) and at 1 row is level
    with MKL's GEMV or faster. ``rows`` None (a fusion pass, a kernel's
    binding: callers that do not know the decode batch): at the rows it was last decided
    at for (k, n, dtype) (opencann.llm decides it at its first decode graph's batch
    before compiling, `steps.hold_weights_once`), else at 1 row. fp32 weights under
    `COLD_RACE_BYTES`, other dtypes and shapes without the GEMV: [n, k] (the unmerged
    weights' layout: eager's bits for addmm)."""
    if dtype != torch.float32 or k * n * 4 < COLD_RACE_BYTES:
        return False
    shape_key = (k, n, str(dtype))
    m = _CONCAT_ROWS.get(shape_key, 1) if rows is None else min(max(int(rows), 1), GEMV_MAX_ROWS)
    _CONCAT_ROWS[shape_key] = m
    gen = torch.Generator().manual_seed(0)

    def row_major() -> Callable:
        w = torch.randn(k, n, generator=gen, dtype=dtype)
        return lambda b, x, _w, out=None: torch.ops.aten.mm.out(x, w, out=out)

    def column_major() -> Callable:
        from .gemv_cpu import bind_gemv
        gemv = bind_gemv(torch.randn(n, k, generator=gen, dtype=dtype), m)
        return lambda b, x, _w, out=None: gemv(x, None, out)
    probe = torch.empty(0, dtype=dtype)
    return _measure_choice(("concat layout", m) + shape_key, {"addmm_kn": row_major, "gemv": column_major},
                           None, probe, has_bias=False, shape=(m, k, n)) == "addmm_kn"


#: GEMM kernels whose result is a tensor of their own (``_linear_pointwise`` and
#: ``_mkl_linear`` have no ``out=``), copied into ``out`` when one is given (`_copy_act`)
FRESH_RESULT_KERNELS = frozenset({"onednn_packed", "onednn_plain", "mkl_packed"})


def fresh_result(kernel: Callable) -> bool:
    """Whether ``kernel`` (a bound LinearAct GEMM) computes into an allocation of its own
    (`FRESH_RESULT_KERNELS`: oneDNN's inner product, MKL's packed GEMM), so that
    ``out=`` costs a copy of the result and ``out=None`` returns it as made: the
    executor's codegen then leaves the node's planned buffer unused and hands its
    consumers the kernel's result (`CodeGen._unplanned_if_fresh`; a 512-token Llama-125M
    prefill copied 5.6 MB per layer)."""
    return bool(getattr(kernel, "fresh_result", False))


def _copy_act(r: torch.Tensor, out, post) -> torch.Tensor:
    """A prepacked GEMM's fresh result ``r`` copied into ``out`` (the planned buffer, when
    given), then the in-place activation ``post`` (or None) applied."""
    if out is not None:
        out.copy_(r)
        r = out
    if post is not None:
        post(r)
    return r


def _available(kernel: str, n: int, bias: Optional[TensorDesc], m: int = 0,
               dtype: torch.dtype = torch.float32, kn: bool = False) -> bool:
    """Whether GEMM ``kernel`` can run here for ``m`` rows, ``n`` output features, a
    bias of ``bias``'s shape or none (None), and operands of ``dtype`` (oneDNN's inner
    product, MKL's packed GEMM and the GEMV take a full [n] bias or none: only addmm
    broadcasts a [1] one, the others read n values from its pointer, past its end, and
    oneDNN's read them as contiguous, `_dense_bias`); the GEMV 1..`GEMV_MAX_ROWS` rows;
    bf16 runs on addmm and oneDNN's prepacked inner product only (that where
    `onednn_bf16_available`): MKL's packed GEMM,
    the numba GEMV, the panel GEMM (2 rows or more), ``addmm_kn`` and ``onednn_plain``
    are fp32). ``kn``: ``addmm_kn``
    (addmm on a contiguous copy of the weight) is offered: a weight held transposed
    (nn.Linear's [n, k] weight viewed as [k, n]) streamed by a few-row GEMM
    (`COLD_RACE_ROWS`, `kn_offered`)."""
    if dtype != torch.float32 and kernel in ("gemv", "mkl_packed", "addmm_kn", "onednn_plain", "panel"):
        return False
    if kernel == "addmm_kn":
        return kn
    full = bias is None or tuple(int(d) for d in bias.shape) == (n,)
    if kernel == "gemv":
        return 1 <= m <= GEMV_MAX_ROWS and full
    if kernel == "panel":
        return m >= 2 and full
    if kernel in ("onednn_packed", "onednn_plain"):
        return onednn_linear_available() and full and (dtype != torch.bfloat16 or onednn_bf16_available())
    if kernel == "mkl_packed":
        return mkl_packed_available() and full
    return kernel == "addmm"


# constant weight -> weak reference to oneDNN's blocked copy of it: one reorder serves every
# row count, so the specialisations of a dynamic model (which share their constants) and every
# executor reuse it while a bound kernel holds it; the copy a GEMM race made for a kernel that
# lost is freed with the race (an LM head's 98 MB blocked copy is not kept beside a GEMV)
# (torch's WeakIdKeyDictionary: keys by identity; tensors' == is elementwise)
_ONEDNN_PACKED = WeakIdKeyDictionary()
_ONEDNN_PACKED_LOCK = threading.Lock()
_GEMV_PACKED = WeakIdKeyDictionary()  # constant weight [k, n] -> weak ref. to its [n, k] copy
_KN_PACKED = WeakIdKeyDictionary()  # constant weight [k, n] (not contiguous) -> its contiguous copy
_PANEL_PACKED = WeakIdKeyDictionary()  # constant weight [k, n] -> weak ref. to its [P, k, NR] panels
# (cache id, data_ptr, shape, strides, dtype, version, probe bytes) -> weak reference to the first constant packed
# for that view of memory: other constant tensors viewing the same memory (graphs compiled
# with the option share_weights, e.g. opencann.llm's prefill buckets and decode graph) reuse
# its packed copy instead of packing their own. While the reference is alive its storage is
# too, so the address cannot have been reused by other data.
_PACKED_VIEWS: Dict[tuple, "weakref.ref"] = {}


def _view_key(cache: WeakIdKeyDictionary, wt: torch.Tensor) -> tuple:
    """`_PACKED_VIEWS`' key of ``cache``'s copy of ``wt``'s memory (`_packed_once`)."""
    return (id(cache), wt.data_ptr(), tuple(wt.shape), wt.stride(), wt.dtype, wt._version,
            probe_bytes(wt))


def _live_copy(cache: WeakIdKeyDictionary, wt: torch.Tensor) -> bool:
    """Whether ``cache`` holds a live copy of ``wt`` or of a constant viewing the same
    memory at the same version (`_packed_once` would share it, not make one)."""
    key = _view_key(cache, wt)
    with _ONEDNN_PACKED_LOCK:
        if _deref(cache.get(wt)) is not None:
            return True
        ref = _PACKED_VIEWS.get(key)
        owner = ref() if ref is not None else None
        return owner is not None and _deref(cache.get(owner)) is not None


def _copies(kernel: str, wt: torch.Tensor) -> bool:
    """Whether GEMM ``kernel`` keeps a copy of the constant weight ``wt`` [k, n]: addmm
    never, the GEMV and ``onednn_plain`` not when ``wt`` is the transpose of a contiguous
    [n, k] weight (else both read one [n, k] copy), the others always (``addmm_kn``'s
    [k, n], oneDNN's blocked layout, MKL's packed)."""
    if kernel == "addmm":
        return False
    if kernel in ("gemv", "onednn_plain"):
        return not wt.t().is_contiguous()
    return True


def copy_allowed(wt: torch.Tensor) -> Callable[[str], bool]:
    """Which GEMM kernels may race for the constant fp32 weight ``wt`` (bf16 binds
    oneDNN's without a race), so that a weight is held in at most two layouts (its own and one packed copy): every kernel that keeps
    no copy (`_copies`); a kernel that keeps one only when ``wt`` is a module's weight
    (not a concatenation made here: `concat_weights`, ``fuse_qkv_linear``, marked by
    ``_opencann_parts``, which is the second layout already) and no other kind of copy
    of its memory lives (one a graph compiled earlier over the same weights made: that
    kind alone may race, and is shared)."""
    if getattr(wt, "_opencann_parts", None) is not None:
        return lambda c: not _copies(c, wt)
    held = {k for k, cache in (("addmm_kn", _KN_PACKED), ("onednn_packed", _ONEDNN_PACKED),
                               ("gemv", _GEMV_PACKED), ("onednn_plain", _GEMV_PACKED),
                               ("panel", _PANEL_PACKED))
            if _copies(k, wt) and _live_copy(cache, wt)}
    return lambda c: not _copies(c, wt) or not held or c in held


def _packed_once(cache: WeakIdKeyDictionary, wt: torch.Tensor,
                 make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``cache``'s packed copy of the constant weight ``wt`` (``make(wt)``), made once per
    weight object and shared with every other constant viewing the same memory (same
    data pointer, shape, strides and dtype) at the same version counter and probe bytes
    (`probe_bytes`: a weight changed in place since, also through ``.data``, which keeps
    the version, then compiled again, is packed again) while the first one lives. ``cache`` holds it
    weakly: it lives while a caller (a bound kernel) holds it, and is made again after."""
    key = _view_key(cache, wt)
    with _ONEDNN_PACKED_LOCK:
        packed = _deref(cache.get(wt))
        if packed is None:
            ref = _PACKED_VIEWS.get(key)
            owner = ref() if ref is not None else None
            packed = _deref(cache.get(owner)) if owner is not None else None
            if packed is None:
                packed = make(wt)
                _PACKED_VIEWS[key] = weakref.ref(
                    wt, lambda r, k=key: _PACKED_VIEWS.pop(k, None) if _PACKED_VIEWS.get(k) is r else None)
                if owner is not None:
                    cache[owner] = weakref.ref(packed)
            cache[wt] = weakref.ref(packed)
    return packed


def _deref(ref: "Optional[weakref.ref]") -> Optional[torch.Tensor]:
    return ref() if ref is not None else None


def _onednn_weight(wt: torch.Tensor, m: int) -> torch.Tensor:
    """oneDNN's blocked copy of the constant weight ``wt`` [k, n], reordered once per
    weight (``m``: the row count of the first shape, a layout hint only) and cached while
    ``wt`` lives (a dynamic model's new shape binds without reordering again; constants
    sharing ``wt``'s memory share the copy, `_packed_once`)."""
    return _packed_once(_ONEDNN_PACKED, wt,
                        lambda w: torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), m))


def _gemv_weight(wt: torch.Tensor) -> torch.Tensor:
    """The ``[n, k]`` contiguous copy of the constant weight ``wt`` [k, n] that the GEMV
    and ``onednn_plain`` read, made once per weight (every row count and executor reuses
    it; ``wt.t()`` itself when it is contiguous) and cached while it lives (shared as
    `_onednn_weight`'s)."""
    from .gemv_cpu import pack_weight
    return _packed_once(_GEMV_PACKED, wt, lambda w: pack_weight(w, transposed=True))


def _panel_weight(wt: torch.Tensor) -> torch.Tensor:
    """The panel GEMM's [P, k, NR] copy of the constant weight ``wt`` [k, n]
    (`gemm_panel_cpu.pack_panels`), made once per weight (every row count and executor
    reuses it) and cached while a bound kernel holds it (shared as `_onednn_weight`'s)."""
    from .gemm_panel_cpu import pack_panels
    return _packed_once(_PANEL_PACKED, wt, pack_panels)


def packed_copies_by_kind(weights: Sequence[torch.Tensor]) -> Dict[str, List[torch.Tensor]]:
    """The packed copies bound kernels hold of the constant ``weights``, by kind:
    ``"onednn_packed"`` (oneDNN's blocked layout), ``"gemv"`` (the GEMV's [n, k]),
    ``"addmm_kn"`` ([k, n] contiguous), ``"panel"`` (the panel GEMM's [P, k, NR]) and
    ``"concat"`` (`concat_weights`), and,
    followed through, the copies kernels made of those copies (a concatenation's own
    packed layout). Made at bind time and alive while a kernel holds them: what a
    compiled graph keeps beside its constants. A copy that is the weight's own memory
    (the GEMV on a transposed weight) is listed too, and a copy may be listed under two
    weights: count storages once."""
    kinds = (("concat", _CONCAT_OF), ("onednn_packed", _ONEDNN_PACKED), ("gemv", _GEMV_PACKED),
             ("addmm_kn", _KN_PACKED), ("panel", _PANEL_PACKED))
    found: Dict[str, List[torch.Tensor]] = {k: [] for k, _ in kinds}
    seen, todo = set(), [w for w in weights if isinstance(w, torch.Tensor)]
    while todo:
        todo = [w for w in todo if id(w) not in seen]
        seen.update(map(id, todo))
        new: List[torch.Tensor] = []
        for kind, cache in kinds:
            with _ONEDNN_PACKED_LOCK:
                refs = [cache.get(w) for w in todo if not w.is_mkldnn]
            got = [t for t in map(_deref, refs) if t is not None]
            found[kind] += got
            new += got
        todo = new
    return found


def packed_copies(weights: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Every packed copy of `packed_copies_by_kind`, in one list (count storages once)."""
    return [t for ts in packed_copies_by_kind(weights).values() for t in ts]


# (memory keys of the parts) -> weak reference to their concatenation (`concat_weights`)
_CONCATS: Dict[tuple, "weakref.ref"] = {}
_CONCAT_OF = WeakIdKeyDictionary()   # a part (constant weight) -> weak ref. to a concatenation


def _memory_key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t._version)


def concat_weights(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """The [k, n1 + n2] concatenation of the constant weights ``w1`` [k, n1] and ``w3``
    [k, n2] (GatedMLP's gate and up projections, so that a few-row GatedMLP is one GEMM):
    where both are transposed views of contiguous [n, k] weights (nn.Linear's), in the
    layout its decode kernel reads fastest (`concat_row_major`: row-major, or the
    transpose of a contiguous [n1 + n2, k], which the decode GEMV reads with no copy of
    its own; no kernel keeps another, `copy_allowed`), else contiguous; a view of the
    weights' own memory, no copy, where they are laid out as that concatenation already
    (`concat_view`: opencann.llm's `concatenate_in_place`). Made once for every graph
    whose constants view the same memory at the same version counters and kept while a
    bound kernel holds it. It holds references to its parts (``_opencann_parts``), so
    their memory (the key's addresses) cannot be reused while it lives; it is counted by
    `packed_copies` as a copy of ``w1``."""
    key = (_memory_key(w1), _memory_key(w3))
    with _ONEDNN_PACKED_LOCK:
        for k in [k for k, r in _CONCATS.items() if r() is None]:
            del _CONCATS[k]
        cat = _deref(_CONCATS.get(key))
        if cat is None:
            k, n = int(w1.shape[0]), int(w1.shape[1] + w3.shape[1])
            if w1.t().is_contiguous() and w3.t().is_contiguous() and not concat_row_major(k, n, w1.dtype):
                cat = concat_view([w1.t(), w3.t()], 0)
                cat = (cat if cat is not None
                       else torch.cat([w1.detach().t(), w3.detach().t()], dim=0)).t()
            else:
                cat = concat_view([w1, w3], 1)
                cat = cat if cat is not None else torch.cat([w1.detach(), w3.detach()], dim=1)
            cat._opencann_parts = (w1, w3)
            _CONCATS[key] = weakref.ref(cat)
        _CONCAT_OF[w1] = weakref.ref(cat)
    return cat


def _kn_weight(wt: torch.Tensor) -> torch.Tensor:
    """``addmm_kn``'s contiguous [k, n] copy of the constant weight ``wt`` [k, n] (a
    transposed view of nn.Linear's [n, k] weight), made once per weight and cached while
    a bound kernel holds it (shared as `_onednn_weight`'s)."""
    return _packed_once(_KN_PACKED, wt, lambda w: w.contiguous())


def _dense_bias(b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The [n] bias ``b`` (or None) as oneDNN's inner product reads it: contiguous (it
    reads n values from the data pointer, whatever the strides: an expanded [1] bias or a
    strided slice gave wrong values), copied only when not."""
    return b if b is None or b.is_contiguous() else b.contiguous()


def _packed_kernel(kernel: str, wt: torch.Tensor, m: int, post, act: str = "none") -> Callable:
    """``run(b, x, _w, out=None)`` of prepacked GEMM ``kernel`` on the constant weight
    ``wt`` [k, n] (packed once; ``m`` is the row count it is packed for), then ``post``
    (an in-place activation or None). ``act``: the activation's LinearAct name; a bf16
    oneDNN GEMM runs one of `BF16_LINEAR_POST` as its post-op instead of ``post``."""
    if kernel == "gemv":
        from .gemv_cpu import bind_gemv
        # shapes, weight view, kernel resolved once (not per call)
        return _bound_rows_kernel(bind_gemv(_gemv_weight(wt), m), post)
    if kernel == "panel":
        from .gemm_panel_cpu import bind_panel
        return _bound_rows_kernel(bind_panel(_panel_weight(wt), m, int(wt.shape[1])), post)
    if kernel == "onednn_packed":
        packed, lin = _onednn_weight(wt, m), torch.ops.mkldnn._linear_pointwise
        fused, algo = "none", ""
        if wt.dtype == torch.bfloat16 and act in BF16_LINEAR_POST:
            (fused, algo), post = BF16_LINEAR_POST[act], None

        def run_onednn(b, x, _w, out=None):
            return _copy_act(lin(x, packed, _dense_bias(b), fused, [], algo), out, post)
        run_onednn.fresh_result = True   # `fresh_result`
        return run_onednn
    if kernel == "onednn_plain":
        w_nk, lin = _gemv_weight(wt), torch.ops.mkldnn._linear_pointwise

        def run_plain(b, x, _w, out=None):
            return _copy_act(lin(x, w_nk, _dense_bias(b), "none", [], ""), out, post)
        run_plain.fresh_result = True
        return run_plain
    w = wt.t().contiguous()  # (out_features, in_features)
    packed, lin = torch.ops.mkl._mkl_reorder_linear_weight(w, m), torch.ops.mkl._mkl_linear

    def run_mkl(b, x, _w, out=None):
        return _copy_act(lin(x, packed, w, b, m), out, post)
    run_mkl.fresh_result = True
    return run_mkl


def _bound_rows_kernel(bound: Callable, post) -> Callable:
    """``run(b, x, _w, out=None)`` of a numba GEMM bound once (`gemv_cpu.bind_rows_kernel`'s
    ``run(x, bias, out)``: the decode GEMV, the panel GEMM), its result straight into
    ``out``, then ``post`` (an in-place activation or None); without ``post`` it carries
    ``prebind`` for the code generator."""
    if post is None:
        def run_plain(b, x, _w, out=None):
            return bound(x, b, out)
        run_plain.prebind = lambda b, x, _w, out=None: bound.prebind(x, b, out)
        return run_plain

    def run_post(b, x, _w, out=None):
        r = bound(x, b, out)
        post(r)
        return r
    return run_post


def _known_choice(made, m: int, k: int, n: int, dtype, bias: Optional[TensorDesc],
                  kn: bool = False, allowed: Optional[Callable[[str], bool]] = None,
                  wt: Optional[torch.Tensor] = None) -> tuple:
    """(cache key, choice) for a GEMM of shape (m, k, n) with a bias of ``bias``'s shape
    or none (None): the kernels raced here (oneDNN's prepacked where it exists, else
    MKL's packed, the GEMV for 1..`GEMV_MAX_ROWS` rows, ``addmm_kn`` where ``kn``
    (`kn_offered`), and addmm, those ``allowed`` (`copy_allowed`; None: all)) are the
    key's last item (after "no bias" for a bias-free GEMM, then "weight [k, n]" where
    the constant weight ``wt`` is not the transpose of a contiguous [n, k]: the GEMV and
    ``onednn_plain`` copy that one and not nn.Linear's, so `_pick`'s copy rule may choose
    differently for the two layouts of one shape); the choice is ``made`` (a
    node's earlier choice, or a model file's) where its kernel exists here (else addmm)
    and ``allowed`` allows it (else as if nothing were made); with nothing made, the
    cached choice for the key, oneDNN's prepacked kernel for bf16 where it exists,
    "addmm" when nothing else can race, or None (to be measured)."""
    def race_key(ok: Callable[[str], bool]) -> tuple:
        raced = tuple(c for c in GEMM_KERNELS if _available(c, n, bias, m, dtype, kn) and ok(c))
        if "onednn_packed" in raced:  # MKL's packing serves one m and measured no faster
            raced = tuple(c for c in raced if c != "mkl_packed")
        return (m, k, n, str(dtype)) + (("no bias",) if bias is None else ()) + (
            ("weight [k, n]",) if wt is not None and not wt.t().is_contiguous() else ()) + (raced,)
    key = race_key(lambda c: allowed is None or c == "addmm" or allowed(c))
    raced = key[-1]
    if allowed is not None and made is None:
        # the choice for this shape without the copy rule, where it is allowed: one GEMM
        # shape of one weight (an LM head at B rows in a prefill and a decode graph) binds
        # one kernel in every graph
        unrestricted = LINEAR_CHOICES.get(race_key(lambda c: True))
        if unrestricted in raced:
            return key, unrestricted
    if made == "gemv" and not 1 <= m <= GEMV_MAX_ROWS:
        made = None  # pinned from a decode shape onto a wider one: choose for this shape
    if made is not None and allowed is not None and made != "addmm" and not allowed(made):
        made = None  # a model file's or an earlier bind's kernel that would copy the weight again
    if made in GEMM_KERNELS:
        return key, (made if _available(made, n, bias, m, dtype, kn) else "addmm")
    cached = LINEAR_CHOICES.get(key)
    if cached in GEMM_KERNELS and _available(cached, n, bias, m, dtype, kn) and (
            allowed is None or cached == "addmm" or allowed(cached)):
        return key, cached
    if dtype == torch.bfloat16 and "onednn_packed" in raced:
        return key, "onednn_packed"   # not raced: see the module docstring
    return key, ("addmm" if len(raced) == 1 else None)


def linear_writes_out(node: Node) -> bool:
    """``out_capable`` of LinearAct: False where the node binds oneDNN's prepacked bf16
    GEMM (a constant bf16 weight [k, n], a static bf16 x [m, k]; `_known_choice`), whose
    result is its own allocation (a planned buffer would cost a copy of the output, 5%
    of BERT-base's bf16 call); True otherwise (addmm writes into the buffer, and fp32's
    choice is only measured at bind time)."""
    a = node.attrs
    x, w = node.inputs[a["mat1"].index], node.inputs[a["mat2"].index]
    b = node.inputs[a["self"].index] if isinstance(a.get("self"), TensorRef) else None
    if not (w.is_const and w.desc.dtype.torch == torch.bfloat16 and x.desc.dtype == w.desc.dtype
            and x.desc.rank == 2 and w.desc.rank == 2 and x.desc.is_static):
        return True
    (m, k), n = (int(d) for d in x.desc.shape), int(w.desc.shape[1])
    return _known_choice(node.meta.get("kernel"), m, k, n, torch.bfloat16,
                         None if b is None else b.desc)[1] != "onednn_packed"


def gemm_kernel(node: Node, x: TensorDesc, wt: Optional[torch.Tensor], bias: Optional[TensorDesc],
                bias_const: Optional[torch.Tensor] = None, post: Optional[Callable] = None,
                act: str = "none") -> Callable:
    """``run(b, x, w, out=None)`` = post(x @ w + b) (``b`` None: no bias, ``x @ w``) by the
    GEMM kernel chosen for ``node``'s shape, recorded in ``node.meta["kernel"]`` (one of
    `GEMM_KERNELS`); the choice of `make_linear_kernel`, shared by every op whose GEMM
    has a constant weight (LinearAct, GatedMLP's two products).

    ``x``: the [m, k] input's description; ``wt``: the constant weight [k, n] (None: not
    a constant, addmm / mm only); ``bias``: the [n] (or broadcast) bias's description, or
    None for a bias-free GEMM (then ``b`` is None at every call and ``addmm`` means eager's
    ``mm``, same bits); ``bias_const``: its value when constant (used to time the race);
    ``post``: an in-place activation or None; ``act``: its LinearAct name (a bf16 oneDNN
    GEMM fuses `BF16_LINEAR_POST` ones as post-ops). Never raises for a shape: what
    cannot race runs addmm / mm."""
    addmm, addmm_out = torch.ops.aten.addmm.default, torch.ops.aten.addmm.out
    mm, mm_out = torch.ops.aten.mm.default, torch.ops.aten.mm.out

    def run_addmm(b, x, w, out=None):
        if b is None:
            r = mm(x, w) if out is None else mm_out(x, w, out=out)
        else:
            r = addmm(b, x, w) if out is None else addmm_out(b, x, w, out=out)
        if post is not None:
            post(r)
        return r

    def run_addmm_kn(w_kn: torch.Tensor) -> Callable:
        def run_kn(b, x, _w, out=None):
            return run_addmm(b, x, w_kn, out)
        return run_kn

    if not (wt is not None and x.rank == 2 and wt.dtype in LINEAR_DTYPES
            and x.dtype.torch == wt.dtype and wt.dim() == 2 and x.is_static):
        return run_addmm
    m, k = (int(d) for d in x.shape)
    n = int(wt.shape[1])
    if 0 in (m, k, n):   # an empty product: oneDNN creates no primitive for it
        node.meta["kernel"] = "addmm"
        return run_addmm
    key, choice = _known_choice(node.meta.get("kernel"), m, k, n, wt.dtype, bias,
                                kn=kn_offered(wt, m),
                                allowed=copy_allowed(wt) if wt.dtype == torch.float32 else None,
                                wt=wt)
    raced = key[-1]
    if choice == "addmm":  # no packing: it copies the weight twice for nothing
        node.meta["kernel"] = "addmm"
        return run_addmm

    def maker(c: str) -> Callable[[], Callable]:
        if c == "addmm":
            return lambda: run_addmm
        if c == "addmm_kn":
            return lambda: run_addmm_kn(_kn_weight(wt))
        return lambda: _packed_kernel(c, wt, m, post, act)
    if choice is None:   # raced one copy at a time (`_measure_choice`)
        choice = _measure_choice(key, {c: maker(c) for c in raced}, bias_const, wt,
                                 has_bias=bias is not None)
    node.meta["kernel"] = choice
    return maker(choice)()


def make_linear_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """LinearAct([bias,] x, w_t, out=buffer) = act(x @ w_t [+ bias]), written into ``out``;
    the inputs as ``node.attrs`` ``self`` (the bias, absent for a bias-free GEMM: a fused
    MatMul), ``mat1`` and ``mat2`` index them.

    x: [m, k], w_t: [k, n] (a constant for the prepacked kernels), bias: [n]; fp32 or
    bf16 (`LINEAR_DTYPES`, x and w_t of one dtype; bf16 races addmm and oneDNN's only,
    see the module docstring) for the prepacked kernels, any dtype addmm takes otherwise.
    GEMM kernels (`GEMM_KERNELS`), raced per shape (m, k, n) at bind time on random data,
    cached in `LINEAR_CHOICES` (autotuning, as Inductor's max-autotune; `gemm_kernel`):

    - ``addmm`` with the bias as its C operand, straight into ``out`` (without a bias,
      eager's ``mm``: the same bits as the unfused MatMul);
    - ``addmm_kn``: the same on a contiguous [k, n] copy of a weight of 1 MiB or more
      that is held transposed (nn.Linear's [n, k] weight viewed as [k, n]), copied once
      at bind time and shared by the graphs that view the same weight; the kernel to
      beat where it races (`kn_offered`): at 1 row MKL's GEMV reads the weight in that
      layout ~10% faster (the decode GEMMs of a 12-layer Llama of 125M parameters in
      rotation, 2 threads: 14.9 -> 14.0 ms; the LM head 3.5 -> 3.0 ms), at 32 and 512
      rows MKL's GEMM on it is level with oneDNN's blocked weight, so prefill and
      decode keep one copy. fp32 rounding of eager's values (another MKL code path);
    - ``onednn_packed``: oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``,
      brgemm on AVX2/AVX-512) on the weight reordered once to oneDNN's blocked layout
      (``_reorder_linear_weight``); the blocked weight serves every row count m, so a
      dynamic-shape model keeps it at every shape. Its result is its own (`fresh_result`);
    - ``onednn_plain``: the same on the weight as nn.Linear holds it (no copy; module
      docstring), for weights that may not get a blocked copy (`copy_allowed`);
    - ``mkl_packed``: MKL's packed GEMM (``torch.ops.mkl._mkl_linear`` on
      ``_mkl_reorder_linear_weight``), packed for one m; raced against addmm only where
      oneDNN's is missing, and bound when a model file chose it;
    - ``panel``: 2 rows or more, the numba panel GEMM on NR-wide panels (`gemm_panel_cpu`);
    - ``gemv``: for 1..`GEMV_MAX_ROWS` (32) rows (LLM decode, short prefills), the
      row-parallel numba GEMV (`gemv_cpu`) on the weight copied once to [n, k] (no copy
      when w_t is the transpose of nn.Linear's contiguous weight); it streams the weight
      once at the memory bandwidth where a BLAS GEMM packs panels per call. Its result
      (fp32 rounding of eager's, another summation order) goes straight into ``out``; a
      dynamic model that pinned it at a decode shape chooses again at more rows.

    A choice already in ``node.meta["kernel"]`` (an earlier bind, a model file) holds
    where its kernel exists and the copy rule allows it (`_known_choice`), so every
    executor of a model, saved or live, runs the same GEMM (same bits). Which kernel wins
    depends on the CPU (docs/performance.md, "GEMM choice", "Panel GEMM"): oneDNN's on an
    AVX-512 EPYC, the panel GEMM for most of BERT's on an AVX2 one. The activation runs in place on
    the result with eager's kernel (eager's NaN/Inf), except a bf16 oneDNN GEMM's, fused
    as post-ops (`BF16_LINEAR_POST`: same NaN/Inf)."""
    a = node.attrs
    bi = a["self"].index if isinstance(a.get("self"), TensorRef) else None
    xi, wi = a["mat1"].index, a["mat2"].index
    run = gemm_kernel(node, in_descs[xi], consts[wi], None if bi is None else in_descs[bi],
                      None if bi is None else consts[bi], _ACT_FN.get(a["act"]), a["act"])
    if bi is not None:
        return run

    def run_no_bias(x, w, out=None):
        return run(None, x, w, out)
    run_no_bias.fresh_result = fresh_result(run)
    if hasattr(run, "prebind"):   # the decode GEMV: `opencann.runtime.codegen` prebinds it
        run_no_bias.prebind = lambda x, w, out=None: run.prebind(None, x, w, out)
    return run_no_bias


__all__ = ["BF16_LINEAR_POST", "COLD_EVICT_MAX", "COLD_EVICT_MIN", "FRESH_RESULT_KERNELS", "fresh_result", "GEMM_KERNELS", "LINEAR_CHOICES", "LINEAR_DTYPES",
           "RACE_MAX_BYTES", "ConvWeightPacks", "ThreadPacks",
           "cold_scratch_bytes", "concat_row_major", "concat_weights", "copy_allowed", "kn_offered", "packed_copies", "packed_copies_by_kind",
           "gemm_kernel", "linear_writes_out", "make_conv_kernel", "make_linear_kernel", "make_trans_data"]
