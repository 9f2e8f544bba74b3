"""`tokenmill serve --data-parallel-size N`: N engine processes on free loopback ports, each with
its share of the CPU threads, and the router in front of them, stopped together.

Replicas run in their own process group (setsid), so a Ctrl-C at the terminal reaches the router alone; the
router then drains its open requests and sends each replica one SIGTERM, which it drains in
turn. Replicas die with the router however it ends (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import socket
import subprocess
import sys
import time

import httpx

from tokenmill.distributed.worker import die_with_parent
from tokenmill.router.app import RouterSettings
from tokenmill.router.launcher import run_router

logger = logging.getLogger("tokenmill.router")

START_TIMEOUT_S = 600
STOP_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_data_parallel(replica_flags: list[list[str]], settings: RouterSettings, host: str,
                      port: int, shutdown_timeout: float) -> None:
    """`replica_flags`: each replica's `tokenmill serve` flags, without --host and --port."""
    replicas: list[subprocess.Popen] = []
    urls: list[str] = []
    try:
        for flags in replica_flags:
            replica_port = free_port()
            replicas.append(subprocess.Popen(
                [sys.executable, "-m", "tokenmill.cli", "serve", "--host", "127.0.0.1",
                 "--port", str(replica_port), *flags],
                start_new_session=True, preexec_fn=die_with_parent))
            urls.append(f"http://127.0.0.1:{replica_port}")
        _wait_healthy(replicas, urls)
        run_router(dataclasses.replace(settings, workers=urls), host, port, shutdown_timeout)
    finally:
        for replica in replicas:
            if replica.poll() is None:
                replica.send_signal(signal.SIGTERM)
        for replica in replicas:
            try:
                replica.wait(STOP_TIMEOUT_S + shutdown_timeout)
            except subprocess.TimeoutExpired:
                replica.kill()
                replica.wait()


def _wait_healthy(replicas: list[subprocess.Popen], urls: list[str]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    waiting = dict(zip(urls, replicas))
    while waiting:
        for url, replica in list(waiting.items()):
            if replica.poll() is not None:
                raise RuntimeError(f"replica {url} exited with code {replica.returncode} while "
                                   "starting; its log is above")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    del waiting[url]
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"replicas {list(waiting)} did not start in {START_TIMEOUT_S} s")
        time.sleep(0.5)
    logger.info("%d replicas ready: %s", len(urls), ", ".join(urls))

