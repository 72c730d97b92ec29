"""``opencann.compile(..., dynamic_shapes=...)`` for inputs that are dicts, lists or tuples
of tensors: the entry follows the input's structure, in torch.export's own Dim form or
with dim names (names inside nested entries become the shared Dims too); values match
eager at several shapes (random inputs, a NaN), after save/load too, with gears; a spec
that does not match the input's structure is one clear error line. (A dict input's entry
was refused as "key its dims by index", and names inside a list input's entry reached
torch.export as raw strings.)

A nested input left out of the spec, or given None (at any depth), is static: the entry
is expanded into the input's structure (torch.export refused a bare None for a dict).
The gear options ``dynamic_batch_size`` / ``dynamic_image_size`` reach tensors inside
dict, list and tuple inputs. Every entry is checked against its input before
torch.export sees it (a string, a Dim or a list of the wrong structure for a tensor
gave torch.export's error with the fix "use torch.compile").
Namedtuple and pytree-dataclass inputs take an entry keyed by field or positional."""
import collections
import dataclasses
import os

import pytest
import torch

import opencann

B = torch.export.Dim("b", min=1, max=16)


class DictIn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 4)

    def forward(self, x, extra):
        return self.lin(x) * extra["a"] + extra["b"].sum(-1, keepdim=True)


class ListIn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 4)

    def forward(self, x, pair):
        return self.lin(x) * pair[0] + pair[1][0].sum(-1, keepdim=True)


def _dict_args(b, n, nan=False):
    x = torch.randn(b, 6)
    if nan:
        x[0, 2] = float("nan")
    return x, {"a": torch.randn(b, 1), "b": torch.randn(b, n)}


def _list_args(b, n, nan=False):
    x, extra = _dict_args(b, n, nan)
    return x, [extra["a"], (extra["b"],)]


N = torch.export.Dim("n", min=1, max=16)
CASES = {
    "dict-names": (DictIn, _dict_args, {"x": {0: "b"}, "extra": {"a": {0: "b"}, "b": {0: "b", 1: "n"}}}),
    "dict-dims": (DictIn, _dict_args, {"x": {0: B}, "extra": {"a": {0: B}, "b": {0: B, 1: N}}}),
    "list-names": (ListIn, _list_args, {"x": {0: "b"}, "pair": [{0: "b"}, ({0: "b", 1: "n"},)]}),
    "list-dims": (ListIn, _list_args, {"x": {0: B}, "pair": [{0: B}, ({0: B, 1: N},)]}),
    "positional": (ListIn, _list_args, ({0: "b"}, [{0: "b"}, ({0: "b", -1: "n"},)])),
}


def _same(out, ref):
    assert out.shape == ref.shape
    assert torch.equal(out.isnan(), ref.isnan())
    torch.testing.assert_close(out, ref, equal_nan=True, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_nested_inputs_are_dynamic_and_match_eager(case, tmp_path):
    make, args_of, spec = CASES[case]
    torch.manual_seed(0)
    m = make().eval()
    cm = opencann.compile(m, args_of(4, 3), dynamic_shapes=spec)
    dims = cm.report.dynamic["dims"]
    assert sorted(dims) == ["b", "n"]                    # the names, not placeholder names
    assert len(dims["b"]["sources"]) == 3 and len(dims["n"]["sources"]) == 1
    for b, n in [(3, 3), (5, 2), (2, 7), (4, 3)]:
        a = args_of(b, n, nan=True)
        _same(cm(*a), m(*a))
    path = os.path.join(tmp_path, "m.ocm")
    opencann.save(cm, path)
    loaded = opencann.load(path)
    for b, n in [(7, 2), (3, 5)]:
        a = args_of(b, n, nan=True)
        _same(loaded(*a), m(*a))


def test_nested_dim_names_serve_gears():
    torch.manual_seed(0)
    m = DictIn().eval()
    cm = opencann.compile(m, _dict_args(4, 3), dynamic_shapes=CASES["dict-names"][2],
                          options={"dynamic_dims": [[2, 3], [4, 5], [6, 2]]})
    assert cm.report.dynamic["gears"]["dims"] == ["b", "n"]
    for b, n in [(2, 3), (4, 5), (6, 2)]:
        a = _dict_args(b, n, nan=True)
        _same(cm(*a), m(*a))


@pytest.mark.parametrize("spec,message", [
    ({"extra": {0: "b"}}, r"dynamic_shapes\['extra'\] has key\(s\) \[0\], but that input is a "
                          r"dict with keys \['a', 'b'\]"),
    ({"extra": {"c": {0: "b"}}}, r"has key\(s\) \['c'\].*key its entry like the input"),
    ({"extra": [{0: "b"}, None]}, r"dynamic_shapes\['extra'\] is a list, but that input is a dict"),
    ({"extra": {"a": {"b": 0}}}, r"dynamic_shapes\['extra'\]\['a'\] has key 'b'; key its dims by index"),
    ({"extra": {"a": {2: "b"}}}, r"dynamic_shapes\['extra'\]\['a'\] names dim 2, but that input "
                                 r"has 2 dims"),
])
def test_a_spec_not_matching_a_dict_input_is_one_clear_error(spec, message):
    with pytest.raises(ValueError, match=message) as e:
        opencann.compile(DictIn().eval(), _dict_args(4, 3), dynamic_shapes=spec)
    assert "\n" not in str(e.value)


def test_a_spec_not_matching_a_list_input_is_one_clear_error():
    with pytest.raises(ValueError, match=r"dynamic_shapes\['pair'\] has 1 entries, but that input "
                                         r"is a list of 2: give a list with one entry per element"):
        opencann.compile(ListIn().eval(), _list_args(4, 3), dynamic_shapes={"pair": [{0: "b"}]})
    with pytest.raises(ValueError, match=r"dynamic_shapes\[1\]\[1\] is a dict, but that input is "
                                         r"a tuple of 1"):
        opencann.compile(ListIn().eval(), _list_args(4, 3),
                         dynamic_shapes=(None, [None, {0: "b"}]))


# -- nested inputs left static ----------------------------------------------------------

class Broadcast(torch.nn.Module):
    """x is batched; every tensor of ``extra`` (a dict holding a list holding a tuple) is
    broadcast against it, so extra must stay static."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 4)

    def forward(self, x, extra):
        return self.lin(x) * extra["s"] + extra["p"][0] - extra["p"][1][0]


def _broadcast_args(b, nan=False):
    x = torch.randn(b, 6)
    if nan:
        x[0, 2] = float("nan")
    return x, {"s": torch.randn(4), "p": [torch.randn(1, 4), (torch.randn(4),)]}


STATIC_SPECS = {
    "left-out": {"x": {0: "b"}},
    "none": {"x": {0: "b"}, "extra": None},
    "inner-none": {"x": {0: "b"}, "extra": {"p": None}},
    "inner-keys-left-out": {"x": {0: "b"}, "extra": {}},
    "deep-none": {"x": {0: "b"}, "extra": {"s": None, "p": [None, None]}},
    "deepest-none": {"x": {0: "b"}, "extra": {"p": [None, (None,)]}},
    "list-for-tuple": {"x": {0: "b"}, "extra": {"p": [None, [None]]}},
    "positional": ({0: "b"}, None),
    "dims": {"x": {0: B}},
}


@pytest.mark.parametrize("case", list(STATIC_SPECS))
def test_a_nested_input_left_static_matches_eager(case, tmp_path):
    torch.manual_seed(0)
    m = Broadcast().eval()
    cm = opencann.compile(m, _broadcast_args(4), dynamic_shapes=STATIC_SPECS[case])
    assert cm.report.dynamic["dims"]["b"]["sources"] == ["x.shape[0]"]
    for b in (3, 7, 2, 4):
        a = _broadcast_args(b, nan=True)
        _same(cm(*a), m(*a))
    if case == "none":
        path = os.path.join(tmp_path, "m.ocm")
        opencann.save(cm, path)
        loaded = opencann.load(path)
        for b in (5, 2):
            a = _broadcast_args(b, nan=True)
            _same(loaded(*a), m(*a))


# -- gear options reach the tensors inside dict, list and tuple inputs -------------------

class BatchedNest(torch.nn.Module):
    def forward(self, x, extra):
        return x + extra["a"] * 2 - extra["p"][1][0].relu(), extra["a"].exp()


def _nest_args(b, nan=False):
    x = torch.randn(b, 4)
    if nan:
        x[-1, 1] = float("nan")
    return x, {"a": torch.randn(b, 4), "p": [3, (torch.randn(b, 4),)]}


def _same_all(out, ref):
    assert len(out) == len(ref)
    for o, r in zip(out, ref):
        _same(o, r)


def test_dynamic_batch_size_makes_dim_0_of_nested_tensors_dynamic(tmp_path):
    m = BatchedNest()
    cm = opencann.compile(m, _nest_args(2), options={"dynamic_batch_size": [2, 4, 8]})
    assert cm.report.dynamic["dims"]["batch"]["sources"] == [
        "x.shape[0]", "extra_a.shape[0]", "extra_p_1_0.shape[0]"]
    assert cm.report.dynamic["padding"]["applies"]
    for b in (1, 2, 3, 4, 6, 8):                      # 1, 3, 6: padded to a gear
        a = _nest_args(b, nan=True)
        _same_all(cm(*a), m(*a))
    path = os.path.join(tmp_path, "g.ocm")
    opencann.save(cm, path)
    loaded = opencann.load(path)
    for b in (3, 8):
        a = _nest_args(b, nan=True)
        _same_all(loaded(*a), m(*a))
    with pytest.raises(ValueError, match="not one of the gears"):
        loaded(*_nest_args(9))


class ImageNest(torch.nn.Module):
    def forward(self, imgs):
        return imgs["pair"][0] * 2 + imgs["pair"][1].mean(), imgs["scale"] * 3


def _image_args(h, w):
    pair = [torch.randn(2, 3, h, w), torch.randn(2, 3, h, w)]
    pair[0][0, 0, 0, 0] = float("nan")
    return ({"pair": pair, "scale": torch.randn(3)},)


def test_dynamic_image_size_makes_dims_2_and_3_of_nested_4d_tensors_dynamic():
    m = ImageNest()
    cm = opencann.compile(m, _image_args(8, 8), options={"dynamic_image_size": [[8, 8], [10, 12]]})
    assert sorted(cm.report.dynamic["dims"]) == ["height", "width"]
    for h, w in [(8, 8), (10, 12)]:
        a = _image_args(h, w)
        _same_all(cm(*a), m(*a))
    with pytest.raises(ValueError, match="not one of the gears"):
        cm(*_image_args(12, 10))


def test_dynamic_dims_with_a_positional_spec_of_nested_inputs():
    torch.manual_seed(0)
    m = ListIn().eval()
    cm = opencann.compile(m, _list_args(4, 3), dynamic_shapes=CASES["positional"][2],
                          options={"dynamic_dims": [[2, 3], [4, 5], [6, 2]]})
    assert cm.report.dynamic["gears"]["dims"] == ["b", "n"]
    for b, n in [(2, 3), (4, 5), (6, 2)]:
        a = _list_args(b, n, nan=True)
        _same(cm(*a), m(*a))


class DictWeight(torch.nn.Module):
    def forward(self, x, d):
        return x @ d["w"] + d["b"]


def test_gear_option_errors_name_the_nested_tensor_that_lacks_the_batch():
    with pytest.raises(ValueError, match=r"input 'd'\['w'\] has 5 there and 'x' has 8: name the "
                                         r"inputs that carry it, e\.g\. dynamic_shapes="
                                         r"\{'x': \{0: 'batch'\}\}") as e:
        opencann.compile(DictWeight(), (torch.randn(8, 5), {"w": torch.randn(5, 5),
                                                            "b": torch.randn(8, 5)}),
                         options={"dynamic_batch_size": [1, 2]})
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"but input 'd'\['w'\] float32\[5, 5\] does not carry "
                                         r"them.*dynamic_shapes=\{'x': \{0: 'batch'\}, 'd': "
                                         r"\{'w': None, 'b': \{0: 'batch'\}\}\}") as e:
        opencann.compile(DictWeight(), (torch.randn(5, 5), {"w": torch.randn(5, 5),
                                                            "b": torch.randn(5, 5)}),
                         options={"dynamic_batch_size": [1, 2]})
    assert "\n" not in str(e.value)


# -- namedtuple and pytree-class inputs -------------------------------------------------

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class PairData:
    a: torch.Tensor
    b: torch.Tensor


torch.utils._pytree.register_dataclass(PairData)


class Fields(torch.nn.Module):
    def forward(self, x, p):
        return x * p.a + p.b


@pytest.mark.parametrize("kind", [Pair, PairData])
@pytest.mark.parametrize("entry", [{"a": {0: "b"}}, [{0: "b"}, None], ({0: "b"}, {})])
def test_namedtuple_and_dataclass_inputs_take_a_keyed_or_positional_entry(kind, entry):
    m = Fields()
    cm = opencann.compile(m, (torch.randn(3, 4), kind(torch.randn(3, 4), torch.randn(4))),
                          dynamic_shapes={"x": {0: "b"}, "p": entry})
    assert cm.report.dynamic["dims"]["b"]["sources"] == ["x.shape[0]", "p_a.shape[0]"]
    for b in (2, 5, 9):
        a = (torch.randn(b, 4), kind(torch.randn(b, 4), torch.randn(4)))
        a[1].a[0, 0] = float("nan")
        _same(cm(*a), m(*a))


# -- every entry checked against its input before torch.export sees it ------------------

def _broadcast_ex():
    return _broadcast_args(4)


@pytest.mark.parametrize("spec,message", [
    ({"x": {0: "b"}, "extra": {"s": "b"}},
     r"dynamic_shapes\['extra'\]\['s'\] is 'b', but that input is a tensor of shape \[4\]: give "
     r"its dynamic dims by index, e\.g\. \{0: 'b'\}"),
    ({"x": {0: "b"}, "extra": {"p": [[{0: "b"}], None]}},
     r"dynamic_shapes\['extra'\]\['p'\]\[0\] is a list of 1, but that input is a tensor of "
     r"shape \[1, 4\]: .*one entry per dim, e\.g\. \['b', None\]"),
    ({"x": {0: "b"}, "extra": {"p": [{0: "b"}, {0: "b"}]}},
     r"dynamic_shapes\['extra'\]\['p'\]\[1\] is a dict, but that input is a tuple of 1: give a "
     r"list with one entry per element"),
    ({"x": {0: "b"}, "extra": {"p": [None, (None, None)]}},
     r"dynamic_shapes\['extra'\]\['p'\]\[1\] has 2 entries, but that input is a tuple of 1"),
    ({"x": B}, r"dynamic_shapes\['x'\] is Dim\('b'.*but that input is a tensor of shape \[4, 6\]: "
               r"give its dynamic dims by index"),
    ({"x": {0: "b"}, "extra": B}, r"dynamic_shapes\['extra'\] is Dim\('b'.*but that input is a "
                                  r"dict with keys \['s', 'p'\]: key its entry like the input"),
    ({"x": {0: "b"}, "extra": {"p": [{0: 3}, None]}},
     r"dynamic_shapes\['extra'\]\['p'\]\[0\] dim 0: dynamic dim 3: name it with an identifier"),
    (({0: "b"}, {"p": "b"}), r"dynamic_shapes\[1\]\['p'\] is 'b', but that input is a list of 2: "
                             r"give a list with one entry per element"),
])
def test_an_entry_not_fitting_its_nested_input_is_one_clear_error(spec, message):
    with pytest.raises(ValueError, match=message) as e:
        opencann.compile(Broadcast().eval(), _broadcast_ex(), dynamic_shapes=spec)
    assert "\n" not in str(e.value)


class TakesInt(torch.nn.Module):
    def forward(self, x, extra):
        return x * extra["k"] + extra["t"]


def test_an_entry_for_a_number_inside_a_nested_input_is_one_clear_error():
    with pytest.raises(ValueError, match=r"dynamic_shapes\['extra'\]\['k'\] is a dict, but that "
                                         r"input is int 3, not a tensor: give None there") as e:
        opencann.compile(TakesInt(), (torch.randn(4, 2), {"k": 3, "t": torch.randn(4, 2)}),
                         dynamic_shapes={"x": {0: "b"}, "extra": {"k": {0: "b"}, "t": {0: "b"}}})
    assert "\n" not in str(e.value)
    m = TakesInt()   # the int left static (left out, or None), the tensor beside it dynamic
    cm = opencann.compile(m, (torch.randn(4, 2), {"k": 3, "t": torch.randn(4, 2)}),
                          dynamic_shapes={"x": {0: "b"}, "extra": {"k": None, "t": {0: "b"}}})
    for b in (2, 6):
        a = (torch.randn(b, 2), {"k": 3, "t": torch.randn(b, 2)})
        a[0][0, 0] = float("nan")
        _same(cm(*a), m(*a))


def test_torch_exports_own_spec_errors_point_at_the_spec_not_at_torch_compile():
    """A spec torch.export itself refuses (a form opencann passes on) gets the spec's fix."""
    from opencann.frontend.torch.capture import _explain
    e = RuntimeError("Detected mismatch between the structure of `inputs` and `dynamic_shapes`: "
                     "`inputs[1]` is a <class 'dict'>, but `dynamic_shapes[1]` is not\nmore")
    line = _explain(Broadcast(), _broadcast_ex(), {}, e)
    assert "\n" not in line and "torch.compile" not in line
    assert "fix: give each input an entry of its own structure" in line
