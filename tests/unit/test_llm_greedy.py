"""`opencann.llm.sampling.greedy` (NumPy's argmax for float32 CPU rows) equals
``torch.argmax(dim=-1)`` index for index and dtype: ties (first index), NaN (the first
NaN), rows of -inf, +inf twice, and non-contiguous or other-dtype input (torch's path)."""
import torch

from opencann.llm.sampling import greedy


def test_greedy_equals_torch_argmax_with_ties_nan_and_inf():
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        x = torch.randn(5, 97, generator=g)
        x[0, 3] = x[0, 50] = x[0].max() + 1               # a tie: the first index
        if trial % 2:
            x[1, 7] = x[1, 20] = float("nan")             # the first NaN wins
        x[2] = float("-inf")
        x[3, 5] = x[3, 40] = float("inf")
        x[4] = float("nan")
        got, want = greedy(x), torch.argmax(x, dim=-1)
        assert got.dtype == torch.int64 and torch.equal(got, want)
    t = torch.randn(97, 4, generator=g).t()                # not contiguous
    assert torch.equal(greedy(t), torch.argmax(t, dim=-1))
    h = torch.randn(3, 97, generator=g).double()
    assert torch.equal(greedy(h), torch.argmax(h, dim=-1))


def test_greedy_result_is_independent_of_the_scores():
    x = torch.randn(2, 33)
    tok = greedy(x)
    before = tok.clone()
    x.fill_(0.0)
    assert torch.equal(tok, before)
