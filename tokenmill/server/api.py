"""The FastAPI app: routes, API-key checks and the lifespan that starts and drains the engine.

Routes stay thin: they authenticate, pick the cache salt and hand over to OpenAIServing. The
lifespan starts the AsyncEngine and the periodic stats log, and on shutdown (after uvicorn has
stopped taking connections and drained the open ones) aborts what is left and reports whether
every KV block came back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

import tokenmill
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.engine import LLMEngine
from tokenmill.server.auth import ApiKeys, cache_salt
from tokenmill.server.errors import APIError, install_error_handlers
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                       DetokenizeRequest, TokenizeRequest)
from tokenmill.server.serving import OpenAIServing

logger = logging.getLogger("tokenmill.server")


@dataclass(slots=True)
class ServerSettings:
    model_name: str
    api_keys: ApiKeys | None = None
    max_waiting_requests: int = 256
    shutdown_timeout: float = 30.0  # seconds running requests get to finish on shutdown
    log_interval: float = 5.0  # seconds between stats log lines


def build_app(engine: LLMEngine, settings: ServerSettings) -> FastAPI:
    metrics = ServerMetrics(settings.model_name)
    async_engine = AsyncEngine(engine, on_step=metrics.observe_step)
    serving = OpenAIServing(async_engine, engine, settings.model_name,
                            settings.max_waiting_requests)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        async_engine.start()
        log_task = asyncio.create_task(_log_stats(metrics, settings.log_interval))
        yield
        log_task.cancel()
        stats = await async_engine.shutdown(settings.shutdown_timeout)
        if stats.num_kv_blocks_used:
            logger.error("shutdown: %d of %d KV blocks still in use", stats.num_kv_blocks_used,
                         stats.num_kv_blocks_total)
        else:
            logger.info("shutdown: all %d KV blocks free", stats.num_kv_blocks_total)

    app = FastAPI(title="tokenmill", version=tokenmill.__version__, lifespan=lifespan)
    install_error_handlers(app)

    def tenant(request: Request) -> str | None:
        if settings.api_keys is None:
            return None
        return settings.api_keys.tenant(request.headers.get("authorization"))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request,
                          caller: str | None = Depends(tenant)) -> Response:
        return await serving.completions(body, cache_salt(caller, body.cache_salt), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               caller: str | None = Depends(tenant)) -> Response:
        return await serving.chat(body, cache_salt(caller, body.cache_salt), request)

    @app.get("/v1/models", dependencies=[Depends(tenant)])
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": settings.model_name, "object": "model", "owned_by": "tokenmill",
            "max_model_len": engine.max_model_len}]}

    @app.post("/tokenize", dependencies=[Depends(tenant)])
    async def tokenize(body: TokenizeRequest) -> dict:
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of 'prompt' and 'messages'", param="prompt")
        if body.messages is not None:
            tokens = serving.encode(serving.chat_prompt(body.messages), add_special_tokens=False)
        else:
            tokens = serving.encode(body.prompt, body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}

    @app.post("/detokenize", dependencies=[Depends(tenant)])
    async def detokenize(body: DetokenizeRequest) -> dict:
        vocab = engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in 0..{vocab - 1}", param="tokens")
        return {"prompt": serving.tokenizer.decode(body.tokens)}

    @app.get("/health")
    async def health() -> Response:
        # Unhealthy too once tensor-parallel workers failed, so a router stops sending here.
        return Response(status_code=200 if async_engine.accepting and engine.healthy else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": tokenmill.__version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.state.async_engine = async_engine
    return app


async def _log_stats(metrics: ServerMetrics, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        line = metrics.log_line()
        if line:
            logger.info(line)

