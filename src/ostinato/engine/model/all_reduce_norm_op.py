"""``ostinato::tp_all_reduce_add_rms_norm``: a tensor-parallel block's partial output
summed over the group, added to the residual and normalised, as one op: ``(rms_norm(
sum_ranks(x) + residual), sum_ranks(x) + residual)``.

Where the group has a ``FusedReduceNorm`` that serves the call (its dtype and width, at
most ``max_rows`` rows, which start-up measured faster than the two ops) it is one kernel
(``kernels.all_reduce_norm``); elsewhere it is the group's all-reduce
(``ostinato::tp_all_reduce``) and then ``ostinato::add_rms_norm``, the same values. The op
is opaque: it runs eagerly, inside captured graphs and inside compiled pieces.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

import ostinato.engine.model.norm_op  # noqa: F401  (registers ostinato::add_rms_norm)
from ostinato.distributed.collectives import every_rank, largest_over_group
from ostinato.distributed.symm_all_reduce import tp_all_reduce
from ostinato.platform.cuda import graph_call_us

logger = logging.getLogger(__name__)

MAX_ROWS = 64
"""Rows the staging buffer holds (decode steps; a longer call takes the two ops)."""

LADDER = tuple(1 << i for i in range(MAX_ROWS.bit_length()) if 1 << i <= MAX_ROWS)
"""The row counts start-up times (1, 2, 4, ... ``MAX_ROWS``)."""

PROTOCOL = "lamport-3"
"""The kernel's protocol (sentinel data in three slots), named in the key of a kept
measurement: rows measured for another protocol are measured anew."""

_FUSED: dict[str, FusedReduceNorm] = {}


class FusedReduceNorm:
    """One tensor-parallel group's symmetric buffer and slot counts for the fused kernel,
    and ``max_rows``: the row counts up to which it runs (0 until
    ``setup_fused_reduce_norm`` measured it; then every rank holds the same value).

    Guarantees: ``__call__`` returns what the two ops return, bitwise with two ranks
    (the same roundings, and a sum of two is exact before it) but for a zero's sign; the
    same bits on every rank."""

    def __init__(
        self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, hidden: int
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from ostinato.engine.kernels.all_reduce_norm import PROGRAMS, SENTINEL, buffer_elements

        self.group, self.group_name = group, group.group_name
        self.dtype, self.hidden = dtype, hidden
        self.segment = MAX_ROWS * hidden
        size = buffer_elements(MAX_ROWS, hidden, group.size())
        self.buffer = symm_mem.empty(size, dtype=dtype, device=device)
        handle = symm_mem.rendezvous(self.buffer, self.group_name)
        self.rank, self.world = handle.rank, handle.world_size
        if handle.buffer_ptrs[self.rank] != self.buffer.data_ptr():
            raise RuntimeError("the staging buffer does not start its mapping")
        self.buffer.fill_(SENTINEL)
        handle.barrier()  # (every rank's buffer filled before any rank writes a peer's)
        torch.cuda.synchronize(device)
        self.handle = handle  # (keeps the peers' mappings alive)
        self.buffers = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.slots = torch.zeros(PROGRAMS, dtype=torch.int32, device=device)
        self.max_rows = 0

    def serves(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether the kernel takes this call (else the two ops do)."""
        rows = x.numel() // self.hidden
        return (
            x.dtype == residual.dtype == self.dtype
            and x.shape == residual.shape
            and x.shape[-1] == self.hidden
            and 0 < rows <= self.max_rows
        )

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        pdl: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from ostinato.engine.kernels.all_reduce_norm import all_reduce_add_norm_rows

        rows = x.reshape(-1, self.hidden).contiguous()
        out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
        total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        all_reduce_add_norm_rows(
            rows, residual.reshape(-1, self.hidden).contiguous(), weight, eps,
            out.view(-1, self.hidden), total.view(-1, self.hidden), self.buffers,
            self.slots, self.segment, self.rank, self.world, pdl,
        )  # fmt: skip
        return out, total

    def release(self) -> None:
        """Forgets this group's fused op (calls take the two ops); the buffer is freed
        with the last reference."""
        if _FUSED.get(self.group_name) is self:
            del _FUSED[self.group_name]


@torch.library.custom_op("ostinato::tp_all_reduce_add_rms_norm", mutates_args=())
def tp_all_reduce_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_name: str,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the norm of ``sum_ranks(x) + residual``, that sum), over the group whose
    ``SymmetricAllReduce`` is ``group_name``; see the module docstring."""
    fused = _FUSED.get(group_name)
    if fused is not None and fused.serves(x, residual):
        return fused(x, residual, weight, eps, pdl)
    return _apart(x, residual, weight, eps, group_name, pdl)


def _apart(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_name: str,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two ops: the group's all-reduce, then ``ostinato::add_rms_norm``."""
    summed = tp_all_reduce(x, group_name)
    return torch.ops.ostinato.add_rms_norm(summed, residual, weight, eps, pdl)


@tp_all_reduce_add_rms_norm.register_fake
def _(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_name: str,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    return out, torch.empty(x.shape, dtype=x.dtype, device=x.device)


def setup_fused_reduce_norm(
    group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, hidden: int,
    max_rows: int | None = None,
) -> FusedReduceNorm | None:  # fmt: skip
    """The fused op for ``group`` (which has a ``SymmetricAllReduce``), checked
    against the two ops and timed against them at each row count of ``LADDER`` in
    captured graphs, the slowest rank's times deciding (``max_rows``: a count measured
    before, which every rank passes alike, and nothing is timed); None (with a log line)
    where it cannot be set up, disagrees, or is never faster. Collective over ``group``."""
    if max_rows == 0:  # (measured never faster before)
        return None
    try:
        fused = FusedReduceNorm(group, device, dtype, hidden)
    except Exception as exc:  # noqa: BLE001  (any set-up failure means: not available)
        logger.info("ostinato: fused all-reduce + norm unavailable (%s)", exc)
        return None
    _FUSED[fused.group_name] = fused
    fused.max_rows = MAX_ROWS
    if not _agrees(fused):
        logger.warning("ostinato: fused all-reduce + norm disagrees with the two ops; unused")
        fused.release()
        return None
    fused.max_rows = _measured_rows(fused) if max_rows is None else max_rows
    if fused.max_rows == 0:
        fused.release()
        return None
    return fused


def _measured_rows(fused: FusedReduceNorm) -> int:
    times = [[_time(fused, n, use) for n in LADDER] for use in (True, False)]
    fast, slow = largest_over_group(times, fused.group)
    rows = rows_faster(list(LADDER), fast, slow)
    said = ", ".join(f"{n}: {a:.1f}/{b:.1f}" for n, a, b in zip(LADDER, fast, slow, strict=True))
    logger.info("ostinato: fused all-reduce + norm up to %d rows (us fused/apart: %s)", rows, said)
    return rows


def rows_faster(ladder: list[int], fused_us: list[float], apart_us: list[float]) -> int:
    """The largest row count of ``ladder`` (ascending) up to which the fused op measured
    faster at every count (0 where not at the first): the calls it takes, a threshold
    (between the counts measured the kernel's cost grows with its rows alone)."""
    rows = 0
    for n, fused, apart in zip(ladder, fused_us, apart_us, strict=True):
        if fused >= apart:
            break
        rows = n
    return rows


def _inputs(fused: FusedReduceNorm, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Small integers sum exactly in any order; the residual and weight match on every rank.
    g = torch.arange(rows * fused.hidden, device=fused.buffer.device).view(rows, -1)
    x = (g.remainder(7) - 3 + fused.rank).to(fused.dtype)
    residual = g.remainder(5).to(fused.dtype) / 4
    weight = (g[0].remainder(3).to(fused.dtype) + 1) / 2
    return x, residual, weight


def _agrees(fused: FusedReduceNorm) -> bool:
    ok = True
    for rows in (1, 3, MAX_ROWS):
        x, residual, weight = _inputs(fused, rows)
        got = fused(x, residual, weight, 1e-6)
        want = _apart(x, residual, weight, 1e-6, fused.group_name)
        ok = ok and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    return every_rank(ok, fused.group)


def _time(fused: FusedReduceNorm, rows: int, use: bool) -> float:
    x, residual, weight = _inputs(fused, rows)
    keep, name = fused.max_rows, fused.group_name
    fused.max_rows = MAX_ROWS if use else 0
    try:
        call = lambda: tp_all_reduce_add_rms_norm(x, residual, weight, 1e-6, name)  # noqa: E731
        call()  # (eagerly first, on every rank)
        return graph_call_us(call, calls=16)
    finally:
        fused.max_rows = keep
