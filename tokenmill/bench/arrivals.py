"""When each conversation starts: Poisson arrivals, gamma burstiness, or all at once.

As vllm bench serve: gaps drawn from a gamma distribution with shape `burstiness` and mean
1 / request_rate. Burstiness 1 is a Poisson process; below 1 arrivals come in bursts, above 1
they are more even. An infinite rate sends everything at time 0.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_times(count: int, request_rate: float, burstiness: float = 1.0,
                  seed: int = 0) -> list[float]:
    """Seconds after the start at which each of `count` conversations is sent."""
    if not request_rate > 0:
        raise ValueError(f"invalid benchmark option request_rate={request_rate!r}: must be > 0 "
                         "(inf sends every request at once)")
    if not burstiness > 0:
        raise ValueError(f"invalid benchmark option burstiness={burstiness!r}: must be > 0")
    if math.isinf(request_rate):
        return [0.0] * count
    gaps = np.random.default_rng(seed).gamma(shape=burstiness,
                                             scale=1.0 / (request_rate * burstiness), size=count)
    gaps[0] = 0.0  # the first request opens the run
    return np.cumsum(gaps).tolist()
