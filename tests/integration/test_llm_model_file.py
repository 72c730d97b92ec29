"""An opencann.llm generator in one ``.ocm`` file (``Generator.save`` / ``opencann.llm.load``
/ ``opencann.load``): loaded in a fresh process it gives the saved generator's tokens,
greedy and seeded sampling, batched prompts of different lengths, with zero graphs built;
the weights are stored once; the tokenizer and generation defaults come back; a file of
another format is one line; ``opencann generate model.ocm`` streams the same text."""
import json
import os
import struct
import subprocess
import sys

import pytest
import torch
import transformers as T

import opencann
import opencann.llm as L
from opencann.llm import saving
from opencann.runtime.model_file import ModelFileError, peek_version, read, read_sections
from helpers import run_cli
from tiny_llm import tiny_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = [[5, 17, 200, 33, 9, 41, 77], [12, 250, 3, 60]]

_CHILD = r"""
import json, sys, torch, opencann, opencann.llm as L
path, prompts = sys.argv[1], json.loads(sys.argv[2])
gen = opencann.load(path)
assert isinstance(gen, L.Generator), type(gen)
out = {"greedy": gen.generate(prompts, max_new_tokens=10).tolist(),
       "again": gen.generate(prompts, max_new_tokens=10).tolist(),
       "sampled": gen.generate(prompts[:1], max_new_tokens=10, do_sample=True, top_k=20,
                               temperature=0.8, seed=7).tolist(),
       "one": L.load(path).generate(prompts[1:], max_new_tokens=5).tolist(),
       "built": gen.stats.graphs_built, "recompiles": gen.stats.recompiles,
       "loaded": gen.stats.graphs_loaded, "plans": gen.stats.memory_plans,
       "eos": gen.generation_config.eos_token_id, "pad": gen.generation_config.pad_token_id,
       "cache": [list(c.shape) for c in gen.caches[:1]], "layers": len(gen.caches) // 2,
       "text": gen.tokenizer.decode(prompts[0]),
       "chat": gen.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)}
print("OUT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(model, tokenizer, generator, path): a tiny random Llama (GQA, RoPE) compiled for 2
    rows of up to 32 positions, saved with every step graph and its tokenizer."""
    tok = tiny_tokenizer()
    torch.manual_seed(3)
    cfg = T.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64, eos_token_id=1, pad_token_id=1)
    m = T.LlamaForCausalLM(cfg).eval()
    gen = L.compile(m, max_seq_len=32, max_batch=2,
                    options={"prefill_buckets": [16], "batch_sizes": [2]})
    path = str(tmp_path_factory.mktemp("llm_file") / "gen.ocm")
    gen.save(path, tokenizer=tok)
    return m, tok, gen, path


def test_a_fresh_process_gives_the_same_tokens_with_zero_compiles(saved):
    m, tok, gen, path = saved
    assert gen.stats.graphs == ["decode b2 t1", "prefill b2 t16", "prefill b2 t32"]
    want = {"greedy": gen.generate(PROMPTS, max_new_tokens=10).tolist(),
            "sampled": gen.generate(PROMPTS[:1], max_new_tokens=10, do_sample=True, top_k=20,
                                    temperature=0.8, seed=7).tolist(),
            "one": gen.generate(PROMPTS[1:], max_new_tokens=5).tolist()}
    assert want["greedy"][1][3:] == m.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=10,
                                               do_sample=False).tolist()[0]
    r = subprocess.run([sys.executable, "-c", _CHILD, path, json.dumps(PROMPTS)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("OUT")][0][3:])
    assert {k: got[k] for k in want} == want
    assert got["again"] == want["greedy"]          # a second call: the same
    assert got["built"] == 0 == got["recompiles"] and got["loaded"] == 3 and got["plans"] == 0
    assert got["eos"] == 1 == got["pad"]
    assert got["cache"] == [[2, 2, 32, 16]] and got["layers"] == 2
    assert got["text"] == tok.decode(PROMPTS[0])
    assert got["chat"] == tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_weights_are_stored_once_and_shared_after_loading(saved):
    m, _, gen, path = saved
    _, secs = read_sections(path)
    assert peek_version(path) == 4
    params = sum(p.nbytes for p in m.parameters())
    assert params <= len(secs["constants"]) < params * 1.1 + 64 * 1024   # three graphs, one copy
    meta = json.loads(bytes(secs["metadata"]))
    assert meta["cache"] == {"max_seq_len": 32, "max_batch": 2, "layers": 2, "kv_heads": 2,
                             "head_dim": 16, "dtype": "float32", "buckets": [16, 32],
                             "batch_sizes": [2]}
    g = L.load(path)
    storages = [{c.const.untyped_storage().data_ptr() for c in cm.graph.constants
                 if c.const.dim() == 2} for cm in g.steps.compiled().values()]
    assert storages[0] == storages[1] == storages[2]    # every graph views the same weights
    assert g.lm is None and repr(g).startswith("Generator(llama, 2 layers, max_seq_len=32")


def test_built_graphs_only_and_a_missing_step_is_one_line(saved, tmp_path):
    _, _, gen, _ = saved
    path = str(tmp_path / "built.ocm")
    small = L.compile(saved[0], max_seq_len=32, max_batch=2,
                      options={"prefill_buckets": [16], "batch_sizes": [2]})
    small.generate(PROMPTS, max_new_tokens=3)
    small.save(path, graphs="built")
    g = L.load(path)
    assert g.tokenizer is None and g.stats.graphs_loaded == 2
    assert g.stats.graphs == ["decode b2 t1", "prefill b2 t16"]      # the loaded ones, named
    assert g.stats.weight_bytes >= small.stats.weight_bytes - 2**20 and g.stats.arena_bytes > 0
    assert g.generate(PROMPTS, max_new_tokens=3).tolist() == small.generate(PROMPTS, max_new_tokens=3).tolist()
    with pytest.raises(ValueError, match=r"^built.ocm holds no step graph prefill b2 t32 \(it holds "
                       r"decode b2 t1, prefill b2 t16\): save the generator with graphs='all'"):
        g.generate([list(range(3, 20))], max_new_tokens=2)
    assert g.generate(PROMPTS, max_new_tokens=3).shape == (2, 10)   # still usable


def test_wrong_files_and_settings_are_one_line(saved, tmp_path, monkeypatch):
    m, _, gen, path = saved
    with pytest.raises(ModelFileError, match=r"^gen.ocm holds an opencann.llm generator "
                       r"\(several graphs, format 4\), not one compiled model: load it with "
                       r"opencann.load or opencann.llm.load$"):
        read(path)
    single = str(tmp_path / "one.ocm")
    opencann.save(gen.steps.step(2, 1).compiled, single)
    with pytest.raises(ModelFileError, match=r"^one.ocm holds one compiled model \(model file "
                       r"format 3\), not a bundle .*: load it with opencann.load$"):
        L.load(single)
    # a newer container version
    newer = tmp_path / "newer.ocm"
    data = bytearray(open(path, "rb").read())
    struct.pack_into("<I", data, 8, 5)
    newer.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match=r"^newer.ocm: model file format version 5 is newer "
                       r"than this opencann supports \(4\): upgrade opencann$"):
        opencann.load(str(newer))
    # another generator layout version
    other = str(tmp_path / "other.ocm")
    monkeypatch.setattr(saving, "GENERATOR_FORMAT", 99)
    gen.save(other, graphs="built")
    monkeypatch.undo()
    with pytest.raises(ModelFileError, match=r"^other.ocm holds an opencann.llm generator of "
                       r"format 99, this opencann reads format 1: save it again"):
        opencann.load(other)
    eager = L.compile(m, max_seq_len=32, options={"backend": "eager"})
    with pytest.raises(ValueError, match=r"^Generator.save writes compiled step graphs, but this "
                       r"generator runs backend 'eager'"):
        eager.save(str(tmp_path / "e.ocm"))
    with pytest.raises(ValueError, match=r"^Generator.save takes graphs='all'"):
        gen.save(str(tmp_path / "e.ocm"), graphs="some")
    assert not os.path.exists(tmp_path / "e.ocm")


def test_a_files_cache_beyond_the_machines_memory_is_one_line(saved, monkeypatch):
    """Checked before the caches are allocated; the fix names what applies to a file."""
    monkeypatch.setattr("opencann.llm.generator.memory_bytes", lambda: 16 * 1024)
    with pytest.raises(ValueError, match=r"^the KV cache for max_batch=2 and max_seq_len=32 needs "
                       r"3.1e-05 GiB .* more than this machine's 1.5e-05 GiB of memory: save a "
                       r"generator compiled with a smaller max_batch or max_seq_len"):
        L.load(saved[3])


def test_cli_generates_from_the_saved_file(saved, capsys):
    _, tok, gen, path = saved
    argv = ["generate", path, "--prompt", "The capital of France", "--max-new-tokens", "6"]
    rc, out, err = run_cli(argv, capsys)
    assert rc == 0, err
    first, _, rest = out.partition("\n")
    assert first.startswith("loaded ") and "3 step graphs" in first, first
    text, _, last = rest.rstrip("\n").rpartition("\n")
    ids = tok("The capital of France", return_tensors="pt").input_ids
    new = gen.generate(ids, max_new_tokens=6, eos_token_id=1)[0, ids.shape[-1]:]
    assert text == tok.decode(new, skip_special_tokens=True)
    assert " new tokens: TTFT " in last and "0 step graphs built" in last, last
    rc, _, err = run_cli(argv + ["--max-seq-len", "64"], capsys)
    assert rc == 2 and len(err) == 1 and "--max-seq-len cannot change a saved generator" in err[0], err


def test_bytes_appended_to_a_generator_file_are_refused(saved, tmp_path, capsys):
    """A generator file with bytes after its last section (damaged, or files
    concatenated) is one ModelFileError line from every reader of a bundle."""
    _, _, _, path = saved
    data = open(path, "rb").read()
    bad = tmp_path / "appended.ocm"
    bad.write_bytes(data + b"\0" * 4096 + b"appended by another tool")
    want = (r"^appended.ocm has 4120 bytes after its last section \(\d+ bytes, expected "
            rf"{len(data)}\): the file is damaged or something was appended to it")
    for load in (opencann.load, L.load, read_sections):
        with pytest.raises(ModelFileError, match=want):
            load(str(bad))
    rc, _, err = run_cli(["generate", str(bad), "--prompt", "Hi"], capsys)
    assert rc == 2 and len(err) == 1 and "bytes after its last section" in err[0], err


def test_cli_default_new_tokens_fit_the_files_cache(saved, capsys):
    """Without --max-new-tokens a saved generator makes as many tokens as its cache (32
    positions) holds after the prompt, at most 128 (before: 128, refused by every file of
    a shorter cache); asking for more names what applies to a file - its cache length is
    fixed - not compiling with a larger max_seq_len."""
    _, tok, gen, path = saved
    prompt = "The capital of France"
    ids = tok(prompt, return_tensors="pt").input_ids
    rc, out, err = run_cli(["generate", path, "--prompt", prompt], capsys)
    assert rc == 0, err
    text, _, last = out.rstrip("\n").partition("\n")[2].rpartition("\n")
    want = gen.generate(ids, max_new_tokens=32 - ids.shape[-1] + 1, eos_token_id=1)
    assert text == tok.decode(want[0, ids.shape[-1]:], skip_special_tokens=True)
    assert last.startswith(f"{want.shape[-1] - ids.shape[-1]} new tokens: "), last
    rc, _, err = run_cli(["generate", path, "--prompt", prompt, "--max-new-tokens", "100"], capsys)
    assert rc == 2 and len(err) == 1, err
    n = ids.shape[-1]
    assert (f"the prompt ({n} tokens) and --max-new-tokens 100 need {n + 99} positions, more "
            f"than {path}'s KV cache of 32 positions (fixed in the file): lower --max-new-tokens "
            f"to at most {33 - n}, shorten the prompt or save a generator compiled with a larger "
            "max_seq_len") in err[0] and "max_new_tokens=" not in err[0], err[0]
    rc, _, err = run_cli(["generate", path, "--prompt", "a " * 40], capsys)
    assert rc == 2 and len(err) == 1 and "'s KV cache of 32 positions (fixed in the file): " \
        "shorten the prompt or save a generator" in err[0], err
    loaded = L.load(path)
    with pytest.raises(ValueError, match=r"exceeds max_seq_len 32; shorten the prompt or save a "
                                         r"generator compiled with a larger max_seq_len"):
        loaded.generate([list(range(2, 42))], max_new_tokens=1)


@pytest.mark.parametrize("name", ["../escaped.txt", "a/../../escaped.txt", "/tmp/escaped_abs.txt",
                                  "sub/./x", "", "..", "a//b", "a\\..\\..\\escaped.txt"])
def test_tokenizer_file_names_that_leave_their_folder_are_refused(saved, tmp_path, monkeypatch, name):
    """A model file is data: a crafted one (valid checksums) naming a tokenizer file outside
    the temporary folder it is written to is refused in one line and writes nothing."""
    import base64
    _, tok, gen, _ = saved
    real = saving._tokenizer_files(tok)
    evil = {**real, name: base64.b64encode(b"written by a model file\n").decode()}
    monkeypatch.setattr(saving, "_tokenizer_files", lambda t: evil)
    path = str(tmp_path / "evil.ocm")
    gen.save(path, tokenizer=tok, graphs="built")
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    before = set(os.listdir(tmp_path))
    with pytest.raises(ValueError, match=r"^the model file's tokenizer names a file .* outside its "
                       r"folder: refused"):
        opencann.load(path)
    assert set(os.listdir(tmp_path)) == before
    assert not os.path.exists("/tmp/escaped_abs.txt")
    # the file's own names load
    good = str(tmp_path / "good.ocm")
    gen.save(good, tokenizer=tok, graphs="built")
    assert L.load(good).tokenizer.encode("hi") == tok.encode("hi")
