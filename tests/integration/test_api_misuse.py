"""The compiled model's contract with its caller (found by a fresh-user review): inputs
that differ from the compiled ones in ways the graph cannot honour are errors that name
the problem and the fix; layouts and constant outputs behave as in eager."""
import numpy as np
import pytest
import torch
import torch.nn as nn

import opencann
from opencann import zoo
from opencann.ops import flash_attention


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, scale=1.0, w=None):
        y = self.lin(x) * scale
        return y if w is None else y * w


def test_non_tensor_arguments_are_baked_and_checked():
    x = torch.randn(2, 4)
    m = Scaled().eval()
    cm = opencann.compile(m, (x, 2.0))
    assert torch.allclose(cm(x, 2.0), m(x, 2.0))
    with pytest.raises(ValueError, match="was 2.0 when the model was compiled and is 5.0"):
        cm(x, 5.0)
    with pytest.raises(ValueError, match="compiled for 2 positional input"):
        cm(x)
    cm = opencann.compile(m, (x,), example_kwargs={"w": None})
    with pytest.raises(ValueError, match="was None when the model was compiled"):
        cm(x, w=torch.ones(3))


def test_constant_outputs_are_fresh_each_call():
    class C(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", torch.arange(3.0))

        def forward(self, x):
            return x + 1, self.b * 10

    x = torch.randn(2, 3)
    cm = opencann.compile(C().eval(), (x,))
    cm(x)[1].add_(1000)
    assert torch.equal(cm(x)[1], torch.tensor([0.0, 10.0, 20.0]))


def test_weights_changed_after_compile_are_an_error():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    x = torch.randn(1, 3, 6, 6)
    cm = opencann.compile(m, (x,))
    with torch.no_grad():
        m[0].weight.mul_(2)
    with pytest.raises(ValueError, match="'0.weight' was modified in place after compiling"):
        cm(x)


@pytest.mark.parametrize("tail", ["flatten_linear", "conv_only", "bn_flatten"])
def test_conv_output_layout_matches_eager(tail):
    """oneDNN convolutions return channels-last; views and graph outputs need NCHW."""
    torch.manual_seed(0)
    layers = {"flatten_linear": [nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(288, 10)],
              "conv_only": [nn.Conv2d(3, 8, 3)],
              "bn_flatten": [nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten()]}[tail]
    m = nn.Sequential(*layers).eval()
    x = torch.randn(2, 3, 8, 8)
    out = opencann.compile(m, (x,))(x)
    assert torch.allclose(out, m(x), atol=1e-5) and out.is_contiguous()
    out.view(-1)  # as a caller may


def test_non_contiguous_inputs():
    m = nn.Sequential(nn.Flatten(), nn.Linear(48, 2)).eval()
    x = torch.randn(2, 3, 4, 4)
    cm = opencann.compile(m, (x,))
    for xi in (x.to(memory_format=torch.channels_last), x.transpose(2, 3).contiguous().transpose(2, 3)):
        assert torch.allclose(cm(xi), m(xi), atol=1e-6)


@pytest.mark.parametrize("options,match", [
    (["verify"], "options must be a dict"), ({"alignment": "64"}, "power of two"),
    ({"alignment": 48}, "power of two"), ({"disable": "cse"}, "takes a list of names"),
    ({"keep_fp32": ["linear"]}, "unknown op 'linear'"), ({"host_fallback": "no"}, "True or False"),
    ({"disable": 5}, "'disable' takes a list of names"), ({"keep_dtype": 3}, "'keep_dtype' takes a list"),
    ({"lower_ops": 1.5}, "'lower_ops' takes a list"), ({"enable": {"cse": 1}}, "'enable' takes a list"),
])
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        opencann.compile(nn.Linear(4, 4).eval(), (torch.randn(2, 4),), options=options)


def test_flash_attention_and_zoo_input_errors():
    with pytest.raises(ValueError, match="q must be a torch.Tensor, got ndarray"):
        flash_attention(*(np.zeros((1, 1, 4, 8)),) * 3)
    with pytest.raises(ValueError, match="head dim is 0"):
        flash_attention(*(torch.randn(1, 1, 4, 0),) * 3)
    with pytest.raises(ValueError, match="takes \\['batch', 'size'\\], not \\['seq'\\]"):
        zoo.get("resnet50", seq=7)
    with pytest.raises(ValueError, match="batch must be positive"):
        zoo.get("minilm", batch=0)


def test_data_dependent_shapes_and_list_inputs_are_explained():
    from opencann.frontend.torch.convert import ConversionError

    class Masked(nn.Module):
        def forward(self, x):
            return x[x > 0] * 2

    with pytest.raises(ConversionError, match="data-dependent value"):
        opencann.compile(Masked(), (torch.randn(8),))
    with pytest.raises(ValueError, match="tensor or a tuple"):
        opencann.compile(nn.Linear(4, 4), [torch.randn(2, 4)])


def test_report_lists_kernel_allocated_values_and_fused_work():
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3)).eval()
    cm = opencann.compile(m, (torch.randn(1, 3, 16, 16),))
    assert "values outside the arena" in cm.report.to_text()
    assert cm.report.to_dict()["memory"]["kernel_allocated"]
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    r = opencann.compile(mlp, (torch.randn(2, 8),)).report
    assert r.cost_after["flops"] == r.cost_before["flops"]  # fusing moves work, adds none


def test_estimate_batch_follows_the_example_inputs():
    from opencann.tools.estimate import estimate
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU()).eval()
    head = lambda r: r.to_text().splitlines()[0]  # noqa: E731
    assert "batch 2," in head(estimate(m, torch.randn(2, 64)))
    assert "batch 1," in head(estimate(m, torch.randn(2, 64), batch=1))


def test_buffer_mutation_advice_and_host_device():
    from opencann.frontend.torch.convert import ConversionError

    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("n", torch.zeros(()))

        def forward(self, x):
            self.n += 1
            return x * 2

    with pytest.raises(ConversionError, match="counter or cache"):
        opencann.compile(Counter().eval(), (torch.randn(2),))
    bn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).train()
    with pytest.raises(ConversionError, match="call model.eval"):
        opencann.compile(bn, (torch.randn(2, 3, 6, 6),))
    with pytest.raises(ValueError, match="the host is one device"):
        opencann.compile(nn.Linear(4, 4).eval(), (torch.randn(2, 4),), device="cpu:7")


def test_llama_decode_step_with_kv_cache():
    """A one-token decode (RoPE on [1, H, 1, D]): an in-place Add's input and output views
    of one buffer differed only in size-1 strides, which ATen's overlap check rejected."""
    import copy
    import os
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2)).eval()
    ids = torch.randint(0, 100, (1, 5))
    with torch.no_grad():
        cache = m(input_ids=ids, use_cache=True).past_key_values
        ref = m(input_ids=ids[:, -1:], past_key_values=copy.deepcopy(cache), use_cache=True)
        cm = torch.compile(m, backend="opencann", dynamic=False)
        out = cm(input_ids=ids[:, -1:], past_key_values=copy.deepcopy(cache), use_cache=True)
    assert torch.allclose(out.logits, ref.logits, atol=1e-5)
