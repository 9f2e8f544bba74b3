"""Key smoothing for the int8 KV cache: a few large K channels stop setting every row's scale.

An int8 row has one scale per token and KV head (kv_int8.py), set by the row's largest value.
Qwen2's k_proj bias makes a few K channels large for every token (up to 240 against a median
channel of 5 in Qwen2.5-0.5B); the scale follows them, and the small channels that tell keys apart
are left with a few codes each. Dividing K by a factor per channel and multiplying q by the same
factor leaves every q.k unchanged and the row's values of one size. The factors are equal within
each rotary pair (channel i and i + head_dim / 2), so they commute with RoPE and hold at any
position, and they are powers of two, so q * s and k / s are exact in floating point: in float,
attention is unchanged bit for bit. A pair is divided down to about the head's median pair norm
when it is larger, and never scaled up (a channel that is small in calibration may not stay so).
The factors come from one calibration prefill of `CALIBRATION_TEXT` at load (ModelRunner).
"""

from __future__ import annotations

import torch

# Prose and code, as served traffic is; not the perplexity text (tokenmill/eval/perplexity.py),
# so the evaluation does not measure the calibration text.
CALIBRATION_TEXT = """\
The river rose through the night, and by morning the low fields east of the village were under
water. Farmers moved their animals to the church hill, where the ground stays dry; the school
closed for the week, and the baker, whose ovens sit above the flood line, fed whoever came.
Engineers from the county arrived on Tuesday to inspect the old stone bridge, built in 1872.

def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    \"\"\"Sort by start, then extend the last interval while the next one overlaps it.\"\"\"
    merged: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged

Q: What is the capital of France? A: Paris. Q: How many legs does a spider have? A: Eight.
SELECT name, COUNT(*) AS orders FROM customers JOIN orders USING (customer_id)
GROUP BY name HAVING COUNT(*) > 3 ORDER BY orders DESC;
{"id": 17, "tags": ["storage", "retry"], "timeout_ms": 2500, "enabled": true}
"""


def key_smoothing_factors(k: torch.Tensor) -> torch.Tensor:
    """Calibration keys k [T, Hkv, D] (after RoPE) -> factors s [Hkv, D], float32 powers of two
    >= 1, equal within each rotary pair: cache k / s and attend with q * s."""
    half = k.shape[-1] // 2
    values = k.float()
    pair_norms = torch.hypot(values[..., :half], values[..., half:]).amax(dim=0)  # [Hkv, D / 2]
    median = pair_norms.median(dim=-1, keepdim=True).values.clamp_min(torch.finfo().tiny)
    factors = torch.exp2(torch.round(torch.log2((pair_norms / median).clamp_min(1.0))))
    return torch.cat((factors, factors), dim=-1)
