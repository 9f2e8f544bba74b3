"""Starts and stops the servers that sweeps and peer comparisons measure.

A server is a command listening on a free loopback port; it is ready when its health URL answers
200, and stopped with SIGTERM (SIGKILL if it lingers). A server that exits or never gets ready
raises ServerUnavailable with the end of its log, so a comparison can say why and go on.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

import tokenmill

# The checkout (or install) that runs the benchmark also runs the servers it starts.
PACKAGE_ROOT = Path(tokenmill.__file__).resolve().parent.parent


class ServerUnavailable(RuntimeError):
    """A server could not be started; the message says why."""


@dataclass
class LaunchedServer:
    name: str
    process: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 120.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "LaunchedServer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(name: str, command: list[str], port: int, log_path: Path,
           health_path: str = "/health", start_timeout_s: float = 300.0,
           env: dict[str, str] | None = None) -> LaunchedServer:
    """Runs `command` (which must listen on 127.0.0.1:`port`) and waits until it is healthy."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        try:
            process = subprocess.Popen(command, cwd=PACKAGE_ROOT, stdout=log,
                                       stderr=subprocess.STDOUT,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        except OSError as error:
            raise ServerUnavailable(f"{name}: cannot run {command[0]}: {error}") from None
    server = LaunchedServer(name, process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + start_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerUnavailable(f"{name} exited with status {process.returncode} while "
                                    f"starting: {_last_line(server.log())} (log {log_path})\n"
                                    f"{server.log()[-3000:]}")
        try:
            if httpx.get(server.base_url + health_path, timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    raise ServerUnavailable(f"{name} was not ready after {start_timeout_s:.0f} s: "
                            f"{_last_line(server.log())} (log {log_path})\n{server.log()[-3000:]}")


def _last_line(log: str) -> str:
    """The last line a failing server printed: usually the error itself."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def tokenmill_command(port: int, *flags: str) -> list[str]:
    """`tokenmill serve` on `port` with engine and server flags."""
    return [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), *flags]
