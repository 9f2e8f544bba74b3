"""The sampler's draws follow the shaped distribution (temperature, top-k, top-p, min-p), never
pick a token outside it, and depend only on the request's own generator."""

from __future__ import annotations

import pytest
import torch

from tests.distributions import total_variation
from tokenmill.kernels import cpu_kernels
from tokenmill.model.sampler import Sampler, invert_cdf, kept_from, logprob_entries
from tokenmill.sampling_params import SamplingParams

VOCAB = 12
DRAWS = 40000
TV_BOUND = 0.02  # the empirical TV of 40,000 exact draws over 12 tokens is about 0.01


def logits_row() -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 2


def empirical(token_ids: list[int]) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(token_ids), minlength=VOCAB).double()
    return counts / counts.sum()


def uniform_over_support(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Deliberately broken: every token that has a share is equally likely."""
    return invert_cdf((probs > 0).float(), uniforms)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),  # the kernel's path, where it built
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),  # the kernel's path too
    SamplingParams(temperature=0.5, top_p=0.95),
    SamplingParams(temperature=1.0, top_k=6, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.1),
])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_draws_follow_the_shaped_distribution(params, path, monkeypatch):
    if path == "torch":  # shaped_probs and invert_cdf, as without the C++ kernels
        monkeypatch.setattr("tokenmill.model.sampler.row_kernels", lambda logits: None)
    elif cpu_kernels() is None:
        pytest.skip("no C++ compiler here")
    logits = logits_row().expand(DRAWS, VOCAB).contiguous()
    expected = Sampler.shaped_probs(logits[:1].clone(), [params])[0]
    out = Sampler(0)(logits, [params] * DRAWS, [None] * DRAWS)
    drawn = empirical(out.token_ids)
    assert total_variation(drawn, expected) < TV_BOUND
    assert drawn[expected == 0].sum() == 0  # outside top-k / top-p / min-p: never drawn


def test_the_distribution_test_catches_a_skewed_draw(monkeypatch):
    params = SamplingParams(temperature=1.3, top_k=8)
    monkeypatch.setattr("tokenmill.model.sampler.row_kernels", lambda logits: None)
    logits = logits_row().expand(DRAWS, VOCAB).contiguous()
    expected = Sampler.shaped_probs(logits[:1].clone(), [params])[0]
    monkeypatch.setattr("tokenmill.model.sampler.invert_cdf", uniform_over_support)
    drawn = empirical(Sampler(0)(logits, [params] * DRAWS, [None] * DRAWS).token_ids)
    assert total_variation(drawn, expected) > 5 * TV_BOUND


def test_a_draw_depends_only_on_its_own_generator():
    logits = torch.randn(3, VOCAB) * 2
    params = SamplingParams(temperature=1.0)
    for seed in range(20):
        alone = Sampler(0)(logits[1:2], [params], [torch.Generator().manual_seed(seed)])
        together = Sampler(0)(logits, [params] * 3, [torch.Generator().manual_seed(s)
                                                     for s in (100, seed, 200)])
        assert together.token_ids[1] == alone.token_ids[0]


def test_a_uniform_at_either_end_lands_on_a_token_with_a_share():
    probs = torch.tensor([[0.0, 0.2, 0.8, 0.0, 0.0]] * 2)
    assert invert_cdf(probs, torch.tensor([0.0, 1.0], dtype=torch.float64)).tolist() == [1, 2]


def sorted_reference(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Which tokens top-k then top-p keep, by sorting the whole row."""
    values, order = logits.sort(descending=True)
    ranks = torch.arange(len(values))
    keep = ranks < (top_k if top_k > 0 else len(values))
    shares = values.masked_fill(~keep, float("-inf")).softmax(-1)
    keep &= (shares.cumsum(-1) - shares) < top_p
    return torch.zeros_like(keep).scatter_(0, order, keep)


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (0, 0.999), (50, 1.0), (600, 0.99),
                                         (3000, 0.95), (1, 0.5)])
def test_top_k_and_top_p_keep_what_sorting_the_vocabulary_keeps(top_k, top_p):
    # Flat rows (the cut lies past the first TOP_P_WIDTH candidates) and peaked ones.
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 5000, generator=generator) * torch.tensor([[0.5], [1.0], [4.0], [9.0]])
    kept = kept_from(logits, [top_k] * 4, [top_p] * 4)
    for row in range(4):
        assert torch.equal(logits[row] >= kept[row], sorted_reference(logits[row], top_k, top_p))


def test_rows_with_different_cuts_are_cut_each_by_its_own():
    settings = [(0, 0.9), (50, 1.0), (0, 1.0), (600, 0.99), (3000, 0.95), (1, 0.5)]
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(len(settings), 5000, generator=generator) * 0.7
    kept = kept_from(logits, [k for k, _ in settings], [p for _, p in settings])
    for row, (top_k, top_p) in enumerate(settings):
        assert torch.equal(logits[row] >= kept[row], sorted_reference(logits[row], top_k, top_p))


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 40, 1.0, 0.0), (1.2, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.05),
    (0.9, 300, 0.95, 0.02)])
def test_shaped_probs_equal_the_plain_definitions(temperature, top_k, top_p, min_p):
    logits = torch.randn(3, 2000, generator=torch.Generator().manual_seed(8)) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    got = Sampler.shaped_probs(logits.clone(), [params] * 3)
    for row in range(3):
        scaled = logits[row] / temperature
        probs = scaled.masked_fill(~sorted_reference(scaled, top_k, top_p),
                                   float("-inf")).softmax(-1)
        probs = probs * (probs >= min_p * probs.max())
        torch.testing.assert_close(got[row], probs / probs.sum(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_inverts_the_same_distribution_as_the_torch_path(dtype):
    """kernels/sampling.cpp's sample_rows and invert_cdf over shaped_probs map the same uniform
    numbers to the same tokens under mixed temperatures, top-k, top-p and min-p, but where
    rounding moves a boundary."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ compiler here")
    generator = torch.Generator().manual_seed(9)
    rows = 3000
    logits = (torch.randn(rows, 700, generator=generator) * 3).to(dtype)
    temperatures = torch.rand(rows, generator=generator) + 0.3
    which = torch.arange(rows)
    top_ks = torch.where(which % 4 == 1, torch.randint(1, 300, (rows,), generator=generator), 0)
    top_ps = torch.where(which % 3 == 0, 1.0, torch.rand(rows, generator=generator) * 0.9 + 0.05)
    min_ps = torch.where(which % 5 == 2, torch.rand(rows, generator=generator) * 0.2, 0.0)
    uniforms = torch.rand(rows, generator=generator, dtype=torch.float64)
    params = [SamplingParams(temperature=float(t), top_k=int(k), top_p=float(p), min_p=float(m))
              for t, k, p, m in zip(temperatures, top_ks, top_ps, min_ps)]
    reference = invert_cdf(Sampler.shaped_probs(logits.to(torch.float32, copy=True), params),
                           uniforms)
    got = kernels.sample_rows(logits, temperatures, top_ks, top_ps, min_ps, uniforms)
    assert (got == reference).float().mean() > 0.995
    ends = kernels.sample_rows(logits[:2], temperatures[:2], torch.zeros(2, dtype=torch.long),
                               torch.ones(2), torch.zeros(2),
                               torch.tensor([0.0, 1.0], dtype=torch.float64))
    assert ends.tolist() == [0, 699]  # every token has a share at a temperature alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_logprobs_kernel_gives_log_softmax_and_its_top_tokens(dtype, monkeypatch):
    """kernels/sampling.cpp's logprob_rows against log_softmax + topk: the same logprobs within
    float32 rounding of the log-sum-exp, the same top tokens; on ties (bf16 logits have many)
    the lower id, as a stable sort of the values gives them."""
    if cpu_kernels() is None:
        pytest.skip("no C++ compiler here")
    generator = torch.Generator().manual_seed(4)
    logits = (torch.randn(40, 3001, generator=generator) * 4).to(dtype)
    logits[3, :] = 0.0  # every token tied
    chosen = torch.randint(0, 3001, (40,), generator=generator).tolist()
    num_tops = [i % 7 for i in range(40)]
    got = logprob_entries(logits, chosen, num_tops)
    monkeypatch.setattr("tokenmill.model.sampler.row_kernels", lambda logits: None)
    reference = logprob_entries(logits, chosen, [0] * 40)
    logprobs = logits.float().log_softmax(-1)
    for row, entry in enumerate(got):
        ranked = sorted(range(3001), key=lambda t: (-logprobs[row, t].item(), t))
        assert list(entry) == list(dict.fromkeys([chosen[row], *ranked[:num_tops[row]]]))
        for token, value in entry.items():
            assert abs(value - logprobs[row, token].item()) < 1e-5
        assert abs(entry[chosen[row]] - reference[row][chosen[row]]) < 1e-5


def test_the_kernels_read_bfloat16_logits_as_their_float32_copy():
    """The model hands the samplers its own dtype's logits: every kernel gives for bf16 rows
    what it gives for their float32 copy (greedy, shaped draws, logprobs), bit for bit."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ compiler here")
    generator = torch.Generator().manual_seed(5)
    rows = 200
    logits = (torch.randn(rows, 4099, generator=generator) * 3).bfloat16()
    copy = logits.float()
    assert torch.equal(kernels.argmax_rows(logits), kernels.argmax_rows(copy))
    args = (torch.rand(rows, generator=generator) + 0.3,
            torch.where(torch.arange(rows) % 2 == 0, 40, 0),
            torch.where(torch.arange(rows) % 3 == 0, 0.9, 1.0),
            torch.where(torch.arange(rows) % 5 == 0, 0.05, 0.0),
            torch.rand(rows, generator=generator, dtype=torch.float64))
    assert torch.equal(kernels.sample_rows(logits, *args), kernels.sample_rows(copy, *args))
    chosen = torch.randint(0, 4099, (rows,), generator=generator)
    for got, want in zip(kernels.logprob_rows(logits, chosen, 5),
                         kernels.logprob_rows(copy, chosen, 5)):
        assert torch.equal(got, want)
