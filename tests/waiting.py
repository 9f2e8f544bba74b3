"""Polling with a bound: a wait that would hang fails its test, naming what it waited for."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(condition: Callable[[], bool], what: str, timeout_s: float = 60.0,
                     interval_s: float = 0.01) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:.0f} s for {what}")
        await asyncio.sleep(interval_s)
