"""`tokenmill bench sweep`: tokenmill servers over a grid of settings, each started and stopped
here.

The baseline runs with the base flags; then each toggle (a group of `tokenmill serve` flags, such
as "--no-enable-prefix-caching" or "--quantization int8") is added alone, then all of them
together. Every variant runs the same workload at every concurrency.
"""

from __future__ import annotations

import shlex

from tokenmill.bench.grid import ServerPlan
from tokenmill.bench.launch import tokenmill_command
from tokenmill.bench.peers import GREEDY_FULL_LENGTH, PeerServer


def sweep_plans(model: str, base_flags: str = "",
                toggles: tuple[str, ...] = ()) -> list[ServerPlan]:
    variants = [("baseline", "")] + [(toggle, toggle) for toggle in toggles]
    if len(toggles) > 1:
        variants.append(("all toggles", " ".join(toggles)))
    return [_plan(model, label, shlex.split(base_flags) + shlex.split(flags))
            for label, flags in variants]


def _plan(model: str, label: str, flags: list[str]) -> ServerPlan:
    def start(port: int) -> PeerServer:
        return PeerServer(tokenmill_command(port, model, *flags), model, GREEDY_FULL_LENGTH)
    return ServerPlan(label, start)
