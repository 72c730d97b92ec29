"""The ``opencann estimate`` command's arguments and runner (`add_arguments`, `run_args`,
`main`), apart from `opencann.tools.estimate` so that building the CLI parser (``opencann
--help``) does not import the op library, numba and sympy; the estimate itself is
imported when the command runs."""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

from .argtypes import output_file, positive_int


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``estimate`` options to ``ap`` (a parser or a CLI subparser)."""
    ap.add_argument("--model", help="zoo name (resnet50, bert-base, gpt2, minilm), file.py:factory or an .onnx file")
    ap.add_argument("--llm", help="estimate a decoder LLM's prefill (TTFT) and decode latency instead: llama2-7b, "
                                  "llama2-70b or a model directory with a transformers config.json")
    ap.add_argument("--prompt", type=positive_int, default=1024, help="--llm: prompt length (tokens)")
    ap.add_argument("--context", type=positive_int,
                    help="--llm: KV-cache length each decode step reads (default: the model's position limit)")
    ap.add_argument("--cards", type=positive_int, default=1, help="--llm: tensor-parallel cards (HCCS all-reduces)")
    ap.add_argument("--eager", action="store_true", help="--llm: also estimate eager (single-op) mode")
    ap.add_argument("--dtype", choices=("float16", "bfloat16", "float32"),
                    help="cast the model and inputs to this dtype first (default: as given)")
    ap.add_argument("--device", default="vnpu:ascend910b", help="vnpu:<preset> or vnpu:<spec.json|.toml>")
    ap.add_argument("--batch", type=positive_int,
                    help="batch size (default 1; an .onnx file: as the file gives it)")
    ap.add_argument("--size", type=positive_int, help="image size (resnet50)")
    ap.add_argument("--seq", type=positive_int, help="sequence length (bert-base, gpt2, minilm)")
    ap.add_argument("--json", type=output_file, help="write the report as JSON here")
    ap.add_argument("--plot", type=output_file, help="write the roofline PNG here")
    ap.add_argument("--no-fusion", action="store_true", help="report the graph without the fusion passes")
    ap.add_argument("--no-ub-epilogue", action="store_true",
                    help="cost bias Add / Relu / residual Add after a Conv/MatMul as separate Vector kernels "
                         "instead of the Cube epilogue (the vnpu_ub_epilogue rewrite)")
    ap.add_argument("--top", type=positive_int, default=15, help="ops listed by time")
    return ap


def run_args(args: argparse.Namespace) -> int:
    """Run an estimate from parsed ``add_arguments`` options; prints the text report and
    writes --json / --plot. Returns 0, or 2 (one line on stderr) when the plan does not
    fit, the device is not a vnpu, the spec file or model is wrong, or capture fails."""
    import sys
    if getattr(args, "llm", None) is not None or getattr(args, "model", None) is None:
        return _run_llm(args)
    kw = {k: getattr(args, k) for k in ("size", "seq") if getattr(args, k, None) is not None}
    try:
        from .estimate import estimate   # the op library and capture: loaded on use
        rep = estimate(args.model, device=args.device, batch=args.batch, fused=not args.no_fusion,
                       dtype=getattr(args, "dtype", None),
                       ub_epilogue=not getattr(args, "no_ub_epilogue", False), **kw)
    except (ValueError, KeyError, RuntimeError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"error: {(msg.strip().splitlines() or [type(e).__name__])[0]}", file=sys.stderr)
        return 2
    print(rep.to_text(top=args.top))
    if args.json:
        rep.to_json(args.json)
        print(f"wrote {args.json}")
    if args.plot:
        rep.roofline_plot(args.plot)
        print(f"wrote {args.plot}")
    return 0


def _run_llm(args: argparse.Namespace) -> int:
    """``--llm``: print `opencann.tools.estimate_llm.estimate_llm`'s summary (and --json). Returns 0,
    or 2 with one line on stderr (neither --model nor --llm, both, a bad model, device or split)."""
    import sys
    if (getattr(args, "llm", None) is None) == (getattr(args, "model", None) is None):
        print("error: give --model MODEL (a network) or --llm MODEL (a decoder LLM), not both and not neither",
              file=sys.stderr)
        return 2
    try:
        from .estimate_llm import estimate_llm
        rep = estimate_llm(args.llm, device=args.device, dtype=args.dtype or "float16", prompt=args.prompt,
                           context=args.context, batch=args.batch or 1, cards=args.cards, eager=args.eager)
    except (ValueError, KeyError, RuntimeError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"error: {(msg.strip().splitlines() or [type(e).__name__])[0]}", file=sys.stderr)
        return 2
    print(rep.to_text())
    if args.json:
        rep.to_json(args.json)
        print(f"wrote {args.json}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``opencann estimate --model resnet50 --device vnpu:ascend910b [--batch N]
    [--json out.json] [--plot roofline.png] [--no-fusion] [--no-ub-epilogue] [--top K] [--size S] [--seq L]``,
    or ``opencann estimate --llm llama2-7b [--dtype float16] [--prompt N] [--context N] [--batch B]
    [--cards C] [--eager] [--json out.json]``."""
    ap = argparse.ArgumentParser(prog="opencann estimate",
                                 description="estimate time, HBM traffic and memory on a virtual NPU")
    return run_args(add_arguments(ap).parse_args(argv))


__all__ = ["add_arguments", "main", "run_args"]
