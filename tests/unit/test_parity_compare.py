"""`opencann.ops.parity.compare.first_difference` (the one comparison of the eager-parity
probes) and `specials` (the one list of special values)."""
import math

import pytest
import torch

from opencann.ops.parity.compare import first_difference
from opencann.ops.parity.specials import (ACTIVATION_SPECIALS, LAYOUT_SPECIALS, NORM_SPECIALS,
                                          SPECIAL_VALUES, special_values)

NAN, INF = float("nan"), float("inf")


def t(*v, dtype=torch.float32):
    return torch.tensor(v, dtype=dtype)


def test_equal_results_agree_bit_for_bit_and_with_nan_in_the_same_place():
    x = t(1.5, NAN, -INF, -0.0)
    assert first_difference(x, x.clone()) is None
    assert first_difference(x, x.clone(), rtol=1e-6, zeros=True) is None


@pytest.mark.parametrize("got, want, at", [
    ((1.0, NAN, 3.0), (1.0, 2.0, 3.0), 1),       # a NaN where eager has a number
    ((1.0, 2.0, NAN), (1.0, 2.0, INF), 2),       # NaN for +inf (pytorch/pytorch#185770)
    ((INF, 2.0), (-INF, 2.0), 0),                # the inf's sign
    ((1.0, 3e38), (1.0, INF), 1),                # an overflow eager has
])
def test_special_values_differ(got, want, at):
    assert first_difference(t(*got), t(*want)) == at


def test_finite_values_only_with_a_tolerance():
    got, want = t(1.0, 2.001, 3.0), t(1.0, 2.0, 3.0)
    assert first_difference(got, want) is None
    assert first_difference(got, want, rtol=1e-4) == 1
    assert first_difference(got, want, rtol=1e-2) is None


def test_zero_signs_only_when_asked():
    got, want = t(1.0, 0.0), t(1.0, -0.0)
    assert first_difference(got, want, rtol=1e-4) is None
    assert first_difference(got, want, rtol=1e-4, zeros=True) == 1


def test_a_special_difference_is_named_before_an_earlier_finite_one():
    got, want = t(1.5, 2.0, NAN), t(1.0, 2.0, INF)
    assert first_difference(got, want, rtol=1e-4) == 2
    assert first_difference(got[:2], want[:2], rtol=1e-4) == 0


def test_where_masks_rows_out_and_the_index_is_row_major():
    got = torch.zeros(3, 4)
    want = torch.zeros(3, 4)
    got[0, 1], got[2, 3] = NAN, NAN
    assert first_difference(got, want) == 1
    assert first_difference(got, want, where=torch.tensor([False, True, True]).reshape(-1, 1)) == 11
    assert first_difference(got.t(), want.t()) == 3          # the view's logical order: [1, 0]


def test_other_dtypes_and_integers():
    assert first_difference(t(1.0), t(1.0, dtype=torch.float64)) == 0
    assert first_difference(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4])) == 2
    assert first_difference(torch.tensor([True, False]), torch.tensor([True, False])) is None
    bf = t(1.0, INF, dtype=torch.bfloat16)
    assert first_difference(t(1.0, NAN, dtype=torch.bfloat16), bf) == 1


def test_one_list_of_special_values_in_one_order():
    def same(a, b):
        return len(a) == len(b) and all(x == y and math.copysign(1, x) == math.copysign(1, y)
                                        or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))
    # each probe's values are a subsequence of the one list, in its order
    for sub in (ACTIVATION_SPECIALS, NORM_SPECIALS, LAYOUT_SPECIALS):
        it = iter(SPECIAL_VALUES)
        assert all(any(same((v,), (w,)) for w in it) for v in sub)
    assert same(ACTIVATION_SPECIALS, (NAN, INF, -INF, 3e38, -3e38, 1e13, -1e13))
    assert same(NORM_SPECIALS, (NAN, INF, -INF, 3e38, -3e38, 1e13, -1e13, 1e20, -1e20))
    assert same(LAYOUT_SPECIALS, (NAN, INF, -INF, 1.7e38, -1.7e38, 3e38, -3e38, 1e13, -1e13,
                                  -0.0, 0.0))
    with pytest.raises(KeyError, match="unknown special-value group 'huge'"):
        special_values("nan", "huge")
