"""The IR's graph API keeps its invariants: ``Value.users`` is the exact, ordered set of
live nodes reading a value (``x * x`` is one user), insert and erase are O(1) with an
``erased`` flag, and `Graph.replace_all_uses_with` / the `Node` input methods keep the
users of old and new values right (checked by `opencann.ir.verify`)."""
import pytest
import torch

from opencann.ir import DataType, Graph, GraphError, TensorDesc, TensorRef, verify

F32 = TensorDesc((2, 3), DataType.FLOAT)


def _graph():
    g = Graph("t")
    x = g.add_input(F32, "x")
    sq = g.create_node("Mul", [x, x], {"self": TensorRef(0), "other": TensorRef(1)}, [F32], "sq")
    r = g.create_node("Relu", [sq.output], {"self": TensorRef(0)}, [F32], "r")
    g.outputs = [r.output]
    return g, x, sq, r


def test_x_times_x_has_one_user_and_sole_user_finds_it():
    g, x, sq, r = _graph()
    assert list(x.users) == [sq]
    assert g.sole_user(x) is sq
    assert g.sole_user(sq.output) is r
    assert g.sole_user(r.output) is None      # a graph output: the caller reads it too
    verify(g)


def test_users_are_read_only():
    g, x, sq, _ = _graph()
    with pytest.raises(AttributeError):
        x.users.append(sq)
    with pytest.raises(TypeError):
        sq.inputs[0] = x


def test_insert_before_and_erase_keep_order_and_users():
    g, x, sq, r = _graph()
    neg = g.create_node("Neg", [x], {"self": TensorRef(0)}, [F32], "neg", before=sq)
    assert [n.name for n in g.nodes] == ["neg", "sq", "r"]
    assert list(x.users) == [sq, neg] and len(g.nodes) == 3
    assert neg in g.nodes and neg.next is sq and r.next is None
    g.erase_node(neg)
    assert neg.erased and neg not in g.nodes and list(x.users) == [sq]
    assert [n.name for n in g.nodes] == ["sq", "r"] and len(g.nodes) == 2
    with pytest.raises(ValueError, match="still used"):
        g.erase_node(sq)
    with pytest.raises(ValueError, match="not in graph"):
        g.erase_node(neg)
    verify(g)


def test_erasing_while_iterating_visits_every_live_node_once():
    g, x, sq, r = _graph()
    a = g.create_node("Neg", [x], {"self": TensorRef(0)}, [F32], "a")
    b = g.create_node("Neg", [a.output], {"self": TensorRef(0)}, [F32], "b")
    seen = []
    for n in g.nodes:
        seen.append(n.name)
        if n is sq:           # erase a later node while standing on an earlier one
            g.erase_node(b)
    assert seen == ["sq", "r", "a"]
    assert list(reversed(g.nodes)) == [a, r, sq]


def test_replace_all_uses_with_moves_users_and_outputs():
    g, x, sq, r = _graph()
    y = g.add_input(F32, "y")
    assert g.replace_all_uses_with(x, y) == 1
    assert not x.users and list(y.users) == [sq] and sq.inputs == (y, y)
    assert g.replace_all_uses_with(r.output, sq.output) == 1 and g.outputs == [sq.output]
    assert list(sq.output.users) == [r]
    verify(g)


def test_set_input_of_one_position_keeps_the_other_use():
    g, x, sq, r = _graph()
    y = g.add_input(F32, "y")
    sq.set_input(1, y)
    assert list(x.users) == [sq] and list(y.users) == [sq]
    sq.set_input(0, y)
    assert not x.users and sq.inputs == (y, y)
    i = r.add_input(x)
    assert i == 1 and list(x.users) == [r]
    verify(g)


def test_verify_finds_a_stale_user():
    g, x, sq, r = _graph()
    x._users[r] = None           # what editing users by hand used to allow
    with pytest.raises(GraphError, match="is not its input"):
        verify(g)


def test_topo_sort_relinks_in_dependency_order():
    g = Graph("t")
    x = g.add_input(F32, "x")
    late = g.create_node("Neg", [x], {"self": TensorRef(0)}, [F32], "late")
    early = g.create_node("Relu", [x], {"self": TensorRef(0)}, [F32], "early", before=late)
    late.set_input(0, early.output)        # now late reads early, which comes first: fine
    user = g.create_node("Abs", [x], {"self": TensorRef(0)}, [F32], "abs", before=early)
    early.set_input(0, user.output)
    g.outputs = [late.output]
    g.topo_sort()
    assert [n.name for n in g.nodes] == ["abs", "early", "late"]
    verify(g)


def test_a_loaded_model_file_keeps_the_invariants(tmp_path):
    import opencann
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    cm = opencann.compile(m, x)
    opencann.save(cm, str(tmp_path / "m.ocm"))
    lm = opencann.load(str(tmp_path / "m.ocm"))
    verify(lm.graph)
    assert torch.equal(lm(x), cm(x)) and torch.allclose(cm(x), m(x), atol=1e-6)
