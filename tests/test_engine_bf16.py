"""The fp32 invariants of test_engine.py in bf16, where batch shape changes the numerics: each
scenario must agree with its plain reference on at least 95% of tokens."""

from __future__ import annotations

import pytest

from tokenmill import SamplingParams
from tests.prompts import SYSTEM_PROMPT, varied_prompts

PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def agreement(outputs, reference) -> float:
    pairs = [(a, b) for o, r in zip(outputs, reference)
             for a, b in zip(o.outputs[0].token_ids, r.outputs[0].token_ids)]
    return sum(a == b for a, b in pairs) / len(pairs)


@pytest.fixture(scope="module")
def llm_bf16(make_llm):
    return make_llm(dtype="bfloat16")


def test_bf16_batch_invariance(llm_bf16):
    prompts = varied_prompts(8)
    batched = llm_bf16.generate(prompts, PARAMS)
    alone = [llm_bf16.generate([p], PARAMS)[0] for p in prompts]
    assert agreement(batched, alone) >= 0.95


def test_bf16_prefix_cache_preemption_and_chunked_prefill(make_llm, llm_bf16):
    prompts = [SYSTEM_PROMPT + question for question in
               ("How do backups work?", "What are the support hours?", "How is storage billed?")]
    reference = [llm_bf16.generate([p], PARAMS)[0] for p in prompts]
    constrained = make_llm(dtype="bfloat16", num_kv_blocks=20, max_num_batched_tokens=64)
    outputs = constrained.generate(prompts, PARAMS)
    stats = constrained.engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions >= 1
    assert agreement(outputs, reference) >= 0.95
