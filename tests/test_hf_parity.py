"""Parity with Hugging Face transformers on the same GGUF, fp32: the first 32 greedy tokens."""

from __future__ import annotations

import pytest
import torch

from tokenmill import SamplingParams
from tests.prompts import CHAT_QUESTIONS

NUM_TOKENS = 32


def test_greedy_tokens_match_transformers(llm_fp32, hf_smollm):
    hf_smollm.generation_config.eos_token_id = None  # all 32 tokens, like ignore_eos
    engine = llm_fp32.engine
    prompts = [engine.tokenizer.encode(engine.apply_chat_template(
        [{"role": "user", "content": q}]), add_special_tokens=False) for q in CHAT_QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm_fp32.generate(prompts, params)]
    for prompt, tokens in zip(prompts, ours):
        with torch.inference_mode():
            reference = hf_smollm.generate(
                torch.tensor([prompt]), max_new_tokens=NUM_TOKENS,
                do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == reference
