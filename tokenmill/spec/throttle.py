"""SpeculationThrottle: how many tokens to propose on the next step, from load and acceptance.

With B running requests a target step costs about fixed + per_token * tokens seconds, a line fit
online to the engine's own decode steps (prefill steps run large products at another cost per
token, and fitting them too read a proposed token as half its decode cost). Until two step sizes
were seen the slope is unknown, and the throttle alternates all and no proposals to learn it.
Proposal position i adds B tokens to the verifying step (per_token * B) and, for a draft model, one
draft pass; it gains B * r_i tokens in expectation, r_i being the product of the measured
acceptance rates of positions 1..i, and each token is worth a plain step's cost / B. So position i
is proposed while r_i * cost(B) >= per_token * B + draft pass. When that rules out everything, one
position is still proposed every PROBE_INTERVAL steps so acceptance stays measured. Above
`speculative_disable_batch_size` running requests nothing is proposed. With `speculative_adaptive`
off, only that load limit applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_ACCEPTANCE = 0.7  # before anything is measured: optimistic enough to try every position
SMOOTHING = 0.05  # weight of each new observation in the running averages
COST_DECAY = 0.98  # forgetting factor of the step-cost fit, per step
PROBE_INTERVAL = 16
MIN_TOKENS_VARIANCE = 1.0  # of step sizes, in tokens squared: below it the slope is unknown


@dataclass(slots=True)
class StepCostModel:
    """seconds = fixed + per_token * tokens, least squares with exponential forgetting."""
    weight: float = 0.0
    sum_tokens: float = 0.0
    sum_seconds: float = 0.0
    sum_tokens_sq: float = 0.0
    sum_tokens_seconds: float = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        self.weight = self.weight * COST_DECAY + 1.0
        self.sum_tokens = self.sum_tokens * COST_DECAY + num_tokens
        self.sum_seconds = self.sum_seconds * COST_DECAY + seconds
        self.sum_tokens_sq = self.sum_tokens_sq * COST_DECAY + num_tokens * num_tokens
        self.sum_tokens_seconds = self.sum_tokens_seconds * COST_DECAY + num_tokens * seconds

    def _tokens_variance(self) -> float:
        mean_tokens = self.sum_tokens / self.weight
        return self.sum_tokens_sq / self.weight - mean_tokens ** 2

    @property
    def measured(self) -> bool:
        """Steps of different sizes were seen, so the slope means something."""
        return self.weight > 0.0 and self._tokens_variance() >= MIN_TOKENS_VARIANCE

    @property
    def per_token(self) -> float:
        """Seconds one more token adds to a step; 0 until steps of different sizes were seen."""
        if not self.measured:
            return 0.0
        mean_tokens = self.sum_tokens / self.weight
        variance = self._tokens_variance()
        covariance = self.sum_tokens_seconds / self.weight - mean_tokens * self.sum_seconds \
            / self.weight
        return max(covariance / variance, 0.0)

    def seconds(self, num_tokens: int) -> float:
        if self.weight == 0.0:
            return 0.0
        mean_tokens, mean_seconds = self.sum_tokens / self.weight, self.sum_seconds / self.weight
        return max(mean_seconds + self.per_token * (num_tokens - mean_tokens),
                   self.per_token * num_tokens)


@dataclass(slots=True)
class SpeculationThrottle:
    num_speculative_tokens: int
    disable_batch_size: int | None
    adaptive: bool = True
    step_cost: StepCostModel = field(default_factory=StepCostModel)
    draft_pass_seconds: float = 0.0  # one draft forward over the batch; 0 for n-gram
    acceptance: list[float] = field(default_factory=list)  # P(accept i | accepted all before)
    steps_since_proposal: int = 0
    exploring: bool = False  # the last step proposed while the step cost was unmeasured

    def __post_init__(self) -> None:
        self.acceptance = [PRIOR_ACCEPTANCE] * self.num_speculative_tokens

    def num_tokens(self, num_running: int) -> int:
        """Proposals per request for the next step."""
        if self.disable_batch_size is not None and num_running > self.disable_batch_size:
            return 0
        if not self.adaptive:
            return self.num_speculative_tokens
        if not self.step_cost.measured:
            # Until decode steps of two sizes were timed, a proposal's cost is unknown (a slope
            # of 0 would call it free): alternate all and none, so the next steps measure it.
            self.exploring = not self.exploring
            return self.num_speculative_tokens if self.exploring else 0
        plain = self.step_cost.seconds(num_running)
        extra = self.step_cost.per_token * num_running + self.draft_pass_seconds
        count, reach = 0, 1.0
        for rate in self.acceptance:
            reach *= rate
            if reach * plain < extra:
                break
            count += 1
        if count:
            self.steps_since_proposal = 0
            return count
        self.steps_since_proposal += 1
        if self.steps_since_proposal >= PROBE_INTERVAL:
            self.steps_since_proposal = 0
            return 1
        return 0

    def observe_acceptance(self, num_proposed: int, num_accepted: int) -> None:
        # Positions after the first rejection were never judged, so they teach nothing.
        for position in range(min(num_proposed, num_accepted + 1)):
            accepted = float(position < num_accepted)
            self.acceptance[position] += SMOOTHING * (accepted - self.acceptance[position])

    def observe_draft_pass(self, seconds: float) -> None:
        if self.draft_pass_seconds == 0.0:
            self.draft_pass_seconds = seconds
        else:
            self.draft_pass_seconds += SMOOTHING * (seconds - self.draft_pass_seconds)
