"""Greedy runs that may part only where the two top tokens are nearly tied.

Where two computations of the same logits round differently (bf16 products picking kernels by row
count; an int8 KV code flipping on a one-ulp difference in a recomputed K), greedy paths can part
at a near-tie and then differ everywhere after. What must hold instead of token identity:
- the runs give as many tokens each, and agree token for token up to their first difference;
- there the top two logprobs are within `margin` in one of the runs;
- after it, every token the run under test chose is, by the reference engine's own scoring of that
  text, its greedy choice or within `margin` of it. So a run that parts at a tie and then goes
  wrong still fails.
A real bug moves logits by far more and fails this.
"""

from __future__ import annotations

from tokenmill import SamplingParams

# Two bf16 steps of a logit of magnitude 16 to 32 (bf16 keeps 8 significant bits).
BF16_NEAR_TIE = 0.25


def top2_margin(entry: dict[int, float]) -> float:
    first, second = sorted(entry.values(), reverse=True)[:2]
    return first - second


def assert_parts_only_at_near_ties(outputs, reference, scorer,
                                   margin: float = BF16_NEAR_TIE) -> None:
    """Both runs need logprobs=2 (or more) in their SamplingParams; `scorer` (an LLM, the
    reference's configuration) scores what `outputs` chose after parting."""
    assert len(outputs) == len(reference) > 0
    for output, expected in zip(outputs, reference):
        got, want = output.outputs[0], expected.outputs[0]
        assert len(got.token_ids) == len(want.token_ids) > 0, (output.prompt, got, want)
        parted = next((i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids))
                       if a != b), None)
        if parted is None:
            continue
        gap = min(top2_margin(got.logprobs[parted]), top2_margin(want.logprobs[parted]))
        assert gap <= margin, (output.prompt, parted, got.logprobs[parted],
                               want.logprobs[parted])
        assert_greedy_within(scorer, output.prompt_token_ids, got.token_ids, parted, margin)


def assert_greedy_within(scorer, prompt: list[int], tokens: list[int], start: int,
                         margin: float) -> None:
    """Each of tokens[start:] is, scored by `scorer` after prompt + the tokens before it, within
    `margin` of that position's top logprob."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    [scored] = scorer.generate([prompt + tokens], params, use_tqdm=False)
    for index in range(start, len(tokens)):
        entry = scored.prompt_logprobs[len(prompt) + index]
        chosen = tokens[index]
        assert max(entry.values()) - entry[chosen] <= margin, (index, chosen, entry)
