"""`tokenmill router`: say where the router listens and over which workers, run uvicorn."""

from __future__ import annotations

import uvicorn

from tokenmill.router.app import RouterSettings, build_router_app


def run_router(settings: RouterSettings, host: str, port: int,
               shutdown_timeout: float = 30.0) -> None:
    app = build_router_app(settings)
    print(f"tokenmill: router at http://{host}:{port}/v1 over {len(settings.workers)} workers "
          f"({', '.join(settings.workers)}), policy {settings.policy}", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="info",
                timeout_graceful_shutdown=shutdown_timeout)
