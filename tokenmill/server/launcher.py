"""`tokenmill serve`: load the engine, say where it listens, run uvicorn until Ctrl-C or SIGTERM.

Uvicorn owns the signals. On the first Ctrl-C or SIGTERM it stops accepting connections and gives
open requests up to the shutdown timeout; the app's lifespan then aborts whatever is left, stops
the engine loop and logs whether every KV block came back.
"""

from __future__ import annotations

import logging

import uvicorn

from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.server.api import ServerSettings, build_app


def serve(config: EngineConfig, host: str, port: int, settings: ServerSettings) -> None:
    package_logger = logging.getLogger("tokenmill")
    if not package_logger.handlers:  # the `tokenmill` command installs one; other callers may not
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        package_logger.addHandler(handler)
        package_logger.setLevel(logging.INFO)
    engine = LLMEngine(config)
    app = build_app(engine, settings)
    runner = engine.runner
    print(f"tokenmill: serving {settings.model_name} ({str(runner.dtype).removeprefix('torch.')})"
          f" at http://{host}:{port}/v1 -- KV cache {runner.kv_capacity_tokens:,} tokens "
          f"({runner.num_blocks:,} blocks of {runner.block_size}), max_model_len "
          f"{engine.max_model_len:,}, API key {'on' if settings.api_keys else 'off'}",
          flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="info",
                    timeout_graceful_shutdown=settings.shutdown_timeout)
    finally:
        engine.shutdown()
