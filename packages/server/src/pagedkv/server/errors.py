"""Every error leaves the server in OpenAI's shape: ``{"error": {message, type, param, code}}``.

OpenAI's client libraries read `error.message` to build their exceptions, so a user sees our
message, not a generic "422 Unprocessable Entity". FastAPI's 422 for a body that fails
validation becomes a 400 (OpenAI's status for an invalid value). Anything we did not foresee is
logged with its traceback and answered with a 500 in the same shape, never with a bare text page.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error with an HTTP status that the handlers turn into OpenAI's error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status_code, "invalid_request_error")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def error_body(
    status_code: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    type: str | None = None,
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": type or _TYPES.get(status_code, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(status_code: int, message: str, **kw: Any) -> JSONResponse:
    return JSONResponse(error_body(status_code, message, **kw), status_code=status_code)


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable sentence from pydantic's error list, and the first offending field."""
    parts: list[str] = []
    param: str | None = None
    # A value that fails every branch of a union (text or a list of parts) gets an error per
    # branch: the one that says what is wrong with the value itself comes first.
    errors = sorted(exc.errors(), key=lambda e: e.get("type") != "value_error")
    for err in errors:
        if err.get("type") == "json_invalid":
            return "the request body is not valid JSON: " + str(
                err.get("ctx", {}).get("error", "")
            ), None
        # Keep field names and list indexes; drop pydantic's union-branch tags ("list[int]").
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and _is_location(x)]
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        msg = str(err.get("msg", "invalid value"))
        part = f"{where}: {msg}" if where else msg
        if part not in parts:
            parts.append(part)
        if len(parts) == 4:
            break
    text = "; ".join(parts)
    return (text or "invalid request"), param


def _is_location(x: object) -> bool:
    return isinstance(x, int) or (isinstance(x, str) and _NAME.fullmatch(x) is not None)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception the app can raise to OpenAI's error shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(
            exc.status_code, exc.message, param=exc.param, code=exc.code, type=exc.type
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = error_response(exc.status_code, str(exc.detail))
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}")
