"""``ostinato serve``: the engine in a process of its own, the app over it, run by uvicorn
until SIGINT or SIGTERM, then drained.

The drain: the first signal stops accepting connections; requests in flight go on for
``shutdown_timeout`` seconds, and those still running then are ended by the engine with
finish reason ``abort`` (a stream gets its last event and ``[DONE]``), so every client
gets a whole answer; a second signal ends them at once. The process then stops the
engine and exits 0.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from collections.abc import Callable
from types import FrameType

import uvicorn

from ostinato.engine.serve.app import build_app
from ostinato.engine.serve.engine_process import EngineProcess

logger = logging.getLogger(__name__)
BACKSTOP_S = 1.5  # after the aborts, how long uvicorn waits before cancelling what is left


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the drain of the module docstring: ``abort_all`` ends every
    request in flight, ``grace`` seconds after the first signal or at the second."""

    def __init__(self, config: uvicorn.Config, abort_all: Callable[[], None], grace: float) -> None:
        super().__init__(config)
        self._abort_all, self._grace = abort_all, grace
        self._timer: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """A first signal stops accepting and starts the grace timer; a second ends every
        request in flight at once."""
        # (Not uvicorn's: its second Ctrl-C cancels the streams mid-answer, and the
        # signals it captured are raised again at its end, a non-zero exit.)
        if self.should_exit:
            self._abort_now()
            return
        self.should_exit = True
        self._timer = threading.Timer(self._grace, self._abort_now)
        self._timer.daemon = True
        self._timer.start()

    def _abort_now(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        try:
            self._abort_all()
        except Exception as exc:  # the engine is gone: nothing is left to end
            logger.warning("ostinato: ending the requests in flight failed: %s", exc)


def exposed_without_key(host: str, api_key: str | None) -> bool:
    """Whether ``host`` is reachable from other machines and no key guards it."""
    if api_key:
        return False
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost
        return True


def serve(
    engine: EngineProcess,
    model_name: str,
    host: str,
    port: int,
    *,
    api_key: str | None = None,
    max_body_bytes: int,
    shutdown_timeout: float,
    runtime_lora: bool = False,
) -> None:
    """Serves ``engine`` (``EngineProcess.begin``'s: its process may still be building
    it, which ``ready`` waits for), prints its start-up line, and serves until a signal,
    then drains (module docstring) and stops the engine. ``runtime_lora``: clients may
    load and unload LoRA adapters (``lora_routes``)."""
    if exposed_without_key(host, api_key):
        print(
            f"warning: serving on {host} without an API key: anyone who reaches this port "
            "can use the engine (give --api-key or OSTINATO_API_KEY)",
            flush=True,
        )
    try:
        engine.ready()
    except BaseException:  # (a Ctrl-C while it builds, or its failure: nothing to serve)
        engine.abandon()
        raise
    print(engine.startup, flush=True)
    print(f"serving {model_name} at http://{host}:{port}/v1", flush=True)
    app = build_app(
        engine,
        model_name,
        max_body_bytes=max_body_bytes,
        api_key=api_key,
        runtime_lora=runtime_lora,
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=int(shutdown_timeout + BACKSTOP_S + 0.999),
    )
    try:
        DrainingServer(config, engine.abort_all, shutdown_timeout).run()
    finally:
        engine.stop()
