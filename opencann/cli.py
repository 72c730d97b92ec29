"""The ``opencann`` command line: demo, compile, run, bench, generate, estimate, train-demo,
inspect, fuzz, doctor, warm, analyze, compare, tune, readiness.

    opencann demo                               # the main job on the embedded default
    opencann compile resnet50 --report r.json   # zoo name, file.py:factory or m.onnx
    opencann run bert-base --trace trace.json   # run once, Chrome trace of every op
    opencann run m.ocm --input-shape x:4,3,224,224   # a model file (opencann atc), random inputs
    opencann bench minilm --batch 1 --seq 128   # compiled vs eager latency (.onnx: vs ONNX Runtime)
    opencann generate smollm2 --chat --prompt "What is the capital of France?"   # an LLM, streamed
    opencann estimate --model resnet50 --device vnpu:ascend910b --plot roofline.png
    opencann train-demo                         # digits CNN + MiniLM fine-tune, compiled
    opencann atc --model m.onnx --framework 5 --output m --soc_version Ascend910B   # -> m.ocm
    opencann atc --model f.py:make --output m --input_shape "x:-1,3,224,224" --dynamic_batch_size "1,2,4"
    opencann inspect m.ocm [--json]             # a saved model file (opencann.save)
    opencann fuzz --cases 10000 --out fuzz_failures/   # differential fuzzing against eager
    opencann doctor [--json]                    # versions, CPU ISA, oneDNN/MKL, GPU, vnpu, kernel cache
    opencann warm                               # compile the CPU kernels into the cache once
    opencann analyze m.py:factory [--device vnpu]   # op-support audit with source lines
    opencann compare resnet50 --html r.html --bisect   # layer-by-layer vs eager; guilty pass
    opencann tune minilm --out m.ocm --keep-dtype-out keep.txt   # per-node fp32/bf16 search
    opencann readiness gpt2 --device vnpu:ascend910b --context 1024 --html r.html   # one NPU report
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import traceback
import warnings
import sys
import time

import torch
from rich.console import Console
from rich.markup import escape

from .tools.argtypes import output_file, positive_int

console = Console(soft_wrap=True)  # no hard wrapping when piped to a file
warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # torch-internal deprecation noise


class CliError(Exception):
    """A mistake in the command line or in the files it names; printed as one line."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (the usage is one ``-h`` away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but arguments a subcommand does not take point at its own help."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            cmd = getattr(ns, "cmd", None)
            where = f"{self.prog} {cmd}" if cmd else self.prog
            self.exit(2, f"{self.prog}: error: unrecognized arguments: {' '.join(extras)} "
                         f"(see {where} -h)\n")
        return ns


def _user_error(path: str, what: str, e: BaseException) -> CliError:
    """One line for an exception raised by the user's file: its type, message and the
    line of that file where it happened."""
    if isinstance(e, SyntaxError):
        return CliError(f"{path}:{e.lineno}: syntax error: {e.msg}")
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if os.path.abspath(f.filename) == os.path.abspath(path)]
    at = f" at {path}:{frames[-1].lineno}" if frames else ""
    first = (str(e).splitlines() or [""])[0]
    return CliError(f"{what} raised {type(e).__name__}: {first}{at}")


def _describe(x) -> str:
    if isinstance(x, (tuple, list)):
        inner = ", ".join(_describe(y) for y in x[:4]) + (", ..." if len(x) > 4 else "")
        return f"{type(x).__name__} ({inner})"
    if callable(x) and not isinstance(x, torch.nn.Module):
        return "a function"
    return type(x).__name__


def _load(spec: str, batch: int, seq: int, input_shape=None, ocm: str = ""):
    """A zoo name, ``file.py:factory`` where factory() returns (model, inputs), an
    ``.onnx`` file (`OnnxFile`; ``input_shape``: sizes of its symbolic dims) or, where
    the command runs models (``ocm``: how it uses one, else ""), an ``.ocm`` model file
    (`OcmFile`).
    Raises CliError (one line) for a missing file or function, an error raised while
    importing the file or calling the factory, a factory result of another form, an
    ``.ocm`` file given to a command that compiles, or ``input_shape`` for a zoo model or
    factory (their example inputs fix the shapes)."""
    from . import zoo
    if spec.lower().endswith(".ocm"):
        if not ocm:
            raise CliError(f"{spec} is a compiled model file: run it with opencann run / bench, "
                           "show it with opencann inspect; this command takes a zoo name, "
                           "file.py:factory or an .onnx file")
        if not os.path.isfile(spec):
            raise CliError(f"{spec}: no such model file (opencann atc or opencann.save writes one)")
        return OcmFile(spec)
    if spec.lower().endswith(".onnx"):
        return _load_onnx(spec, input_shape)
    if input_shape:
        raise CliError("--input-shape is for .onnx and .ocm models; a zoo model's or a "
                       "factory's example inputs fix the shapes (zoo: --batch, --seq)")
    if ":" in spec and spec.split(":")[0].endswith(".py"):
        path, fn = spec.rsplit(":", 1)
        if not os.path.isfile(path):
            raise CliError(f"{path} " + ("is a directory" if os.path.isdir(path) else "does not exist")
                           + "; give file.py:factory")
        mod_spec = importlib.util.spec_from_file_location("user_model", path)
        mod = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(mod)
        except Exception as e:  # noqa: BLE001 - the user's file: reported in one line
            raise _user_error(path, f"importing {path}", e) from None
        if not callable(getattr(mod, fn, None)):
            raise CliError(f"{path} has no function {fn!r}")
        try:
            res = getattr(mod, fn)()
        except Exception as e:  # noqa: BLE001 - the user's factory: reported in one line
            raise _user_error(path, f"{fn}()", e) from None
        if isinstance(res, zoo.ZooModel):
            return res
        if not (isinstance(res, tuple) and len(res) == 2 and isinstance(res[0], torch.nn.Module)):
            raise CliError(f"{fn}() must return (model, example_inputs) with model a "
                           f"torch.nn.Module, got {_describe(res)}"
                           + ("; wrap the function in a torch.nn.Module" if isinstance(res, tuple)
                              and res and callable(res[0]) else ""))
        model, inputs = res
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        return zoo.ZooModel(fn, model.eval(), inputs, spec)
    kw = {"batch": batch}
    if spec in ("minilm", "bert-base", "gpt2"):
        kw["seq"] = seq
    try:
        return zoo.get(spec, **kw)
    except KeyError as e:
        raise CliError(f"{e.args[0]}; or pass file.py:factory") from None


class OnnxFile:
    """An ``.onnx`` path given on the command line; inputs come from its static shapes
    and ``input_shapes`` (name -> sizes, ``--input-shape``) for its symbolic dims."""

    def __init__(self, path: str, input_shapes=None):
        self.path = self.name = path
        self.input_shapes = input_shapes


class OcmFile:
    """An ``.ocm`` model file given on the command line (what ``opencann atc`` and
    ``opencann.save`` write): loaded, not compiled; run on the device it was compiled
    for, with random inputs of its recorded input shapes."""

    def __init__(self, path: str):
        self.path = self.name = path


def _load_onnx(path: str, input_shapes=None) -> OnnxFile:
    """Checks that ``path`` exists and that every model input has static dims or sizes
    in ``input_shapes``; CliError (one line) otherwise, naming ``--input-shape``."""
    if not os.path.isfile(path):
        raise CliError(f"{path}: no such ONNX file")
    try:
        import onnx
    except ImportError:
        raise CliError("ONNX models need the onnx package: pip install 'opencann[onnx]'") from None
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception:  # noqa: BLE001 - the compile step reports a bad file in one line
        return OnnxFile(path, input_shapes)
    inits = {t.name for t in model.graph.initializer}
    real = [vi for vi in model.graph.input if vi.name not in inits and vi.type.HasField("tensor_type")]
    unknown = sorted(set(input_shapes or {}) - {vi.name for vi in real})
    if unknown:
        shown = "; ".join(vi.name + ":" + ",".join(
            str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?")
            for d in vi.type.tensor_type.shape.dim) for vi in real)
        raise CliError(f"--input-shape names {unknown}, not inputs of {path}; its inputs: {shown}")
    for vi in model.graph.input:
        if vi.name in inits or not vi.type.HasField("tensor_type") or vi.name in (input_shapes or {}):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                for d in vi.type.tensor_type.shape.dim]
        if not all(isinstance(d, int) for d in dims):
            eg = ",".join(str(d) if isinstance(d, int) else "1" for d in dims)
            raise CliError(f"{path}: input {vi.name} has symbolic dims {tuple(dims)}; the CLI "
                           f"compiles static shapes: give their sizes with --input-shape "
                           f"{vi.name}:{eg}, fix them in the model (onnx.tools.update_model_dims."
                           "update_inputs_outputs_dims) or call opencann.compile(path, "
                           "input_shapes=...) from Python")
    return OnnxFile(path, input_shapes)


def _onnx_reference(path: str, cm, inputs):
    """ONNX Runtime's outputs for ``inputs`` (None when onnxruntime is not installed)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    feeds = {n: x.numpy() for n, x in zip(cm.graph.signature.input_names, inputs)}
    return tuple(torch.from_numpy(r) for r in s.run(None, feeds))


def _compile(zm, device="cpu", options=None):
    import opencann
    if isinstance(zm, OnnxFile):
        with console.status(f"compiling {zm.name} (ONNX conversion, passes, planning)..."):
            t0 = time.perf_counter()
            cm = opencann.compile(zm.path, device=device, options=options,
                                  input_shapes=zm.input_shapes)
        console.print(f"compiled {zm.name} in {time.perf_counter() - t0:.1f} s")
        return cm
    with console.status(f"compiling {zm.name} (torch.export, decomposition, passes, planning)..."):
        t0 = time.perf_counter()
        cm = opencann.compile(zm.model, zm.example_inputs, device=device, options=options)
    console.print(f"compiled {zm.name} in {time.perf_counter() - t0:.1f} s")
    return cm


def _max_diff(a, b) -> str:
    """``max |a-b|`` and the relative figure max|a-b| / max|b| over all float leaves."""
    import torch.utils._pytree as pytree
    leaves = [(x, y) for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b))
              if isinstance(x, torch.Tensor)]
    pairs = [(x.double(), y.double()) for x, y in leaves if x.dtype.is_floating_point]
    if not pairs:  # integer/bool outputs (argmax, masks): exact comparison
        same = all(torch.equal(x, y) for x, y in leaves)
        return f"{'identical' if same else 'DIFFERENT'} (non-float outputs, compared exactly)"
    ab = max(float((x - y).abs().max()) for x, y in pairs)
    rel = max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)) for x, y in pairs)
    return f"{ab:.2e} (relative {rel:.2e})"


def cmd_demo(args) -> int:
    """``opencann demo``: all-MiniLM-L6-v2 (real weights) on the zoo's sentences (cosine-similarity
    table) and ResNet-50 on the sample image, compiled vs eager: max difference, median latency
    (ms, ``--runs`` runs, ``--threads`` threads) and the compile reports; then (unless
    ``--no-llm``) one SmolLM2 chat turn through opencann.llm against eager greedy ``generate``
    (opencann.tools.llm_demo). Returns 0."""
    from rich.table import Table

    from . import zoo
    from .timing import median_ms
    torch.set_num_threads(args.threads)
    console.rule("[bold]all-MiniLM-L6-v2 (real weights) on real sentences")
    zm = zoo.minilm()
    ids, mask = zoo.tokenize(zoo.SENTENCES)
    zm.example_inputs = (ids, mask)
    cm = _compile(zm)
    out = cm(ids, mask).last_hidden_state
    with torch.no_grad():
        ref = zm.model(ids, mask).last_hidden_state
    emb = torch.nn.functional.normalize((out * mask[..., None]).sum(1) / mask.sum(1, keepdim=True), dim=-1)
    sim = emb @ emb.T
    t = Table(title="cosine similarity (compiled model)")
    t.add_column("")
    for i in range(len(zoo.SENTENCES)):
        t.add_column(str(i))
    for i, s in enumerate(zoo.SENTENCES):
        t.add_row(f"{i} {s[:40]}", *[f"{sim[i, j]:.3f}" for j in range(len(zoo.SENTENCES))])
    console.print(t)
    eager_ms = median_ms(zm.model, ids, mask, runs=args.runs)
    comp_ms = median_ms(cm, ids, mask, runs=args.runs)
    console.print(f"max |compiled - eager| = {_max_diff(out, ref)}")
    console.print(f"latency: eager {eager_ms:.1f} ms, opencann {comp_ms:.1f} ms "
                  f"(compiled/eager = {comp_ms / eager_ms:.2f})")
    console.print(cm.report.summary())

    console.rule("[bold]ResNet-50 on an image")
    zr = zoo.resnet50()
    img = zoo.sample_image()
    cr = _compile(zr)
    out = cr(img)
    with torch.no_grad():
        ref = zr.model(img)
    eager_ms = median_ms(zr.model, img, runs=args.runs)
    comp_ms = median_ms(cr, img, runs=args.runs)
    console.print(f"pooled features {tuple(out.pooler_output.shape)}, max |compiled - eager| = "
                  f"{_max_diff(out, ref)}")
    console.print(f"latency: eager {eager_ms:.1f} ms, opencann {comp_ms:.1f} ms "
                  f"(compiled/eager = {comp_ms / eager_ms:.2f})")
    console.print(cr.report.summary())
    if not args.no_llm:
        from .tools.llm_demo import chat_turn
        console.rule("[bold]SmolLM2-135M-Instruct (real weights): a chat turn")
        chat_turn(console)
    return 0


def cmd_compile(args) -> int:
    """``opencann compile MODEL``: compile and print the report summary (``-v``: the full text);
    ``--report`` writes the JSON report, ``--dot`` the optimized graph. Returns 0. Raises
    CliError for ``--options`` that is not valid JSON."""
    zm = _load(args.model, args.batch, args.seq, args.input_shape)
    options = _json_options(args.options) or None
    cm = _compile(zm, args.device, options)
    console.print(cm.report.to_text() if args.verbose else cm.report.summary())
    if args.report:
        with open(args.report, "w") as f:
            f.write(cm.report.to_json())
        console.print(f"report written to {args.report}")
    if args.dot:
        from .ir import to_dot
        with open(args.dot, "w") as f:
            f.write(to_dot(cm.graph))
        console.print(f"graph written to {args.dot} (render: dot -Tsvg {args.dot} -o graph.svg)")
    return 0


def _runnable(args, use: str):
    """What ``opencann run`` / ``bench`` (``use``) runs: (the model's source, the compiled
    model, the call's (args, kwargs), where and on what it runs, for the output line).
    An ``.ocm`` file is loaded and runs on the device it was compiled for (``--device``
    must name that one) with random inputs of its recorded shapes (`opencann.tools.
    run_inputs`; a dynamic model's dims from ``--input-shape`` or its example); an
    ``.onnx`` file is compiled for ``--device`` with random inputs; a zoo model or
    factory is compiled for ``--device`` and called with its example inputs. Raises
    CliError (one line) for ``--device`` other than a model file's."""
    import opencann
    from .devices import parse_device
    from .tools.run_inputs import call_args, describe, input_specs, random_inputs
    zm = _load(args.model, args.batch, args.seq, args.input_shape, ocm=use)
    if isinstance(zm, OcmFile):
        cm = opencann.load(zm.path)
        device = str(cm.report.device)
        want, have = parse_device(args.device) if args.device else None, parse_device(device)
        if want is not None and (want.kind, getattr(want.spec, "name", "")) != \
                (have.kind, getattr(have.spec, "name", "")):   # a bare vnpu is its preset
            raise CliError(f"{zm.name} was compiled for {device} and runs there: drop --device "
                           f"{args.device}, or convert the model again for it (opencann atc "
                           "--soc_version, or opencann.compile(..., device=...))")
        specs = input_specs(cm, args.input_shape, zm.name)
        return zm, cm, call_args(cm, random_inputs(specs)), f"{device}, random inputs {describe(specs)}"
    device = args.device or "cpu"
    cm = _compile(zm, device)
    if isinstance(zm, OnnxFile):
        specs = input_specs(cm, None, zm.name)
        return zm, cm, call_args(cm, random_inputs(specs)), f"{device}, random inputs {describe(specs)}"
    return zm, cm, (tuple(zm.example_inputs), {}), f"{device}, its example inputs"


def cmd_run(args) -> int:
    """``opencann run MODEL``: compile (or load an ``.ocm`` file), run once and print what it
    ran on, and the max difference to eager PyTorch (ONNX: to onnxruntime when installed;
    an ``.ocm`` file: its outputs, and whether a second call gives the same); ``--trace``
    writes a Chrome trace (µs) and lists the 10 slowest ops. Returns 0."""
    from .tools.run_inputs import describe_outputs, same_outputs
    zm, cm, (a, kw), on = _runnable(args, "run")
    out = cm(*a, **kw)
    if isinstance(zm, OcmFile):
        import torch.utils._pytree as pytree
        first = pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, out)
        again = cm(*a, **kw)
        console.print(f"ran {zm.name} on {on}: outputs {describe_outputs(first)}; a second call "
                      + ("gives the same outputs" if same_outputs(first, again)
                         else "gives DIFFERENT outputs"), markup=False, highlight=False)
    elif isinstance(zm, OnnxFile):
        ref = _onnx_reference(zm.path, cm, a)
        console.print(f"ran {zm.name} on {on}: " + (
            f"max |compiled - onnxruntime| = {_max_diff(out, ref)}" if ref is not None else
            f"outputs {describe_outputs(out)} (install onnxruntime to compare)"),
            markup=False, highlight=False)
    else:
        with torch.no_grad():
            ref = zm.model(*a, **kw)
        console.print(f"ran {zm.name} on {on}: max |compiled - eager| = {_max_diff(out, ref)}",
                      markup=False, highlight=False)
    if args.trace:
        ev = cm.profile(*a, path=args.trace, **kw)
        top = sorted(ev, key=lambda e: -e["dur"])[:10]
        console.print(f"Chrome trace with {len(ev)} ops written to {args.trace}; slowest ops:")
        for e in top:
            console.print(f"  {e['dur'] / 1e3:8.2f} ms  {e['name']:22s} {e['args']['node']}  {e['cat']}")
    return 0


def _onnx_session_fn(path: str, cm, inputs, threads: int):
    """A function running ONNX Runtime on ``inputs`` with ``threads`` intra-op threads and
    spinning off (spinning threads slow whatever runs next in the process, docs/
    performance.md); None when onnxruntime is not installed."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    feeds = {n: x.numpy() for n, x in zip(cm.graph.signature.input_names, inputs)}
    return lambda: s.run(None, feeds)


def cmd_bench(args) -> int:
    """``opencann bench MODEL``: median latency in ms of the compiled model (``--runs`` runs,
    ``--threads`` threads) against eager PyTorch (a zoo model or factory), ONNX Runtime
    (an ``.onnx`` file, when installed) or alone (an ``.ocm`` file: no reference model).
    Prints what it ran on. Returns 0."""
    from .timing import median_ms
    torch.set_num_threads(args.threads)
    zm, cm, (a, kw), on = _runnable(args, "bench")
    c = median_ms(lambda: cm(*a, **kw), runs=args.runs)
    how = f"median of {args.runs}, {args.threads} threads"
    if isinstance(zm, OnnxFile):
        ort_fn = _onnx_session_fn(zm.path, cm, a, args.threads)
        if ort_fn is None:
            line = f"opencann {c:.3g} ms ({how}; install onnxruntime to compare)"
        else:
            o = median_ms(ort_fn, runs=args.runs)
            line = f"onnxruntime {o:.3g} ms, opencann {c:.3g} ms, opencann/onnxruntime {c / o:.2f} ({how})"
    elif isinstance(zm, OcmFile):
        line = f"opencann {c:.3g} ms ({how}; a model file has no reference to time against)"
    else:
        e = median_ms(zm.model, *a, runs=args.runs)
        zoo_batch = "" if ":" in args.model else f"batch {args.batch}: "
        line = f"{zoo_batch}eager {e:.3g} ms, opencann {c:.3g} ms, compiled/eager {c / e:.2f} ({how})"
    console.print(f"{zm.name} on {on}: {line}", markup=False, highlight=False)
    return 0


def cmd_inspect(args) -> int:
    """Print a model file's metadata, inputs/outputs, op counts, memory plan, sections
    (sizes, sha256) and graph; ``--json`` prints the same as JSON."""
    from .runtime.model_file import describe, describe_text
    info = describe(args.file)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        console.print(describe_text(info), markup=False, highlight=False)
    return 0


def cmd_atc(args) -> int:
    """ATC-style conversion: --model (.onnx with --framework 5, or file.py:factory with
    --framework pytorch) -> <output>.ocm for --soc_version's device."""
    import opencann
    from .log import logger
    from .tools.atc import LOG_LEVELS
    if args.log:
        logger.setLevel(LOG_LEVELS[args.log])
    is_onnx = args.model.lower().endswith(".onnx")
    fw = args.framework or ("onnx" if is_onnx else "pytorch")
    if fw == "onnx" and not is_onnx:
        raise CliError(f"--framework 5 (ONNX) takes an .onnx file, got --model {args.model}")
    if fw == "pytorch" and (is_onnx or not (":" in args.model
                                            and args.model.split(":")[0].endswith(".py"))):
        raise CliError(f"--framework pytorch takes --model file.py:factory, got {args.model}")
    if args.output_dir and not os.path.isdir(args.output_dir):
        raise CliError(f"directory {args.output_dir} of --output does not exist; create it first")
    if args.dump_graph and os.path.isfile(args.dump_graph):
        raise CliError(f"--dump_graph {args.dump_graph} is a file; give a directory")
    options = _atc_precision(args)
    if args.fusion_switch_file:
        options["fusion_switch_file"] = args.fusion_switch_file
    if args.dump_graph:
        options["dump_graph"] = args.dump_graph
    from .tools.atc_gears import GEAR_FLAGS, check_profile, gear_options
    flag = next((f for f in GEAR_FLAGS if getattr(args, f) is not None), None)
    spec = check_profile(flag, getattr(args, flag) if flag else None, args.input_shape,
                         args.input_format)
    t0 = time.perf_counter()
    if fw == "onnx":
        if not os.path.isfile(args.model):
            raise CliError(f"{args.model}: no such ONNX file")
        if flag:
            raise CliError(f"--{flag} with an ONNX model: opencann compiles ONNX models for "
                           "static shapes (gears are for --framework pytorch with --model "
                           "file.py:factory); or convert once per gear with its --input_shape sizes")
    with _quant_config_names(args):
        cm = (opencann.compile(args.model, device=args.soc_version, options=options,
                               input_shapes=args.input_shape) if fw == "onnx"
              else _atc_pytorch(args, options, flag, spec))
    opencann.save(cm, args.output)
    r = cm.report
    off = [p.name for p in r.passes if not p.enabled]
    gears = ""
    if flag:
        spec = r.dynamic["gears"]
        shown = [g[0] if len(g) == 1 else g for g in spec["values"]]
        gears = f", gears {flag}={shown} over {', '.join(spec['dims'])}"
    console.print(f"ATC run success: wrote {args.output} (device {args.soc_version}, "
                  f"{sum(r.op_counts_after.values())} ops, {len(r.applied)} fusions applied, "
                  f"passes off: {', '.join(off) or 'none'}{gears}) in "
                  f"{time.perf_counter() - t0:.1f} s", markup=False, highlight=False)
    if args.dump_graph:
        console.print(f"graph after each stage written to {args.dump_graph}/ (.dot, .json)",
                      markup=False, highlight=False)
    return 0


@contextlib.contextmanager
def _quant_config_names(args):
    """Around atc's compile: a ``quant_config`` whose layer names are no layer of the graph
    (`check_layer_names`) as one line naming the --quant_config file and the likely cause:
    written for another model, or by opencann tune on the cpu (its records name the CPU's
    fused layers, which an Ascend --soc_version's graph does not have)."""
    try:
        yield
    except ValueError as e:
        msg = str(e)
        if not args.quant_config or not msg.startswith(("option 'quant_config': 'layers' names no",
                                                          "quant_config's skip_layers names no")):
            raise
        why = (f"its records name the CPU's fused layers (opencann tune calibrates on the cpu), which "
               f"--soc_version {args.soc_version} does not have; drop --quant_config there"
               if args.soc_version != "cpu" else
               "written for another model, or for a graph the precision files here do not build (an op type "
               "whose nodes opencann tune gave int8 from fp32 and bf16 cannot be said by --modify_mixlist: "
               "use its model file, opencann tune --out)? opencann tune --quant-config-out --keep-dtype-out "
               "--mixlist-out on this --model writes matching files")
        raise CliError(f"--quant_config {args.quant_config}: {why}: {msg}") from None


#: atc's --precision_mode when unset for an Ascend --soc_version: CANN ATC's default
#: (CANN docs, ATC parameter --precision_mode: "force_fp16 (default)"); for the cpu the
#: model's dtypes stay (no Ascend default applies to it)
ATC_NPU_PRECISION = "force_fp16"


def _atc_precision(args) -> dict:
    """The compile options of atc's --precision_mode (checked: one ValueError line naming
    the modes; unset: `ATC_NPU_PRECISION` for an Ascend --soc_version, the model's dtypes
    for the cpu), --keep_dtype, --modify_mixlist and --quant_config files
    (`opencann.tools.precision_files`)."""
    options = {}
    mode = args.precision_mode or (ATC_NPU_PRECISION if args.soc_version != "cpu" else None)
    if mode:
        from .passes.prepare.precision import low_dtype
        low_dtype(mode)
        options["precision_mode"] = mode
    if args.keep_dtype:
        from .tools.precision_files import read_keep_dtype
        options["keep_dtype"] = read_keep_dtype(args.keep_dtype)
    if args.modify_mixlist:
        from .tools.precision_files import read_mixlist
        options["keep_fp32"], options["lower_ops"] = read_mixlist(args.modify_mixlist)
    if args.quant_config:
        from .tools.precision_files import read_quant_config
        options["quant_config"] = read_quant_config(args.quant_config)
    return options


def _atc_pytorch(args, options, flag, spec):
    """``opencann atc --framework pytorch``: the factory's model compiled on its example
    inputs, which ``--input_shape`` must match but for its -1s; with a gear flag, the
    gears over the dims ``spec`` names (`opencann.tools.atc_gears`)."""
    import opencann
    from .runtime.call_binding import forward_arg_names
    from .tools.atc_gears import check_example, gear_options
    zm = _load(args.model, 1, 128)
    if args.input_shape:
        names = forward_arg_names(zm.model) or []
        check_example(args.input_shape, {n: t for n, t in zip(names, zm.example_inputs)
                                         if n and isinstance(t, torch.Tensor)})
    if flag:
        options = {**options, **gear_options(flag, getattr(args, flag), spec)}
    return opencann.compile(zm.model, zm.example_inputs, device=args.soc_version,
                            options=options, dynamic_shapes=spec if flag else None)


def _csv(s):
    return [x for x in s.split(",") if x] if s else None


def cmd_fuzz(args) -> int:
    """``opencann fuzz``: differential fuzzing (`opencann.tools.fuzz.run_fuzz`) with the command's
    options; prints progress and the summary. Returns 1 when a check failed, else 0."""
    from .tools.fuzz import BACKENDS, run_fuzz
    from .tools.fuzz_shapes import BACKEND as SHAPES, run_shape_fuzz
    if args.backend == "onnx":       # random ONNX graphs checked against ONNX Runtime
        from .tools.fuzz_onnx import run_onnx_fuzz
        res = run_onnx_fuzz(cases=args.cases, seed=args.seed, ops=_csv(args.op))
        console.print(res.summary(), markup=False, highlight=False)
        return 1 if res.failures else 0
    backends = list(BACKENDS) + [SHAPES] if args.backend == "all" else _csv(args.backend)
    every = {"dynamo": args.dynamo_every} if args.dynamo_every > 1 else None
    shapes = SHAPES in backends
    backends = [b for b in backends if b != SHAPES]
    if shapes:   # torch.compile at three input sizes (opencann.tools.fuzz_shapes)
        sres = run_shape_fuzz(cases=args.cases, seed=args.seed,
                              progress=lambda m: console.print(m, markup=False, highlight=False))
        console.print(sres.summary(), markup=False, highlight=False)
        if not backends:
            return 1 if sres.failures else 0
    res = run_fuzz(cases=args.cases, seed=args.seed, backends=backends, ops=_csv(args.op),
                   kinds=_csv(args.kinds), checks=_csv(args.checks), out_dir=args.out,
                   max_steps=args.max_steps, shrink_budget=args.shrink_budget,
                   max_shrinks=args.max_shrinks, every=every,
                   progress=lambda m: console.print(m, markup=False, highlight=False))
    console.print(res.summary(), markup=False, highlight=False)
    if res.failures and args.out:
        console.print(f"minimal repros written to {args.out}/ (run one with python)")
    return 1 if res.failures or (shapes and sres.failures) else 0


def _json_options(text):
    """``--options`` as a dict ({} when not given). Raises CliError (one line) for text that
    is not JSON or not a JSON object."""
    try:
        options = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise CliError(f"--options is not valid JSON ({e.msg} at column {e.colno}); e.g. "
                       "--options '{\"disable\": [\"cse\"]}'") from None
    if not isinstance(options, dict):
        raise CliError(f"--options must be a JSON object, got {type(options).__name__} {text}; "
                       "e.g. --options '{\"disable\": [\"cse\"]}'")
    return options


def cmd_doctor(args) -> int:
    """Environment checks (opencann.tools.doctor); exit 1 when one is an error."""
    from .tools.doctor import doctor, to_json
    checks = doctor()
    if args.json:
        print(json.dumps(to_json(checks), indent=2))
    else:
        mark = {"ok": "[green]ok[/green]", "warning": "[yellow]warning[/yellow]", "error": "[red]error[/red]"}
        for c in checks:
            console.print(f"{mark[c.status]:>26s}  {c.name:12s} {escape(c.value)}"
                          + (f"\n{'':16s}fix: {escape(c.advice)}" if c.advice else ""))
    return 1 if any(c.status == "error" for c in checks) else 0


def cmd_warm(args) -> int:
    """``opencann warm``: compile the shipped kernel signatures into the numba cache
    (opencann.tools.warm_cli); exit 1 when a worker process failed."""
    from .tools.warm_cli import run_args
    return run_args(args, console)


def cmd_analyze(args) -> int:
    """Op-support audit (opencann.tools.analyze); exit 1 when an op keeps the model
    from compiling into one device graph."""
    from .tools.analyze import analyze, analyze_onnx
    zm = _load(args.model, args.batch, args.seq)
    if isinstance(zm, OnnxFile):
        a = analyze_onnx(zm.path, args.device)
    else:
        a = analyze(zm.model, zm.example_inputs, args.device, name=zm.name)
    if args.json:
        print(json.dumps(a.to_dict(), indent=2))
    else:
        console.print(a.to_text(), markup=False, highlight=False)
    return a.exit_code


def _compare_table(res, rows: int) -> str:
    """The first diverging layer and its neighbours (or the first rows), one per line."""
    i = res.first_divergence if res.first_divergence is not None else 0
    lo = max(0, i - rows // 2)
    lines = [f"{'#':>4} {'node':28s} {'op':12s} {'dtype':9s} {'cosine':>10s} {'max abs':>9s} "
             f"{'rel RMSE':>9s} {'1/1000':>6s}  status  source"]
    for r in res.layers[lo:lo + rows]:
        lines.append(f"{r.index:4d} {r.node[:28]:28s} {r.op[:12]:12s} {r.dtype:9s} {r.cosine:10.6f} "
                     f"{r.max_abs:9.2e} {r.rel_rmse:9.2e} {r.thousandth:6.3f}  {r.status:6s}  "
                     f"{r.module} ({r.source})" + ("  <- first divergence" if r.index == res.first_divergence else ""))
    return "\n".join(lines)


def cmd_compare(args) -> int:
    """Layer-by-layer accuracy against eager (opencann.tools.compare), CSV/HTML, and
    --bisect; exit 1 when the outputs fail their thresholds."""
    from .tools.compare import Session
    zm = _load(args.model, args.batch, args.seq)
    if isinstance(zm, OnnxFile):
        raise CliError("compare checks against eager PyTorch and takes zoo names or "
                       "file.py:factory; for an .onnx file use opencann run (against onnxruntime)")
    options = _json_options(args.options)
    if args.precision_mode:
        options["precision_mode"] = args.precision_mode
    with console.status(f"capturing {zm.name} and running it eagerly..."):
        s = Session(zm.model, zm.example_inputs)
    with console.status("compiling and comparing layer by layer..."):
        res = s.run(args.device, options)
    console.print(res.summary(), markup=False, highlight=False)
    console.print(_compare_table(res, args.rows), markup=False, highlight=False)
    if args.csv:
        res.to_csv(args.csv)
        console.print(f"CSV written to {args.csv}", markup=False, highlight=False)
    if args.html:
        from .tools.compare_html import write_html
        write_html(res, args.html)
        console.print(f"HTML written to {args.html}", markup=False, highlight=False)
    if args.bisect:
        from .tools.bisect import bisect
        b = bisect(zm.model, zm.example_inputs, args.device, options, on=args.bisect_on,
                   session=s, progress=lambda m: console.print(m, markup=False, highlight=False))
        console.print(f"bisect ({b.cost()}): {b.message}", markup=False, highlight=False)
    return 1 if res.status == "fail" else 0


def cmd_readiness(args) -> int:
    """``opencann readiness MODEL --device vnpu:<preset>``: one NPU readiness report
    (opencann.tools.readiness) in the terminal, and as HTML / JSON; exit 0 when the
    verdict is "ready", 1 otherwise (host ops, or not ready)."""
    from .devices import parse_device
    from .tools.readiness import readiness
    from .tools.readiness_cli import print_report
    parse_device(args.device, kind="vnpu")   # one line before the model is built
    zm = _load(args.model, args.batch or 1, args.seq, args.input_shape, ocm="readiness")
    kw = dict(device=args.device, precision=args.precision, context=args.context,
              batch=args.batch, accuracy=not args.no_accuracy)
    with console.status(f"checking {zm.name} for {args.device} (op support, estimate, accuracy)..."):
        if isinstance(zm, OnnxFile):
            rep = readiness(zm.path, input_shapes=zm.input_shapes, **kw)
        elif isinstance(zm, OcmFile):
            rep = readiness(zm.path, **kw)
        else:
            rep = readiness(zm.model, tuple(zm.example_inputs), name=zm.name, **kw)
    print_report(rep, console, args.top)
    if args.html:
        from .tools.readiness_html import write_html
        write_html(rep, args.html)
        console.print(f"HTML written to {args.html}", markup=False, highlight=False)
    if args.json:
        rep.to_json(args.json)
        console.print(f"JSON written to {args.json}", markup=False, highlight=False)
    return 0 if rep.verdict == "ready" else 1


def _add_migration_commands(sub) -> None:
    """doctor, analyze, compare, readiness: the migration toolkit (docs/guide/migration.md)."""
    d = sub.add_parser("doctor", help="check versions, CPU, oneDNN/MKL, threads, GPU, vnpu presets")
    d.add_argument("--json", action="store_true", help="print JSON instead of text")
    d.set_defaults(fn=cmd_doctor)
    for name, fn, hlp in (("analyze", cmd_analyze, "op-support audit: host fallbacks, custom "
                           "ops, data-dependent branches, ops without a device kernel"),
                          ("compare", cmd_compare, "layer-by-layer accuracy against eager "
                           "(cosine, max abs/rel, relative RMSE, 1/1000 ratio); --bisect")):
        s = sub.add_parser(name, help=hlp)
        s.add_argument("model", help="zoo name (minilm, bert-base, gpt2, resnet50), file.py:factory"
                       + (" or an .onnx file" if name == "analyze" else ""))
        s.add_argument("--device", default="cpu", help="cpu or vnpu[:preset]")
        s.add_argument("--batch", type=positive_int, default=1)
        s.add_argument("--seq", type=positive_int, default=128)
        s.set_defaults(fn=fn)
        if name == "analyze":
            s.add_argument("--json", action="store_true", help="print JSON instead of text")
            continue
        s.add_argument("--precision-mode", help="CANN precision mode, e.g. allow_mix_precision_bf16")
        s.add_argument("--options", help='compile options as JSON, e.g. \'{"disable": ["cse"]}\'')
        s.add_argument("--csv", type=output_file, help="write every layer's metrics here")
        s.add_argument("--html", type=output_file, help="write a self-contained HTML report here")
        s.add_argument("--rows", type=positive_int, default=12, help="layers shown around the first divergence")
        s.add_argument("--bisect", action="store_true", help="find the pass and rewrite that "
                       "cause a divergence of the outputs")
        s.add_argument("--bisect-on", choices=("fail", "warn"), default="fail",
                       help="the output status that counts as a divergence")
    from .tools.warm_cli import add_arguments as _warm_args
    w = sub.add_parser("warm", help="compile the CPU kernels into the cache once, so that "
                       "first compiles and generate calls on this machine load them",
                       description="Compile opencann's numba CPU kernels (the signatures shipped "
                       "in opencann/tools/numba_signatures.tsv) into the kernel cache: "
                       "$NUMBA_CACHE_DIR, else $OPENCANN_CACHE_DIR/numba, else "
                       "~/.cache/opencann/numba. Run it once on a new machine or after upgrading "
                       "opencann; a second run finds them cached. Exit 1 when a worker process "
                       "failed, 2 when the cache cannot be written.")
    _warm_args(w)
    w.set_defaults(fn=cmd_warm)
    from .tools.readiness_cli import add_arguments as _ready_args
    r = sub.add_parser("readiness", help="one NPU readiness report: op support, formats, HBM fit "
                       "(LLM KV cache), latency, accuracy at fp16/bf16, verdict and next steps")
    _ready_args(r)
    r.set_defaults(fn=cmd_readiness)


def _add_model_commands(sub) -> None:
    """demo, compile, run and bench: the commands that take a zoo name or model file."""
    from .tools import atc as _atc
    d = sub.add_parser("demo", help="the main job: MiniLM and ResNet-50, compiled vs eager, "
                       "and a SmolLM2 chat turn")
    d.add_argument("--runs", type=positive_int, default=10)
    d.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    d.add_argument("--no-llm", action="store_true", help="skip the SmolLM2 chat turn")
    for name, fn, hlp in (("compile", cmd_compile, "compile a model and print its report"),
                          ("run", cmd_run, "compile, run once, optionally trace"),
                          ("bench", cmd_bench, "compiled vs eager latency")):
        s = sub.add_parser(name, help=hlp)
        s.add_argument("model", help="zoo name (minilm, bert-base, gpt2, resnet50), file.py:factory, "
                       "an .onnx file" + (" or an .ocm model file (opencann atc)"
                                          if name != "compile" else ""))
        s.add_argument("--batch", type=positive_int, default=1)
        s.add_argument("--seq", type=positive_int, default=128)
        s.add_argument("--input-shape", "--input_shape", dest="input_shape",
                       type=_atc.concrete_input_shape, metavar="SHAPES",
                       help='sizes of inputs, ATC\'s --input_shape form "x:1,3,224,224;y:1,128": '
                       "an .onnx file's symbolic dims" + (", an .ocm file's dynamic dims (default: "
                                                          "its example's)" if name != "compile" else ""))
        s.set_defaults(fn=fn)
        if name != "compile":
            s.add_argument("--device", help="cpu or vnpu:<preset> (default cpu; an .ocm file "
                           "runs on the device it was compiled for)")
        if name == "compile":
            s.add_argument("--device", default="cpu")
            s.add_argument("--report", type=output_file, help="write the JSON report here")
            s.add_argument("--dot", type=output_file,
                           help="write the optimized graph as Graphviz DOT here")
            s.add_argument("--options", help='compile options as JSON, e.g. \'{"disable": ["cse"]}\'')
            s.add_argument("-v", "--verbose", action="store_true", help="the full text report")
        if name == "run":
            s.add_argument("--trace", type=output_file,
                           help="write a Chrome trace (chrome://tracing, Perfetto) here")
        if name == "bench":
            s.add_argument("--runs", type=positive_int, default=10)
            s.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    d.set_defaults(fn=cmd_demo)


def cmd_generate(args) -> int:
    """``opencann generate MODEL --prompt TEXT``: an LLM compiled by opencann.llm, its answer
    streamed, then TTFT and decode tokens/s (opencann.tools.generate_cli). Returns 0."""
    from .tools.generate_cli import run_args
    return run_args(args, console, _json_options(args.options))


def _add_tool_commands(sub) -> None:
    """generate, estimate and train-demo (their arguments come from their tools' modules)."""
    from .tools.generate_cli import add_arguments as _gen_args
    g = sub.add_parser("generate", help="an LLM (smollm2, a .gguf file or a transformers "
                       "folder) compiled by opencann.llm: streams the answer, then TTFT and "
                       "tokens/s")
    _gen_args(g)
    g.set_defaults(fn=cmd_generate)
    from .tools.estimate_cli import add_arguments as _est_args, run_args as _est_run
    e = sub.add_parser("estimate", help="time, HBM traffic and memory on a virtual NPU")
    _est_args(e)
    e.set_defaults(fn=_est_run)
    t = sub.add_parser("train-demo", help="train a CNN on scikit-learn's digits through the "
                       "compiled path (mixed precision, recomputation), then fine-tune MiniLM")
    from .tools.train_demo import add_arguments as _train_args, run_args as _train_run
    _train_args(t, minilm_steps=4)  # show transformer training too
    t.set_defaults(fn=_train_run)
    from .tools.tune_cli import add_arguments as _tune_args
    tu = sub.add_parser("tune", help="per-node precision search (fp32 / bf16): the fastest mix "
                        "passing msprobe's accuracy gate or your metric")
    _tune_args(tu)
    tu.set_defaults(fn=cmd_tune)


def cmd_tune(args) -> int:
    """``opencann tune MODEL``: `opencann.tools.tune` on a zoo model or factory; prints the
    per-node table and writes the model / CANN precision files asked for. Returns 0."""
    from .tools.tune_cli import run_args
    return run_args(args, console, _load)


def _add_atc_command(sub) -> None:
    """atc, with ATC's flag names, and inspect (a saved model file)."""
    from .tools import atc as _atc
    a = sub.add_parser("atc", help="ATC-style conversion to a model file (.ocm), with ATC's "
                       "flag names")
    a.add_argument("--model", required=True, help="an .onnx file, or file.py:factory "
                   "(--framework pytorch)")
    a.add_argument("--framework", type=_atc.framework,
                   help="5 (ONNX) or pytorch; default from --model")
    a.add_argument("--output", required=True, type=_atc.output_path,
                   help="output path; .ocm is appended (ATC appends .om)")
    a.add_argument("--input_shape", type=_atc.input_shape,
                   help='sizes of inputs with symbolic dims, e.g. "x:1,3,224,224;y:1,128"; '
                   "-1 marks a dim the gears fill")
    from .tools import atc_gears as _gears
    g = a.add_mutually_exclusive_group()
    g.add_argument("--dynamic_batch_size", type=_gears.dynamic_batch_size, metavar="GEARS",
                   help='batch gears, e.g. "1,2,4,8" (-1 at dim 0 of --input_shape)')
    g.add_argument("--dynamic_image_size", type=_gears.dynamic_image_size, metavar="GEARS",
                   help='image-size gears "h,w;h,w", e.g. "224,224;448,448" (-1 at H and W)')
    g.add_argument("--dynamic_dims", type=_gears.dynamic_dims, metavar="GEARS",
                   help='ND gears, one value per -1 of --input_shape, e.g. "16,16;32,32"')
    a.add_argument("--input_format", type=_gears.input_format,
                   help=f"{', '.join(_gears.FORMATS)}: where --dynamic_image_size finds H and W "
                   "(default NCHW); --dynamic_dims is ND")
    a.add_argument("--soc_version", type=_atc.soc_version, default="cpu",
                   help="cpu, Ascend910B[1-4], Ascend910[A], Ascend310[P3] (vnpu presets)")
    a.add_argument("--precision_mode", metavar="MODE",
                   help="CANN precision mode: force_fp32, must_keep_origin_dtype, "
                   "allow_fp32_to_fp16, allow_mix_precision(_fp16|_bf16), force_fp16 (default for an "
                   "Ascend --soc_version, as CANN's ATC; for cpu, unset keeps the model's dtypes; "
                   "see docs/guide/precision.md)")
    a.add_argument("--keep_dtype", metavar="FILE", help="CANN keep_dtype file: node names "
                   "(one per line) kept in their original dtype (opencann tune writes one)")
    a.add_argument("--modify_mixlist", metavar="FILE", help='CANN mixlist JSON ({"black-list": '
                   '{"to-add": [...]}, "white-list": {...}}) changing which op types are lowered')
    a.add_argument("--quant_config", metavar="FILE", help="int8 layers with their calibration "
                   "records (JSON, as opencann tune --quant-config-out writes; AMCT's record in CANN)")
    a.add_argument("--fusion_switch_file", help="CANN fusion switch JSON file "
                   '({"Switch": {"GraphFusion": {"ConvBatchnormFusionPass": "off"}}})')
    a.add_argument("--log", choices=sorted(_atc.LOG_LEVELS), help="log level")
    a.add_argument("--dump_graph", metavar="DIR",
                   help="write the graph after each pipeline stage as DOT and JSON here")
    a.set_defaults(fn=cmd_atc)
    ins = sub.add_parser("inspect", help="show a saved model file (.ocm): metadata, ops, "
                         "memory plan, sections with checksums, graph")
    ins.add_argument("file", help="a file written by opencann.save")
    ins.add_argument("--json", action="store_true", help="print JSON instead of text")
    ins.set_defaults(fn=cmd_inspect)


def _add_fuzz_command(sub) -> None:
    """fuzz: differential fuzzing against eager."""
    f = sub.add_parser("fuzz", help="differential fuzzing: random small programs compiled "
                       "and checked against eager; failures shrunk to minimal repros")
    f.add_argument("--cases", type=positive_int, default=200, help="number of programs")
    f.add_argument("--seed", type=int, default=0, help="first seed (case i uses seed+i)")
    f.add_argument("--backend", default="opencann",
                   help="all, or a comma list of opencann, vnpu, dynamo, flash, dynamo_shapes "
                   "(torch.compile called at three input sizes: interpolate, computed slices); "
                   "or onnx: random ONNX graphs checked against ONNX Runtime")
    f.add_argument("--out", help="write each failure's minimal repro script here")
    f.add_argument("--op", help="only these ops or op groups (comma list; see opencann/tools/fuzz_ops.py)")
    f.add_argument("--kinds", help="only these op groups and input features (special, lowp, ints, multi_out)")
    f.add_argument("--checks", help="only these checks (error, meta, values, nan, input-mutation, "
                   "second-call, alias, threads, weights)")
    f.add_argument("--max-steps", type=int, default=10, help="most steps per program")
    f.add_argument("--shrink-budget", type=int, default=60, help="compiles spent shrinking one failure (0: off)")
    f.add_argument("--max-shrinks", type=int, default=50, help="failures shrunk (the rest kept as found)")
    f.add_argument("--dynamo-every", type=int, default=1,
                   help="run torch.compile on every k-th program only (it is the slowest backend)")
    f.set_defaults(fn=cmd_fuzz)


def _parser() -> argparse.ArgumentParser:
    """The ``opencann`` argument parser, one subcommand per ``cmd_*``."""
    p = _Parser(prog="opencann", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    _add_model_commands(sub)
    _add_tool_commands(sub)
    _add_atc_command(sub)
    _add_fuzz_command(sub)
    _add_migration_commands(sub)
    return p


def main(argv=None) -> int:
    """Run the ``opencann`` command line with ``argv`` (default ``sys.argv[1:]``); returns
    the exit status: 0 on success, 1 when a command reports failures (fuzz), 2 for bad
    input or a failed compile/run, printed as one ``error:`` line on stderr. Argument
    errors exit through argparse (status 2)."""
    args = _parser().parse_args(argv)
    if args.cmd == "atc":
        from .tools.atc import output_in
        args.output = output_in(args.output, args.model)
        args.output_dir = os.path.dirname(args.output)
    try:
        return args.fn(args)
    except (CliError, ValueError, RuntimeError, KeyError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        if isinstance(e, OSError) and e.filename is not None:
            msg = f"{e.filename}: {e.strerror}"
        lines = msg.strip().splitlines() or [type(e).__name__]
        Console(stderr=True, soft_wrap=True).print(f"[red]error:[/red] {escape(lines[0])}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
