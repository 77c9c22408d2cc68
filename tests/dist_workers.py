"""Worker functions for the two-process CPU tests (gloo): importable, so spawn can pickle
them. Each writes its result to ``out/<rank>.pt``."""

from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path

import torch

from ostinato.distributed.groups import local_launch_env
from ostinato.engine import LLM, SamplingParams
from ostinato.modes import GraphMode

PROMPTS = [[1, 5, 9, 200, 3], [7], [(13 * i + 5) % 512 for i in range(60)]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_env(rank: int, world: int, port: int) -> None:
    os.environ.update(local_launch_env(rank, world, port))


def tp_logits_and_tokens(
    rank: int,
    world: int,
    port: int,
    model_dir: str,
    out: str,
    device: str = "cpu",
    mode: str = "none",
    dtype: torch.dtype = torch.float32,
) -> None:
    """Last-token logits of PROMPTS and 8 greedy tokens each, under tensor parallelism."""
    set_env(rank, world, port)
    llm = engine(model_dir, device, mode, dtype, tp=world)
    reqs = [llm.scheduler.add(p, SamplingParams()) for p in PROMPTS]
    logits = llm.runner.execute(llm.scheduler.schedule())
    llm.scheduler.abort(reqs)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    torch.save({"logits": logits, "tokens": [o.token_ids for o in outs]}, Path(out) / f"{rank}.pt")
    if not llm.close():
        os._exit(0)  # the result is saved; do not wait in a hung teardown


def engine(
    model_dir: str, device: str, mode: str, dtype: torch.dtype, tp: int = 1, dp: int = 1
) -> LLM:
    """The engine every parallel test builds (tp = dp = 1 for the reference)."""
    return LLM(
        model_dir,
        device=device,
        mode=mode,
        dtype=dtype,
        max_model_len=128,
        max_num_seqs=4,
        max_capture_size=32,
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        progress=False,
    )


def dp_agreement(rank: int, world: int, port: int, out: str) -> None:
    """Agree on 20 random steps; record what each rank proposed and what came back."""
    set_env(rank, world, port)
    from ostinato.distributed import (
        ParallelConfig,
        agree_on_step,
        init_parallel,
        shutdown_parallel,
    )

    groups = init_parallel(ParallelConfig(data_parallel_size=world), "cpu")
    rng = random.Random(rank)
    modes = [GraphMode.NONE, GraphMode.PIECEWISE, GraphMode.FULL]
    rows = []
    for _ in range(20):
        mine = (rng.choice(modes), rng.choice([0, 1, 3, 8, 17, 64]))
        got = agree_on_step(*mine, groups.dp_group)
        rows.append((mine[0].name, mine[1], got.mode.name, got.num_tokens, got.tokens_per_rank))
    torch.save(rows, Path(out) / f"{rank}.pt")
    shutdown_parallel()


def one_rank_raises(rank: int, world: int, port: int, out: str) -> None:
    """Rank 1 fails before a collective; rank 0 records what its collective raised and when."""
    set_env(rank, world, port)
    import torch.distributed as dist

    from ostinato.distributed import ParallelConfig, all_reduce_sum, init_parallel

    torch.set_num_threads(1)

    groups = init_parallel(ParallelConfig(tensor_parallel_size=world), "cpu", timeout_s=10)
    dist.barrier()
    if rank == 1:
        raise RuntimeError("rank 1 failed on purpose")
    start = time.perf_counter()
    try:
        all_reduce_sum(torch.ones(4), groups.tp.group)
        result = "no error"
    except Exception as exc:  # the point: it raises instead of hanging
        result = f"{type(exc).__name__}: {exc}"
    torch.save((result, time.perf_counter() - start), Path(out) / f"{rank}.pt")


def dp_prompts(rank: int) -> list[list[int]]:
    """Different work per replica: rank 1 has fewer, shorter prompts and finishes first."""
    rng = random.Random(100 + rank)
    count = 5 if rank == 0 else 2
    return [[rng.randrange(1, 500) for _ in range(rng.randint(3, 30))] for _ in range(count)]


def dp_generate(
    rank: int, world: int, port: int, model_dir: str, out: str, device: str, mode: str
) -> None:
    """Greedy tokens of this replica's prompts under data parallelism."""
    set_env(rank, world, port)
    llm = engine(model_dir, device, mode, torch.float32, dp=world)
    max_tokens = 12 if rank == 0 else 4
    outs = llm.generate(dp_prompts(rank), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    torch.save([o.token_ids for o in outs], Path(out) / f"{rank}.pt")
    if not llm.close():
        os._exit(0)
