"""Loading and unloading LoRA adapters while serving: ``POST /v1/load_lora_adapter``
(``{"lora_name", "lora_path"}``) and ``POST /v1/unload_lora_adapter`` (``{"lora_name"}``),
vLLM's routes and bodies.

Off unless the server was started with ``--allow-runtime-lora``: a client then names a
folder on the server's machine, which only its operator should allow (vLLM asks for an
environment variable). Until then both answer 403 naming the flag.

Guarantees: a loaded adapter is listed by ``/v1/models`` and requests may name it as
their ``model`` once the load has answered 200; an unloaded one is gone from both once
the unload has (requests it already runs finish with it; one in use by running requests
is refused, 409). Each refusal is in OpenAI's error shape and names its field: the
adapter's folder where the adapter does not fit the model (its rank, its target modules,
its shapes), the name where it is taken (by a loaded adapter, or the served model).
"""

from __future__ import annotations

from typing import Protocol

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from ostinato.engine.api.lora_registry import AdapterInUse, LoraNotEnabled, UnknownAdapter
from ostinato.engine.loading.peft_adapter import LoraAdapterError
from ostinato.engine.serve.bodies import LoadLoraBody, UnloadLoraBody
from ostinato.engine.serve.errors import error_response

FLAG = "--allow-runtime-lora"


class LoraEngine(Protocol):
    """What these routes need of the server's engine (``app.Engine`` has it)."""

    async def aload_lora(self, name: str, path: str) -> None: ...

    async def aunload_lora(self, name: str) -> None: ...


def add_lora_routes(app: FastAPI, engine: LoraEngine, model_name: str, allowed: bool) -> None:
    """The two routes of the module docstring on ``app``, over ``engine``, which serves
    ``model_name``; ``allowed``: whether the server was started with ``FLAG`` (without
    it both answer 403 whatever the body)."""
    if not allowed:
        for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            app.post(route)(_off)
        return

    @app.post("/v1/load_lora_adapter")
    async def load(body: LoadLoraBody) -> Response:
        name = body.lora_name
        if name == model_name:
            return error_response(f"lora_name: {name!r} is the served model's name", "lora_name")
        try:
            await engine.aload_lora(name, body.lora_path)
        except LoraNotEnabled as exc:
            return error_response(f"{exc} (ostinato serve: --enable-lora)", None)
        except LoraAdapterError as exc:
            return error_response(str(exc), "lora_path")
        except ValueError as exc:  # (the name: taken, or not a name)
            return error_response(str(exc), "lora_name")
        except Exception as exc:  # (what reading the files raised: a broken file)
            why = f"lora_path: LoRA adapter {name!r} could not be read: {type(exc).__name__}: {exc}"
            return error_response(why, "lora_path")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload(body: UnloadLoraBody) -> Response:
        name = body.lora_name
        try:
            await engine.aunload_lora(name)
        except UnknownAdapter as exc:
            return error_response(str(exc), "lora_name", 404, "model_not_found")
        except AdapterInUse as exc:
            return error_response(str(exc), "lora_name", 409)
        except LoraNotEnabled as exc:
            return error_response(f"{exc} (ostinato serve: --enable-lora)", None)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _off() -> JSONResponse:
    message = f"loading LoRA adapters while serving is off; start the server with {FLAG}"
    return error_response(message, None, 403, "runtime_lora_disabled")
