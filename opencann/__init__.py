"""opencann: an open graph engine and runtime for PyTorch models.

    import opencann
    cm = opencann.compile(model, (x,))      # capture, optimize, plan, bind
    y = cm(x)                               # run
    print(cm.report.summary())              # what was optimized, what was not, and why

``torch.compile(model, backend="opencann")`` works too, without importing opencann first:
the backend is torch's entry point ``torch_dynamo_backends: opencann`` (pyproject.toml),
loaded by torch._dynamo on first use. ``import opencann`` imports neither torch._dynamo
nor the engine (they load on the first call that needs them); only in a source checkout
without the installed entry point does it register the backend itself, as it used to.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from .version import __version__  # noqa: F401


def compile(model, example_inputs=None, device: str = "cpu", options: Optional[Dict[str, Any]] = None,
            example_kwargs: Optional[Dict[str, Any]] = None,
            input_shapes: Optional[Dict[str, Any]] = None, dynamic_shapes: Any = None,
            dim_ranges: Optional[Dict[str, Any]] = None):
    """Compile ``model`` (a torch.nn.Module, in eval mode for inference) for ``device``.

    ``example_inputs``: a tensor or tuple of positional inputs fixing shapes and dtypes.
    ``options``: ``disable``/``enable`` (pass names), ``verify`` (IR checks after each
    pass), ``alignment`` (arena alignment, bytes), ``inplace`` (in-place reuse).
    Returns a `CompiledModel`. Raises CaptureError or ValueError with the fix.

    ``model`` may also be an ONNX model (a ``.onnx`` path or ``onnx.ModelProto``): its
    inputs come from the model's static shapes, or ``input_shapes`` (name -> sizes) for
    symbolic dims; the result is called with tensors in graph-input order (or by name)
    and returns a tuple of outputs.

    ``dynamic_shapes``: dims that vary between calls, as torch.export's spec
    (``{"x": {0: torch.export.Dim("batch", min=1, max=64)}}``) or by name
    (``{"input_ids": {0: "batch", 1: "seq"}}``, ranges in ``dim_ranges``:
    ``{"seq": (16, 512)}``). The model is captured and optimised once; each new shape
    gets its own memory plan on its first call (cached, option ``plan_cache_size``,
    default 8). The `CompiledModel` returned holds the `DynamicShapes` policy (see
    ``docs/guide/dynamic_shapes.md``).
    ATC-style gears: ``options={"dynamic_batch_size": [1, 2, 4, 8]}`` (or
    ``dynamic_image_size``, ``dynamic_dims``) plan each gear at compile time and serve a
    call with the smallest gear that holds it, padding the call where no op can let a
    padded row reach a real one (else exact gears only; `opencann.engine.gears`). On ``vnpu``
    each concrete shape (each gear) is compiled whole, its layout needing static shapes.

    When it returns, the calling thread's OpenMP worker pool is released
    (`release_openmp_pool`), so calls from other threads are not slowed by it.
    Under ``torch.inference_mode()`` it compiles as outside it: what the compiled model
    keeps (weight copies, arenas) is made of ordinary tensors, usable in any mode."""
    import torch
    with torch.inference_mode(False):
        cm = _compile(model, example_inputs, device, options, example_kwargs, input_shapes,
                      dynamic_shapes, dim_ranges)
    release_openmp_pool()
    return cm


def _compile(model, example_inputs, device, options, example_kwargs, input_shapes,
             dynamic_shapes, dim_ranges):
    import os
    if isinstance(model, (str, os.PathLike)) or type(model).__name__ == "ModelProto":
        from .engine.options import GEAR_OPTIONS
        given = [k for k, v in (("dynamic_shapes", dynamic_shapes), ("dim_ranges", dim_ranges),
                                ("example_inputs", example_inputs), ("example_kwargs", example_kwargs))
                 if v is not None] + [k for k in GEAR_OPTIONS if k in (options or {})]
        if given:
            raise ValueError(f"{', '.join(given)} apply to torch modules; an ONNX model is compiled "
                             "for static shapes: give its symbolic dims sizes with "
                             "input_shapes={'x': (1, 3, 224, 224)}, or export the torch model "
                             "and compile that with dynamic_shapes or gears")
        from .engine import compile_onnx
        return compile_onnx(model, device=device, options=options, input_shapes=input_shapes)
    if example_inputs is None:
        raise ValueError("example_inputs is required for a torch model: a tensor or tuple of "
                         "the model's positional inputs fixing shapes and dtypes")
    from .engine.dispatch import compile_torch
    return compile_torch(model, example_inputs, device=device, options=options,
                         example_kwargs=example_kwargs, dynamic_shapes=dynamic_shapes,
                         dim_ranges=dim_ranges)


def tune(model, example_inputs, **kwargs):
    """Per-node precision search: the fastest mix of fp32 / bf16 (and other candidates)
    whose results pass an accuracy gate (msprobe's rules by default, or a metric on your
    data), compiled. See `opencann.tools.tune.tune` for the arguments (``budget``,
    ``data``, ``candidates``, ``time_budget_s``, ``seed``...), the search and the errors;
    returns its `TuneResult` (``.compiled``, ``.precision``, ``.kept``, ``.speedup``,
    ``.export(keep_dtype=..., modify_mixlist=...)``)."""
    # imported by name at call time: opencann.acl imports this package for compile / load,
    # and the layer contract keeps acl from depending on the tools beside it
    import importlib
    return importlib.import_module(f"{__name__}.tools.tune").tune(model, example_inputs, **kwargs)


def warm(processes: Optional[int] = None, only=None, progress=None):
    """Compile opencann's numba CPU kernels (the signatures shipped with the package) into
    the kernel cache now, so that the first compile, call or ``generate`` on this machine
    loads them instead of compiling them (tens of seconds on an empty cache). ``processes``:
    worker processes (default: the CPUs this process may use); ``only``: substrings of
    kernel function names; ``progress(done, total, function)``: called after each
    signature. Returns a `WarmResult` (``compiled``, ``cached``, ``skipped`` with reasons,
    ``failed``, ``seconds``, ``cache_dir``; ``ok``). Safe to repeat (cached signatures are
    not compiled again). Raises OSError (one line) when the cache directory cannot be
    written, ValueError when ``only`` matches nothing. See `opencann.tools.numba_warm.warm`
    and ``opencann warm``."""
    import importlib     # by name at call time, as `tune`
    return importlib.import_module(f"{__name__}.tools.numba_warm").warm(
        processes=processes, only=only, progress=progress)


def save(compiled, path: str, description: str = "") -> None:
    """Write a `CompiledModel` to ``path`` (an ``.ocm`` model file: optimized graph, memory
    plan, schedule, report, metadata as JSON; weights as safetensors; sha256 per
    section; no pickle). Raises ModelFileError if part of the graph cannot be stored,
    TypeError for anything but an `opencann.compile` result (a module, a torch.compile
    result)."""
    from .engine import CompiledModel
    if not isinstance(compiled, CompiledModel):
        what = ("a torch.compile result" if hasattr(compiled, "_torchdynamo_orig_callable")
                or type(compiled).__name__ == "OptimizedModule" else type(compiled).__name__)
        raise TypeError(f"opencann.save takes what opencann.compile returns (a CompiledModel), "
                        f"got {what}: compile with opencann.compile(model, example_inputs) and "
                        "save that")
    from .runtime.model_file import save as _save
    _save(compiled, path, description=description)


def quantize(model, calibration_inputs, *, config=None, device: str = "cpu",
             options: Optional[Dict[str, Any]] = None, dynamic_shapes=None, dim_ranges=None):
    """Post-training int8 quantization (CANN AMCT's flow): calibrate on
    ``calibration_inputs`` (a list of batches, each a tensor or a tuple of positional
    inputs, one shape) and return a `CompiledModel` whose convolutions and linears run
    oneDNN's int8 kernels (per-tensor uint8 activations, per-channel int8 weights);
    ``config`` from ``opencann.tools.quantize.create_quant_config`` (``skip_layers``,
    ``mode="dynamic"``). ``dynamic_shapes`` / ``dim_ranges`` and gear options work as in
    `compile`. Save it with `save`. Raises ValueError (one line) for an empty
    calibration set or a bad config. See `opencann.engine.quantize.quantize`."""
    from .engine.quantize import quantize as _quantize
    return _quantize(model, calibration_inputs, config=config, device=device, options=options,
                     dynamic_shapes=dynamic_shapes, dim_ranges=dim_ranges)


def load(path: str):
    """Load a model file written by `save` into a `CompiledModel`, in any process: no
    model class, no torch.export, no pickled code. Outputs are bit-for-bit those of the
    saved model. Raises ModelFileError (a ValueError) with one line saying what is wrong
    (not a model file, truncated, corrupted or modified, newer format, unknown device or
    op) and FileNotFoundError. A model compiled with dynamic dims or gears comes back as
    such: the same shapes, gears and padding, and the same errors for other shapes.
    Releases the calling thread's OpenMP pool on return, as `compile` does.
    A file written by ``Generator.save`` (format 4, several graphs) comes back as the
    `opencann.llm.Generator` (`opencann.llm.load`). Under ``torch.inference_mode()`` it
    loads as outside it (ordinary tensors, usable in any mode)."""
    from .engine.loading import load_model_file
    from .runtime.model_file import BUNDLE_FORMAT_VERSION, peek_version
    if peek_version(path) == BUNDLE_FORMAT_VERSION:
        from .llm import load as load_generator
        return load_generator(path)
    import torch
    with torch.inference_mode(False):
        cm = load_model_file(path)
    release_openmp_pool()
    return cm


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP worker pool (torch's intra-op threads) so that
    threads serving calls run unthrottled; `opencann.compile` and `load` do it on return.
    Call it on a thread that ran torch's parallel kernels since (an eager check) before
    other threads serve. Returns whether a pool was released; never raises
    (`opencann.devices.cpu_threads`, docs/performance.md "OpenMP pools")."""
    from .devices.cpu_threads import release_openmp_pool as _release
    return _release()


def keep_freed_memory(nbytes: int = 1 << 30) -> bool:
    """Keep freed blocks of up to ``nbytes`` bytes in glibc malloc's heap (process-wide
    ``mallopt``), so tensors a kernel allocates afresh on every call (oneDNN's convolution
    outputs) reuse memory without page faults: ResNet-50 at batch 8 ran 11-13% faster.
    Resident memory then stays at its peak. Returns False where there is no glibc;
    raises ValueError for a non-positive ``nbytes`` (`opencann.devices.cpu_malloc`,
    docs/performance.md "fp32 ResNet-50: where the call goes")."""
    from .devices.cpu_malloc import keep_freed_memory as _keep
    return _keep(nbytes)


# subpackages and modules reachable as attributes (``opencann.ops.get_op``) after a bare
# ``import opencann``, imported on first access (PEP 562) so the import stays light
_SUBMODULES = frozenset({"acl", "cli", "devices", "dynamo", "engine", "extend", "frontend", "ir",
                         "llm", "log", "ops", "passes", "report", "runtime", "timing", "tools",
                         "zoo"})


def __getattr__(name):
    if name in _SUBMODULES:
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    if name == "readiness":
        # ``opencann.readiness(model, inputs, device="vnpu:ascend910b", precision="fp16",
        # context=None, batch=None)``: the NPU readiness report of the migration toolkit
        # (`opencann.tools.readiness.readiness`, docs/guide/readiness.md), resolved on
        # first use like the submodules above: the facade does not import the toolkit
        import importlib
        return importlib.import_module(f"{__name__}.tools.readiness").readiness
    if name == "ModelFileError":
        from .runtime.model_file import ModelFileError
        return ModelFileError
    if name in ("CompiledModel", "CompileReport"):
        from . import report
        from .engine import compiled_model
        return getattr(compiled_model if name == "CompiledModel" else report, name)
    raise AttributeError(name)


def _backend_entry_point_installed() -> bool:
    """Whether the installed opencann distribution declares the ``torch_dynamo_backends``
    entry point ``opencann`` (pyproject.toml), through which torch._dynamo finds the
    backend by name without ``import opencann``. False in a source checkout never
    installed, or installed before the entry point existed (run ``pip install -e .``)."""
    from importlib.metadata import PackageNotFoundError, distribution
    try:
        eps = distribution("opencann").entry_points
    except PackageNotFoundError:
        return False
    return any(e.group == "torch_dynamo_backends" and e.name == "opencann" for e in eps)


def _register_backend() -> None:
    """Register the torch.compile backend now only where torch cannot find it by itself
    (no entry point installed) or torch._dynamo is loaded already (registration is then
    cheap); otherwise leave it to the entry point, so import stays light."""
    import sys
    if "torch._dynamo" not in sys.modules and _backend_entry_point_installed():
        return
    try:
        from .dynamo import register
        register()
    except Exception as e:  # pragma: no cover - dynamo unavailable on this platform
        from .log import logger
        logger.warning("torch.compile backend 'opencann' not registered: %s", e)


_register_backend()


def register_fusion(name, pattern, replacement, example_inputs, section="GraphFusion",
                    cann_names=()):
    """Register a user fusion rule ``pattern(*xs) ⇒ replacement(*xs)`` (torch functions
    traced with ``example_inputs``) as the fusion pass ``name``; see
    `opencann.extend.register_fusion` (arguments, errors) and docs/design/passes.md."""
    from .extend import register_fusion as _register
    return _register(name, pattern, replacement, example_inputs, section, cann_names)


def unregister_fusion(name):
    """Remove the user fusion rule ``name`` (`register_fusion`); raises KeyError naming
    the registered rules."""
    from .extend import unregister_fusion as _unregister
    return _unregister(name)


def register_op(name, op, **columns):
    """Make a torch custom op an opencann op with kernels per device, shape inference and
    cost; see `opencann.extend.register_op` (arguments, errors) and docs/design/passes.md."""
    from .extend import register_op as _register
    return _register(name, op, **columns)

