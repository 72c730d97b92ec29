"""Prefill attention memory is O(S) (issue #27 item 3): the prefill graph runs the
project's FlashAttention, and its planned intermediates (the arena) grow linearly with
the prompt — doubling S at most ~doubles the arena, where a materialized [H, S, S] score
matrix would quadruple it. bench/llm_long_prefill.py measures the 8192-token case."""
import torch
import transformers

import opencann.llm


def _arena(model, s: int):
    gen = opencann.llm.compile(model, max_seq_len=s, options={"prefill_buckets": [s]})
    cm = gen.steps.step(1, s).compiled
    return gen, cm, cm.executor.plan.arena_bytes


def test_prefill_arena_grows_linearly_with_the_prompt():
    # 2 layers: the last one attends its last token only (DecoderLM, as a decode step)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128,
                                   vocab_size=300, max_position_embeddings=1024)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).eval()
    _, small_cm, small = _arena(m, 256)
    gen, cm, big = _arena(m, 512)
    assert any(n.op == "FlashAttention" for n in cm.graph.nodes)
    assert big / small < 2.2, (small, big)
    scores = cfg.num_attention_heads * 512 * 512 * 4   # one [H, S, S] fp32 score matrix
    assert big < scores, (big, scores)
    ids = torch.randint(3, 300, (1, 500), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = m(ids).logits[:, -1]
    got = gen.steps.step(1, 512)(torch.nn.functional.pad(ids, (0, 12)), torch.zeros(1, dtype=torch.long),
                                 torch.tensor([500]))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
