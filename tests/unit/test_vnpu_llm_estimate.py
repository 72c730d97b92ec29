"""`opencann.tools.estimate_llm`: LLM prefill / decode estimates on the vnpu (tiny configs for the
machinery), the HCCS all-reduce cost, and the calibration rows against TorchAir's published Llama2
figures (one and two decoder layers of the real shapes are built, never the whole model)."""
import json

import pytest
import torch
from transformers import LlamaConfig

from opencann.devices.vnpu import ascend310, ascend910b
from opencann.devices.vnpu.cost_model import allreduce_cost
from opencann.devices.vnpu.presets import load_spec
from opencann.tools.estimate_cli import main as estimate_main
from opencann.tools.estimate_llm import (LLAMA2_CONFIGS, _empty_lm, estimate_llm, llm_calibration_table,
                                         shard_config)


def tiny(layers=4, heads=4, kv=2, vocab=1000, inter=512):
    return LlamaConfig(hidden_size=256, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                       intermediate_size=inter, vocab_size=vocab, max_position_embeddings=256)


@pytest.fixture(scope="module")
def tiny_est():
    return estimate_llm(tiny(), prompt=32, batch=2, eager=True)


def test_scaling_by_layers_is_exact(tiny_est):
    """rest + L x layer from the 1- and 2-layer graphs equals the estimate of the whole 4-layer graph."""
    from opencann.tools.estimate_llm import _step_report
    lm = _empty_lm(tiny(), torch.float16)
    whole = _step_report(lm, 2, 1, 256, "vnpu:ascend910b", torch.float16, True)
    assert tiny_est.decode.total_us == pytest.approx(whole.total_time_us, rel=1e-6)
    assert tiny_est.decode.kernels == sum(r.bound != "fused" for r in whole.rows)
    assert tiny_est.layers == 4 and tiny_est.context == 256


def test_prefill_decode_eager_and_memory(tiny_est):
    e = tiny_est
    assert e.prefill.layer_us > 0 and e.decode.layer_us > 0 and e.decode.rest_us > 0
    # eager issues the same kernels, each at least one host dispatch (22 us > the 5 us launch)
    assert e.decode_eager.kernels == e.decode.kernels
    assert e.decode_eager.total_us > e.decode.total_us
    assert e.decode_eager.total_us >= e.decode.kernels * 22.0 - 1e-6
    assert e.weights_bytes > 2 * 1000 * 256 * 2                # at least embedding + LM head, fp16
    assert e.kv_cache_bytes == 2 * 4 * 2 * 2 * 256 * 64 * 2    # K,V x layers x B x Hkv x context x D x fp16
    d = json.loads(e.to_json())
    assert d["decode"]["total_us"] == pytest.approx(e.decode.total_us) and d["cards"] == 1
    assert "ms graph mode" in e.to_text() and "eager" in e.to_text()


@pytest.mark.full   # make test: test_prefill_decode_eager_and_memory on the tiny model
def test_decode_grows_with_context_and_batch():
    short = estimate_llm(tiny(layers=2), prompt=16, context=64, batch=1)
    long = estimate_llm(tiny(layers=2), prompt=16, context=256, batch=8)
    assert long.decode.hbm_bytes > short.decode.hbm_bytes
    assert long.decode.total_us >= short.decode.total_us


@pytest.mark.full   # make test: the 70B 8-card calibration rows and test_allreduce_cost
def test_tensor_parallel_split_and_allreduce():
    one = estimate_llm(tiny(layers=2, kv=4), prompt=16, batch=1)
    two = estimate_llm(tiny(layers=2, kv=4), prompt=16, batch=1, cards=2)
    assert two.decode.allreduce_us == pytest.approx(2 * allreduce_cost(256 * 2, 2, ascend910b).time_us)
    assert one.decode.allreduce_us == 0
    assert two.kv_cache_bytes == pytest.approx(one.kv_cache_bytes / 2)
    assert two.weights_bytes < one.weights_bytes
    assert two.decode.kernels == one.decode.kernels + 2 * 2          # two all-reduces per layer


def test_shard_config_replicates_kv_heads_and_checks_splits():
    c = shard_config(LlamaConfig(**LLAMA2_CONFIGS["llama2-70b"]), 8)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size, c.vocab_size) == \
        (8, 1, 128, 3584, 4000)
    c16 = shard_config(LlamaConfig(**LLAMA2_CONFIGS["llama2-70b"]), 16)
    assert c16.num_key_value_heads == 1
    with pytest.raises(ValueError, match="do not split evenly over 3 cards"):
        shard_config(LlamaConfig(**LLAMA2_CONFIGS["llama2-7b"]), 3)


def test_allreduce_cost():
    assert allreduce_cost(1 << 20, 1, ascend910b).time_us == 0
    small, big = allreduce_cost(16 << 10, 8, ascend910b), allreduce_cost(64 << 20, 8, ascend910b)
    assert small.time_us == pytest.approx(ascend910b.kernel_launch_us + 2 * (ascend910b.hccs_latency_us
                                                                            + (2 << 10) / 56e3))
    assert big.time_us > small.time_us and big.bound == "link"
    with pytest.raises(ValueError, match="ascend310 has no HCCS figures"):
        allreduce_cost(1024, 8, ascend310)
    with pytest.raises(ValueError, match="cards must be >= 1"):
        allreduce_cost(1024, 0, ascend910b)


def test_hccs_fields_in_spec_files(tmp_path):
    p = tmp_path / "chip.json"
    p.write_text(json.dumps({"base": "ascend310", "hccs_gbps": 30.0, "hccs_latency_us": 20.0}))
    s = load_spec(p)
    assert (s.hccs_gbps, s.hccs_latency_us) == (30.0, 20.0) and "hccs_gbps" in s.describe()
    p.write_text(json.dumps({"base": "ascend910b", "hccs_gbps": -1}))
    with pytest.raises(ValueError, match="'hccs_gbps'.*positive number in GB/s"):
        load_spec(p)


@pytest.mark.parametrize("kw, msg", [
    (dict(prompt=0), "prompt must be an integer >= 1"),
    (dict(batch=True), "batch must be an integer >= 1"),
    (dict(dtype="int8"), "not a float dtype"),
    (dict(prompt=16, context=8), "context 8 is shorter than the prompt 16"),
    (dict(device="cpu"), "vnpu"),
    (dict(cards=2, device="vnpu:ascend310"), "no HCCS figures"),
])
def test_bad_input_is_one_line(kw, msg):
    with pytest.raises(ValueError, match=msg) as ei:
        estimate_llm(tiny(layers=1), **kw)
    assert "\n" not in str(ei.value)


def test_unknown_model_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="not a built-in config") as ei:
        estimate_llm(str(tmp_path / "nowhere"))
    assert "\n" not in str(ei.value)
    with pytest.raises(ValueError, match=r"^--llm Linear: not a built-in config") as ei:
        estimate_llm(torch.nn.Linear(2, 2))    # named by its type, not its whole repr
    assert "\n" not in str(ei.value)


def test_a_transformers_model_is_estimated_from_its_config(tiny_est):
    from transformers import LlamaForCausalLM
    a, b = estimate_llm(LlamaForCausalLM(tiny()), prompt=32, batch=2, eager=True), tiny_est
    assert (a.ttft_ms, a.decode_ms, a.weights_bytes, a.kv_cache_bytes) == (b.ttft_ms, b.decode_ms, b.weights_bytes, b.kv_cache_bytes)


def test_cli(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    tiny(layers=2).save_pretrained(tmp_path / "m")
    out = tmp_path / "e.json"
    assert estimate_main(["--llm", str(tmp_path / "m"), "--prompt", "16", "--batch", "2", "--eager",
                          "--json", str(out)]) == 0
    assert "decode / token" in capsys.readouterr().out
    assert json.loads(out.read_text())["batch"] == 2
    assert estimate_main(["--llm", "llama2-7b", "--cards", "3"]) == 2
    assert "do not split evenly" in capsys.readouterr().err
    assert estimate_main([]) == 2
    assert "give --model MODEL" in capsys.readouterr().err


@pytest.mark.full   # make test: the per-layer scaling, phases and TP cases above on a tiny model
def test_torchair_llama2_calibration():
    """Every TorchAir Llama2 row is within +-25% or a known miss with its reason; the fitted row is
    flagged; the graph-mode decode rows (7B batch 4, 70B batch 1 and 48) all in band."""
    rows = llm_calibration_table(batches_70b=(1, 48))
    assert len(rows) == 4 + 2 + 2              # 7B x4, 70B decode b1 + b48, 70B prefill b1 + b48 (eager b4 left out)
    for r in rows:
        assert r["within_band"] or (r["known_miss"] and r["note"]), r
    decode = [r for r in rows if "decode graph" in r["workload"]]
    assert len(decode) == 3 and all(r["within_band"] for r in decode)
    assert sum(r["fitted"] for r in rows) == 1
