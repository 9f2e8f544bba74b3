"""A real `tokenmill serve` process on a free loopback port, for the end-to-end server tests.

Tests run the real SmolLM2 weights in fp32 with one torch thread. `stop()` sends SIGTERM and
returns the log, so a test module can check that the shutdown was graceful and every KV block
came back.
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

REPO_ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 240


@dataclass
class ServerProcess:
    process: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> str:
        """SIGTERM, as an operator would send, then the whole log."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.log()

    def metrics(self) -> dict[str, float]:
        """The /metrics samples as {'name{labels}': value}, with the model_name label dropped."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=30).text
        samples = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, _, value = line.rpartition(" ")
            name = name.replace('model_name="smollm2-135m-instruct"', "")
            name = name.replace("{,", "{").replace(",}", "}").replace("{}", "")
            samples[name] = float(value)
        return samples


    def wait_until_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """The metrics once nothing runs or waits and the KV cache is empty (or at timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            idle = metrics["tokenmill:num_requests_running"] == 0 \
                and metrics["tokenmill:num_requests_waiting"] == 0 \
                and metrics["tokenmill:kv_cache_usage_perc"] == 0
            if idle or time.monotonic() > deadline:
                return metrics
            time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# fp32 keeps greedy output exact; one torch thread leaves the other core to the test clients.
TEST_FLAGS = ("--dtype", "float32", "--num-threads", "1", "--log-interval", "2")


def start_server(log_path: Path, *flags: str,
                 base_flags: tuple[str, ...] = TEST_FLAGS) -> ServerProcess:
    port = free_port()
    command = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port),
               *base_flags, *flags]
    log = log_path.open("w")
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return wait_healthy(ServerProcess(process, f"http://127.0.0.1:{port}", log_path))


def wait_healthy(server: ServerProcess) -> ServerProcess:
    """The server once its /health answers 200; stopped, with its log in the error, otherwise."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited with {server.process.returncode}:\n"
                               f"{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"the server did not start in {START_TIMEOUT_S} s:\n{server.log()}")
