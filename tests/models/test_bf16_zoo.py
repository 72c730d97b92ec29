"""``allow_mix_precision_bf16`` on the zoo's ResNet-50 (a real photograph) and BERT-base
(seeded token ids): every convolution and Linear runs fused in bf16 on prepacked weights
(no reorder in oneDNN's verbose log of a call), and the output is within bf16's rounding
of eager fp32 (cosine >= 0.999, the issue's gate; measured 0.99995 and 0.99998)."""
import pytest
import torch

import opencann
from opencann import zoo
from opencann.devices.cpu import mkldnn_available, onednn_linear_available
from opencann.passes.prepare.precision import precision_summary

pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(not (mkldnn_available() and onednn_linear_available()),
                                 reason="no oneDNN convolutions / inner products in this torch")]


def _cosine(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


@pytest.mark.parametrize("name,fused", [pytest.param("resnet50", {"ConvBiasAct", "ConvAddAct"},
                                                     marks=pytest.mark.full),
                                        pytest.param("bert-base", {"LinearAct"},
                                                     marks=pytest.mark.full)])
# make test: bf16 ConvBiasAct / ConvAddAct / LinearAct on small models in
# tests/integration/test_bf16_kernels.py (the zoo models here: make test-all)
def test_bf16_zoo_model_runs_fused_kernels_close_to_eager_fp32(name, fused, capfd):
    zm = zoo.get(name)
    x = (zoo.sample_image(224),) if name == "resnet50" else zm.example_inputs
    with torch.no_grad():
        ref = zm.model(*x)[0]
    cm = opencann.compile(zm.model, x, options={"precision_mode": "allow_mix_precision_bf16"})
    summ = precision_summary(cm.graph)
    assert not {"BatchNorm", "Conv2D", "MatMulV2"} & set(summ), summ
    assert all(set(summ[op]) == {"bfloat16"} for op in fused), summ
    out = cm(*x)[0]
    assert out.dtype == torch.float32 and _cosine(out, ref) >= 0.999
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        again = cm(*x)[0]
    log = [ln for ln in capfd.readouterr().out.splitlines() if ",exec," in ln]
    assert torch.equal(out, again)
    assert not [ln for ln in log if ",reorder," in ln], "\n".join(log)
    kernels = [ln for ln in log if ",convolution," in ln or ",inner_product," in ln]
    assert kernels and all("wei:bf16" in ln for ln in kernels)
