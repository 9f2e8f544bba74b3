"""RouterSettings: every router option in one dataclass, and the flags that set them (shared by
`tokenmill router` and `tokenmill serve --data-parallel-size`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from tokenmill.router.policies import POLICIES, PolicySettings


@dataclass(slots=True)
class RouterSettings:
    workers: list[str]  # URL or URL#long
    policy: str = "cache_aware"
    policy_settings: PolicySettings = field(default_factory=PolicySettings)
    health_check_interval: float = 2.0  # seconds
    request_timeout: float = 600.0  # seconds without a byte from a worker

    def __post_init__(self) -> None:
        if self.health_check_interval <= 0:
            raise ValueError(f"invalid router option health_check_interval="
                             f"{self.health_check_interval}: must be > 0 seconds")


def router_settings(args: argparse.Namespace, workers: list[str]) -> RouterSettings:
    """The settings the parsed flags of add_router_args give, over these workers."""
    policy = PolicySettings(balance_abs_threshold=args.balance_abs_threshold,
                            balance_rel_threshold=args.balance_rel_threshold,
                            cache_threshold=args.cache_threshold,
                            max_tree_chars=args.max_tree_chars,
                            long_prompt_threshold=args.long_prompt_threshold)
    return RouterSettings(workers=workers, policy=args.policy, policy_settings=policy,
                          health_check_interval=args.health_check_interval)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    defaults = PolicySettings()
    parser.add_argument("--policy", choices=POLICIES, default="cache_aware",
                        help="how the router picks a worker (default: cache_aware)")
    parser.add_argument("--balance-abs-threshold", type=int,
                        default=defaults.balance_abs_threshold,
                        help="cache_aware balances load once max - min in-flight requests "
                        "exceeds this ...")
    parser.add_argument("--balance-rel-threshold", type=float,
                        default=defaults.balance_rel_threshold,
                        help="... and max exceeds this times min")
    parser.add_argument("--cache-threshold", type=float, default=defaults.cache_threshold,
                        help="cache_aware follows a prefix match covering more than this "
                        "fraction of the prompt; else the worker with the smallest tree")
    parser.add_argument("--max-tree-chars", type=int, default=defaults.max_tree_chars,
                        help="characters of prompt text remembered per worker (LRU)")
    parser.add_argument("--long-prompt-threshold", type=int,
                        default=defaults.long_prompt_threshold,
                        help="prompt_length sends prompts of this many characters or more to "
                        "workers tagged URL#long")
    parser.add_argument("--health-check-interval", type=float, default=2.0,
                        help="seconds between health checks of the workers")
