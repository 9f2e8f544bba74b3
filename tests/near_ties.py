"""Greedy runs that may part only where the two top tokens are nearly tied.

Where two computations of the same logits round differently (bf16 products picking kernels by row
count; an int8 KV code flipping on a one-ulp difference in a recomputed K), greedy paths can part
at a near-tie and then differ everywhere after. What must hold instead of token identity: the runs
agree token for token up to their first difference, and there the top two logprobs are within
`margin` in one of the runs. A real bug moves logits by far more and fails this.
"""

from __future__ import annotations

# Two bf16 steps of a logit of magnitude 16 to 32 (bf16 keeps 8 significant bits).
BF16_NEAR_TIE = 0.25


def top2_margin(entry: dict[int, float]) -> float:
    first, second = sorted(entry.values(), reverse=True)[:2]
    return first - second


def assert_parts_only_at_near_ties(outputs, reference, margin: float = BF16_NEAR_TIE) -> None:
    """Both runs need logprobs=2 (or more) in their SamplingParams."""
    for output, expected in zip(outputs, reference):
        got, want = output.outputs[0], expected.outputs[0]
        parted = next((i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids))
                       if a != b), None)
        if parted is None:
            continue
        gap = min(top2_margin(got.logprobs[parted]), top2_margin(want.logprobs[parted]))
        assert gap <= margin, (output.prompt, parted, got.logprobs[parted],
                               want.logprobs[parted])
