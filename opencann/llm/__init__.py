"""LLM generation on the graph engine: an application above the engine, beside
`opencann.dynamo`.

    gen = opencann.llm.compile(model, max_seq_len=512, max_batch=4)
    out = gen.generate(input_ids, max_new_tokens=32)        # like transformers' generate
    print(gen.stats.summary())                               # TTFT, tokens/s, graphs, plans

- `arch`: a transformers config read into `LLMArch` (GPT-2, Llama, Mistral, Qwen2), or
  one ValueError line naming the unsupported piece (`read_arch`);
- `builder`: `DecoderLM`, the model rewritten over a preallocated KV cache with the
  ``opencann::kv_cache_update`` / ``opencann::decode_attention`` custom ops, sharing the
  transformers model's parameters; `module_values`: the values transformers' forward
  reads from the modules (norm epsilons, attention scales, RoPE), read from them;
- `steps`: the prefill graphs (per prompt bucket and batch size) and one decode graph
  per batch size; `prompts`: the call's prompts checked and normalised;
- `sampling`: greedy and sampling through transformers' logits processors, seeded;
- `generator`: `compile` and `Generator.generate`; `stats`: `GenerationStats`;
- `saving`: ``Generator.save(path)`` (one ``.ocm`` file: the step graphs, weights once,
  cache layout, generation defaults, tokenizer); `loading`: `load` reads it back;
- `sources`: `load_causal_lm` (the zoo's SmolLM2 GGUF, a .gguf file or a transformers
  folder, offline) for the CLI, the demo and the benchmarks.
See docs/guide/llm.md.
"""
from .arch import LLMArch, read_arch
from .builder import DecoderLM
from .generator import Generator, compile
from .loading import load
from .stats import GenerationStats

__all__ = ["DecoderLM", "GenerationStats", "Generator", "LLMArch", "compile", "load", "read_arch"]
