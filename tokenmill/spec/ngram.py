"""N-gram (prompt lookup) proposer: a request's next tokens guessed from its own earlier tokens.

The last n tokens (n from ngram_max down to ngram_min) are looked up in the request's prompt and
output; the tokens that followed their latest earlier occurrence are the proposal. It runs no
model, so it pays wherever the output copies the input: code edits, reformatting, quoting.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(frozen=True, slots=True)
class NgramProposer:
    ngram_max: int
    ngram_min: int

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens that followed the longest matching suffix; [] if none."""
        tokens = np.asarray(token_ids)
        for n in range(min(self.ngram_max, len(token_ids) - 1), self.ngram_min - 1, -1):
            # Windows that end before the last token, so each has at least one successor.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return token_ids[start:start + num_tokens]
        return []
