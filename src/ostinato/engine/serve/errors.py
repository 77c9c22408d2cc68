"""The server's refusals in OpenAI's error shape: what a route raises (``BadRequest``,
``ModelNotFound``), the response every refusal becomes (``error_response``), and the
app's handlers that make one of each (``add_error_handlers``)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException


class BadRequest(Exception):
    """A request the engine refuses: ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(Exception):
    """A request for a model this server does not serve (404, as OpenAI answers)."""


def error_response(
    message: str,
    param: str | None,
    status: int = 400,
    code: str | None = None,
    kind: str = "invalid_request_error",
) -> JSONResponse:
    """``{"error": {...}}`` with ``status``: the message, its type (``kind``), the field it
    names (or None) and OpenAI's code where there is one."""
    body = {"message": message, "type": kind, "param": param, "code": code}
    return JSONResponse({"error": body}, status_code=status)


def add_error_handlers(app: FastAPI) -> None:
    """``app`` answers a body that fails validation with a 400 naming the field (an unknown
    one as not a parameter; a body that is no JSON object as such), ``BadRequest`` with a
    400 naming its ``param``, ``ModelNotFound`` with OpenAI's 404 ``model_not_found``,
    and an unknown route or method, or a fault of the server's (a 500 of type
    ``server_error``), in OpenAI's error shape too."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":  # (its place: the body and the character)
            why = first.get("ctx", {}).get("error", "invalid")
            return error_response(f"body: not JSON ({why} at character {first['loc'][-1]})", None)
        if tuple(first["loc"]) == ("body",):  # empty, or JSON that is no object
            return error_response("body: a JSON object is required", None)
        param = ".".join(str(p) for p in first["loc"] if p != "body")
        if first["type"] == "extra_forbidden":
            return error_response(f"{param}: not a parameter of this endpoint", param)
        return error_response(f"{param}: {first['msg']}", param or None)

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        # (the server's own fault: its traceback is logged as well, by uvicorn)
        message = f"internal error: {type(exc).__name__}: {exc}"
        return error_response(message, None, 500, kind="server_error")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = f"{exc.detail} ({request.method} {request.url.path})"
        response = error_response(message, None, exc.status_code)
        response.headers.update(exc.headers or {})  # (a 405's Allow)
        return response

    @app.exception_handler(BadRequest)
    async def refused(request: Request, exc: BadRequest) -> JSONResponse:
        return error_response(str(exc), exc.param)

    @app.exception_handler(ModelNotFound)
    async def not_found(request: Request, exc: ModelNotFound) -> JSONResponse:
        return error_response(str(exc), "model", 404, "model_not_found")
