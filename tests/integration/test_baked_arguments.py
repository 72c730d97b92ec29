"""Float arguments baked into the graph at compile time: a call with another value is one
clear error, and 0.0 and -0.0 count as different values (a NaN equals a NaN)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import opencann


def _x(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) + 0.5
    x.view(-1)[1] = float("nan")
    return x


# -- baked float arguments: 0.0 and -0.0 compared equal, so a call with -0.0 ran the ----
# graph baked with 0.0 (1 / (x * 0 + s) gave +inf where eager gives -inf).

class _Scaled(nn.Module):
    def forward(self, x, s, pair=(1.0, 2.0)):
        return 1 / (x * 0 + s) + torch.copysign(x, torch.tensor(pair[1]))


@pytest.mark.parametrize("compiled_with, called_with", [
    ((0.0,), (-0.0,)), ((-0.0,), (0.0,)), ((1.0, (1.0, 0.0)), (1.0, (1.0, -0.0)))],
    ids=["zero_then_negative_zero", "negative_zero_then_zero", "zero_inside_a_tuple"])
def test_baked_float_arguments_tell_the_sign_of_zero(compiled_with, called_with, tmp_path):
    m = _Scaled()
    x = _x(5)
    cm = opencann.compile(m, (x, *compiled_with))
    opencann.save(cm, tmp_path / "m.ocm")
    for c in (cm, opencann.load(tmp_path / "m.ocm")):
        with pytest.raises(ValueError, match=r"was .*0\.0 when the model was compiled and is "
                                             r".*0\.0 now"):
            c(x, *called_with)
        torch.testing.assert_close(c(x, *compiled_with), m(x, *compiled_with), equal_nan=True)


def test_baked_nan_argument_still_matches_nan():
    m = _Scaled()
    x = _x(5)
    cm = opencann.compile(m, (x, float("nan")))
    torch.testing.assert_close(cm(x, float("nan")), m(x, float("nan")), equal_nan=True)
