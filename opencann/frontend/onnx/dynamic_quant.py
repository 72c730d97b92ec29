"""ONNX Runtime's dynamic quantization (``quantize_dynamic``) of a MatMul, recognized before
conversion so that it runs on oneDNN's int8 inner product:

    xq, xs, xz = DynamicQuantizeLinear(x)
    s  = Mul(xs, w_scale)                       # w_scale: a constant
    yi = MatMulInteger(xq, W_int8, xz, w_zp)    # W_int8, w_zp = 0: constants
    y  = Mul(Cast(yi, to=FLOAT), s)             # (either operand order)
  ⇒ y = MatMul(x, W_int8 * w_scale)             # named as the MatMulInteger node

`fold_dynamic_matmuls` rewrites each match in a copy of the model and returns the names of
the dequantized weights; the IR graph records them (``graph.meta["int8_dynamic_weights"]``)
and the ``quantize_int8`` pass runs the linears over those weights as dynamic
``QuantLinearAct`` (x's scale and
zero point taken per call by DynamicQuantizeLinear's rule, the weight's int8 values and
scales as in the file: ``W_int8 * w_scale`` quantizes back to them exactly when they are
symmetric with max |q| = 127; the file's values are kept, so on a CPU without VNNI, whose
oneDNN u8 x s8 products are exact only for |w| <= 64, such a layer runs the fp32
emulation, `opencann.devices.cpu.int8_weight_bound`). The two agree up to the rounding of the output's rescale
(ONNX Runtime: int32 → float, then one product; oneDNN: one fused rescale) and of x's
quantization (oneDNN's kernel multiplies by 1/scale where ONNX divides: a value on a
rounding boundary may land one step apart). A layer the pass then does not quantize (not a
2-D GEMM after conversion) runs the fp32 MatMul of the dequantized weight and says so in
the compile report.

Only this shape of the pattern is taken: a W that is not a constant 2-D int8 tensor, a
nonzero w_zp, a per-column w_scale that is not 1-D, or a DynamicQuantizeLinear / Cast /
Mul output read elsewhere leaves the nodes as they are (MatMulInteger then runs on ONNX
Runtime, exactly). Source: ONNX Runtime, onnxruntime/python/tools/quantization/
operators/matmul.py (the nodes it writes); ONNX operator specification."""
from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np


def _consumers(graph) -> Dict[str, List]:
    out: Dict[str, List] = {}
    for n in graph.node:
        for x in n.input:
            out.setdefault(x, []).append(n)
    return out


def _match(n, producer, consumers, inits, outputs):
    """(DynamicQuantizeLinear, Cast, output Mul, scales Mul or None, w_deq) for a
    MatMulInteger ``n`` of the pattern, else None."""
    if len(n.input) < 3 or n.input[1] not in inits:
        return None
    d = producer.get(n.input[0])
    if d is None or d.op_type != "DynamicQuantizeLinear" or n.input[2] != d.output[2]:
        return None
    w = inits[n.input[1]]
    if w.dtype != np.int8 or w.ndim != 2:
        return None
    if len(n.input) > 3 and n.input[3] and (n.input[3] not in inits or np.any(inits[n.input[3]] != 0)):
        return None
    cs = consumers.get(n.output[0], [])
    if len(cs) != 1 or cs[0].op_type != "Cast" or n.output[0] in outputs:
        return None
    cast = cs[0]
    if not any(a.name == "to" and a.i == 1 for a in cast.attribute):
        return None
    ms = consumers.get(cast.output[0], [])
    if len(ms) != 1 or ms[0].op_type != "Mul" or cast.output[0] in outputs:
        return None
    mul = ms[0]
    other = mul.input[1] if mul.input[0] == cast.output[0] else mul.input[0]
    sm = producer.get(other)
    if sm is None or sm.op_type != "Mul" or d.output[1] not in sm.input:
        return None
    ws_name = sm.input[1] if sm.input[0] == d.output[1] else sm.input[0]
    if ws_name not in inits:
        return None
    ws = inits[ws_name].astype(np.float32)
    if ws.size != 1 and (ws.ndim != 1 or ws.shape[0] != w.shape[1]):
        return None
    return d, cast, mul, sm, (w.astype(np.float32) * ws.reshape(-1)[None, :] if ws.size > 1
                              else w.astype(np.float32) * np.float32(ws.reshape(())))


def fold_dynamic_matmuls(model) -> Tuple[object, List[str]]:
    """(model, names): ``model`` itself and [] when nothing matches; else a rewritten copy
    (each MatMulInteger now a MatMul, of its name, over a dequantized fp32 weight) and the
    names of those weight initializers (``<MatMulInteger name>_w_dequantized``)."""
    import onnx
    from onnx import helper, numpy_helper
    g = model.graph
    if not any(n.op_type == "MatMulInteger" for n in g.node):
        return model, []
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    producer = {y: n for n in g.node for y in n.output}
    consumers = _consumers(g)
    outputs = {o.name for o in g.output}
    found = []
    for n in g.node:
        if n.op_type == "MatMulInteger":
            m = _match(n, producer, consumers, inits, outputs)
            if m is not None:
                found.append((n, m))
    if not found:
        return model, []
    new = onnx.ModelProto()
    new.CopyFrom(model)
    drop, add, names = set(), {}, []
    taken = {t.name for t in g.initializer}
    for n, (d, cast, mul, sm, w_deq) in found:
        wname = f"{n.name or n.output[0]}_w_dequantized"
        while wname in taken:
            wname += "_"
        taken.add(wname)
        new.graph.initializer.append(numpy_helper.from_array(w_deq, wname))
        add[id(n)] = helper.make_node("MatMul", [d.input[0], wname], [mul.output[0]], name=n.name or wname)
        drop.update({id(cast), id(mul)})
        names.append(wname)
    nodes = [add.get(id(n), n) for n in g.node if id(n) not in drop]
    # the scales Mul and the DynamicQuantizeLinear go when nothing else reads them
    used = {x for nd in nodes for x in nd.input} | outputs
    nodes = [nd for nd in nodes if nd.op_type not in ("Mul", "DynamicQuantizeLinear")
             or any(y in used for y in nd.output)]
    used = {x for nd in nodes for x in nd.input} | outputs
    nodes = [nd for nd in nodes if nd.op_type != "DynamicQuantizeLinear" or any(y in used for y in nd.output)]
    del new.graph.node[:]
    new.graph.node.extend(nodes)
    return new, names


__all__ = ["fold_dynamic_matmuls"]
