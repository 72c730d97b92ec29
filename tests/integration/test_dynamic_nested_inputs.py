"""``opencann.compile(..., dynamic_shapes=...)`` for inputs that are dicts, lists or tuples
of tensors: the entry follows the input's structure, in torch.export's own Dim form or
with dim names (names inside nested entries become the shared Dims too); values match
eager at several shapes (random inputs, a NaN), after save/load too, with gears; a spec
that does not match the input's structure is one clear error line. (A dict input's entry
was refused as "key its dims by index", and names inside a list input's entry reached
torch.export as raw strings.)"""
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
