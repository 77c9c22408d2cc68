"""``python -m benchmarks --tp N``: the decode benchmark under tensor parallelism.

Starts N worker processes on this host the way ``torchrun`` would (one per GPU), runs the
same benchmark on every rank in lock-step, and returns rank 0's result: the step time of
the sharded model, all-reduces included. With several ``all_reduce`` choices the whole
benchmark runs once per choice; variant names carry the choice (``eager [nccl]``).
"""

from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import torch.multiprocessing as mp

from benchmarks.decode import BenchConfig, BenchResult


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


def _merged(merged: BenchResult, result: BenchResult) -> BenchResult:
    """``merged`` with ``result``'s rows, costs, profiles and notes added to it."""
    merged.rows += result.rows
    merged.costs += result.costs
    merged.profile.update(result.profile)
    merged.kernels_by_name.update(result.kernels_by_name)
    merged.notes += result.notes
    merged.all_reduce_us = merged.all_reduce_us or result.all_reduce_us
    return merged


def _worker(rank: int, tp: int, port: int, cfg: BenchConfig, profile: bool, out: str) -> None:
    from benchmarks import decode
    from ostinato.distributed import ParallelConfig, init_parallel, shutdown_parallel
    from ostinato.distributed.groups import local_launch_env
    from ostinato.distributed.symm_all_reduce import setup_symmetric_all_reduce

    os.environ.update(local_launch_env(rank, tp, port))

    groups = init_parallel(ParallelConfig(tensor_parallel_size=tp), "cuda")
    assert groups.tp.group is not None
    dtype = getattr(torch, cfg.dtype)
    max_bytes = max(cfg.batch_sizes) * cfg.model["hidden_size"] * dtype.itemsize
    merged: BenchResult | None = None
    for choice in cfg.all_reduce:

        def log(line: str, choice: str = choice) -> None:
            if rank == 0:
                print(f"[tp={tp} {choice}] {line}", flush=True)

        reducer = setup_symmetric_all_reduce(
            groups.tp.group, groups.device, dtype, choice, max_bytes
        )
        tp_info = replace(groups.tp, symmetric_group=reducer and reducer.group_name)
        plan = reducer.plan.describe() if reducer else "nccl"
        fused = None
        if reducer is not None and choice == "auto":  # (as the engine sets it up)
            hidden = cfg.model["hidden_size"]
            fused = decode.fused_all_reduce_norm(tp_info, groups.device, dtype, hidden)
            plan += f"; fused with the norm up to {fused.max_rows if fused else 0} rows"
        log(f"all-reduce plan: {plan}")
        # Every rank profiles: the census replays graphs that hold all-reduces, and a rank
        # that ran them alone waited for its peer forever (the TP=2 census hung).
        result = decode.run(cfg, groups.device, log, profile=profile, tp=tp_info)
        for row in result.rows:
            row.variant = f"{row.variant} [{choice}]"
        for cost in result.costs:
            cost.variant = f"{cost.variant} [{choice}]"
        result.profile = {f"{k} [{choice}]": v for k, v in result.profile.items()}
        result.kernels_by_name = {f"{k} [{choice}]": v for k, v in result.kernels_by_name.items()}
        result.notes.append(f"all_reduce={choice}: plan {plan}")
        if reducer is not None and reducer.timings is not None:
            t = reducer.timings
            result.all_reduce_us = {
                "sizes": [float(s) for s in t.sizes],
                **{a.value: us for a, us in t.us.items()},
            }
        if fused is not None:
            fused.release()
        if reducer is not None:
            reducer.release()
        merged = result if merged is None else _merged(merged, result)
        torch.cuda.empty_cache()
    if rank == 0:
        torch.save(merged, out)
    if not shutdown_parallel():
        os._exit(0)  # rank 0's result is saved; do not wait in a hung teardown
