"""The ``opencann generate`` command: a causal LM (zoo name, ``.gguf`` file or transformers
folder, `opencann.llm.sources`) compiled by ``opencann.llm.compile``, or a generator saved
to an ``.ocm`` file (``Generator.save``, read by ``opencann.llm.load``: no compile), asked
one prompt;
the text streams as tokens arrive and the time to first token and decode tokens/s close
the output.

    opencann generate smollm2 --chat --prompt "What is the capital of France?"
    opencann generate ./my-llama --prompt "Once upon a time" --max-new-tokens 64 \\
        --sample --temperature 0.8 --top-p 0.9 --seed 1
    opencann generate model.ocm --chat --prompt "Hi"        # a saved generator

The arguments live here, apart from `opencann.cli`, and transformers and the LLM package
are imported only when the command runs, so that ``opencann --help`` stays fast."""
from __future__ import annotations

import argparse
import time
from typing import Optional

import torch

from .argtypes import nonnegative_int, positive_float, positive_int, probability

SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}  # transformers' defaults
MAX_SEQ_LEN_STEP = 64  # the default --max-seq-len: prompt + new tokens rounded up to this
#: the most new tokens without --max-new-tokens (fewer where the cache or context has less room)
DEFAULT_NEW_TOKENS = 128


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``generate`` options to ``ap`` (a parser or a CLI subparser)."""
    ap.add_argument("model", help="zoo name (smollm2), a .gguf file, a transformers folder "
                    "(config.json and tokenizer) or a saved generator (.ocm, Generator.save)")
    ap.add_argument("--prompt", required=True, help="the text to continue (with --chat: the "
                    "user's message)")
    ap.add_argument("--max-new-tokens", type=positive_int,
                    help=f"at most this many new tokens (default: as many as the KV cache holds "
                    f"after the prompt - the model's context, --max-seq-len or a saved "
                    f"generator's cache - at most {DEFAULT_NEW_TOKENS})")
    ap.add_argument("--chat", action="store_true",
                    help="put the prompt through the tokenizer's chat template as a user turn")
    ap.add_argument("--sample", action="store_true",
                    help="sample (temperature, top-k, top-p) instead of greedy decoding")
    ap.add_argument("--temperature", type=positive_float,
                    help=f"with --sample (default {SAMPLING_DEFAULTS['temperature']})")
    ap.add_argument("--top-k", type=nonnegative_int,
                    help=f"with --sample; 0 turns it off (default {SAMPLING_DEFAULTS['top_k']})")
    ap.add_argument("--top-p", type=probability,
                    help=f"with --sample, in (0, 1] (default {SAMPLING_DEFAULTS['top_p']})")
    ap.add_argument("--seed", type=nonnegative_int, help="with --sample (default 0)")
    ap.add_argument("--repetition-penalty", type=positive_float, default=1.0,
                    help="CTRL's penalty on tokens already in the sequence (1.0: off)")
    ap.add_argument("--max-seq-len", type=positive_int,
                    help="KV-cache positions (default: prompt + new tokens, rounded up "
                    f"to a multiple of {MAX_SEQ_LEN_STEP}, at most the model's context)")
    ap.add_argument("--options", help="opencann.llm.compile options as JSON, e.g. "
                    "'{\"backend\": \"opencann\"}' (step graphs compiled by opencann.compile)")
    ap.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    return ap


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """``Generator.generate`` keyword arguments for the decoding options of ``args``.
    Raises ValueError (one line) for a sampling option given without ``--sample``."""
    given = [k for k in (*SAMPLING_DEFAULTS, "seed") if getattr(args, k) is not None]
    if not args.sample:
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} applies to sampling: add --sample")
        return {"do_sample": False, "repetition_penalty": args.repetition_penalty}
    kw = {k: v if getattr(args, k) is None else getattr(args, k)
          for k, v in SAMPLING_DEFAULTS.items()}
    return {"do_sample": True, "seed": 0 if args.seed is None else args.seed,
            "repetition_penalty": args.repetition_penalty, **kw}


def new_tokens(requested: Optional[int], prompt_len: int, positions: int) -> int:
    """The new tokens to ask for: ``requested`` (``--max-new-tokens``), else as many as
    ``positions`` cache positions hold after a prompt of ``prompt_len`` tokens (prompt +
    new - 1 positions: the last new token is never fed back), at most
    `DEFAULT_NEW_TOKENS`, at least 1 (a prompt that fills the positions is reported by
    the caller's check)."""
    if requested is not None:
        return requested
    return max(1, min(DEFAULT_NEW_TOKENS, positions - prompt_len + 1))


def lengths(args: argparse.Namespace, prompt_len: int, model) -> "tuple[int, int]":
    """(KV-cache length, new tokens) for a prompt of ``prompt_len`` tokens. The cache:
    ``--max-seq-len``, or prompt + new tokens rounded up to `MAX_SEQ_LEN_STEP` and capped
    at the model's context as ``opencann.llm.compile`` reads it
    (`opencann.llm.arch.rope_context`: ``max_position_embeddings``, longer under a
    ``linear``/``llama3``/``yarn`` RoPE scaling; GPT-2's ``n_positions``; a sliding
    window's size where it is shorter: the generator serves up to it). New tokens:
    `new_tokens` within that room. The cache holds prompt + new - 1 positions (the last
    new token is never fed back), as the generator counts them. Raises ValueError (one
    line) when they do not fit."""
    from ..llm.arch import rope_context, sliding_window
    context, what = rope_context(model.config), "the model's context of {}"
    window = sliding_window(model.config)     # opencann.llm serves up to the window
    if window and (not context or window < context):
        context, what = window, "the model's sliding window of {}"
    room, what = ((args.max_seq_len, f"--max-seq-len {args.max_seq_len}")
                  if args.max_seq_len is not None else (context, what.format(context)))
    new = new_tokens(args.max_new_tokens, prompt_len, room or prompt_len + DEFAULT_NEW_TOKENS)
    need = prompt_len + new - 1
    if room and need > room and args.max_new_tokens is None:
        raise ValueError(f"the prompt ({prompt_len} tokens) fills {what}: shorten the prompt"
                         + (" or raise --max-seq-len" if args.max_seq_len is not None else ""))
    if room and need > room:
        fix = ("raise --max-seq-len or lower --max-new-tokens" if args.max_seq_len is not None
               else "shorten the prompt or lower --max-new-tokens")
        raise ValueError(f"the prompt ({prompt_len} tokens) and --max-new-tokens "
                         f"{args.max_new_tokens} need {need} positions, more than {what}: {fix}")
    if args.max_seq_len is not None:
        return args.max_seq_len, new
    seq = -(-need // MAX_SEQ_LEN_STEP) * MAX_SEQ_LEN_STEP
    return (min(seq, context) if context else seq), new


def check_saved_fit(args: argparse.Namespace, prompt_len: int, new: int, positions: int) -> None:
    """Raise ValueError (one line, in the command line's terms) when a prompt of
    ``prompt_len`` tokens and ``new`` new tokens (prompt + new - 1 positions) do not fit
    the ``positions`` of a saved generator's KV cache (``args.model``, fixed in the file)."""
    where = f"{args.model}'s KV cache of {positions} positions (fixed in the file)"
    larger = "save a generator compiled with a larger max_seq_len"
    if prompt_len > positions:
        raise ValueError(f"the prompt ({prompt_len} tokens) exceeds {where}: shorten the prompt "
                         f"or {larger}")
    if prompt_len + new - 1 > positions:
        raise ValueError(f"the prompt ({prompt_len} tokens) and --max-new-tokens {new} need "
                         f"{prompt_len + new - 1} positions, more than {where}: lower "
                         f"--max-new-tokens to at most {positions - prompt_len + 1}, shorten "
                         f"the prompt or {larger}")


def max_seq_len(args: argparse.Namespace, prompt_len: int, model) -> int:
    """The KV-cache length of `lengths`. Raises ValueError (one line) when the prompt and
    the new tokens do not fit."""
    return lengths(args, prompt_len, model)[0]


def stats_line(new_tokens: int, stats) -> str:
    """``"N new tokens: TTFT x ms, decode y tokens/s, prefill z tokens/s, ..."`` from a
    ``Generator.stats`` (the fields it has; KV cache in MiB; the step graphs built so far,
    which on a first call are built inside the TTFT and decode times)."""
    parts = [f"TTFT {stats.ttft_s * 1e3:.0f} ms",
             f"decode {stats.decode_tokens_per_s:.1f} tokens/s"]
    extra = (("prefill_tokens_per_s", "prefill {:.0f} tokens/s", 1),
             ("kv_cache_bytes", "KV cache {:.1f} MiB", 1 / 2 ** 20),
             ("graphs_built", "{:d} step graphs built", 1),
             ("recompiles", "{:d} recompiles", 1))
    for name, fmt, scale in extra:
        v = getattr(stats, name, None)
        if v is not None:
            parts.append(fmt.format(v * scale if scale != 1 else v))
    return f"{new_tokens} new tokens: " + ", ".join(parts)


def run_args(args: argparse.Namespace, console, options: Optional[dict] = None) -> int:
    """Load, compile (with ``options``, the parsed ``--options``) and generate from parsed
    `add_arguments` options, printing with the rich ``console``; returns 0. Raises
    ValueError (one line; the CLI prints it) for a bad model source, an empty prompt,
    ``--chat`` without a chat template, sampling options without ``--sample`` or a prompt
    that does not fit ``--max-seq-len``, and what ``opencann.llm.compile`` raises for an
    unsupported model or option."""
    from .. import llm
    from ..llm.sources import load_causal_lm
    from .llm_chat import encode_prompt, eos_ids, text_streamer
    torch.set_num_threads(args.threads)
    gen_kw = sampling_kwargs(args)
    if str(args.model).endswith(".ocm"):
        return _run_saved(args, console, options, gen_kw)
    from ..llm.arch import read_arch
    with console.status(f"loading {args.model}..."):
        model, tokenizer = load_causal_lm(args.model)
    read_arch(model.config)   # an unsupported model says so before any length check
    ids = encode_prompt(tokenizer, args.prompt, chat=args.chat)
    seq, new = lengths(args, ids.shape[-1], model)
    with console.status(f"compiling {type(model).__name__} for {seq} positions..."):
        t0 = time.perf_counter()
        gen = llm.compile(model, max_seq_len=seq, max_batch=1, options=options or None)
    n_params = sum(p.numel() for p in model.parameters()) / 1e6
    console.print(f"compiled {args.model} ({type(model).__name__}, {n_params:.3g}M parameters, "
                  f"{seq} positions) in {time.perf_counter() - t0:.1f} s", style="dim",
                  highlight=False)  # opencann.llm builds its step graphs on first use
    stream = text_streamer(tokenizer)
    out = gen.generate(ids, max_new_tokens=new, streamer=stream,
                       eos_token_id=eos_ids(model, tokenizer), **gen_kw)
    console.print(stats_line(out.shape[-1] - ids.shape[-1], gen.stats), style="dim",
                  highlight=False)
    return 0


def _run_saved(args: argparse.Namespace, console, options: Optional[dict], gen_kw: dict) -> int:
    """`run_args` for a saved generator (``args.model`` an ``.ocm`` file): loaded, not
    compiled; its own tokenizer, stop tokens and cache length. Raises ValueError (one
    line) for ``--max-seq-len`` or ``--options`` (fixed in the file), a file without a
    tokenizer, a prompt and ``--max-new-tokens`` beyond the file's cache
    (`check_saved_fit`), and what ``opencann.llm.load`` and ``generate`` raise."""
    from .. import llm
    from .llm_chat import encode_prompt, eos_ids, text_streamer
    fixed = [f for f, v in (("--max-seq-len", args.max_seq_len), ("--options", options)) if v]
    if fixed:
        raise ValueError(f"{' and '.join(fixed)} cannot change a saved generator ({args.model} "
                         "holds its compiled graphs and cache length): drop them, or generate "
                         "from the model folder")
    with console.status(f"loading {args.model}..."):
        t0 = time.perf_counter()
        gen = llm.load(args.model)
    if gen.tokenizer is None:
        raise ValueError(f"{args.model} holds no tokenizer: save the generator with "
                         "gen.save(path, tokenizer=tokenizer)")
    console.print(f"loaded {args.model} ({gen.arch.model_type}, {gen.stats.graphs_loaded} step "
                  f"graphs, {gen.max_seq_len} positions) in {time.perf_counter() - t0:.1f} s",
                  style="dim", highlight=False)
    ids = encode_prompt(gen.tokenizer, args.prompt, chat=args.chat)
    new = new_tokens(args.max_new_tokens, ids.shape[-1], gen.max_seq_len)
    check_saved_fit(args, ids.shape[-1], new, gen.max_seq_len)
    out = gen.generate(ids, max_new_tokens=new, streamer=text_streamer(gen.tokenizer),
                       eos_token_id=eos_ids(gen, gen.tokenizer), **gen_kw)
    console.print(stats_line(out.shape[-1] - ids.shape[-1], gen.stats), style="dim",
                  highlight=False)
    return 0
