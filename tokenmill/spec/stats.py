"""SpecDecodeStats: counts of proposed and accepted speculative tokens, overall and per position.

Names follow vLLM's spec_decode metrics. The engine's stats snapshot carries a copy; the server
exports it to Prometheus and the periodic log line.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    num_speculative_tokens: int  # K, the most proposed per request and step
    num_drafts: int = 0  # request-steps that carried proposals
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    current_num_speculative_tokens: int = 0  # what load and acceptance allowed on the last step
    num_throttled_steps: int = 0  # steps that proposed fewer than K tokens per request

    def __post_init__(self) -> None:
        self.num_draft_tokens_per_pos = [0] * self.num_speculative_tokens
        self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens
        self.current_num_speculative_tokens = self.num_speculative_tokens

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for position in range(num_proposed):
            self.num_draft_tokens_per_pos[position] += 1
            self.num_accepted_tokens_per_pos[position] += position < num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """Of the proposals made at position i, the fraction accepted (all before it were)."""
        return [a / d if d else 0.0 for a, d in zip(self.num_accepted_tokens_per_pos,
                                                    self.num_draft_tokens_per_pos)]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a request gains per verifying step: accepted proposals plus the target's own."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def snapshot(self) -> "SpecDecodeStats":
        return copy.deepcopy(self)
