"""Speculator: the engine's one handle on speculative decoding.

After each step it asks the throttle how many tokens to propose, asks the proposer (n-gram
lookup or a draft model) for them and sets each decoding request's `spec_token_ids`; the
scheduler counts them in the budget and the model runner verifies them. After verification it
records what was accepted. It owns the proposal statistics and, through the draft proposer, the
draft model's KV cache. It never changes a request's tokens or its progress.
"""

from __future__ import annotations

import time

from tokenmill.config import EngineConfig
from tokenmill.engine.request import Request
from tokenmill.model.loader import LoadedModel
from tokenmill.spec.draft import DraftProposer
from tokenmill.spec.ngram import NgramProposer
from tokenmill.spec.stats import SpecDecodeStats
from tokenmill.spec.throttle import SpeculationThrottle


class Speculator:
    def __init__(self, config: EngineConfig, proposer: NgramProposer | DraftProposer) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.proposer = proposer
        self.throttle = SpeculationThrottle(config.num_speculative_tokens,
                                            config.speculative_disable_batch_size,
                                            config.speculative_adaptive)
        self.stats = SpecDecodeStats(config.num_speculative_tokens)

    @classmethod
    def create(cls, config: EngineConfig, target: LoadedModel, num_blocks: int,
               max_model_len: int) -> "Speculator | None":
        if config.speculative_method is None:
            return None
        if config.speculative_method == "ngram":
            return cls(config, NgramProposer(config.ngram_max, config.ngram_min))
        return cls(config, DraftProposer.load(config, target, num_blocks, max_model_len))

    def propose(self, running: list[Request]) -> None:
        """Set the proposals of every running request for the next step ([] for most when
        load or acceptance says speculation would not pay)."""
        if not running:
            return
        count = self.throttle.num_tokens(len(running))
        self.stats.current_num_speculative_tokens = count
        self.stats.num_throttled_steps += count < self.num_speculative_tokens
        wanted: list[tuple[Request, int]] = []
        for request in running:
            request.spec_token_ids = []
            # Only a decoding request (its last token sampled, all before it computed) proposes,
            # and never past its length limit: the step emits up to count + 1 tokens.
            room = request.max_output_tokens - len(request.output_token_ids) - 1
            if count and request.num_computed_tokens == request.num_tokens - 1 and room > 0:
                wanted.append((request, min(count, room)))
        if not wanted:
            return
        if isinstance(self.proposer, NgramProposer):
            proposals = [self.proposer.propose(r.all_token_ids, n) for r, n in wanted]
        else:
            started = time.perf_counter()
            proposals = self.proposer.propose([r for r, _ in wanted], [n for _, n in wanted])
            self.throttle.observe_draft_pass((time.perf_counter() - started) / count)
        for (request, _), proposal in zip(wanted, proposals):
            request.spec_token_ids = proposal

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.stats.record(num_proposed, num_accepted)
        self.throttle.observe_acceptance(num_proposed, num_accepted)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A target step's size and duration: what verification costs."""
        self.throttle.step_cost.observe(num_tokens, seconds)

    def release(self, request: Request) -> None:
        if isinstance(self.proposer, DraftProposer):
            self.proposer.release(request)

    def check_invariants(self) -> None:
        if isinstance(self.proposer, DraftProposer):
            self.proposer.check_invariants()
