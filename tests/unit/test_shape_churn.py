"""`ShapeChurn`: a symbolic torch.compile graph turns eager only after ``limit`` calls in a
row each at a shape it never saw; a call at a shape seen before (whether or not its plan
is still cached) starts the count again."""
from opencann.dynamo import eager_fallbacks
from opencann.dynamo.recompiles import Compile
from opencann.dynamo.shape_churn import ShapeChurn


def test_a_repeated_shape_resets_the_count():
    c = ShapeChurn("g_reset", limit=3)
    for key in (1, 2, 1, 3, 4, None, 5, 6):     # None: a call served by a cached plan
        c.after(key)
        assert not c.eager
    assert not any(r["graph"] == "g_reset" for r in eager_fallbacks())


def test_limit_new_shapes_in_a_row_turn_it_eager_once():
    n0 = len(eager_fallbacks())
    c = ShapeChurn("g_churn", limit=3, compile=Compile("7/2", 1))
    c.after((1, 8))
    c.after((2, 8))
    assert not c.eager
    c.after((3, 8))
    assert c.eager and "last 3 calls" in c.reason
    c.after((1, 8))   # stays eager: a known shape later does not undo the switch
    c.after((4, 8))
    assert c.eager
    rows = eager_fallbacks()[n0:]
    assert rows == [{"graph": "g_churn", "compile_id": "7/2", "reason": c.reason}]
    assert c.compile.eager == [c.reason]    # counted on its compile too


def test_shapes_cycling_among_more_sizes_than_the_cache_are_not_churn():
    """An evicted shape built again is not new: a cycle of 3 sizes never turns eager,
    whatever the plan cache's size (counting plan builds turned it eager at once)."""
    c = ShapeChurn("g_cycle", limit=4)
    for key in [(3,), (5,), (7,)] * 10:
        c.after(key)
    assert not c.eager
