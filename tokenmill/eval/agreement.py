"""Greedy agreement, teacher-forced: the share of positions where a configuration's greedy token
equals the reference's.

The reference generates a greedy continuation of each prompt (free-run, `num_tokens` tokens or up
to its end of sequence). Each configuration then reads prompt + that continuation as one prompt
and, at every continuation position, its likeliest next token (prompt logprobs, top 1) is compared
with the reference's token there. Teacher forcing scores every position on the same context, so
one early difference does not turn the rest of a continuation into noise, as free-running would.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill import LLM, SamplingParams

PROMPTS = (
    "Explain how a hash table works.",
    "Write a short poem about autumn leaves.",
    "What are the benefits of regular exercise?",
    "Describe the water cycle in a few sentences.",
    "Give three tips for writing clear emails.",
    "How does a bicycle stay upright?",
    "Write a Python function that reverses a string.",
    "What is the difference between weather and climate?",
    "Summarise the story of Cinderella.",
    "Why do we have seasons on Earth?",
    "List some good habits for learning a new language.",
    "Explain what a database index is for.",
)


@dataclass(frozen=True, slots=True)
class Continuation:
    prompt_token_ids: list[int]
    token_ids: list[int]  # the reference's greedy tokens after the prompt


def reference_continuations(llm: LLM, num_prompts: int, num_tokens: int) -> list[Continuation]:
    engine = llm.engine
    prompts = [engine.tokenizer.encode(
        engine.apply_chat_template([{"role": "user", "content": text}]),
        add_special_tokens=False) for text in PROMPTS[:num_prompts]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=num_tokens),
                           use_tqdm=False)
    return [Continuation(p, o.outputs[0].token_ids) for p, o in zip(prompts, outputs)]


def greedy_agreement(llm: LLM, continuations: list[Continuation]) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate([c.prompt_token_ids + c.token_ids for c in continuations], params,
                           use_tqdm=False)
    matches = positions = 0
    for continuation, output in zip(continuations, outputs):
        start = len(continuation.prompt_token_ids)
        # prompt_logprobs[p] scores token p given the tokens before it; its likeliest entry is
        # the greedy choice there.
        entries = output.prompt_logprobs[start:]
        for token_id, entry in zip(continuation.token_ids, entries):
            matches += max(entry, key=entry.__getitem__) == token_id
            positions += 1
    return matches / positions
