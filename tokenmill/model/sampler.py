"""Sampler: next tokens from logits under each request's SamplingParams.

Greedy rows take the argmax. Other rows are shaped by temperature, top-k, top-p and min-p, then
drawn with the exponential-race trick (argmax of p / Exp(1) noise), where the noise comes from
the request's own generator when it has a seed, so a seeded request draws the same tokens
whatever batch it shares. Logprobs are of the model's raw distribution, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.kernels import fused_kernels
from tokenmill.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # chosen token first, then the top alternatives


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> SamplerOutput:
        token_ids = greedy_tokens(logits)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows)
            probs = self.shaped_probs(logits[rows].float(), [params[i] for i in random_rows])
            noise = torch.empty_like(probs)
            for r, i in enumerate(random_rows):
                noise[r].exponential_(generator=generators[i] or self.generator)
            token_ids[rows] = (probs / noise).argmax(dim=-1)
        chosen = token_ids.tolist()
        return SamplerOutput(chosen, self._logprobs(logits, params, chosen))

    @staticmethod
    def shaped_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Probabilities after temperature, top-k, top-p and min-p, one row per request."""
        temperature = torch.tensor([p.temperature for p in params]).unsqueeze(1)
        logits = logits / temperature
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            vocab = logits.shape[-1]
            ks = torch.tensor([k if k > 0 else vocab for k in top_k]).unsqueeze(1)
            ranks = torch.arange(vocab).unsqueeze(0)
            sorted_logits = sorted_logits.masked_fill(ranks >= ks, float("-inf"))
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Drop a token when the tokens ranked above it already cover top_p; the top one stays.
            covered = sorted_probs.cumsum(dim=-1) - sorted_probs
            ps = torch.tensor(top_p).unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(covered >= ps, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params]).unsqueeze(1)
        if (min_p > 0).any():
            keep = probs >= min_p * probs.max(dim=-1, keepdim=True).values
            probs = probs * keep
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    @staticmethod
    def _logprobs(logits: torch.Tensor, params: list[SamplingParams],
                  chosen: list[int]) -> list[dict[int, float] | None]:
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        result: list[dict[int, float] | None] = [None] * len(params)
        if not wanted:
            return result
        logprobs = logits[torch.tensor(wanted)].float().log_softmax(dim=-1)
        for r, i in enumerate(wanted):
            result[i] = logprob_entries(logprobs[r:r + 1], [chosen[i]], params[i].logprobs)[0]
        return result


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, in the logits' own dtype (a float32 copy orders them the same): by the
    CPU kernel where it takes them (kernels/argmax.cpp: torch's argmax was 5% of a 64-sequence
    step), else torch.argmax."""
    kernels = fused_kernels(logits)
    if kernels is not None and logits.dim() == 2 and logits.stride(-1) == 1 \
            and logits.dtype in (torch.float32, torch.bfloat16):
        return kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


def logprob_entries(logprobs: torch.Tensor, chosen: list[int],
                    num_top: int) -> list[dict[int, float]]:
    """One dict per row of `logprobs`: the chosen token's logprob, then the `num_top` likeliest."""
    chosen_values = logprobs.gather(1, torch.tensor(chosen).unsqueeze(1)).squeeze(1).tolist()
    entries = [{token_id: value} for token_id, value in zip(chosen, chosen_values)]
    if num_top:
        values, ids = logprobs.topk(num_top, dim=-1)
        for entry, row_ids, row_values in zip(entries, ids.tolist(), values.tolist()):
            for token_id, value in zip(row_ids, row_values):
                entry.setdefault(token_id, value)
    return entries
