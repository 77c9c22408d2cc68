"""Process groups for tensor and data parallelism, started the way ``torchrun`` starts them.

Every process runs the same program (SPMD): ``torchrun --nproc-per-node N script.py`` (or
``--nnodes``/``--rdzv-endpoint`` across hosts) sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``
and the rendezvous address; ``init_parallel`` reads them. Ranks ``[d * tp, (d + 1) * tp)``
form tensor-parallel group ``d``; ranks with the same position in their TP group form a
data-parallel group. NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ostinato.distributed.collectives import all_reduce_sum
from ostinato.distributed.failure import FailureBoard, HealthCheck, ParallelError
from ostinato.distributed.symm_all_reduce import tp_all_reduce
from ostinato.turns import CollectiveTurn, current_turn

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelConfig:
    """``tensor_parallel_size`` ranks share one model; ``data_parallel_size`` replicas."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        """Processes needed: ``tensor_parallel_size * data_parallel_size``."""
        return self.tensor_parallel_size * self.data_parallel_size


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group (``group`` None when ``size`` is 1).
    ``symmetric_group`` names the group's ``SymmetricAllReduce`` when one is set up."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    symmetric_group: str | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group: through the symmetric-memory reducer when set
        up (it routes each size to the faster algorithm), else NCCL; ``x`` alone."""
        if self.group is None:
            return x
        turn = _turn()
        if turn is not None:  # a micro-batch: the collective runs while the other computes
            turn.begin_collective()
            out = self._all_reduce(x)
            if x.is_cuda:
                # Made on one stream, used on the other: keep the allocator from handing
                # their memory out again before the other stream is done with them.
                x.record_stream(turn.comm)
                out.record_stream(turn.compute)
            turn.end_collective()
            return out
        return self._all_reduce(x)

    def fusable_group(self) -> str | None:
        """The symmetric group's name where an all-reduce may run inside the op that
        consumes it (``engine.model.all_reduce_norm_op``): set up, and not inside a
        micro-batch's turn, whose collectives ``all_reduce`` issues on the turn's own
        stream; else None."""
        return self.symmetric_group if _turn() is None else None

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.symmetric_group is not None:
            return tp_all_reduce(x, self.symmetric_group)
        return all_reduce_sum(x, self.group)

    def split(self, total: int, what: str) -> int:
        """``total / size``; ``ValueError`` naming ``what`` when it does not divide."""
        if total % self.size:
            raise ValueError(
                f"tensor_parallel_size: {self.size} does not divide {what} ({total}); "
                "choose a size that divides it"
            )
        return total // self.size


@dataclass(frozen=True)
class ParallelGroups:
    """This process's rank, device and groups."""

    rank: int
    world_size: int
    device: torch.device
    tp: TensorParallel
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: dist.ProcessGroup | None = None
    failures: FailureBoard | None = None  # where a failing rank names itself
    timeout_s: float = 120.0  # bound on every collective and device wait


def single_process(device: torch.device | None = None) -> ParallelGroups:
    """The groups of a run without parallelism."""
    return ParallelGroups(0, 1, device or torch.device("cpu"), TensorParallel())


def local_launch_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment ``torchrun --nproc-per-node world_size`` gives local rank ``rank``
    (rendezvous on 127.0.0.1:``port``), for launching workers without torchrun."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def launched_by_torchrun() -> bool:
    """Whether this process carries a rank from ``torchrun`` (or an equivalent launcher)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_parallel(
    config: ParallelConfig,
    device_type: str | None = None,
    timeout_s: float = 120.0,
    launch_env: dict[str, str] | None = None,
    health: HealthCheck | None = None,
) -> ParallelGroups:
    """Joins the process group ``torchrun`` described (or ``launch_env``, a
    ``local_launch_env`` for a process the engine started itself) and builds the TP and
    DP groups. ``health`` (rank 0 with ``launch_env``): the ranks it started, polled while
    waiting for them to join; a failure it reports is raised as ``ParallelError``.

    Raises ``ParallelError`` before anything starts when the world size is not
    ``tp * dp``, or a CUDA run has more local ranks than GPUs. ``timeout_s`` bounds every
    collective: a rank that dies makes the others fail within it instead of hanging.
    """
    source = os.environ if launch_env is None else launch_env
    if config.world_size == 1 and source.get("WORLD_SIZE") in (None, "1"):
        return single_process(torch.device(device_type or "cpu"))
    rank, world, local_rank = _launch_ranks(config, source)
    device = _rank_device(device_type, source, local_rank, world)
    if launch_env is not None and dist.is_initialized():
        # Its workers would wait at a rendezvous this process never joins.
        raise ParallelError(
            "this process still holds the process group of an earlier parallel engine "
            "(its close() returned False: PyTorch's teardown did not finish); start the "
            "new engine in a fresh process"
        )
    failures = None
    if not dist.is_initialized():
        failures = _join(rank, world, device, timeout_s, launch_env, health)
    tp_group, dp_group = _new_groups(config, rank, world)
    tp_size, dp_size = config.tensor_parallel_size, config.data_parallel_size
    tp = TensorParallel(rank % tp_size, tp_size, tp_group if tp_size > 1 else None)
    return ParallelGroups(
        rank,
        world,
        device,
        tp,
        rank // tp_size,
        dp_size,
        dp_group if dp_size > 1 else None,
        failures,
        timeout_s,
    )


def _launch_ranks(config: ParallelConfig, source: Mapping[str, str]) -> tuple[int, int, int]:
    """This process's rank, the world size and its local rank, as torchrun set them;
    ``ParallelError`` names what is missing or does not add up."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    env = {k: source.get(k) for k in keys}
    missing = [k for k, v in env.items() if v is None]
    if missing:
        raise ParallelError(
            f"parallel run (tp={config.tensor_parallel_size}, dp={config.data_parallel_size}) "
            f"but {missing} are not set; start it with torchrun --nproc-per-node "
            f"{config.world_size} (or set them as torchrun does)"
        )
    rank, world, local_rank = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    if world != config.world_size:
        raise ParallelError(
            f"world size {world} (from torchrun) is not tensor_parallel_size * "
            f"data_parallel_size = {config.world_size}; launch {config.world_size} processes"
        )
    return rank, world, local_rank


def _rank_device(
    device_type: str | None, source: Mapping[str, str], local_rank: int, world: int
) -> torch.device:
    """The device of this rank (its GPU, made current, or the CPU); ``ParallelError``
    when this host runs more ranks than it has GPUs."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type != "cuda":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    local_world = int(source.get("LOCAL_WORLD_SIZE", world))
    if local_world > count:
        raise ParallelError(
            f"{local_world} ranks on this host but only {count} GPU(s); launch at most "
            f"{count} processes per host"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _join(
    rank: int,
    world: int,
    device: torch.device,
    timeout_s: float,
    launch_env: dict[str, str] | None,
    health: HealthCheck | None,
) -> FailureBoard:
    """Joins the default process group (NCCL on CUDA, gloo on the CPU) through a store of
    our own, whose failure board is returned."""
    timeout = datetime.timedelta(seconds=timeout_s)
    # Our own rendezvous (the one init_process_group would do) so the store is ours to
    # share: the failure board lives in it.
    if launch_env is None:
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    else:
        # Rank 0 hosts the store and does not block in it: it waits for the ranks it
        # started below, watching ``health``, so one that dies while starting is named at
        # once instead of after the timeout.
        host, port = launch_env["MASTER_ADDR"], int(launch_env["MASTER_PORT"])
        store = dist.TCPStore(host, port, world, rank == 0, timeout, wait_for_workers=False)
    store.set_timeout(timeout)
    _wait_for_ranks(store, rank, world, timeout_s, health)
    nccl = device.type == "cuda"
    dist.init_process_group(
        "nccl" if nccl else "gloo",
        store=dist.PrefixStore("default_pg", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
        device_id=device if nccl else None,
    )
    return FailureBoard(dist.PrefixStore("ostinato", store))


def _new_groups(
    config: ParallelConfig, rank: int, world: int
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's TP group (consecutive ranks) and DP group (ranks a TP size apart).
    Every rank creates every group, in the same order, as PyTorch requires."""
    tp_size = config.tensor_parallel_size
    tp_group = dp_group = None
    for d in range(config.data_parallel_size):
        ranks = list(range(d * tp_size, (d + 1) * tp_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            tp_group = group
    for t in range(tp_size):
        ranks = list(range(t, world, tp_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            dp_group = group
    return tp_group, dp_group


def _wait_for_ranks(
    store: dist.Store, rank: int, world: int, timeout_s: float, health: HealthCheck | None
) -> None:
    """Every rank checks in; rank 0 waits until all have, polling ``health``."""
    store.add("ostinato_joined", 1)
    if rank != 0:
        return
    deadline = time.monotonic() + timeout_s
    while store.add("ostinato_joined", 0) < world:
        failure = health() if health is not None else None
        if failure is not None:
            raise failure.error(rank)
        if time.monotonic() > deadline:
            raise ParallelError(
                f"rank 0: the other {world - 1} rank(s) did not join within {timeout_s:.0f} s"
            )
        time.sleep(0.05)


def abort_parallel(groups: ParallelGroups, timeout_s: float = 10.0) -> bool:
    """Aborts this process's communicators without a collective (a dead peer cannot
    join one): NCCL kernels still waiting on that peer end, so this process can go on
    or exit instead of hanging in them. The groups are unusable afterwards. Returns
    False if the backend has no abort or it did not finish within ``timeout_s``."""
    if not dist.is_initialized():
        return True
    pgs = [g for g in (groups.tp.group, groups.dp_group) if g is not None]
    pgs.append(dist.group.WORLD)
    aborts = [getattr(g, "abort", None) for g in pgs]
    if not all(callable(a) for a in aborts):
        return False

    def abort() -> None:
        for a in aborts:
            with contextlib.suppress(Exception):  # one already aborted, say
                a()

    return _finishes_within(abort, timeout_s, "ostinato-abort")


def _finishes_within(work: Callable[[], None], timeout_s: float, name: str) -> bool:
    """Runs ``work`` on a daemon thread; whether it finished within ``timeout_s`` (a
    teardown that hangs is left behind, not waited on)."""
    done = threading.Event()

    def run() -> None:
        try:
            work()
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name=name).start()
    return done.wait(timeout_s)


def shutdown_parallel(timeout_s: float = 30.0) -> bool:
    """Destroys the process group, giving up after ``timeout_s`` (PyTorch's teardown can
    hang, e.g. after symmetric-memory use). Returns True if it finished in time."""
    if not dist.is_initialized():
        return True
    if not _finishes_within(dist.destroy_process_group, timeout_s, "ostinato-shutdown"):
        logger.warning("ostinato: destroy_process_group did not finish in %.0f s", timeout_s)
        return False
    return True


def _turn() -> CollectiveTurn | None:
    """The micro-batch turn this thread runs in, or None (also inside compiled code:
    micro-batches never run there, and the check stays out of its trace)."""
    return None if torch.compiler.is_compiling() else current_turn()
