"""A test double for the graph platform that behaves like a graph, on the CPU.

During 'capture' a TorchDispatchMode records every aten op with the tensors it read and
wrote; 'replay' re-runs those ops and writes each result into the tensor the op produced
at capture. So, as with a real graph, replay recomputes on whatever data now sits at the
captured tensors, writes to the same outputs, and runs no Python of the captured code.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ostinato.platform.base import Platform, exclusive_device


class FakeGraph:
    def __init__(self) -> None:
        self.ops: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = []
        self.replays = 0
        self.was_reset = False

    def replay(self) -> None:
        self.replays += 1
        # A real replay ignores autograd modes; inference tensors need this to be writable.
        with torch.inference_mode():
            run_ops(self.ops)

    def reset(self) -> None:
        self.was_reset = True
        self.ops.clear()


def run_ops(ops: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]]) -> None:
    """Re-runs recorded ops, writing each result into the tensor the op produced when it
    was recorded (what a replay does)."""
    for func, args, kwargs, captured in ops:
        fresh = func(*args, **kwargs)
        for old, new in zip(tree_leaves(captured), tree_leaves(fresh), strict=True):
            if isinstance(old, torch.Tensor) and new is not old:
                old.copy_(new)


def copies_into(graph: FakeGraph, buffer: torch.Tensor) -> list[torch.Tensor]:
    """The destinations of ``graph``'s recorded copies that share ``buffer``'s memory."""
    storage = buffer.untyped_storage().data_ptr()
    return [
        args[0]
        for func, args, _, _ in graph.ops
        if func is torch.ops.aten.copy_.default and args[0].untyped_storage().data_ptr() == storage
    ]


def _reads_the_forward_context(name: str) -> Any:
    """The Python of an engine op that reads the step from the forward context."""
    if name == "ostinato::attention":
        from ostinato.engine.model.attention_op import attention

        return attention
    if name == "ostinato::norm_qkv":
        from ostinato.engine.model.fused_ops import norm_qkv

        return norm_qkv
    return None


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: FakeGraph) -> None:
        super().__init__()
        self.graph = graph

    @classmethod
    def is_infra_mode(cls) -> bool:
        # As a CUDA stream capture is invisible to Dynamo, so is the recorder: code
        # compiled before a capture runs inside it (else Dynamo refuses the frame).
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        python = _reads_the_forward_context(func.name())
        if python is not None:
            # The op runs Python that reads the forward context: a real graph holds the
            # kernels it launches, so record those instead.
            with _Recorder(self.graph):
                return python(*args, **kwargs)
        out = func(*args, **kwargs)
        self.graph.ops.append((func, args, kwargs, out))
        return out


class FlaggedTurn:
    """A stand-in for the steps' turn (a ``Held``): ``with turn():`` holds it, and
    ``turn.held`` says whether it is held now (what the tests check work against)."""

    def __init__(self) -> None:
        self.held = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self.held = True
        try:
            yield
        finally:
            self.held = False


class FakePlatform(Platform):
    name = "fake"
    device_type = "cpu"
    supports_graphs = True

    def __init__(self, fail_capture: BaseException | None = None, lends: bool = False) -> None:
        self.lends = lends  # (CUDA's lending: an alias that does not own, and its revoke)
        self.lent: list[torch.Tensor] = []
        self.revoked: list[tuple[int, str]] = []  # (index in ``lent``, message)
        self.capturing: FakeGraph | None = None
        self.graphs: list[FakeGraph] = []
        self.pools = 0
        self.fail_capture = fail_capture
        self.sync_errors_active = False
        self.reserved = 0

    def new_graph(self) -> FakeGraph:
        g = FakeGraph()
        self.graphs.append(g)
        return g

    def revocable(self, alias: torch.Tensor) -> int | None:
        if not self.lends:
            return None
        # (the CPU cannot revoke: the fake records the alias and, later, its revocation)
        self.lent.append(alias)
        return len(self.lent) - 1

    def revoke(self, handle: int, message: str) -> None:
        self.revoked.append((handle, message))

    def graph_pool_handle(self) -> Any:
        self.pools += 1
        return ("pool", self.pools)

    @contextlib.contextmanager
    def capture(self, graph: Any, pool: Any) -> Iterator[None]:
        assert self.capturing is None, "nested capture"
        # As CUDA's: one capture at a time in a process, and a device-wide synchronize
        # from another thread meanwhile fails (``synchronize``).
        with exclusive_device():
            self.capturing = graph
            FakePlatform.capturing_thread = threading.get_ident()
            try:
                with _Recorder(graph):
                    yield
                if self.fail_capture is not None:
                    raise self.fail_capture
            finally:
                self.capturing = None
                FakePlatform.capturing_thread = None
        self.reserved += 1024  # each capture 'costs' 1 KiB of pool

    # The thread of the capture in progress in this process, of any fake platform.
    capturing_thread: int | None = None

    def synchronize(self) -> None:
        thread = FakePlatform.capturing_thread
        if thread is not None and thread != threading.get_ident():
            raise RuntimeError(
                "FakePlatform: a device-wide synchronize during another thread's capture "
                "(CUDA: operation not permitted when stream is capturing)"
            )

    def memory_reserved(self) -> int:
        return self.reserved

    @contextlib.contextmanager
    def sync_errors(self) -> Iterator[None]:
        self.sync_errors_active = True
        try:
            yield
        finally:
            self.sync_errors_active = False


class DenseGraphAttention:
    """A capturable attention backend for the CPU (test double of the Triton one): only
    tensor ops on the step's device tensors (no host lists), so a ``FakeGraph`` replays it
    on whatever the persistent metadata buffers hold. Each token attends to every slot of
    its request's block table up to its own position, densely."""

    from ostinato.resolution import AttentionGraphSupport as _Support

    graph_support = _Support.ALWAYS
    applies_rope = False

    def __init__(self) -> None:
        from ostinato.engine.model.attention import write_kv

        self.write_kv = write_kv

    def __call__(self, q, k_cache, v_cache, meta, scale, out, rope=None):
        assert rope is None  # applies_rope is False: the model rotates q and k
        n, heads, d = q.shape
        _, bs, kv_heads, _ = k_cache.shape
        tables = meta.block_tables[meta.token_req.long()].long()  # [n, max_blocks]
        ctx = tables.shape[1] * bs
        slots = (tables[:, :, None] * bs + torch.arange(bs)).reshape(n, ctx)
        group = heads // kv_heads
        k = k_cache.reshape(-1, kv_heads, d)[slots].repeat_interleave(group, dim=2)
        v = v_cache.reshape(-1, kv_heads, d)[slots].repeat_interleave(group, dim=2)
        s = torch.einsum("nhd,nchd->nhc", q.float(), k.float()) * scale
        live = torch.arange(ctx)[None, :] <= meta.positions[:, None]  # [n, ctx]
        s = s.masked_fill(~live[:, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # padding rows: no keys, zero output
        out.copy_(torch.einsum("nhc,nchd->nhd", p, v.float()).to(out.dtype))


def engine_on(monkeypatch, platform: Platform) -> None:
    """Makes ``platform`` the one every engine part builds its graphs on, whatever the
    device (the CPU here); pair with ``ostinato.use_platform(platform)``."""
    import ostinato.engine.api.startup as llm_module
    import ostinato.engine.spec.self_draft as self_draft_module
    import ostinato.engine.worker.runner as runner_module

    for module in (llm_module, runner_module, self_draft_module):
        monkeypatch.setattr(module, "platform_for_device", lambda device: platform)


def capture_threads(platform: FakePlatform) -> list[threading.Thread]:
    """The threads ``platform``'s captures run on from now on, in order (filled as they
    happen)."""
    seen: list[threading.Thread] = []
    real = platform.capture

    def capture(graph: Any, pool: Any) -> Any:
        seen.append(threading.current_thread())
        return real(graph, pool)

    platform.capture = capture  # type: ignore[method-assign]
    return seen


def turn_free(owner: Any) -> bool:
    """Whether a step on another thread may take ``owner``'s turn now (``stepping()``: a
    ``GraphManager``'s or a ``StagedRuntime``'s; tried for 0.3 s). The turn is asked for
    here, by the caller: a thread that started late would find a background capture done
    and no turn to take (``stepping()``'s no-op), and must not release one."""
    turn = owner.stepping()

    def step() -> None:
        with turn:
            pass

    stepper = threading.Thread(target=step)
    stepper.start()
    stepper.join(0.3)
    return not stepper.is_alive()
