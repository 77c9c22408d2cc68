"""The server's refusals in OpenAI's error shape: what a route raises (``BadRequest``,
``ModelNotFound``) and the response every refusal becomes (``error_response``)."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class BadRequest(Exception):
    """A request the engine refuses: ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(Exception):
    """A request for a model this server does not serve (404, as OpenAI answers)."""


def error_response(
    message: str, param: str | None, status: int = 400, code: str | None = None
) -> JSONResponse:
    """``{"error": {...}}`` with ``status``: the message, ``invalid_request_error``, the
    field it names (or None) and OpenAI's code where there is one."""
    body = {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    return JSONResponse({"error": body}, status_code=status)
