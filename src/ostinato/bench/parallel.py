"""``ostinato bench --tp N``: the decode benchmark under tensor parallelism.

Starts N worker processes on this host the way ``torchrun`` would (one per GPU), runs the
same benchmark on every rank in lock-step, and returns rank 0's result: the step time of
the sharded model, all-reduces included.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from ostinato.bench.decode import BenchConfig, BenchResult


def run_parallel(cfg: BenchConfig, tp: int, profile: bool) -> BenchResult:
    """Rank 0's ``BenchResult`` of ``cfg`` on ``tp`` local GPUs (NCCL)."""
    if torch.cuda.device_count() < tp:
        raise ValueError(
            f"--tp: {tp} ranks asked for, but this host has {torch.cuda.device_count()} GPU(s)"
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.pt"
        mp.spawn(_worker, args=(tp, port, cfg, profile, str(out)), nprocs=tp)
        return torch.load(out, weights_only=False)


def _worker(rank: int, tp: int, port: int, cfg: BenchConfig, profile: bool, out: str) -> None:
    from ostinato.bench import decode
    from ostinato.distributed import ParallelConfig, init_parallel, shutdown_parallel
    from ostinato.distributed.groups import local_launch_env

    os.environ.update(local_launch_env(rank, tp, port))

    groups = init_parallel(ParallelConfig(tensor_parallel_size=tp), "cuda")

    def log(line: str) -> None:
        if rank == 0:
            print(f"[tp={tp}] {line}", flush=True)

    result = decode.run(cfg, groups.device, log, profile=profile and rank == 0, tp=groups.tp)
    if rank == 0:
        torch.save(result, out)
    if not shutdown_parallel():
        os._exit(0)  # rank 0's result is saved; do not wait in a hung teardown
