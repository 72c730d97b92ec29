"""`ShapeChurn`: a symbolic torch.compile graph turns eager only after ``limit`` calls in a
row that each built a plan; a call served by a cached plan starts the count again."""
from opencann.dynamo import eager_fallbacks
from opencann.dynamo.recompiles import Compile
from opencann.dynamo.shape_churn import ShapeChurn


def test_a_repeated_shape_resets_the_count():
    c = ShapeChurn("g_reset", limit=3)
    for built in (True, True, False, True, True, False, True):
        c.after(built)
        assert not c.eager
    assert not any(r["graph"] == "g_reset" for r in eager_fallbacks())


def test_limit_new_shapes_in_a_row_turn_it_eager_once():
    n0 = len(eager_fallbacks())
    c = ShapeChurn("g_churn", limit=3, compile=Compile("7/2", 1))
    c.after(True)
    c.after(True)
    assert not c.eager
    c.after(True)
    assert c.eager and "last 3 calls" in c.reason
    c.after(False)   # stays eager: a cached shape later does not undo the switch
    c.after(True)
    assert c.eager
    rows = eager_fallbacks()[n0:]
    assert rows == [{"graph": "g_churn", "compile_id": "7/2", "reason": c.reason}]
    assert c.compile.eager == [c.reason]    # counted on its compile too
