"""A real `tokenmill serve` process on a free loopback port, for the end-to-end server tests.

Tests run the real SmolLM2 weights in fp32 with one torch thread. Starting and stopping are
tokenmill.bench.launch's, as for the servers `tokenmill bench` starts. `stop()` sends SIGTERM and
returns the log, so a test can check that the shutdown was graceful and every KV block came back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tokenmill.bench.launch import LaunchedServer, free_port, launch, tokenmill_command

REPO_ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 240


@dataclass
class ServerProcess(LaunchedServer):
    def stop(self) -> str:  # type: ignore[override]
        """SIGTERM, as an operator would send, then the whole log."""
        super().stop()
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


# fp32 keeps greedy output exact; one torch thread leaves the other core to the test clients.
TEST_FLAGS = ("--dtype", "float32", "--num-threads", "1", "--log-interval", "2")


def start_server(log_path: Path, *flags: str,
                 base_flags: tuple[str, ...] = TEST_FLAGS) -> ServerProcess:
    port = free_port()
    server = launch("tokenmill", tokenmill_command(port, *base_flags, *flags), port, log_path,
                    start_timeout_s=START_TIMEOUT_S)
    return ServerProcess(server.name, server.process, server.base_url, server.log_path)
