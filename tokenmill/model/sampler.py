"""Sampler: next tokens from logits under each request's SamplingParams.

Greedy rows take the argmax. Other rows are shaped by temperature, top-k, top-p and min-p, then
drawn by inverting their cumulative distribution at one uniform number a row, which comes from
the request's own generator when it has a seed, so a seeded request draws the same tokens
whatever batch it shares. Logprobs are of the model's raw distribution, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

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
        # shaped_probs' float32 rows, kept between steps: a fresh 12 MB tensor for 64 rows had
        # cost its page faults every step, an eighth of a 64-sequence step at temperature 1.
        self.workspace = torch.empty(0)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> SamplerOutput:
        token_ids = greedy_tokens(logits)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            uniforms = draw_uniforms([generators[i] or self.generator for i in random_rows])
            rows = torch.tensor(random_rows, device=logits.device)
            chosen_logits = logits if len(rows) == len(params) else logits[rows]
            token_ids[rows] = self.draw_tokens(chosen_logits, [params[i] for i in random_rows],
                                               uniforms)
        chosen = token_ids.tolist()
        return SamplerOutput(chosen, self._logprobs(logits, params, chosen))

    def draw_tokens(self, logits: torch.Tensor, params: list[SamplingParams],
                    uniforms: torch.Tensor) -> torch.Tensor:
        """Row r's token where uniforms[r] falls in its distribution after params[r]'s shaping:
        by the C++ kernel where it takes the rows, else shaped_probs + invert_cdf. The two round
        the shares differently in the last bits, so the plain and the rejection sampler both
        draw here: a seeded request then emits the same tokens with or without speculation."""
        kernels = row_kernels(logits)
        if kernels is not None:  # its passes over the logits, no probability tensor
            return kernels.sample_rows(
                logits, torch.tensor([p.temperature for p in params], dtype=torch.float32),
                torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.long),
                torch.tensor([p.top_p for p in params], dtype=torch.float32),
                torch.tensor([p.min_p for p in params], dtype=torch.float32), uniforms)
        size = logits.numel()
        if self.workspace.numel() < size or self.workspace.device != logits.device:
            self.workspace = torch.empty(size, device=logits.device)
        work = self.workspace[:size].view(logits.shape)
        return invert_cdf(self.shaped_probs(work.copy_(logits), params), uniforms)

    @staticmethod
    def shaped_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Probabilities after temperature, top-k, top-p and min-p, one row per request, worked
        out in place in `logits` (float32; the caller's to give up)."""
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
        logits = logits.div_(temperature)
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
        row_max = logits.max(dim=-1, keepdim=True).values
        least = None  # the least logit kept, a row
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            least = kept_from(logits, top_k, top_p)
        if (min_p > 0).any():  # p >= min_p * p_max, as logits: at least log(min_p) below the top
            by_min_p = row_max + min_p.log()
            least = by_min_p if least is None else torch.maximum(least, by_min_p)
        cut = None if least is None else logits < least
        # The cut tokens' shares are zeroed after exp: exp(-inf) ran 5x slower than exp of a number.
        probs = logits.sub_(row_max).exp_()
        if cut is not None:
            probs.masked_fill_(cut, 0.0)
        probs = probs.div_(probs.sum(dim=-1, keepdim=True))
        return probs

    @staticmethod
    def _logprobs(logits: torch.Tensor, params: list[SamplingParams],
                  chosen: list[int]) -> list[dict[int, float] | None]:
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        result: list[dict[int, float] | None] = [None] * len(params)
        if not wanted:
            return result
        rows = logits if len(wanted) == len(params) \
            else logits[torch.tensor(wanted, device=logits.device)]
        entries = logprob_entries(rows, [chosen[i] for i in wanted],
                                  [params[i].logprobs for i in wanted])
        for i, entry in zip(wanted, entries):
            result[i] = entry
        return result


# Candidates a row's top-p cut is first looked for among: its likeliest TOP_P_WIDTH tokens, then
# four times as many while the cut lies past them.
TOP_P_WIDTH = 256


def kept_from(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Per row, the least logit that top-k and then top-p keep, [rows, 1] (-inf: all kept). A
    token goes when top_k tokens rank above it, or when those ranked above it (within the top k)
    already cover top_p. Found among each row's likeliest tokens (torch.topk), not by sorting the
    vocabulary: sorting 64 rows of 49,152 took 125 ms a step."""
    rows, vocab = logits.shape
    device = logits.device
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=device)
    ps = torch.tensor(top_p, dtype=logits.dtype, device=device)
    kept = torch.full((rows, 1), float("-inf"), dtype=logits.dtype, device=device)
    pending = ((ks < vocab) | (ps < 1.0)).nonzero().flatten()
    guess = TOP_P_WIDTH
    while len(pending):
        k, p = ks[pending].unsqueeze(1), ps[pending].unsqueeze(1)
        width = int(torch.where(k < vocab, k, guess).max().clamp(max=vocab))
        chosen = logits if len(pending) == rows else logits[pending]
        values = chosen.topk(width, dim=-1).values  # each row's likeliest, in order
        in_top_k = torch.arange(width, device=device).unsqueeze(0) < k
        # top-p's shares are of the top-k tokens alone, so top-k's normaliser, else the row's.
        normaliser = values.masked_fill(~in_top_k, float("-inf")).logsumexp(-1, True)
        whole_rows = (k >= vocab) & (p < 1.0)
        if whole_rows.any():
            normaliser = torch.where(whole_rows, chosen.logsumexp(-1, True), normaliser)
        shares = (values - normaliser).exp().masked_fill_(~in_top_k, 0.0)
        covered = shares.cumsum(dim=-1) - shares
        keep = in_top_k & ((covered < p) | (p >= 1.0))
        count = keep.sum(dim=-1, keepdim=True)
        # Settled when the cut falls inside the candidates, or they hold all of the top k.
        settled = ((count < width) | (k <= width)).flatten()
        kept[pending[settled]] = values.gather(1, count - 1)[settled]
        pending = pending[~settled]
        guess *= 4
    return kept


def row_kernels(logits: torch.Tensor) -> ModuleType | None:
    """The CPU kernels where they take these logits (kernels/sampling.cpp): 2-D float32 or
    bfloat16 with contiguous rows, on the CPU."""
    if logits.dim() == 2 and logits.stride(-1) == 1 \
            and logits.dtype in (torch.float32, torch.bfloat16):
        return fused_kernels(logits)
    return None


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, in the logits' own dtype (a float32 copy orders them the same): by the
    CPU kernel where it takes them (torch's argmax was 5% of a 64-sequence step), else
    torch.argmax."""
    kernels = row_kernels(logits)
    return logits.argmax(dim=-1) if kernels is None else kernels.argmax_rows(logits)


def draw_uniforms(generators: list[torch.Generator]) -> torch.Tensor:
    """One uniform number in [0, 1) a row, float64, from the row's generator. One a row where the
    exponential race drew one a token: that race (a log and a random number each, serially)
    took 100 of a 64-sequence step's 140 ms at temperature 1 (perf, AMX VM)."""
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])


CDF_BLOCK = 256


def invert_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Each row's token where uniforms[row], in [0, 1], falls in its cumulative distribution, in
    float64 so every token's share is its probability to within 1e-15: first among the sums of
    blocks of CDF_BLOCK tokens, then within the block found. A float64 cumulative sum over the
    whole vocabulary ran serially (14 ms for 64 rows of 49,152); a float32 one would blur a
    rare token's share beside a likely one's."""
    rows, vocab = probs.shape
    blocks = -(-vocab // CDF_BLOCK)
    if blocks * CDF_BLOCK != vocab:
        probs = torch.nn.functional.pad(probs, (0, blocks * CDF_BLOCK - vocab))
    probs = probs.view(rows, blocks, CDF_BLOCK)
    block_cdf = probs.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)
    target = uniforms.to(probs.device).unsqueeze(1) * block_cdf[:, -1:]
    block = last_with_share(block_cdf, torch.searchsorted(block_cdf, target, right=True))
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inner = probs[torch.arange(rows, device=probs.device), block.squeeze(1)].double().cumsum(dim=-1)
    within = last_with_share(inner, torch.searchsorted(inner, target - before, right=True))
    return (block * CDF_BLOCK + within).squeeze(1)


def last_with_share(cdf: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """index, or where it lies past the last entry with a share (a uniform at or within rounding
    of 1), that entry."""
    return torch.minimum(index, torch.searchsorted(cdf, cdf[:, -1:].contiguous()))


def logprob_entries(logits: torch.Tensor, chosen: list[int],
                    num_tops: list[int]) -> list[dict[int, float]]:
    """One dict per row of `logits` [rows, vocab]: the chosen token's logprob, then the
    num_tops[row] likeliest tokens'. By the C++ kernel where it takes the rows
    (kernels/sampling.cpp: a pass for the log-sum-exp, one for the top tokens, the lower id kept
    on ties), else log_softmax and topk."""
    num_top = max(num_tops, default=0)
    kernels = row_kernels(logits)
    if kernels is not None:
        values, ids = kernels.logprob_rows(logits, torch.tensor(chosen), num_top)
        chosen_values, top_values = values[:, 0].tolist(), values[:, 1:].tolist()
        top_ids = ids.tolist()
    else:
        logprobs = logits.float().log_softmax(dim=-1)
        chosen_ids = torch.tensor(chosen, device=logprobs.device).unsqueeze(1)
        chosen_values = logprobs.gather(1, chosen_ids).squeeze(1).tolist()
        top_values, top_ids = [[]] * len(chosen), [[]] * len(chosen)
        if num_top:
            top = logprobs.topk(num_top, dim=-1)
            top_values, top_ids = top.values.tolist(), top.indices.tolist()
    entries = []
    for token_id, value, n, row_ids, row_values in zip(chosen, chosen_values, num_tops, top_ids,
                                                        top_values):
        entry = {token_id: value}
        for top_id, top_value in zip(row_ids[:n], row_values[:n]):
            entry.setdefault(top_id, top_value)
        entries.append(entry)
    return entries
