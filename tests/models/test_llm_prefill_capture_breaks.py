"""Inputs that once broke the shared prefill capture (`SymbolicCapture` in
`StepGraphs._compile`): each must give transformers' greedy tokens or one clear error
line, and leave the generator usable."""
import pytest
import torch
import transformers as T

import opencann
import opencann.llm as L
from opencann.engine.per_shape import SymbolicCapture


def _llama():
    torch.manual_seed(7)
    return T.AutoModelForCausalLM.from_config(T.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, eos_token_id=None)).eval()


def _want(m, ids, n):
    return m.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)


def test_max_seq_len_2_has_one_prompt_length_and_no_dynamic_capture():
    """max_seq_len=2: the only prefill length > 1 is 2, a dynamic dim of range [2, 2]
    (torch.export's Dim asserts min < max: an AssertionError at every call, each
    counted as a capture); the bucket is captured statically."""
    m = _llama()
    gen = L.compile(m, max_seq_len=2)
    for n in (1, 2, 2, 1):
        ids = torch.randint(3, 97, (1, n), generator=torch.Generator().manual_seed(n))
        assert torch.equal(gen.generate(ids, max_new_tokens=1), _want(m, ids, 1)), n
    assert gen.stats.graphs == ["decode b1 t1", "prefill b1 t2"]
    assert gen.stats.captures == 2 and gen.stats.recompiles == 0


def test_any_failure_of_the_shared_capture_falls_back_to_a_capture_per_bucket(monkeypatch):
    """Not only CaptureError/ValueError: whatever the dynamic capture raises (an
    assertion inside torch.export, a conversion error) leaves the buckets to static
    captures, tried once per batch size."""
    def fail(self, *a, **k):
        raise AssertionError("torch.export internals (test)")
    monkeypatch.setattr(SymbolicCapture, "__init__", fail)
    m = _llama()
    gen = L.compile(m, max_seq_len=16, options={"prefill_buckets": [4, 8]})
    for n in (3, 7, 3):
        ids = torch.randint(3, 97, (1, n), generator=torch.Generator().manual_seed(n))
        assert torch.equal(gen.generate(ids, max_new_tokens=2), _want(m, ids, 2)), n
    # decode, the first bucket, the one failed shared capture, the second bucket
    assert gen.stats.graphs_built == 3 and gen.stats.captures == 4


def test_a_dynamic_dim_of_one_size_is_a_clear_error():
    lin = torch.nn.Linear(4, 4).eval()
    with pytest.raises(ValueError, match="one size 3 .*min < max"):
        opencann.compile(lin, (torch.randn(3, 4),), dynamic_shapes={"input": {0: "batch"}},
                         dim_ranges={"batch": (3, 3)})


class _Sum(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, y):
        return torch.softmax(self.lin(x), -1).sum(1) + y


def test_a_capture_refuses_inputs_whose_static_sizes_or_dtypes_differ():
    """`SymbolicCapture.compile` binds the dynamic dims only: a static dim, a dtype or an
    input count other than captured compiled the captured sizes silently (or raised an
    IndexError); now one ValueError line, and the capture stays usable."""
    m = _Sum().eval()
    x, y = torch.randn(2, 5, 8), torch.randn(2, 8)
    cap = SymbolicCapture(m, (x, y), {"x": {1: "t"}}, {"t": (2, 16)})
    for bad, what in (((torch.randn(3, 5, 8), y), r"'x' is float32\[3, 5, 8\] .*\[2, 't', 8\]"),
                      ((x, torch.randn(2, 7)), r"'y' is float32\[2, 7\]"),
                      ((x, y.double()), r"'y' is float64"),
                      ((x,), "takes 2 tensor inputs")):
        with pytest.raises(ValueError, match=what):
            cap.compile(bad)
    x9 = torch.randn(2, 9, 8)
    torch.testing.assert_close(cap.compile((x9, y))(x9, y), m(x9, y), rtol=1e-5, atol=1e-5)
