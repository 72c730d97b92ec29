"""What users do with a model after compiling it, written as a new user would: saving a
transformers model after opencann.llm laid its weights out (weights held once), and calling
a compiled in-place writer with empty or aliased inputs against a dynamic range. Values are
compared with eager PyTorch / transformers."""
import pytest
import torch
import transformers as T

import opencann.llm as L


def _llama(seed=0):
    torch.manual_seed(seed)
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, eos_token_id=None)).eval()


def test_save_pretrained_after_compile_with_the_row_major_layout(monkeypatch, tmp_path):
    """Where the decode kernel reads a row-major [k, Σn] concatenation, the module's weights
    are left as they are (a transposed view would make save_pretrained / safetensors fail):
    they stay contiguous and the model saves and reloads with the same tokens."""
    monkeypatch.setattr("opencann.ops.kernels.cpu.concat_row_major",
                        lambda k, n, dtype=torch.float32, rows=None: True)
    m = _llama()
    ids = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(1))
    want = m.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    gen = L.compile(m, max_seq_len=16, max_batch=1, options={"prefill_buckets": [8]})
    assert torch.equal(gen.generate(ids, max_new_tokens=4, pad_token_id=0), want)
    assert all(p.is_contiguous() for p in m.parameters())
    m.save_pretrained(tmp_path / "saved")
    back = T.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert torch.equal(back.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0), want)


# -- inputs that alias a compiled model's in-place write --------------------------------

class _WritesA(torch.nn.Module):
    def forward(self, a, b):
        a.add_(1)
        return b * 2


def _rows(n, seed=0):
    x = torch.randn(n, 6, generator=torch.Generator().manual_seed(seed)) + 0.5
    if n:
        x.view(-1)[1] = float("nan")
    return x


def test_an_empty_dim_outside_the_range_names_a_range_that_keeps_the_upper_bound():
    """n = 0 outside the default [1, inf) range: the fix named is (0, None), not (0, 0)
    (which would refuse every size the model served); following it runs empty inputs,
    and empty views of one tensor (no element shared) are not refused as aliases."""
    import opencann
    m, dyn = _WritesA(), {"a": {0: "n"}, "b": {0: "n"}}
    cm = opencann.compile(m, (_rows(4), _rows(4, 1)), dynamic_shapes=dyn)
    with pytest.raises(ValueError, match=r"dim_ranges=\{'n': \(0, None\)\}\) if the model allows it$") as e:
        cm(_rows(0), _rows(0, 1))
    assert "\n" not in str(e.value)
    cm0 = opencann.compile(m, (_rows(4), _rows(4, 1)), dynamic_shapes=dyn, dim_ranges={"n": (0, None)})
    base = _rows(4)
    for a, b in ((base[:0], base[:0]), (base[2:2], base[1:1])):
        assert cm0(a, b).shape == (0, 6)
    for n in (3, 9):                       # the sizes it served before still run, eager's values and writes
        ra, rb, ga, gb = _rows(n), _rows(n, 1), _rows(n), _rows(n, 1)
        torch.testing.assert_close(cm0(ga, gb), m(ra, rb), equal_nan=True)
        torch.testing.assert_close(ga, ra, equal_nan=True)
    same = _rows(3)
    with pytest.raises(ValueError, match=r"^input 'a' \(argument #0\) and input 'b' \(argument #1\) are "
                                         r"the same tensor, and the model writes into input 'a'"):
        cm0(same, same)
