"""Shared checks for the ONNX conformance tests: a model compiled by opencann against
ONNX Runtime (values, NaN positions, dtypes, shapes including rank 0), a second call,
and the saved model file loaded here and in a fresh process."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import helper

import opencann

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def model(nodes, inputs, outputs, inits=(), opset=17):
    """A one-graph model: ``inputs``/``outputs`` as (name, elem type, dims or None)."""
    vi = helper.make_tensor_value_info
    g = helper.make_graph(nodes, "m", [vi(*i) for i in inputs], [vi(*o) for o in outputs],
                          initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = min(m.ir_version, 10)
    if any(o[2] is None for o in outputs):      # output shapes from onnx's own inference
        inferred = onnx.shape_inference.infer_shapes(m, data_prop=True)
        for o, io in zip(m.graph.output, inferred.graph.output):
            if not o.type.tensor_type.HasField("shape"):
                o.CopyFrom(io)
    return m


def ort_run(m, feeds):
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def assert_like_ort(outs, refs, rtol=1e-5, atol=1e-6):
    """Same count, dtypes and shapes (rank 0 included); NaN at the same places; values close."""
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        o = o.numpy() if isinstance(o, torch.Tensor) else np.asarray(o)
        assert o.dtype == r.dtype, (o.dtype, r.dtype)
        assert o.shape == r.shape, (o.shape, r.shape)
        if o.dtype.kind == "f":
            np.testing.assert_array_equal(np.isnan(o), np.isnan(r))
        np.testing.assert_allclose(o, r, rtol=rtol, atol=atol)


def check(m, feeds, tmp_path=None, rtol=1e-5, atol=1e-6, fresh=False, input_shapes=None):
    """Compile ``m``, compare two calls with ONNX Runtime, save + load (and, ``fresh``, run
    the file in a new process); returns the compiled model."""
    refs = ort_run(m, feeds)
    cm = opencann.compile(m, input_shapes=input_shapes) if input_shapes else opencann.compile(m)
    ts = [torch.from_numpy(np.array(v)) for v in feeds.values()]
    assert_like_ort(cm(*ts), refs, rtol, atol)
    assert_like_ort(cm(*[t.clone() for t in ts]), refs, rtol, atol)     # a second call
    if tmp_path is not None:
        path = str(tmp_path / "m.ocm")
        opencann.save(cm, path)
        assert_like_ort(opencann.load(path)(*ts), refs, rtol, atol)
        if fresh:
            npz = str(tmp_path / "io.npz")
            np.savez(npz, *[np.array(v) for v in feeds.values()], **{f"ref{k}": r for k, r in enumerate(refs)})
            code = ("import sys, numpy as np, torch, opencann\n"
                    f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
                    "from onnx_check import assert_like_ort\n"
                    f"d = np.load({npz!r}); n = {len(feeds)}\n"
                    "ins = [torch.from_numpy(d[f'arr_{i}']) for i in range(n)]\n"
                    "refs = [d[k] for k in sorted(k for k in d.files if k.startswith('ref'))]\n"
                    f"assert_like_ort(opencann.load({path!r})(*ins), refs, {rtol}, {atol})\n"
                    "print('ok')\n")
            env = dict(os.environ, PYTHONPATH=ROOT)
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               env=env, timeout=300)
            assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
    return cm


def fallbacks(cm):
    """The OnnxHostFallback nodes' op types of a compiled model."""
    return [n.attrs["op_type"] for n in cm.graph.nodes if n.op == "OnnxHostFallback"]
