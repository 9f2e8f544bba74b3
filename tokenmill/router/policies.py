"""Routing policies: which healthy worker takes a request, and the name of the decision made.

- round_robin: each worker in turn.
- least_load: the worker with the fewest requests in flight.
- cache_aware: SGLang's rule. Each worker has a RadixTree of the prompts sent to it. When load
  is imbalanced (max - min > balance_abs_threshold and max > balance_rel_threshold * min) the
  least-loaded worker wins; otherwise the worker whose tree matches the longest prefix wins if
  the match covers more than cache_threshold of the prompt, and else the worker with the
  smallest tree (the most room for a new prefix). The chosen worker's tree records the prompt.
- prompt_length: prompts of at least long_prompt_threshold characters go to the workers tagged
  #long and the others to the untagged ones (least-loaded within each); a class with no healthy
  worker falls back to every healthy worker.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from tokenmill.router.radix_tree import RadixTree
from tokenmill.router.workers import Worker

POLICIES = ("round_robin", "least_load", "cache_aware", "prompt_length")


@dataclass(frozen=True, slots=True)
class PolicySettings:
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    cache_threshold: float = 0.5
    max_tree_chars: int = 2_000_000  # per worker: about 500,000 tokens of prompt text
    long_prompt_threshold: int = 8000  # characters

    def __post_init__(self) -> None:
        for name, ok, rule in (
                ("balance_abs_threshold", self.balance_abs_threshold >= 0, ">= 0"),
                ("balance_rel_threshold", self.balance_rel_threshold >= 1, ">= 1"),
                ("cache_threshold", 0 <= self.cache_threshold <= 1, "in [0, 1]"),
                ("max_tree_chars", self.max_tree_chars >= 1, ">= 1"),
                ("long_prompt_threshold", self.long_prompt_threshold >= 1, ">= 1")):
            if not ok:
                raise ValueError(f"invalid router option {name}={getattr(self, name)!r}: "
                                 f"must be {rule}")


class Policy:
    name: str

    def choose(self, workers: list[Worker], text: str) -> tuple[Worker, str]:
        """`workers` are the healthy candidates (never empty); returns (worker, decision)."""
        raise NotImplementedError

    def forget(self, worker: Worker) -> None:
        """The worker went down or came back: whatever was known of its cache is stale."""


def least_loaded(workers: list[Worker]) -> Worker:
    return min(workers, key=lambda w: w.load)


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, workers: list[Worker], text: str) -> tuple[Worker, str]:
        return workers[next(self._turn) % len(workers)], "next_in_turn"


class LeastLoad(Policy):
    name = "least_load"

    def choose(self, workers: list[Worker], text: str) -> tuple[Worker, str]:
        return least_loaded(workers), "least_load"


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(self, settings: PolicySettings) -> None:
        self.settings = settings
        self.trees: dict[str, RadixTree] = {}

    def tree(self, worker: Worker) -> RadixTree:
        if worker.url not in self.trees:
            self.trees[worker.url] = RadixTree(self.settings.max_tree_chars)
        return self.trees[worker.url]

    def imbalanced(self, workers: list[Worker]) -> bool:
        loads = [w.load for w in workers]
        most, least = max(loads), min(loads)
        return most - least > self.settings.balance_abs_threshold \
            and most > self.settings.balance_rel_threshold * least

    def choose(self, workers: list[Worker], text: str) -> tuple[Worker, str]:
        if self.imbalanced(workers):
            chosen, decision = least_loaded(workers), "balance"
        else:
            # Longest match first, then the lighter load; `max` keeps the first of equals.
            matched, chosen = max(((self.tree(w).match(text), w) for w in workers),
                                  key=lambda pair: (pair[0], -pair[1].load))
            if text and matched / len(text) > self.settings.cache_threshold:
                decision = "cache_hit"
            else:
                chosen = min(workers, key=lambda w: (self.tree(w).num_chars, w.load))
                decision = "new_prefix"
        self.tree(chosen).insert(text)
        return chosen, decision

    def forget(self, worker: Worker) -> None:
        self.trees.pop(worker.url, None)


class PromptLength(Policy):
    name = "prompt_length"

    def __init__(self, settings: PolicySettings) -> None:
        self.threshold = settings.long_prompt_threshold

    def choose(self, workers: list[Worker], text: str) -> tuple[Worker, str]:
        long_prompt = len(text) >= self.threshold
        matching = [w for w in workers if w.long_context == long_prompt]
        if not matching:
            return least_loaded(workers), "fallback"
        return least_loaded(matching), "long" if long_prompt else "short"


def make_policy(name: str, settings: PolicySettings) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "cache_aware":
        return CacheAware(settings)
    if name == "prompt_length":
        return PromptLength(settings)
    raise ValueError(f"invalid router option policy={name!r}: must be one of "
                     f"{', '.join(POLICIES)}")
