"""OpenVINO GenAI as a peer of bench/llm.py: export a transformers folder with
optimum-intel and generate with ``openvino_genai.LLMPipeline``.

Export: ``optimum-cli export openvino -m <folder> --task text-generation-with-past
--weight-format fp32 <out>`` (optimum-intel's stateful LLM export, the model and its
tokenizer/detokenizer as OpenVINO IR). optimum-intel pins a transformers older than the one
opencann needs, so the export runs in a virtual environment of its own: ``make venv-ov``
makes ``.venv-ov`` (torch CPU, optimum-intel, openvino-genai), and `export_python` finds it
(or the ``OPENCANN_OV_PYTHON`` interpreter). The run needs only ``openvino-genai`` in the
bench's own environment (the ``bench`` extra).

Rows (source: OpenVINO GenAI's LLMPipeline docs, "Generation configuration" and
"Performance metrics"):
  ov-genai          ``INFERENCE_PRECISION_HINT=f32``: fp32 like every other row
  ov-genai-default  the plugin's default precision (bf16 on a CPU with avx512_bf16/AMX)
Both with ``INFERENCE_NUM_THREADS`` = the bench's threads, greedy, ``ignore_eos``, exactly
``new`` tokens. Batch 1: each token is stamped by a ``StreamerBase`` subclass, as the other
backends' streamers do. Batch > 1 (LLMPipeline streams batch 1 only): TTFT is the wall time
of a 1-token ``generate`` and each decode step (total − TTFT) / (new − 1) of a full one
(the result's ``perf_metrics`` count tokens over the whole batch, and its TTFT is not
comparable).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = ("ov-genai", "ov-genai-default")
MAKE_VENV = "make venv-ov"


def export_python() -> str | None:
    """The interpreter with optimum-intel: ``$OPENCANN_OV_PYTHON`` or the repository's
    ``.venv-ov/bin/python``; None when neither exists."""
    for p in (os.environ.get("OPENCANN_OV_PYTHON"), os.path.join(REPO, ".venv-ov", "bin", "python")):
        if p and os.path.exists(p):
            return p
    return None


def unavailable() -> str | None:
    """Why the OpenVINO GenAI rows cannot run here, or None."""
    import importlib.util
    if importlib.util.find_spec("openvino_genai") is None:
        return "openvino-genai is not installed (pip install -e .[bench] installs it)"
    if export_python() is None:
        return f"no optimum-intel environment for the export ({MAKE_VENV} makes .venv-ov)"
    return None


def build_ov(folder: str, out: str) -> float:
    """Export ``folder`` to OpenVINO IR (fp32 weights, stateful KV cache) in ``out``;
    returns seconds. Raises RuntimeError with optimum-cli's last output line on failure."""
    t0 = time.perf_counter()
    py = export_python()
    cli = os.path.join(os.path.dirname(py), "optimum-cli")
    cmd = [cli] if os.path.exists(cli) else [py, "-m", "optimum.commands.optimum_cli"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(cmd + ["export", "openvino", "-m", folder, "--task", "text-generation-with-past",
                              "--weight-format", "fp32", out],
                       capture_output=True, text=True, cwd=tempfile.gettempdir(), env=env)
    if r.returncode != 0 or not os.path.exists(os.path.join(out, "openvino_model.xml")):
        tail = [ln for ln in (r.stderr or r.stdout).strip().splitlines() if ln.strip()]
        shutil.rmtree(out, ignore_errors=True)
        raise RuntimeError(f"optimum-cli export openvino failed: {tail[-1] if tail else r.returncode}")
    return time.perf_counter() - t0


def ov_runner(backend: str, folder: str, ids: torch.Tensor, new: int, threads: int):
    """(prepare seconds, run, facts) for OpenVINO GenAI on the exported ``folder``;
    run() -> (tokens int64 [B, new], token times, t0) as bench/llm.py's runners."""
    import openvino as ov
    import openvino_genai as og
    props = {"INFERENCE_NUM_THREADS": threads}
    if backend == "ov-genai":
        props["INFERENCE_PRECISION_HINT"] = "f32"
    # no prefix caching: the timed generations repeat one prompt, and a cached prefix
    # would skip its prefill (TTFT 16-18 ms for 32 or 512 tokens, which fp32 FLOPs on
    # two cores cannot give); the other backends recompute the prompt every time
    sched = og.SchedulerConfig()
    sched.enable_prefix_caching = False
    t = time.perf_counter()
    pipe = og.LLMPipeline(folder, "CPU", scheduler_config=sched, **props)
    prep = time.perf_counter() - t
    cfg = og.GenerationConfig()
    cfg.max_new_tokens = cfg.min_new_tokens = new
    cfg.ignore_eos, cfg.do_sample = True, False
    arr = ids.numpy().astype(np.int64)
    inputs = og.TokenizedInputs(ov.Tensor(arr), ov.Tensor(np.ones_like(arr)))

    class Stamps(og.StreamerBase):
        def __init__(self):
            super().__init__()
            self.times = []

        def write(self, token):
            self.times.append(time.perf_counter())
            return og.StreamingStatus.RUNNING

        def end(self):
            pass

    first = og.GenerationConfig()
    first.max_new_tokens = first.min_new_tokens = 1
    first.ignore_eos, first.do_sample = True, False

    def run():
        if arr.shape[0] == 1:
            st = Stamps()
            t0 = time.perf_counter()
            res = pipe.generate(inputs, cfg, st)
            return torch.tensor(np.asarray(res.tokens), dtype=torch.int64), st.times, t0
        # batch > 1: no streamer; TTFT = a 1-token generate, decode = the rest of a full one
        t0 = time.perf_counter()
        pipe.generate(inputs, first)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = pipe.generate(inputs, cfg)
        total = time.perf_counter() - t0
        step = (total - ttft) / max(new - 1, 1)
        return (torch.tensor(np.asarray(res.tokens), dtype=torch.int64),
                [t0 + ttft + i * step for i in range(new)], t0)
    return prep, run, {"precision": props.get("INFERENCE_PRECISION_HINT", "plugin default"),
                       "openvino_genai": og.__version__}


__all__ = ["BACKENDS", "build_ov", "export_python", "ov_runner", "unavailable"]
