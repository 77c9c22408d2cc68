"""``EngineProcess``: the engine and its ``EngineLoop`` in a child process; this process
keeps the tokenizer, submits and aborts requests and receives each step's tokens over a
pipe.

Why a process: the HTTP server's event loop turns every token into an event, and in one
interpreter that work and the engine's step loop take turns on the interpreter lock. On
the H200 (1.5 B shape, 32 streaming clients) the server then ran at 0.43 of offline
``generate``. Apart, the engine steps at its own pace and a server that falls behind
sends several tokens per event.

Start-up: ``EngineProcess.begin`` starts the child and returns at once, and this module
imports nothing heavy at its top (the engine, torch, the loop come in where they are
used), so ``ostinato serve`` starts the engine before it imports torch and the web
framework for itself, and the two proceed side by side (``ready`` then waits).

Guarantees: the same as ``EngineLoop`` (``submit`` raises the engine's ``ValueError`` /
``TypeError`` naming the field; a request's tokens are those it gets alone; aborts land
at the next step boundary), plus: if the child dies, every open request ends with
``EngineDead`` and later calls raise it; ``stop`` ends the child's requests (ABORT) and
waits for it to exit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import math
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ostinato import switch_interval
from ostinato.engine.api.early_start import start_early
from ostinato.engine.api.prompts import Prompt, chat_ids, decode_text
from ostinato.engine.core.heap import quiet_start
from ostinato.engine.core.params import SamplingParams

if TYPE_CHECKING:  # (imported where used: see the module docstring)
    from ostinato.engine.serve.loop import EngineLoop, EngineStatus, RequestHandle, TokenEvent

REPLY_TIMEOUT_S = 60.0  # an answer to a submit or a status query (the child is alive)
# While the reader runs: the server's event loop rarely blocks under load, so the reader,
# woken by the engine's events, waited for its interpreter lock up to the default switch
# interval (5 ms): a probe on an H200 (64 streams) put 4.9 ms between the engine's
# publishing a request's first token and its delivery here, and as much on each answer.
SWITCH_INTERVAL_S = 0.0005


class EngineDead(RuntimeError):
    """The engine's process exited or failed to start (the message says how)."""


class EngineProcess:
    """An ``LLM(**llm_kwargs)`` served by an ``EngineLoop`` in a child process (see the
    module docstring). Blocks until the engine is built; ``startup`` is the line
    describing it. ``EngineDead`` if it could not be built (with the child's error)."""

    def __init__(self, llm_kwargs: dict[str, Any], describe: bool = True) -> None:
        self._begin(llm_kwargs, describe)
        self.ready()

    @classmethod
    def begin(cls, llm_kwargs: dict[str, Any], describe: bool = True) -> EngineProcess:
        """Starts the engine's process and returns at once, the engine still building
        there; ``ready`` waits for it. Nothing else may be called before ``ready``."""
        engine = cls.__new__(cls)
        engine._begin(llm_kwargs, describe)
        return engine

    def _begin(self, llm_kwargs: dict[str, Any], describe: bool) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: CUDA cannot be forked
        # One thread at a time waits for the child: two concurrent waitpid calls let the
        # loser see ECHILD and report a reaped child as still running (exit code None).
        self._reap_lock = threading.Lock()
        self._lowered = False  # the switch interval, while this engine's reader runs
        self._conn, child_end = ctx.Pipe()
        self._proc = ctx.Process(
            target=_child, args=(child_end, llm_kwargs, describe), name="ostinato-engine"
        )
        self._proc.start()
        child_end.close()

    def abandon(self) -> None:
        """Ends a process ``begin`` started whose engine will not be served (``ready``
        not called, or interrupted): killed if still running, reaped, its pipe closed."""
        if self._proc.is_alive():
            self._proc.kill()
        self._reap(5)
        self._conn.close()

    def ready(self) -> EngineProcess:
        """Waits until the engine is built (``EngineDead`` if it could not be, with the
        child's error); returns this process."""
        from ostinato.engine.serve.loop import Handles

        try:
            first = self._conn.recv()
        except EOFError:
            raise EngineDead(f"the engine process exited (code {self._reap(5)})") from None
        if first[0] == "failed":
            self._reap(30)
            raise EngineDead(f"the engine could not start:\n{first[1]}") from first[2]
        _, self.tokenizer, self.startup, self.max_model_len, self.lora_names = first
        self._ids = itertools.count()
        self._handles = Handles()
        self._waiting: dict[str, concurrent.futures.Future[Any]] = {}
        self._send_lock = threading.Lock()
        self._dead: EngineDead | None = None
        switch_interval.lower(SWITCH_INTERVAL_S)  # (put back by ``stop``)
        self._lowered = True
        self._reader = threading.Thread(target=self._read, name="ostinato-engine-reader")
        self._reader.daemon = True
        self._reader.start()
        return self

    def decode(self, token_ids: Sequence[int]) -> str:
        return decode_text(self.tokenizer, token_ids)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return chat_ids(self.tokenizer, messages)

    def submit(
        self, prompt: Prompt, params: SamplingParams | None = None, lora: str | None = None
    ) -> RequestHandle:
        """Queues ``prompt`` in the engine (with LoRA adapter ``lora``); returns its
        handle once the engine accepted it (``ValueError`` / ``TypeError`` as the
        engine's checks say)."""
        rid = f"req-{next(self._ids)}"
        return self._handles.open(rid, None, self._enqueue_and_wait, prompt, params, lora)

    async def asubmit(
        self, prompt: Prompt, params: SamplingParams | None = None, lora: str | None = None
    ) -> RequestHandle:
        """``submit`` for asyncio: waits for the engine's answer without blocking."""
        rid = f"req-{next(self._ids)}"
        handle = self._handles.register(rid, asyncio.get_running_loop(), params)
        try:
            asked = self._enqueue(rid, prompt, params, lora)
            handle.accepted(await asyncio.wrap_future(asked))
        except BaseException:
            self._handles.discard(rid)
            raise
        return handle

    async def aload_lora(self, name: str, path: str) -> None:
        """Loads the PEFT adapter at ``path`` (a path on the engine's machine) as
        ``name`` in the engine (``LLM.load_lora``, on a thread of the child, so its steps
        go on); the engine's error where it refuses. ``lora_names`` has it on return."""
        await self._lora_call("load_lora", name, path)

    async def aunload_lora(self, name: str) -> None:
        """Unloads adapter ``name`` in the engine (``LLM.unload_lora``); the engine's
        error where it refuses (``UnknownAdapter``, ``AdapterInUse``)."""
        await self._lora_call("unload_lora", name)

    async def _lora_call(self, kind: str, *args: str) -> None:
        key = f"{kind}-{next(self._ids)}"
        self.lora_names = await asyncio.wrap_future(self._ask(key, (kind, key, *args)))

    def abort(self, request_id: str) -> bool:
        """Asks the engine to end ``request_id`` at its next step boundary (True: asked;
        an id the engine no longer runs is ignored there)."""
        self._send(("abort", request_id))
        return True

    def abort_all(self) -> None:
        """Asks the engine to end every open request at its next step boundary."""
        for request_id in self._handles.ids():
            self.abort(request_id)

    def status(self) -> EngineStatus:
        """The engine now, asked of the child (a round trip over the pipe)."""
        qid = f"status-{next(self._ids)}"
        return self._ask(qid, ("status", qid)).result(REPLY_TIMEOUT_S)

    def stop(self, timeout: float = 60.0) -> bool:
        """Ends every request (ABORT), stops the engine and waits for its process."""
        if self._proc.is_alive():
            try:
                self._send(("stop",))
            except EngineDead:
                pass
        code = self._reap(timeout)
        if code is None:
            self._proc.kill()
            code = self._reap(5)
        self._conn.close()
        if self._lowered:
            self._lowered = False
            switch_interval.restore(SWITCH_INTERVAL_S)
        return code == 0

    def _reap(self, timeout: float) -> int | None:
        """Waits up to ``timeout`` s for the child; its exit code, None while it runs."""
        with self._reap_lock:
            self._proc.join(timeout)
            return self._proc.exitcode

    def _enqueue(
        self, rid: str, prompt: Prompt, params: SamplingParams | None, lora: str | None
    ) -> concurrent.futures.Future[Any]:
        return self._ask(rid, ("submit", rid, prompt, params, lora))

    def _enqueue_and_wait(
        self, rid: str, prompt: Prompt, params: Any, lora: str | None
    ) -> list[int]:
        return self._enqueue(rid, prompt, params, lora).result(REPLY_TIMEOUT_S)

    def _ask(self, key: str, message: tuple[Any, ...]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._waiting[key] = future
        try:
            self._send(message)
        except BaseException:
            self._waiting.pop(key, None)
            raise
        return future

    def _send(self, message: tuple[Any, ...]) -> None:
        if self._dead is not None:
            raise self._dead
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError) as exc:
                raise EngineDead(f"the engine process is gone: {exc}") from None

    def _read(self) -> None:
        """The reader thread: routes the child's messages until the pipe closes."""
        try:
            while True:
                kind, *rest = self._conn.recv()
                if kind == "events":
                    self._handles.deliver(_unwire(rest[0]))
                    continue
                future = self._waiting.pop(rest[0])
                if kind == "refused":
                    future.set_exception(rest[1])
                else:  # "accepted" (the prompt's ids), "status", or "lora" (the names)
                    future.set_result(rest[1])
        except (EOFError, OSError):
            self._dead = EngineDead(f"the engine process exited (code {self._reap(5)})")
            for future in list(self._waiting.values()):
                future.set_exception(self._dead)
            self._waiting.clear()
            self._handles.end_all(self._dead)


def _child(conn: Any, llm_kwargs: dict[str, Any], describe: bool) -> None:
    """The engine process: builds the engine, then answers the parent's messages."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    # tqdm's default lock holds a multiprocessing semaphore, which this process's exit
    # (os._exit, below) would leave for the resource tracker to report as leaked.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    try:
        with quiet_start():  # torch's import and the engine's modules (heap; the build has its own)
            # The device's CUDA context and Triton's set-up are made while torch imports.
            start_early(*_placement(llm_kwargs))
            from ostinato.engine.api.llm import LLM
            from ostinato.engine.serve.loop import EngineLoop

        llm = LLM(**llm_kwargs)
    except BaseException as exc:
        conn.send(("failed", traceback.format_exc(), _portable(exc)))
        return
    lock = threading.Lock()

    def send(message: tuple[Any, ...]) -> None:
        with lock:
            conn.send(message)

    outbox = _Outbox(send)
    loop = EngineLoop(llm, publish=outbox.put)
    described = llm.describe() if describe else ""
    send(("ready", llm.tokenizer, described, loop.max_model_len, llm.lora_names))
    try:
        _answer(conn, loop, send)
    finally:
        stopped = loop.stop()
        outbox.close()  # (the loop's last events, those ending its requests, sent)
        closed = llm.close()
    # Every request is ended, every event sent and the engine released: exit here, not
    # through the interpreter's finalization, whose teardown of torch's and the engine's
    # threads could still hang or crash and turn a clean stop into a failed exit code.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if stopped and closed else 1)


def _placement(llm_kwargs: dict[str, Any]) -> tuple[object, int, object]:
    """The ``device`` an ``LLM(**llm_kwargs)`` runs on, as given (None: the default), its
    number of ranks, and its ``cache_dir`` (the early start points Triton into it)."""
    args = llm_kwargs.get("args")
    if args is not None:
        return args.device, args.parallel.world_size, args.cache_dir
    sizes = (llm_kwargs.get(k, 1) for k in ("tensor_parallel_size", "data_parallel_size"))
    # (A size that is not an int is the engine's to refuse, by name: here it counts as 1.)
    ranks = math.prod(n if isinstance(n, int) else 1 for n in sizes)
    return llm_kwargs.get("device"), ranks, llm_kwargs.get("cache_dir")


def _answer(conn: Any, loop: EngineLoop, send: Any) -> None:
    while True:
        try:
            kind, *rest = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if kind == "stop":
            return
        if kind == "abort":
            loop.abort(rest[0])
        elif kind == "status":
            send(("status", rest[0], loop.status()))
        elif kind == "submit":
            rid, prompt, params, lora = rest
            try:
                send(("accepted", rid, loop.enqueue(rid, prompt, params, lora)))
            except (ValueError, TypeError, RuntimeError) as exc:
                send(("refused", rid, exc))
        elif kind in ("load_lora", "unload_lora"):
            # On a thread: reading an adapter's files takes a while, and submits, aborts
            # and status queries are answered meanwhile.
            args = (loop, kind, rest, send)
            threading.Thread(target=_lora_call, args=args, name="ostinato-lora").start()


def _lora_call(loop: EngineLoop, kind: str, rest: list[Any], send: Any) -> None:
    """``LLM.load_lora`` / ``unload_lora`` for the parent: its answer is the adapters'
    names after it, or the engine's refusal."""
    key, *args = rest
    try:
        getattr(loop.llm, kind)(*args)
        answer: tuple[Any, ...] = ("lora", key, loop.lora_names)
    except Exception as exc:  # (the engine's refusal, raised again in the parent)
        answer = ("refused", key, _portable(exc))
    try:
        send(answer)
    except (OSError, ValueError):  # the parent is gone, or the engine stopped meanwhile
        pass


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives the pipe (pickled and read back), else a ``RuntimeError``
    of its text: the parent raises it as the cause of ``EngineDead``."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


class _Outbox:
    """The engine's events on their way to the parent. The loop's thread hands a step's
    events over without waiting; a thread of its own sends all that gathered as one
    message, in the order they came. Why: the parent reads while its event loop serves
    every stream, and a send blocked on a full pipe would stall the steps."""

    def __init__(self, send: Callable[[tuple[Any, ...]], None]) -> None:
        self._send = send
        self._pending: list[TokenEvent] = []
        self._ready = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ostinato-events", daemon=True)
        self._thread.start()

    def put(self, events: list[TokenEvent]) -> None:
        with self._ready:
            self._pending += events
            self._ready.notify()

    def close(self, timeout: float = 30.0) -> None:
        """Sends what is left, then stops the thread."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._pending or self._closed)
                events, self._pending = self._pending, []
            if not events:
                return  # closed, and everything sent
            try:
                self._send(("events", _wire(events)))
            except (OSError, ValueError):  # (ValueError: the pipe was closed here)
                return  # the parent is gone


Wire = tuple[str, list[int], bool, str | None, str | None, Any, tuple[float, float] | None]
"""A ``TokenEvent`` on the pipe: request id, tokens, ended, finish reason's value, error's
text, log probabilities, the engine's timing (queued, prefill). Why plain tuples: a step's
events are pickled in the engine's process, beside its step thread, and 64 dataclass
events took 46 µs to pickle where these take 11 with their conversion
(``benchmarks/results/serve_ladder_h200/cpu_host_costs``)."""


def _wire(events: list[TokenEvent]) -> list[Wire]:
    """The events as they travel (an error as its text: it may hold anything)."""
    return [
        (
            e.request_id,
            e.tokens,
            e.ended,
            None if e.finish is None else e.finish.value,
            None if e.error is None else str(e.error),
            e.logprobs,
            None if e.timing is None else (e.timing.queued, e.timing.prefill),
        )
        for e in events
    ]


def _unwire(rows: list[Wire]) -> list[TokenEvent]:
    """The events ``_wire`` sent (an error as a ``RuntimeError`` of its text)."""
    from ostinato.engine.core.scheduler import FinishReason
    from ostinato.engine.serve.loop import EngineTiming, TokenEvent

    return [
        TokenEvent(
            rid,
            tokens,
            ended,
            None if finish is None else FinishReason(finish),
            None if error is None else RuntimeError(error),
            logprobs,
            None if timing is None else EngineTiming(*timing),
        )
        for rid, tokens, ended, finish, error, logprobs, timing in rows
    ]
