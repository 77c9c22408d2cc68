"""``LLM``: the engine's user API, a thin facade over one ``Engine``: token ids or text in,
tokens and text out."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from ostinato.adaptive_ladder import LadderChange
from ostinato.distributed.failure import ParallelError
from ostinato.engine.api.engine import Engine, Session, Tracked
from ostinato.engine.api.engine_args import EngineArgs
from ostinato.engine.api.lora_registry import LoraNames
from ostinato.engine.api.outputs import RequestOutput
from ostinato.engine.api.prompts import Prompt, chat_ids, decode_text
from ostinato.engine.api.startup import build, check_args
from ostinato.engine.core.params import SamplingParams
from ostinato.engine.core.scheduler import Request
from ostinato.engine.parallel.peers import Peers
from ostinato.replay_stats import StatsSnapshot

TokenCallback = Callable[[int, int], None]
"""``on_token(prompt_index, token_id)``: called for each token as it is produced."""


def _part(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.engine.parts, name), doc=doc)


def _engine(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.engine, name), doc=doc)


class LLM:
    """A compact inference engine over ostinato's graphs.

    ``LLM(model, **keywords)``: the keywords are the fields of ``EngineArgs`` and of its
    groups (``CacheArgs``, ``GraphArgs``, ``ParallelArgs``, ``KernelOptions``; each
    field also as a plain keyword: ``LLM(mode="full", max_model_len=512)``); a keyword
    nothing has, or a field given both ways, is a ``TypeError`` naming it; every value is
    checked before the model is opened. ``LLM(args=EngineArgs(...))`` takes the whole
    configuration at once (worker processes are built so). See ``EngineArgs`` and the
    groups for each option; ``model``: None for SmolLM2-135M-Instruct, a preset name, a
    Hugging Face folder, a ``.gguf`` file, a HF config dict or a ``ModelConfig``.

    Under tensor or data parallelism from a plain process, this process is rank 0 and
    starts the others (``parallel.peers``); under ``torchrun`` every rank builds its own
    and makes the same calls. Graphs are captured at construction (or in the background,
    ``capture="background"``); if that fails, all allocated is released first.
    """

    def __init__(self, model: Any = None, *, args: EngineArgs | None = None, **keywords: Any):
        start = time.perf_counter()
        if args is None:
            args = EngineArgs.build(model, **keywords)
        elif model is not None or keywords:
            raise TypeError("LLM: give args=EngineArgs(...) alone, or the model and keywords")
        checked = check_args(args)
        self._one_call = threading.Lock()  # the scheduler and the step buffers: one owner
        self._generating_thread: int | None = None
        worker_args = replace(args, progress=False)
        self.peers = Peers(checked.parallel, checked.device, LLM, worker_args)
        try:
            peers = self.peers
            parts = build(checked, peers.launch_env, peers.health, peers.attach)
            self.engine = Engine(parts, peers.peer_failure)
            peers.ready(parts.parallel.timeout_s)
        except BaseException as exc:
            if "engine" in self.__dict__:
                self.engine.release()
            cause = self.peers.failed_start(exc)
            if cause is not None:
                raise cause from exc
            raise
        self.startup_seconds = time.perf_counter() - start
        self.engine.parts.startup.total_s = self.startup_seconds

    config = _part("config", "The model's ``ModelConfig``.")
    tokenizer = _part("tokenizer", "The model's tokenizer (None for random weights).")
    device = _part("device", "The device this rank runs on.")
    dtype = _part("dtype", "The weights' dtype.")
    source_name = _part("source_name", "Where the model came from.")
    speculative = _part("speculative", "The ``SpeculativeConfig`` in use, or None.")
    spec_stats = _part("spec_stats", "Speculative decoding's counts over the engine's life.")
    kernels = _part("kernels", "The ``KernelOptions`` the engine was built with.")
    parallel = _part("parallel", "This rank's process groups (``ParallelGroups``).")
    memory = _part("memory", "The memory plan that sized the KV cache (None on the CPU).")
    startup = _part("startup", "Where the construction's seconds went (``StartupTimes``).")
    capture_report = _part("capture_report", "What the capture of each bucket took.")
    draft_report = _part("draft_report", "The self-draft graphs' capture, or None.")
    graph_memory = _part("graph_memory", "The graphs' memory reserve against their use.")
    background = _part("background", "The background capture or staged upgrade, or None.")

    mode = _engine("mode", "The graph mode in use after downgrades.")
    resolution = _engine("resolution", "The mode in use and why it differs from the one asked.")
    num_kv_blocks = _engine("num_kv_blocks", "Blocks of the KV cache, the null block included.")
    free_kv_blocks = _engine("free_kv_blocks", "KV blocks free now.")
    num_preemptions = _engine("num_preemptions", "Requests preempted (recomputed later) so far.")
    has_work = _engine("has_work", "Whether requests are queued or running.")
    lora_names = _engine("lora_names", "The loaded LoRA adapters' names.")
    plans_pending = _engine("plans_pending", "Whether deferred kernel plans await measuring.")

    def graph_stats(self) -> StatsSnapshot:
        """This process's live statistics per bucket (``Engine.graph_stats``)."""
        return self.engine.graph_stats()

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_token: TokenCallback | None = None,
        request_ids: Sequence[str] | None = None,
        lora: LoraNames = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt (token ids, or text when there is a tokenizer);
        returns outputs in prompt order (a prompt's ``SamplingParams.n`` samples in its
        output's ``samples``); ``lora``: an adapter's name for all, or one per prompt.

        All or nothing: every prompt and parameter is checked before anything is queued
        (``ValueError`` / ``TypeError`` naming the prompt and the problem), and if the
        call raises or is interrupted (Ctrl-C) its requests are aborted and their KV
        blocks freed, so the engine stays usable and no later call finishes old work.
        ``request_ids`` names the requests (distinct, and not naming one still running);
        ``abort(request_id)`` from any thread, or from ``on_token``, ends one early with
        finish reason ABORT. Calls from several threads run one after the other; a
        ``generate`` from inside ``on_token`` is refused; a closed engine says so."""
        if self._one_call.locked() and self._generating_thread == threading.get_ident():
            raise RuntimeError(
                "generate: called again from inside its own on_token callback; collect the "
                "tokens and call generate after it returns"
            )
        self._check_open("generate")
        # The lock itself, not a generator's context: an interrupt as the call ends cannot
        # leave it held by a suspended generator another thread's generate waits on.
        with self._one_call:
            self._generating_thread, owner = threading.get_ident(), self.engine.new_call()
            try:
                checked = self.engine.checked(prompts, params, lora)
                if on_token is not None and any(p.n > 1 for _, p, _ in checked):
                    raise ValueError(
                        "on_token: not with n > 1 (a callback names the prompt, not the "
                        "sample); read each output's samples after generate returns"
                    )
                ids = self.engine.request_ids(request_ids, len(checked))
                self.peers.check_usable()
                self.engine.reserve(ids, owner)
                if self.peers.workers is None:
                    return self._run(checked, ids, on_token)
                return self._run_replicas(checked, ids, on_token)
            finally:
                self._generating_thread = None
                self.engine.end(owner)

    def load_lora(self, name: str, path: str) -> None:
        """Loads a PEFT adapter as ``name``, from any thread (``LoraRegistry.load``)."""
        self.engine.lora("load_lora").load(name, path)

    def unload_lora(self, name: str) -> None:
        """Forgets adapter ``name``; refused while running requests use it."""
        self.engine.lora("unload_lora").unload(name)

    def abort(self, request_id: str) -> bool:
        """Ends request ``request_id`` (finish reason ABORT) at the engine's next step
        boundary and frees its KV blocks; callable from any thread. False when no live
        request has that id. Requests of this process only."""
        return self.engine.abort(request_id)

    def _run(self, checked: list, ids: list[str], on_token: TokenCallback | None) -> list:
        """This process's requests, stepped to the end through one session."""
        engine = self.engine
        engine.reset_if_interrupted()
        session = Session(engine, engine.steps)
        try:
            tracked = [session.admit(i, *c) for i, c in zip(ids, checked, strict=True)]
            session.apply_aborts()
            with self.peers.watching() as watchdog:
                for _ in session.steps():
                    if watchdog is not None:
                        watchdog.check()  # a step run after the abort computed nothing valid
                    for i, t in enumerate(tracked if on_token is not None else ()):
                        for token in t.take():
                            on_token(i, token)
                    session.apply_aborts()
                if watchdog is not None:
                    watchdog.check()
        except BaseException as exc:
            engine.reset()  # everything queued was this call's (calls run one at a time)
            self.peers.stop_after(exc)
            raise
        return [self._output(t) for t in tracked]

    def _run_replicas(self, checked: list, ids: list[str], on_token: TokenCallback | None):
        """This process drives its workers: the data-parallel replicas share the prompts
        (``Peers.generate``), this process's share through ``_run``."""
        run = lambda share, cb: self._run([checked[i] for i in share], [ids[i] for i in share], cb)  # noqa: E731
        outputs = self.peers.generate(checked, run, self.parallel, on_token)
        return [replace(out, request_id=rid) for out, rid in zip(outputs, ids, strict=True)]

    def chat(
        self,
        conversations: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_token: TokenCallback | None = None,
        lora: LoraNames = None,
    ) -> list[RequestOutput]:
        """``generate`` over chat messages (``[{"role": "user", "content": ...}]``, or a
        list of such conversations), formatted by the model's chat template."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("chat: the model has no chat template; use generate")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [self.chat_prompt(list(c)) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, params, on_token=on_token, lora=lora)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """The token ids of ``messages`` in the model's chat template, ready to answer."""
        return chat_ids(self.tokenizer, messages)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (special tokens dropped); needs a tokenizer."""
        return decode_text(self.tokenizer, token_ids)

    @contextlib.contextmanager
    def serving(self) -> Iterator[Session]:
        """Owns the engine (as ``exclusive``) and yields the ``Session`` a server drives
        it through (``serve.loop.EngineLoop``). With worker processes (tensor
        parallelism), each change reaches every worker before the step after it, and a
        step that fails stops the engine as a failed ``generate`` does. Data-parallel
        replicas are refused: each would need requests of its own."""
        peers = self.peers
        if peers.workers is not None and self.parallel.dp_size > 1:
            raise ParallelError(
                "serving: an engine with data-parallel replicas cannot be served yet (each "
                "replica needs requests of its own); serve with tensor_parallel_size only"
            )
        self._check_open("serving")
        with self._one_call:
            peers.check_usable()
            send = peers.send_changes if peers.workers is not None else None
            with peers.watching() as watchdog:
                steps = lambda: peers.served_steps(self.engine.steps, watchdog)  # noqa: E731
                session = Session(self.engine, steps, send)
                try:
                    yield session
                finally:
                    if peers.workers is not None:
                        session.end()

    def step(self) -> list[Request]:
        """Runs one scheduled step; returns the requests that finished in it. Under data
        parallelism (torchrun) every replica calls it together."""
        if self.peers.workers is not None:
            raise ParallelError(
                "step: this engine drives its own worker processes; use generate (or "
                "launch every rank with torchrun and call step on each)"
            )
        return self.engine.step() or []

    def _output(self, t: Tracked) -> RequestOutput:
        return RequestOutput.of(t, self.decode if self.tokenizer is not None else None)

    def close(self, timeout_s: float = 30.0) -> bool:
        """Releases every graph and, under tensor parallelism, leaves the process group
        (bounded by ``timeout_s``) and stops the engine's own worker processes. False if
        the process group did not shut down in time; the process should then exit at
        once (``os._exit``). The engine cannot be used afterwards."""
        self.peers.ask_close()
        self.engine.release()
        return self.peers.close(timeout_s)

    def exclusive(self) -> contextlib.AbstractContextManager[None]:
        """Inside, this thread owns the engine: ``generate`` from other threads waits
        (``serve.loop.EngineLoop`` holds it while it serves). Refused on a closed engine."""
        self._check_open("exclusive")
        return self._one_call

    def _check_open(self, what: str) -> None:
        if self.engine.closed:
            raise RuntimeError(f"{what}: this LLM is closed; make a new one")

    def describe(self) -> str:
        """One line: the model, device, graph mode, start-up phases and graphs."""
        return self.engine.describe()

    def wait_for_graphs(self, timeout: float | None = None) -> bool:
        """Waits for a background capture (``Engine.wait_for_graphs``). Where it ended and
        no call is stepping the engine (``generate`` on another thread, a server's loop),
        the heap freeze it asked for runs before this returns; else at the engine's next
        idle moment (``ModelRunner.idle_freeze``)."""
        return self.engine.wait_for_graphs(timeout, owner=self._one_call)

    def replan_graphs(self, budget_bytes: int, granule: int = 1 << 20) -> LadderChange | None:
        """Between calls: the FULL ladder moved to pad least (``Engine.replan_graphs``)."""
        return self.engine.replan_graphs(budget_bytes, granule)
