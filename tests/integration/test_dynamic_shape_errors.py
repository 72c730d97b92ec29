"""Dynamic dims and gears: what cannot be compiled is one line naming the problem and a
fix that works; what can (one gear, repeated gears, a range torch.export narrows) is
compiled and matches eager."""
import pytest
import torch

import opencann
from opencann.frontend.torch import CaptureError
from opencann.frontend.torch.dynamic import constraint_violation


class Lin(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.l(x).relu()


class Two(torch.nn.Module):
    """``b`` has no batch dim: it broadcasts over the features."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l = torch.nn.Linear(4, 4)

    def forward(self, x, b):
        return self.l(x) + b


class Half(torch.nn.Module):
    def forward(self, x):
        return x[:, : x.shape[1] // 2] * 2


class PosTable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.p = torch.nn.Parameter(torch.randn(16, 4))

    def forward(self, x):
        return x + self.p[: x.shape[1]]


def _x(*shape, seed=0):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    t.view(-1)[1] = float("nan")
    return t


def _one_line(e):
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


@pytest.mark.parametrize("gears", [[8], [8, 8]])
def test_one_gear_compiles_and_serves_only_it(gears):
    m = Lin().eval()
    cm = opencann.compile(m, (_x(8, 4),), options={"dynamic_batch_size": gears})
    for _ in range(2):
        x = _x(8, 4, seed=1)
        torch.testing.assert_close(cm(x), m(x), equal_nan=True, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"not one of the gears compiled with dynamic_batch_size=\[8\]"):
        cm(_x(9, 4))


def test_dynamic_dims_gear_with_a_dim_constant_across_gears():
    m = Lin().eval()
    cm = opencann.compile(m, (_x(2, 3, 4),), dynamic_shapes={"x": {0: "b", 1: "s"}},
                          options={"dynamic_dims": [[2, 3], [2, 5]]})
    for s in (3, 5):
        x = _x(2, s, 4, seed=s)
        torch.testing.assert_close(cm(x), m(x), equal_nan=True, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("how", ["dynamic_shapes", "gears"])
def test_size_one_example_of_a_dynamic_dim_is_one_line(how):
    kw = ({"dynamic_shapes": {"x": {0: "batch"}}} if how == "dynamic_shapes"
          else {"options": {"dynamic_batch_size": [1, 2, 4]}})
    with pytest.raises(ValueError) as e:
        opencann.compile(Lin().eval(), (_x(1, 4),), **kw)
    msg = _one_line(e)
    assert "is 1 in the example" in msg and "at least 2" in msg and "specialises" in msg


def test_size_two_example_still_serves_size_one():
    m = Lin().eval()
    cm = opencann.compile(m, (_x(2, 4),), dynamic_shapes={"x": {0: "batch"}})
    x = _x(1, 4, seed=3)
    torch.testing.assert_close(cm(x), m(x), equal_nan=True, rtol=1e-6, atol=1e-6)


def test_gear_input_without_the_batch_dim_is_named():
    with pytest.raises(ValueError) as e:
        opencann.compile(Two().eval(), (_x(4, 4), _x(4)), options={"dynamic_batch_size": [2, 4]})
    msg = _one_line(e)
    assert "input 'b' float32[4] does not carry them" in msg
    assert "dynamic_shapes={'x': {0: 'batch'}}" in msg
    # the fix the message names works
    m = Two().eval()
    cm = opencann.compile(m, (_x(4, 4), _x(4)), dynamic_shapes={"x": {0: "batch"}},
                          options={"dynamic_batch_size": [2, 4]})
    x, b = _x(2, 4, seed=5), _x(4, seed=6)
    torch.testing.assert_close(cm(x, b), m(x, b), equal_nan=True, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["n", "batch"])
def test_batch_gears_take_the_dim_dynamic_shapes_names_whatever_its_name(name):
    """With dynamic_shapes, dynamic_batch_size's dim is the one it names (any name); the
    inputs it leaves out or sets to None are static."""
    m = Two().eval()
    cm = opencann.compile(m, (_x(4, 4), _x(4)), dynamic_shapes={"x": {0: name}, "b": None},
                          options={"dynamic_batch_size": [2, 4]})
    b = _x(4, seed=6)
    for n in (2, 3, 4):   # 3: padded to the batch-4 gear
        x = _x(n, 4, seed=n)
        torch.testing.assert_close(cm(x, b), m(x, b), equal_nan=True, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError) as e:
        cm(_x(5, 4), b)
    assert name in _one_line(e) and "dynamic_batch_size=[2, 4]" in str(e.value)


@pytest.mark.parametrize("spec, named", [({"b": None}, "[]"),
                                         ({"x": {0: "n", 1: "f"}, "b": None}, "['n', 'f']")])
def test_batch_gears_with_dynamic_shapes_naming_no_dim_or_two_say_the_rule(spec, named):
    with pytest.raises(ValueError) as e:
        opencann.compile(Two().eval(), (_x(4, 4), _x(4)), dynamic_shapes=spec,
                         options={"dynamic_batch_size": [2, 4]})
    msg = _one_line(e)
    assert "dim_ranges" not in msg
    assert f"must name exactly 1 dim by a string (any name), but it names {named}" in msg
    assert "dynamic_shapes={'x': {0: 'batch'}}" in msg


def test_image_gears_take_the_two_dims_dynamic_shapes_names():
    torch.manual_seed(0)
    m = torch.nn.Conv2d(2, 3, 3, padding=1).eval()
    cm = opencann.compile(m, (_x(1, 2, 8, 8),), dynamic_shapes={"input": {2: "h", 3: "w"}},
                          options={"dynamic_image_size": [[8, 8], [6, 10]]})
    for hw in ((8, 8), (6, 10)):
        x = _x(1, 2, *hw, seed=hw[1])
        with torch.no_grad():
            torch.testing.assert_close(cm(x), m(x), equal_nan=True, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError) as e:
        opencann.compile(m, (_x(1, 2, 8, 8),), dynamic_shapes={"input": {2: "h"}},
                         options={"dynamic_image_size": [[8, 8], [6, 10]]})
    assert "must name exactly 2 dims" in _one_line(e)


def test_dim_the_model_fixes_is_one_line():
    with pytest.raises(CaptureError) as e:
        opencann.compile(Two().eval(), (_x(4, 4), _x(4)),
                         dynamic_shapes={"x": {0: "batch"}, "b": {0: "batch"}})
    msg = _one_line(e)
    assert "fixes the dynamic dim batch to 4" in msg and "leave that dim out of dynamic_shapes" in msg


def test_guards_true_in_the_range_are_not_blamed_on_the_range():
    with pytest.raises(CaptureError) as e:
        opencann.compile(Half(), (_x(2, 8),), dynamic_shapes={"x": {1: "s"}})
    msg = _one_line(e)
    assert "cannot prove guards that hold for every size of s" in msg
    assert "no range fixes it" in msg and "torch.compile" in msg
    assert "narrow the dims' ranges" not in msg


def test_a_bound_the_model_needs_is_applied_or_named():
    m = PosTable()
    cm = opencann.compile(m, (_x(2, 8, 4),), dynamic_shapes={"x": {1: "s"}})   # narrowed to [.., 16]
    for s in (2, 16):
        x = _x(2, s, 4, seed=s)
        torch.testing.assert_close(cm(x), m(x), equal_nan=True)
    with pytest.raises(ValueError, match="16"):
        cm(_x(2, 17, 4))
    with pytest.raises(CaptureError) as e:                     # a declared range too wide
        opencann.compile(m, (_x(2, 8, 4),), dynamic_shapes={"x": {1: ("s", 2, 64)}})
    assert "fix: dim_ranges={'s': (2, 16)}" in _one_line(e)


def test_constraint_messages_drop_tautologies_and_find_the_range():
    msg = ("Constraints violated (s)!\n"
           "  - Not all values of s = L['x'].size()[1] in the specified range satisfy the generated "
           "guard (L['x'].size()[1] // 2) <= L['x'].size()[1].\n"
           "  - Not all values of s = L['x'].size()[1] in the specified range satisfy the generated "
           "guard (L['x'].size()[1] // 2) != 1.\n")
    line = constraint_violation(msg, {"s": (1, None)})
    assert "(s // 2) != 1 (false at s = 2, 3)" in line and "(s // 2) <= s" not in line
    assert line.endswith("fix: dim_ranges={'s': (4, None)}")
    parity = msg.replace("(L['x'].size()[1] // 2) != 1", "L['x'].size()[1] % 2 == 0")
    assert "no range of s satisfies it" in constraint_violation(parity, {"s": (1, None)})


def test_profile_serves_what_a_call_serves():
    """A batch between gears that a call serves through padding can be profiled too."""
    m = Lin().eval()
    cm = opencann.compile(m, (_x(2, 4),), options={"dynamic_batch_size": [2, 4]})
    x = _x(3, 4, seed=9)
    torch.testing.assert_close(cm(x), m(x), equal_nan=True, rtol=1e-6, atol=1e-6)
    events = cm.profile(x)
    assert events and all("name" in e for e in events)
    with pytest.raises(ValueError, match="not one of the gears"):
        cm.profile(_x(5, 4))


def test_dim_ranges_naming_an_undeclared_dim_is_one_line():
    with pytest.raises(ValueError) as e:
        opencann.compile(Lin().eval(), (_x(3, 4),), dynamic_shapes={"x": {0: "b"}},
                         dim_ranges={"q": (2, 8)})
    assert "dim_ranges names ['q'], which dynamic_shapes does not declare" in _one_line(e)


def test_dynamic_axis_outside_the_rank_is_one_line_and_negative_axes_count_from_the_end():
    with pytest.raises(ValueError) as e:
        opencann.compile(Lin().eval(), (_x(3, 4),), dynamic_shapes={"x": {5: "b"}})
    assert "names dim 5, but that input has 2 dims" in _one_line(e)
    m = Lin().eval()
    cm = opencann.compile(m, (_x(3, 2, 4),), dynamic_shapes={"x": {-2: "s"}})
    x = _x(3, 5, 4, seed=2)
    torch.testing.assert_close(cm(x), m(x), equal_nan=True, rtol=1e-6, atol=1e-6)


def test_example_outside_its_declared_range_is_one_line():
    with pytest.raises(ValueError) as e:
        opencann.compile(Lin().eval(), (_x(3, 4),), dynamic_shapes={"x": {0: "b"}},
                         dim_ranges={"b": (4, 8)})
    assert "is 3 in the example, outside its range [4, 8]" in _one_line(e)


@pytest.mark.parametrize("gears", ["abc", "1;2"])
def test_gear_string_that_is_not_atc_form_names_the_option(gears):
    with pytest.raises(ValueError) as e:
        opencann.compile(Lin().eval(), (_x(2, 4),), options={"dynamic_batch_size": gears})
    assert "option 'dynamic_batch_size' takes gears" in _one_line(e)


def test_gear_larger_than_memory_is_refused_at_compile():
    with pytest.raises(ValueError) as e:
        opencann.compile(Lin().eval(), (_x(2, 4),), options={"dynamic_batch_size": [2, 10 ** 12]})
    assert "gear 1000000000000 needs" in _one_line(e) and "drop that gear" in str(e.value)


def test_dynamic_options_on_an_onnx_model_are_refused(tmp_path):
    pytest.importorskip("onnx")
    m, x = Lin().eval(), _x(2, 4)
    path = str(tmp_path / "lin.onnx")
    torch.onnx.export(m, (x,), path, input_names=["x"], dynamo=False)
    for kw in ({"dynamic_shapes": {"x": {0: "b"}}}, {"options": {"dynamic_batch_size": [1, 2]}}):
        with pytest.raises(ValueError) as e:
            opencann.compile(path, **kw)
        assert "apply to torch modules" in _one_line(e)


class _Halves(torch.nn.Module):
    """Needs an even length: torch.export proves it only for ``seq = 2 * _seq``."""

    def forward(self, x, y):
        h = x.shape[1] // 2
        return x[:, :h] * 2 + x[:, -h:] + y[:, :h]


@pytest.mark.parametrize("offset", [0, 1])
def test_a_derived_dim_as_the_constraint_message_suggests_compiles_and_serves(offset, tmp_path):
    """torch.export's derived dims (``seq = 2 * _seq (+ 1)``, what opencann's constraint
    message suggests for such a model) compile: the root is solved from the size at each
    call, a size the expression cannot take and a root outside its range are one line
    each, and a model file keeps serving them."""
    _seq = torch.export.Dim("_seq", min=2, max=16)
    m = _Halves().eval()
    y_len = 40
    cm = opencann.compile(m, (torch.randn(2, 6 + offset), torch.randn(2, y_len)),
                          dynamic_shapes={"x": {1: 2 * _seq + offset}, "y": None})
    opencann.save(cm, str(tmp_path / "d.ocm"))
    loaded = opencann.load(str(tmp_path / "d.ocm"))
    for n in (4, 10, 32):
        x, y = torch.randn(2, n + offset), torch.randn(2, y_len)
        x[1, 0] = float("nan")
        with torch.no_grad():
            ref = m(x, y)
        for model in (cm, loaded):
            out = model(x, y)
            assert torch.equal(out.isnan(), ref.isnan())
            assert torch.equal(out.nan_to_num(), ref.nan_to_num())
    with pytest.raises(ValueError) as e:
        cm(torch.randn(2, 7 + offset), torch.randn(2, y_len))
    assert "\n" not in str(e.value) and "for any integer _seq" in str(e.value)
    with pytest.raises(ValueError) as e:
        cm(torch.randn(2, 34 + offset), torch.randn(2, y_len))
    assert "\n" not in str(e.value) and "outside the compiled range [2, 16] of _seq" in str(e.value)


def test_a_derived_dim_on_two_inputs_names_it_in_the_users_terms():
    """Inconsistent sizes of one derived dim on two inputs, and a root out of range, are
    one line each in the user's names (``2*_s``, never an internal symbol), and the range
    fix names what applies to a torch.export Dim."""
    import re
    _s = torch.export.Dim("_s", min=2, max=16)

    class Add(torch.nn.Module):
        def forward(self, x, y):
            return x + y
    cm = opencann.compile(Add().eval(), (torch.randn(2, 6), torch.randn(2, 6)),
                          dynamic_shapes={"x": {1: 2 * _s}, "y": {1: 2 * _s}})
    x, y = torch.randn(2, 10), torch.randn(2, 10)
    assert torch.equal(cm(x, y), x + y)
    for args, want in (((torch.randn(2, 6), torch.randn(2, 8)), "2*_s"),
                       ((torch.randn(2, 34), torch.randn(2, 34)), "torch.export.Dim's min / max")):
        with pytest.raises(ValueError) as e:
            cm(*args)
        msg = str(e.value)
        assert "\n" not in msg and want in msg and not re.search(r"\bs\d+\b", msg), msg
