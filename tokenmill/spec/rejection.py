"""Verification of speculative tokens: which proposals the target keeps, and its own next token.

Every proposer here is deterministic (n-gram lookup, a draft model's argmax), so the draft
distribution q is one-hot at the proposal x. Modified rejection sampling (Leviathan et al. 2023,
Chen et al. 2023) then accepts x with probability min(1, p(x) / q(x)) = p(x), where p is the
target's distribution after temperature, top-k, top-p and min-p, and on a rejection draws from
the normalised residual max(p - q, 0), which is p conditioned on "not x"; after K acceptances a
bonus token comes from the last row. We realise exactly that by drawing the target's token at
each position the way the plain sampler does (Sampler.draw_tokens: one uniform number per
position from the request's generator) and accepting x when the draw equals it: P(accept) = p(x),
and a rejection's draw is distributed as p given "not x". Since one number is consumed per emitted
token, and both samplers turn it into a token by the same code, a seeded request emits the very
tokens it would without speculation. Greedy requests accept the longest prefix equal to the
target's argmax, then take the argmax after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from tokenmill.engine.scheduler import ScheduledChunk
from tokenmill.model.sampler import Sampler, draw_uniforms, greedy_tokens, logprob_entries
from tokenmill.sampling_params import SamplingParams


@dataclass(slots=True)
class RejectionSampler:
    sampler: Sampler  # its generator serves requests without a seed

    def __call__(self, logits: torch.Tensor, chunks: list[ScheduledChunk]
                 ) -> tuple[list[list[int]], list[list[dict[int, float] | None]]]:
        """`logits` holds 1 + K rows per chunk (K = its num_spec_tokens), chunk after chunk.
        Returns, per chunk, the emitted tokens (accepted proposals, then one more) and their
        logprobs."""
        logits = logits.float()
        counts = [c.num_spec_tokens + 1 for c in chunks]
        starts = [0, *accumulate(counts)]
        params = [c.request.sampling_params for c in chunks]
        greedy_ids = greedy_tokens(logits).tolist()
        token_ids, logprobs = [], []
        for i, chunk in enumerate(chunks):
            request = chunk.request
            proposals = request.spec_token_ids[:chunk.num_spec_tokens]
            if params[i].greedy:
                emitted = accept_greedy(proposals, greedy_ids[starts[i]:starts[i + 1]])
            else:
                emitted = self.accept_sampled(proposals, logits[starts[i]:starts[i + 1]],
                                              params[i],
                                              request.generator or self.sampler.generator)
            token_ids.append(emitted)
            logprobs.append(_logprobs(logits[starts[i]:starts[i] + len(emitted)], emitted,
                                      params[i]))
        return token_ids, logprobs

    def accept_sampled(self, proposals: list[int], logits: torch.Tensor, params: SamplingParams,
                       generator: torch.Generator) -> list[int]:
        """Rejection sampling of deterministic proposals against the target's `logits`,
        [K + 1, vocab]: each position's target token is drawn as the plain sampler draws it,
        and the proposal survives when the draw equals it."""
        emitted: list[int] = []
        for position, proposal in enumerate([*proposals, None]):  # None: the bonus position
            token = self.sampler.draw_tokens(logits[position:position + 1], [params],
                                             draw_uniforms([generator]))
            emitted.append(int(token[0]))
            if emitted[-1] != proposal:
                break
        return emitted


def accept_greedy(proposals: list[int], target_ids: list[int]) -> list[int]:
    """The proposals up to the first that differs from the target's argmax, then its argmax."""
    accepted = 0
    while accepted < len(proposals) and proposals[accepted] == target_ids[accepted]:
        accepted += 1
    return target_ids[:accepted + 1]


def _logprobs(logits: torch.Tensor, emitted: list[int],
              params: SamplingParams) -> list[dict[int, float] | None]:
    if params.logprobs is None:
        return [None] * len(emitted)
    return logprob_entries(logits, emitted, [params.logprobs] * len(emitted))
