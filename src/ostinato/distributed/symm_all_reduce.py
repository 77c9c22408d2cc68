"""A faster all-reduce for small tensor-parallel messages: PyTorch's symmetric-memory
one-shot and two-shot all-reduce, chosen against NCCL per message size.

Every rank of a tensor-parallel group allocates one buffer with
``torch.distributed._symmetric_memory.empty`` and maps its peers' buffers
(``rendezvous``). An all-reduce copies the message into the buffer and runs the
symmetric-memory kernel over it (peer-to-peer loads over NVLink; NVLink multicast is
never used; the one-shot copies and reduces in one kernel where PyTorch has
``one_shot_all_reduce_copy``), or hands the message to NCCL when the plan says NCCL is
faster for that size or the message does not fit. The buffer lives outside every graph
pool, so graphs captured with these kernels replay against the same addresses.

The model calls ``torch.ops.ostinato.tp_all_reduce``, an opaque custom op: it runs eagerly,
inside captured graphs, and inside ``torch.compile``d pieces (it is not a splitting point).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ostinato.distributed.all_reduce_plan import AllReduceAlgo, AllReducePlan
from ostinato.platform.cuda import graph_call_us

logger = logging.getLogger(__name__)

DEFAULT_BUFFER_BYTES = 8 << 20
"""Largest message the symmetric buffer takes (8 MiB: a 4096-wide bf16 hidden state of
1024 tokens); larger ones always go to NCCL, which is bandwidth-bound there anyway."""

_REDUCERS: dict[str, SymmetricAllReduce] = {}


class SymmetricAllReduce:
    """One tensor-parallel group's symmetric buffer and the plan that routes each message.

    Guarantees: ``all_reduce(x)`` returns the sum of ``x`` over the group, a new tensor of
    ``x``'s shape and dtype, whichever algorithm serves it; ``x`` is not modified.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        dtype: torch.dtype,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group
        self.group_name = group.group_name
        self.dtype = dtype
        self.buffer_bytes = buffer_bytes
        # [buffer_bytes / itemsize] flat staging buffer, mapped by every rank of the group.
        self.buffer = symm_mem.empty(buffer_bytes // dtype.itemsize, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        self.plan = AllReducePlan.nccl()
        self.timings: AllReduceTimings | None = None  # set when the plan was measured
        _REDUCERS[self.group_name] = self

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group, by the algorithm the plan picks for its size."""
        algo = self.plan.choose(x.numel() * x.element_size())
        if algo is AllReduceAlgo.NCCL or x.dtype != self.dtype:
            out = x.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(out, group=self.group)
            return out
        staged = self.buffer[: x.numel()]
        if algo is AllReduceAlgo.ONE_SHOT and _ONE_SHOT_COPY is not None:
            # One kernel copies x into the mapped buffer and reduces (the TP=2 census of
            # the 8 B shape: a copy kernel before each of the 65 all-reduces of a step).
            return _ONE_SHOT_COPY(staged, x.reshape(-1), "sum", self.group_name).view(x.shape)
        staged.copy_(x.reshape(-1))
        if algo is AllReduceAlgo.ONE_SHOT:
            return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.group_name).view(
                x.shape
            )
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group_name, out.view(-1))
        return out

    def release(self) -> None:
        """Forgets this group's reducer; the buffer is freed with the last reference."""
        if _REDUCERS.get(self.group_name) is self:
            del _REDUCERS[self.group_name]


def _one_shot_copy() -> Any:
    """PyTorch's one-shot all-reduce that stages its input itself, where this PyTorch has
    it (None: the copy and the reduce run as two kernels)."""
    try:
        return torch.ops.symm_mem.one_shot_all_reduce_copy
    except (AttributeError, RuntimeError):
        return None


_ONE_SHOT_COPY = _one_shot_copy()


@torch.library.custom_op("ostinato::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of ``x`` over the tensor-parallel group ``group_name``, through its
    ``SymmetricAllReduce`` (which must exist on this rank)."""
    reducer = _REDUCERS.get(group_name)
    if reducer is None:
        raise RuntimeError(
            f"tp_all_reduce: no symmetric all-reduce for group {group_name!r} on this rank; "
            "it was released (engine closed) or never set up"
        )
    return reducer.all_reduce(x)


@tp_all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@dataclass(frozen=True)
class AllReduceTimings:
    """Per-call microseconds of each algorithm at each message size, the slowest rank's
    (so every rank holds the same numbers and makes the same choice)."""

    sizes: list[int]
    us: dict[AllReduceAlgo, list[float]]

    def plan(self) -> AllReducePlan:
        """The fastest algorithm per size."""
        return AllReducePlan.from_timings(self.sizes, self.us)


def measure(
    reducer: SymmetricAllReduce, sizes: list[int], calls: int = 16, replays: int = 5
) -> AllReduceTimings:
    """Times every algorithm at every size inside a captured CUDA graph of ``calls``
    all-reduces (how the engine runs them), on every rank together; the timings are
    maxed over the group. Checks each symmetric-memory algorithm against NCCL first and
    raises ``RuntimeError`` if they disagree, so a broken kernel is never chosen."""
    algos = (AllReduceAlgo.NCCL, AllReduceAlgo.ONE_SHOT, AllReduceAlgo.TWO_SHOT)
    saved = reducer.plan
    try:
        _check_agreement(reducer, algos)
        table = torch.zeros(len(algos), len(sizes), dtype=torch.float64)
        for i, algo in enumerate(algos):
            reducer.plan = AllReducePlan.only(algo, reducer.buffer_bytes)
            for j, size in enumerate(sizes):
                table[i, j] = _time_in_graph(reducer, size, calls, replays)
    finally:
        reducer.plan = saved
    table = table.to(reducer.buffer.device)
    dist.all_reduce(table, op=dist.ReduceOp.MAX, group=reducer.group)
    rows = table.cpu().tolist()
    return AllReduceTimings(list(sizes), {a: rows[i] for i, a in enumerate(algos)})


def _check_agreement(reducer: SymmetricAllReduce, algos: tuple[AllReduceAlgo, ...]) -> None:
    rank = dist.get_rank(reducer.group)
    n = reducer.buffer_bytes // reducer.dtype.itemsize // 4
    # Small integers sum exactly in any float type and any order.
    x = torch.arange(n, device=reducer.buffer.device).remainder(7).add(rank).to(reducer.dtype)
    results = {}
    for algo in algos:
        reducer.plan = AllReducePlan.only(algo, reducer.buffer_bytes)
        results[algo] = reducer.all_reduce(x)
    for algo in algos[1:]:
        if not torch.equal(results[algo], results[AllReduceAlgo.NCCL]):
            raise RuntimeError(
                f"symmetric-memory {algo.value} all-reduce disagrees with NCCL on this "
                "device; run with all_reduce='nccl'"
            )


def _time_in_graph(reducer: SymmetricAllReduce, nbytes: int, calls: int, replays: int) -> float:
    x = torch.ones(
        nbytes // reducer.dtype.itemsize, dtype=reducer.dtype, device=reducer.buffer.device
    )
    reducer.all_reduce(x)  # eager first: lazy communicator set-up is not capturable
    return graph_call_us(lambda: reducer.all_reduce(x), calls, replays)


def setup_symmetric_all_reduce(
    group: dist.ProcessGroup,
    device: torch.device,
    dtype: torch.dtype,
    choice: str,
    max_message_bytes: int,
) -> SymmetricAllReduce | None:
    """The reducer for ``choice`` (``"auto"``: measured; ``"one-shot"`` / ``"two-shot"``:
    forced up to the buffer size), or None for ``"nccl"``. Collective over ``group``.

    ``"auto"`` falls back to None (NCCL alone), with a log line, where symmetric memory is
    unavailable or never faster; a forced algorithm that cannot be set up raises.
    """
    if choice == "nccl":
        return None
    buffer_bytes = min(DEFAULT_BUFFER_BYTES, _round_up_pow2(max(max_message_bytes, 4096)))
    try:
        reducer = SymmetricAllReduce(group, device, dtype, buffer_bytes)
    except Exception as exc:  # noqa: BLE001  (any set-up failure means: not available)
        if choice != "auto":
            raise RuntimeError(
                f"all_reduce={choice!r}: symmetric memory could not be set up on {device} "
                f"({type(exc).__name__}: {exc}); use all_reduce='nccl' or 'auto'"
            ) from exc
        logger.info("ostinato: symmetric memory unavailable (%s); NCCL all-reduce only", exc)
        return None
    if choice == "auto":
        sizes = _ladder(4096, buffer_bytes)
        reducer.timings = measure(reducer, sizes)
        reducer.plan = reducer.timings.plan()
        logger.info("ostinato: all-reduce plan: %s", reducer.plan.describe())
        if not reducer.plan.uses_symmetric_memory:
            reducer.release()
            return None
    else:
        reducer.plan = AllReducePlan.only(AllReduceAlgo(choice), buffer_bytes)
    return reducer


def _ladder(lo: int, hi: int) -> list[int]:
    sizes = [lo]
    while sizes[-1] * 2 <= hi:
        sizes.append(sizes[-1] * 2)
    return sizes


def _round_up_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
