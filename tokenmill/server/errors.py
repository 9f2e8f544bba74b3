"""API errors in OpenAI's JSON shape, {"error": {"message", "type", "param", "code"}}, and the
FastAPI handlers that turn every failure, validation errors included, into that shape."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tokenmill.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("tokenmill.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    @classmethod
    def bad_request(cls, error: ValueError, code: str | None = None) -> "APIError":
        """A 400 from a ValueError of our own validation; its message names the parameter."""
        found = re.search(r"parameter (\w+)=", str(error))
        return cls(400, str(error), param=found.group(1) if found else None, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), self.status,
                            headers=self.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        location = [str(part) for part in first["loc"] if part != "body"]
        param = ".".join(location) or None
        return APIError(400, f"invalid request: {param or 'body'}: {first['msg']}",
                        param=param).response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return APIError(error.status_code, str(error.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return APIError(500, f"internal error: {error}", type="internal_server_error").response()
