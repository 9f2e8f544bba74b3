"""Speculative decoding: exact output with every method, the rejection sampler's distribution,
block accounting of target and draft, throttling, stats and flags.

Greedy requests must be token-identical to plain decoding (fp32), and seeded sampled requests
too: verification draws each position's token with the request's own noise, as plain decoding
does. References come from the shared plain engine.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.distributions import total_variation
from tests.prompts import SYSTEM_PROMPT, varied_prompts
from tokenmill import EngineConfig, SamplingParams
from tokenmill.cli import build_parser, engine_config_from_args
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import ScheduledChunk
from tokenmill.kernels import cpu_kernels
from tokenmill.model.loader import DEFAULT_MODEL
from tokenmill.model.sampler import Sampler, draw_uniforms
from tokenmill.server.metrics import ServerMetrics
from tokenmill.spec.draft import check_same_vocabulary
from tokenmill.spec.ngram import NgramProposer
from tokenmill.spec.rejection import RejectionSampler
from tokenmill.spec.throttle import PROBE_INTERVAL, SpeculationThrottle

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=16, ignore_eos=True)
# Each method with K = 4 and the throttle off, so every step proposes.
METHODS = {
    "ngram": dict(speculative_method="ngram"),
    "self": dict(speculative_method="self"),  # the target's int4 form
    "self_layers": dict(speculative_method="self", speculative_draft_layers=4,
                        speculative_quantization="none"),  # a poor draft: many rejections
    "draft": dict(speculative_method="draft", speculative_model=DEFAULT_MODEL,
                  speculative_quantization="int8"),  # loaded again as a separate model
}


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def spec_llm(make_llm, method: str, **options):
    options.setdefault("num_kv_blocks", 256)
    return make_llm(**METHODS[method], speculative_adaptive=False, **options)


@pytest.fixture(scope="module")
def mixed_batch():
    """16 prompts of varied lengths (pairs share a prefix), half greedy, half seeded."""
    prompts = varied_prompts(16)
    params = [GREEDY if i % 2 == 0 else dataclasses.replace(SEEDED, seed=i)
              for i in range(len(prompts))]
    return prompts, params


@pytest.fixture(scope="module")
def mixed_reference(llm_fp32, mixed_batch):
    return token_ids(llm_fp32.generate(*mixed_batch))


def test_the_seeded_references_are_sampled_not_greedy(llm_fp32, mixed_batch, mixed_reference):
    """Speculation matching a seeded reference proves it samples only if the reference was drawn:
    each seeded prompt's reference must part from that prompt's greedy output."""
    prompts, params = mixed_batch
    seeded = [i for i, p in enumerate(params) if not p.greedy]
    greedy = token_ids(llm_fp32.generate([prompts[i] for i in seeded], GREEDY))
    assert all(mixed_reference[i] != g for i, g in zip(seeded, greedy))


@pytest.mark.parametrize("method", ["ngram", "self", "draft"])
def test_output_is_identical_to_plain_decoding(make_llm, llm_fp32, mixed_batch, mixed_reference,
                                               method):
    llm = spec_llm(make_llm, method)
    prompts, params = mixed_batch
    for i in (8, 11):  # single requests, one greedy and one seeded, that fill a few blocks
        assert token_ids(llm.generate([prompts[i]], params[i])) == [mixed_reference[i]]
    # The batch takes those two prompts' blocks from the prefix cache.
    assert token_ids(llm.generate(prompts, params)) == mixed_reference
    stats = llm.engine.stats()
    spec = stats.spec_decode
    assert stats.prefix_cache_hits > 0
    assert spec.num_draft_tokens > 0 and 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert stats.num_kv_blocks_used == 0
    llm.engine.speculator.check_invariants()


@pytest.mark.parametrize("method", ["ngram", "self_layers"])
def test_output_is_identical_under_preemption(make_llm, mixed_batch, mixed_reference, method):
    prompts, params = mixed_batch
    llm = spec_llm(make_llm, method, num_kv_blocks=10)
    outputs = llm.generate(prompts[:8], params[:8])
    assert token_ids(outputs) == mixed_reference[:8]
    assert llm.engine.stats().num_preemptions >= 1
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0


def test_chat_with_shared_system_prompt(make_llm, llm_fp32):
    questions = ["How do backups work?", "What are the support hours?"]
    conversations = [[{"role": "system", "content": SYSTEM_PROMPT},
                      {"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    reference = llm_fp32.chat(conversations, params)
    outputs = spec_llm(make_llm, "ngram").chat(conversations, params)
    assert token_ids(outputs) == token_ids(reference)
    assert [o.outputs[0].finish_reason for o in outputs] == \
        [o.outputs[0].finish_reason for o in reference]


def test_logprobs_and_stop_tokens_with_speculation(make_llm, llm_fp32):
    prompt = varied_prompts(3)[2]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    [plain] = llm_fp32.generate([prompt], params)
    llm = spec_llm(make_llm, "ngram")
    [spec] = llm.generate([prompt], params)
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
    for got, want in zip(spec.outputs[0].logprobs, plain.outputs[0].logprobs):
        assert got.keys() == want.keys()
        assert all(got[t] == pytest.approx(want[t], abs=1e-3) for t in got)
    # A stop token among accepted proposals ends the request there.
    tokens = plain.outputs[0].token_ids
    stop = next(tokens[i] for i in range(4, len(tokens)) if tokens[i] not in tokens[:i])
    [cut] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24,
                                                  ignore_eos=True, stop_token_ids=[stop]))
    assert cut.outputs[0].token_ids == tokens[:tokens.index(stop) + 1]


def test_aborts_return_every_block_of_target_and_draft(make_llm):
    llm = spec_llm(make_llm, "self_layers", num_kv_blocks=128)
    engine = llm.engine
    draft_pool = engine.speculator.proposer.kv_cache.pool
    params = SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True)
    for i, prompt in enumerate(varied_prompts(8)):
        engine.add_request(f"req{i}", prompt, params)
    for _ in range(4):
        engine.step()
    assert draft_pool.num_free < draft_pool.num_blocks
    for i in range(0, 8, 2):
        engine.abort_request(f"req{i}")
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("last", "Once upon a time", params)
    engine.step()
    engine.step()
    engine.abort_request("last")
    assert engine.stats().num_kv_blocks_used == 0
    assert draft_pool.num_free == draft_pool.num_blocks
    engine.kv_cache.check_invariants([])
    engine.speculator.check_invariants()


def test_throttle_turns_a_poor_draft_off_and_says_so(make_llm, llm_fp32):
    """A one-layer draft is rarely right and costs a pass per position: the throttle stops it,
    still probing now and then, and the output stays exact."""
    prompts = varied_prompts(4)
    reference = token_ids(llm_fp32.generate(prompts, GREEDY))
    llm = make_llm(speculative_method="self", speculative_draft_layers=1,
                   speculative_quantization="none", num_kv_blocks=256)
    assert token_ids(llm.generate(prompts * 2, GREEDY)) == reference * 2
    spec = llm.engine.stats().spec_decode
    assert spec.num_throttled_steps > 0 and spec.current_num_speculative_tokens < 4
    assert spec.acceptance_rate < 0.5


def test_disable_batch_size_stops_proposals(make_llm, llm_fp32):
    prompts = varied_prompts(4)
    llm = make_llm(speculative_method="ngram", speculative_disable_batch_size=3,
                   num_kv_blocks=256)
    assert token_ids(llm.generate(prompts, GREEDY)) == token_ids(llm_fp32.generate(prompts,
                                                                                    GREEDY))
    spec = llm.engine.stats().spec_decode
    # The four requests run together from start to end, so nothing is ever proposed.
    assert spec.num_throttled_steps >= GREEDY.max_tokens - 1 and spec.num_draft_tokens == 0


def test_stats_metrics_and_log_line(make_llm):
    llm = spec_llm(make_llm, "ngram")
    metrics = ServerMetrics("m")
    llm.generate(varied_prompts(2), GREEDY)
    stats = llm.engine.stats()
    metrics.observe_step([], stats)
    metrics.log_line()
    spec = stats.spec_decode
    assert spec.num_drafts > 0 and len(spec.num_accepted_tokens_per_pos) == 4
    assert sum(spec.num_accepted_tokens_per_pos) == spec.num_accepted_tokens
    assert 1.0 <= spec.mean_accepted_length <= 5.0
    rates = spec.acceptance_rate_per_pos
    assert all(0.0 <= r <= 1.0 for r in rates)
    text = metrics.render().decode()
    assert f'tokenmill:spec_decode_num_draft_tokens_total{{model_name="m"}} ' \
           f'{float(spec.num_draft_tokens)}' in text
    assert 'tokenmill:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"}' \
        in text
    llm.generate(varied_prompts(1), GREEDY)
    metrics.observe_step([], llm.engine.stats())
    line = metrics.log_line()
    assert "spec decode:" in line and "mean accepted length" in line


# ---- the rejection sampler's distribution ------------------------------------------------------

VOCAB = 8
# At 20,000 draws (about 5,000 for the second token) sampling noise in TV over 8 tokens is
# about 0.01 to 0.02; the draws are seeded, so the test is deterministic.
TV_BOUND = 0.03


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return Sampler.shaped_probs(logits.float().clone(), [params] * len(logits))


class AcceptAlways(RejectionSampler):
    """Deliberately broken: keeps every proposal."""

    def accept_sampled(self, proposals, logits, params, generator):
        last = logits[len(proposals):len(proposals) + 1]
        return [*proposals, int(self.sampler.draw_tokens(last, [params],
                                                         draw_uniforms([generator]))[0])]


class ResampleFromTarget(RejectionSampler):
    """Deliberately broken: accepts with p(x) but redraws from p, not from the residual."""

    def accept_sampled(self, proposals, logits, params, generator):
        probs = target_probs(logits, params)
        emitted = []
        for position, proposal in enumerate([*proposals, None]):
            if proposal is not None \
                    and torch.rand(1, generator=generator).item() < probs[position, proposal]:
                emitted.append(proposal)
                continue
            row = logits[position:position + 1]
            return emitted + [int(self.sampler.draw_tokens(row, [params],
                                                           draw_uniforms([generator]))[0])]
        return emitted


def emitted_distributions(sampler_class, num_samples: int = 20000):
    """First token and, when the first proposal was kept, the second token: their frequencies,
    and the target distributions they should follow (temperature 0.8 and top-k 5 applied)."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5],
                           [0.0, 1.0, 2.0, 0.5, 1.5, -1.0, 0.2, 0.1],
                           [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    params = SamplingParams(temperature=0.8, top_k=5)
    request = Request("r:0", [1, 2, 3], params, frozenset(), 100,
                      generator=torch.Generator().manual_seed(0))
    request.spec_token_ids = [1, 4]
    chunk = ScheduledChunk(request, 3, num_spec_tokens=2)
    sampler = sampler_class(Sampler(0))
    first, second = torch.zeros(VOCAB), torch.zeros(VOCAB)
    for _ in range(num_samples):
        [emitted], _ = sampler(logits, [chunk])
        first[emitted[0]] += 1
        if len(emitted) > 1:  # the first proposal was kept
            second[emitted[1]] += 1
    scaled = logits / 0.8
    expected = scaled.masked_fill(scaled < scaled.topk(5, dim=-1).values[:, -1:], float("-inf"))
    expected = expected.softmax(dim=-1)
    return first / first.sum(), second / second.sum(), expected[0], expected[1]


def test_rejection_sampler_keeps_the_target_distribution():
    first, second, want_first, want_second = emitted_distributions(RejectionSampler)
    assert total_variation(first, want_first) < TV_BOUND
    assert total_variation(second, want_second) < TV_BOUND
    assert first[5:].sum() == 0  # outside the top 5: never emitted


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_seeded_speculation_draws_the_plain_samplers_tokens(path, monkeypatch):
    """Position by position, the token the plain sampler draws from the same generator: right
    proposals are all kept and the bonus follows, a wrong one ends the run with the plain
    token. On 49,152-token rows of bf16 values (many exact ties), on either drawing path."""
    if path == "torch":
        monkeypatch.setattr("tokenmill.model.sampler.row_kernels", lambda logits: None)
    elif cpu_kernels() is None:
        pytest.skip("no C++ compiler here")
    shapings = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
                SamplingParams(temperature=1.2, top_k=40, min_p=0.01)]
    rejection = RejectionSampler(Sampler(0))
    values = torch.Generator().manual_seed(5)
    for trial in range(100):
        params = shapings[trial % len(shapings)]
        logits = (torch.randn(6, 49152, generator=values) * 3).to(torch.bfloat16).float()
        plain_generator = torch.Generator().manual_seed(trial)
        plain = [rejection.sampler(logits[p:p + 1], [params], [plain_generator]).token_ids[0]
                 for p in range(len(logits))]
        kept = rejection.accept_sampled(plain[:-1], logits, params,
                                        torch.Generator().manual_seed(trial))
        assert kept == plain, trial
        wrong = trial % 5
        proposals = plain[:-1].copy()
        proposals[wrong] = (plain[wrong] + 1) % 49152
        cut = rejection.accept_sampled(proposals, logits, params,
                                       torch.Generator().manual_seed(trial))
        assert cut == plain[:wrong + 1], trial


def test_seeded_speculation_agrees_with_plain_sampling_on_the_boundaries(monkeypatch):
    """Uniform numbers exactly on the boundaries between likely tokens, where two ways of
    inverting the distribution round apart (the kernel and shaped_probs + invert_cdf parted on
    about half of them): the rejection sampler still draws the plain sampler's token."""
    uniforms: list[float] = []

    def next_uniforms(generators):
        return torch.tensor([uniforms.pop(0) for _ in generators], dtype=torch.float64)

    monkeypatch.setattr("tokenmill.model.sampler.draw_uniforms", next_uniforms)
    monkeypatch.setattr("tokenmill.spec.rejection.draw_uniforms", next_uniforms)
    params = SamplingParams(temperature=1.0)
    rejection = RejectionSampler(Sampler(0))
    values = torch.Generator().manual_seed(5)
    for _ in range(40):
        logits = (torch.randn(1, 49152, generator=values) * 3).to(torch.bfloat16).float()
        probs = target_probs(logits, params)[0].double()
        cdf = probs.cumsum(0) / probs.sum()
        for token in probs.topk(5).indices.tolist():
            uniforms[:] = [cdf[token].item()] * 2
            plain = rejection.sampler(logits, [params], [None]).token_ids
            assert rejection.accept_sampled([], logits, params, None) == plain


@pytest.mark.parametrize("broken", [AcceptAlways, ResampleFromTarget])
def test_the_distribution_test_catches_a_broken_sampler(broken):
    # Fewer draws suffice: these miss by TV 0.18 (redrawing from p) and 0.74 (accepting all).
    first, second, want_first, want_second = emitted_distributions(broken, num_samples=2000)
    assert max(total_variation(first, want_first),
               total_variation(second, want_second)) > TV_BOUND


def test_greedy_verification_keeps_the_agreeing_prefix_and_the_next_target_token():
    logits = torch.full((4, VOCAB), -1.0)
    for row, token in enumerate([3, 5, 2, 7]):
        logits[row, token] = 1.0
    request = Request("r:0", [1], SamplingParams(temperature=0.0), frozenset(), 100)
    request.spec_token_ids = [3, 5, 6]
    [emitted], _ = RejectionSampler(Sampler(0))(logits, [ScheduledChunk(request, 4, 3)])
    assert emitted == [3, 5, 2]


# ---- proposers, throttle, flags -----------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_longest_match():
    proposer = NgramProposer(ngram_max=3, ngram_min=1)
    assert proposer.propose([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3], 2) == [5, 6]
    assert proposer.propose([7, 8, 9, 7, 8], 3) == [9, 7, 8]
    assert proposer.propose([4, 5, 6], 3) == []
    assert NgramProposer(ngram_max=3, ngram_min=2).propose([1, 2, 9, 2], 2) == []


def test_throttle_follows_acceptance_and_step_cost():
    throttle = SpeculationThrottle(4, disable_batch_size=8)
    for tokens in (1, 5, 1, 5, 32, 160):  # 10 ms per step and 1 ms per token
        throttle.step_cost.observe(tokens, 0.010 + 0.001 * tokens)
    assert throttle.step_cost.per_token == pytest.approx(0.001)
    assert throttle.num_tokens(1) == 4  # a token costs 1 ms, a step 11 ms: any rate pays
    assert throttle.num_tokens(9) == 0  # above the disable batch size
    for _ in range(100):
        throttle.observe_acceptance(4, 0)  # nothing is ever accepted
    assert throttle.num_tokens(1) == 0
    probes = [throttle.num_tokens(1) for _ in range(PROBE_INTERVAL)]
    assert sorted(probes) == [0] * (PROBE_INTERVAL - 1) + [1]  # one probe in every interval
    for _ in range(100):
        throttle.observe_acceptance(4, 4)
    assert throttle.num_tokens(1) == 4
    assert throttle.num_tokens(8) == 4  # 8 tokens cost 8 ms < 18 ms gained at full acceptance


def test_throttle_measures_a_proposal_before_trusting_it():
    """With every timed step of one size the slope is unknown, not zero: the throttle
    alternates all and no proposals until two sizes were timed, then decides by cost."""
    throttle = SpeculationThrottle(4, disable_batch_size=None)
    throttle.step_cost.observe(80, 0.150)  # 16 requests x (1 + 4), as when speculation starts
    assert not throttle.step_cost.measured
    assert [throttle.num_tokens(16) for _ in range(4)] == [4, 0, 4, 0]
    throttle.step_cost.observe(16, 0.050)  # a plain step: a token now costs ~1.6 ms
    assert throttle.step_cost.measured
    for _ in range(100):
        throttle.observe_acceptance(4, 0)  # 1 in 4 accepted at the first position only
        throttle.observe_acceptance(4, 0)
        throttle.observe_acceptance(4, 0)
        throttle.observe_acceptance(4, 1)
    assert throttle.num_tokens(16) == 0  # 25% of a 50 ms step < 16 x 1.6 ms


def test_engine_times_only_decode_steps_for_the_throttle(make_llm):
    """Prefill steps run large products at another cost per token; fitting them made a proposed
    token look half as costly as it is at decode."""
    llm = make_llm(speculative_method="ngram", num_speculative_tokens=2)
    observed: list[int] = []
    speculator = llm.engine.speculator
    original = speculator.observe_step
    speculator.observe_step = lambda tokens, seconds: (observed.append(tokens),
                                                       original(tokens, seconds))
    prompts = varied_prompts(3)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    decode_most = len(prompts) * (1 + 2)  # every request's last token and its 2 proposals
    assert sum(len(llm.engine.tokenize(p)) for p in prompts) > decode_most
    assert observed and max(observed) <= decode_most  # the prefill step was not timed


def test_a_draft_with_another_vocabulary_is_refused(smollm):
    other = dataclasses.replace(smollm, config=dataclasses.replace(smollm.config,
                                                                   vocab_size=32000))
    with pytest.raises(ValueError, match="speculative_model='other'.*vocabulary"):
        check_same_vocabulary(smollm, other, "other")
    check_same_vocabulary(smollm, smollm, DEFAULT_MODEL)


@pytest.mark.parametrize("options, name", [
    (dict(speculative_method="medusa"), "speculative_method"),
    (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative_method="ngram", ngram_min=3, ngram_max=2), "ngram_max"),
    (dict(speculative_method="draft"), "speculative_model"),
    (dict(speculative_method="ngram", speculative_model="x"), "speculative_model"),
    (dict(speculative_method="ngram", speculative_draft_layers=2), "speculative_draft_layers"),
    (dict(speculative_method="self", speculative_quantization="gguf"),
     "speculative_quantization"),
    (dict(speculative_disable_batch_size=0), "speculative_disable_batch_size"),
])
def test_bad_speculative_options_name_the_parameter(options, name):
    with pytest.raises(ValueError, match=f"invalid engine option {name}="):
        EngineConfig(**options)


def test_flags_reach_the_engine_config():
    args = build_parser().parse_args(
        ["generate", "hi", "--speculative-method", "draft", "--speculative-model", "m",
         "--num-speculative-tokens", "3", "--ngram-max", "5", "--ngram-min", "2",
         "--speculative-disable-batch-size", "16", "--no-speculative-adaptive"])
    config = engine_config_from_args(args)
    assert (config.speculative_method, config.speculative_model, config.num_speculative_tokens,
            config.ngram_max, config.ngram_min, config.speculative_disable_batch_size,
            config.speculative_adaptive) == ("draft", "m", 3, 5, 2, 16, False)
