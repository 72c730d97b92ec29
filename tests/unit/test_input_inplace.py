"""input_inplace (TorchAir's input_inplace_pass): a host-fallback ``index_put`` whose result
the model writes back into its input becomes ``index_put_`` on that input, recorded as
sharing the input's storage; it does not apply to a functional index_put (nothing written
back) nor when the input's old contents are read elsewhere, and says so."""
import torch

from opencann.engine.options import complete
from opencann.ir import DataType, Graph, TensorDesc, TensorRef
from opencann.passes import PassContext, PassManager
from opencann.passes.prepare.input_inplace import InputInplace
from opencann.report import CompileReport

aten = torch.ops.aten


def _graph(written_back: bool = True, read_elsewhere: bool = False) -> Graph:
    """cache [1, 2, 8, 4], pos [1] int64, rows [1, 2, 1, 4] -> index_put(cache, [:, :, pos],
    rows) written back into cache (input 0) when ``written_back``; plus the sum of rows
    (or of the old cache, when ``read_elsewhere``)."""
    g = Graph("cache_write")
    cache = g.add_input(TensorDesc((1, 2, 8, 4), DataType.FLOAT), "cache")
    pos = g.add_input(TensorDesc((1,), DataType.INT64), "pos")
    rows = g.add_input(TensorDesc((1, 2, 1, 4), DataType.FLOAT), "rows")
    put = g.create_node("HostFallback", [cache, pos, rows],
                        {"self": TensorRef(0), "indices": [None, None, TensorRef(1)],
                         "values": TensorRef(2)}, [cache.desc])
    put.meta["aten"] = aten.index_put.default
    other = g.create_node("ReduceSum", [cache if read_elsewhere else rows],
                          {"self": TensorRef(0), "dim": None}, [TensorDesc((), DataType.FLOAT)])
    g.outputs = [put.outputs[0], other.outputs[0]]
    if written_back:
        g.signature = g.signature.replace(
            input_mutations=(0,), n_outputs=2,
            output_storage=(frozenset({put.outputs[0].id}), frozenset({other.outputs[0].id})))
    return g


def _run(g: Graph):
    ctx = PassContext(options=complete({}), report=CompileReport(model="t", device="cpu"), device="cpu")
    PassManager([InputInplace()]).run(g, ctx)
    return ctx.report.passes[0].changed, ctx.report


def test_before_expected_writes_the_input_in_place():
    g = _graph()
    cache = g.inputs[0]
    changed, _ = _run(g)
    assert changed == 1
    put = g.nodes[0]
    assert put.meta["aten"] is aten.index_put_.default and put.attrs["inplace_input"] == 0
    assert put.inputs[0] is cache and g.outputs[0] is put.outputs[0]
    assert g.signature.output_storage[0] == frozenset({put.outputs[0].id, cache.id})
    assert g.signature.output_storage[1] == frozenset({g.outputs[1].id})
    assert [n.op for n in g.nodes] == ["HostFallback", "ReduceSum"]


def test_a_functional_index_put_keeps_its_copy_and_says_why():
    g = _graph(written_back=False)
    changed, report = _run(g)
    assert changed == 0 and g.nodes[0].meta["aten"] is aten.index_put.default
    assert "inplace_input" not in g.nodes[0].attrs
    reasons = [s["reason"] for s in report.skipped if s["pass"] == "input_inplace"]
    assert reasons == ["its result is not what the model writes back into an input (a functional "
                       "aten::index_put keeps its copy)"], reasons


def test_old_contents_read_elsewhere_block_it_naming_the_reader():
    g = _graph(read_elsewhere=True)
    changed, report = _run(g)
    assert changed == 0 and g.nodes[0].meta["aten"] is aten.index_put.default
    reasons = [s["reason"] for s in report.skipped if s["pass"] == "input_inplace"]
    assert len(reasons) == 1 and reasons[0].startswith("graph input cache is also read by "), reasons
    assert "(ReduceSum): writing it in place would change what that reads" in reasons[0]
