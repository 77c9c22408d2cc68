"""Worker functions for the two-process CPU tests (gloo): importable, so spawn can pickle
them. Each writes its result to ``out/<rank>.pt``."""

from __future__ import annotations

import faulthandler
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
    all_reduce: str = "auto",
    micro_batching: object = False,
    prompts: list[str] = PROMPTS,
    tag: str = "",
) -> None:
    """Step logits of ``prompts`` (their first, prefill step) and 8 greedy tokens each,
    under tensor parallelism, saved to ``out/{tag}{rank}.pt`` with the count of steps
    run as micro-batches. Every rank runs this (as ``torchrun`` would start them)."""
    set_env(rank, world, port)
    llm = engine(
        model_dir,
        device,
        mode,
        dtype,
        tp=world,
        all_reduce=all_reduce,
        micro_batching=micro_batching,
    )
    reqs = [llm.engine.scheduler.add(p, SamplingParams()) for p in prompts]
    logits = llm.engine.runner.execute(llm.engine.scheduler.schedule()).logits
    llm.engine.scheduler.abort(reqs)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    result = {
        "logits": logits.float().cpu(),
        "tokens": [o.token_ids for o in outs],
        "ubatched": llm.engine.runner.ubatch.steps,
        "ubatched_replays": llm.engine.runner.ubatch.replays,
        "timings": [
            (t.descriptor.num_tokens, t.plain_ms, t.ubatched_ms)
            for t in llm.engine.runner.ubatch.timings
        ],
        "candidates": sorted(d.num_tokens for d in llm.engine.runner.ubatch.candidates),
        "ubatched_graphs": sorted(d.num_tokens for d in llm.engine.runner.ubatch.graphs),
    }
    torch.save(result, Path(out) / f"{tag}{rank}.pt")
    if not llm.close():
        os._exit(0)  # the result is saved; do not wait in a hung teardown


SAMPLED = SamplingParams(
    max_tokens=8,
    ignore_eos=True,
    temperature=0.8,
    top_p=0.9,
    seed=7,
    logit_bias={3: 2.0, 5: -1.0},
    presence_penalty=0.5,
    frequency_penalty=0.4,
    logprobs=3,
)
"""Every sampling parameter at once, one seed: the draws are the same wherever the
logits are (a request's seeded draws do not depend on its batch or its rank)."""


def sampled_outputs(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
    """Each prompt's ``SAMPLED`` tokens, with the alternatives' ids and log probabilities
    of every token."""
    outs = llm.generate(prompts, SAMPLED)
    return [
        (o.token_ids, [e.top_ids for e in o.logprobs], [e.top_logprobs for e in o.logprobs])
        for o in outs
    ]


def assert_same_draws(got: list[tuple], want: list[tuple]) -> None:
    """The same tokens and alternatives, their log probabilities within 1e-4 (ranks
    reduce in another order: float32 values differ in their last places)."""
    import pytest

    assert [(t, ids) for t, ids, _ in got] == [(t, ids) for t, ids, _ in want]
    for (_, _, values), (_, _, wanted) in zip(got, want, strict=True):
        for row, wanted_row in zip(values, wanted, strict=True):
            assert row == pytest.approx(wanted_row, abs=1e-4)


def tp_sampled(
    rank: int, world: int, port: int, model_dir: str, out: str, device: str, mode: str
) -> None:
    """``sampled_outputs`` of ``PROMPTS`` and ``dp_prompts(0)`` under tensor parallelism
    (float32), saved to ``out/{rank}.pt``. Every rank runs this."""
    set_env(rank, world, port)
    llm = engine(model_dir, device, mode, torch.float32, tp=world)
    torch.save(sampled_outputs(llm, PROMPTS + dp_prompts(0)), Path(out) / f"{rank}.pt")
    if not llm.close():
        os._exit(0)  # the result is saved; do not wait in a hung teardown


def engine(
    model_dir: str,
    device: str,
    mode: str,
    dtype: torch.dtype,
    tp: int = 1,
    dp: int = 1,
    all_reduce: str = "auto",
    backend: object = None,
    **kw: object,
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
        all_reduce=all_reduce,
        backend=backend,
        progress=False,
        **{"capture": "blocking", **kw},
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
    from ostinato.ubatch.slicing import can_split

    groups = init_parallel(ParallelConfig(data_parallel_size=world), "cpu")
    rng = random.Random(rank)
    modes = [GraphMode.NONE, GraphMode.PIECEWISE, GraphMode.FULL]
    rows = []
    for _ in range(40):
        mode, padded = rng.choice(modes), rng.choice([0, 1, 3, 8, 17, 64])
        micro, real = rng.random() < 0.7, rng.randint(1, padded) if padded else 0
        got = agree_on_step(
            mode, padded, groups.dp_group, micro_batch=micro, real_tokens=real, can_split=can_split
        )
        rows.append(
            (mode.name, padded, got.mode.name, got.num_tokens, got.tokens_per_rank)
            + (micro, real, got.micro_batch)
        )
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


class FailingAttention:
    """The default attention backend, except that on rank ``rank`` its ``after``-th call
    on a step holding a sequence of ``min_seq_len`` tokens or more (only real requests
    do; start-up's dummy steps do not) raises, or with ``exit_code`` kills the process:
    a rank failing mid-generate."""

    def __init__(
        self,
        device: str,
        rank: int,
        after: int,
        exit_code: int | None = None,
        min_seq_len: int = 0,
    ):
        from ostinato.engine.model.backends import default_backend

        self.inner = default_backend(torch.device(device))
        self.graph_support = self.inner.graph_support
        self.applies_rope = self.inner.applies_rope
        self.write_kv = self.inner.write_kv
        self.rank, self.after, self.exit_code = rank, after, exit_code
        self.min_seq_len = min_seq_len
        self.calls = 0

    def __call__(self, q, k_cache, v_cache, meta, scale, out, rope=None):
        import torch.distributed as dist

        real = max(meta.seq_lens, default=0) >= self.min_seq_len
        if real and dist.is_initialized() and dist.get_rank() == self.rank:
            self.calls += 1
            if self.calls == self.after:
                if self.exit_code is not None:
                    os._exit(self.exit_code)
                raise RuntimeError("injected failure")
        return self.inner(q, k_cache, v_cache, meta, scale, out, rope)


def torchrun_rank_fails(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    """Ranks started like torchrun's; rank 1 raises mid-generate; each records its error."""
    set_env(rank, world, port)
    llm = LLM(
        model_dir,
        device="cpu",
        max_model_len=128,
        max_num_seqs=4,
        tensor_parallel_size=world,
        backend=FailingAttention("cpu", rank=1, after=5),
        progress=False,
    )
    start = time.perf_counter()
    try:
        llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
        result = "no error"
    except Exception as exc:
        result = f"{type(exc).__name__}: {exc}"
    torch.save((result, time.perf_counter() - start), Path(out) / f"{rank}.pt")
    os._exit(0)


def symmetric_all_reduce_checks(rank: int, world: int, port: int, out: str) -> None:
    """Each symmetric-memory algorithm against NCCL: eager, replayed from a captured graph
    with new inputs, and inside torch.compile; then a measured plan."""
    set_env(rank, world, port)
    from ostinato.distributed import ParallelConfig, init_parallel, shutdown_parallel
    from ostinato.distributed.all_reduce_plan import AllReduceAlgo, AllReducePlan
    from ostinato.distributed.symm_all_reduce import SymmetricAllReduce, measure, tp_all_reduce

    groups = init_parallel(ParallelConfig(tensor_parallel_size=world), "cuda")
    dev = groups.device
    reducer = SymmetricAllReduce(groups.tp.group, dev, torch.bfloat16, 1 << 20)
    errors = []
    for algo in (AllReduceAlgo.ONE_SHOT, AllReduceAlgo.TWO_SHOT, AllReduceAlgo.NCCL):
        reducer.plan = AllReducePlan.only(algo, 1 << 20)
        for shape in [(1, 4096), (7, 2048), (128, 4096), (3, 5)]:  # (3, 5): NCCL (misaligned)
            gen = torch.Generator(device=dev).manual_seed(rank * 100 + shape[0])
            x = torch.randint(-8, 8, shape, generator=gen, device=dev).to(torch.bfloat16)
            want = x.clone()
            torch.distributed.all_reduce(want, group=groups.tp.group)
            got = tp_all_reduce(x, reducer.group_name)
            errors.append((algo.value, shape, "eager", torch.equal(got, want)))
            static = x.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                a = tp_all_reduce(static, reducer.group_name)
                b = tp_all_reduce(a * 2, reducer.group_name)
            static.copy_(x + 1)
            graph.replay()
            w1 = (x + 1).clone()
            torch.distributed.all_reduce(w1, group=groups.tp.group)
            w2 = (w1 * 2).clone()
            torch.distributed.all_reduce(w2, group=groups.tp.group)
            ok = torch.equal(a, w1) and torch.equal(b, w2)
            errors.append((algo.value, shape, "graph", ok))
        compiled = torch.compile(lambda t: tp_all_reduce(t * 3, reducer.group_name) + 1)
        y = torch.full((16, 256), rank + 1.0, device=dev, dtype=torch.bfloat16)
        ok = torch.equal(compiled(y), torch.full_like(y, 3.0 * (1 + 2) + 1))
        errors.append((algo.value, (16, 256), "compiled", ok))
    timings = measure(reducer, [4096, 65536, 1 << 20])
    reducer.release()
    torch.save(
        {"checks": errors, "plan": timings.plan().describe(), "us": timings.us},
        Path(out) / f"{rank}.pt",
    )
    if not shutdown_parallel():
        os._exit(0)


def fused_reduce_norm_checks(rank: int, world: int, port: int, out: str) -> None:
    """The all-reduce fused with the residual add and RMSNorm against the two ops, bitwise
    on random bf16 rows: eagerly at every row count up to the buffer, then a graph of
    65 calls (an 8 B step's count: no multiple of the slots, so they rotate across replays)
    replayed 50 times on new inputs, each call launched with PDL; then the start-up
    measurement's choice."""
    set_env(rank, world, port)
    from ostinato.distributed import ParallelConfig, init_parallel, shutdown_parallel
    from ostinato.distributed.symm_all_reduce import SymmetricAllReduce, tp_all_reduce
    from ostinato.engine.model import all_reduce_norm_op as op

    dump_stacks_after(out, 240)
    groups = init_parallel(ParallelConfig(tensor_parallel_size=world), "cuda")
    dev, dtype, hidden = groups.device, torch.bfloat16, 4096
    reducer = SymmetricAllReduce(groups.tp.group, dev, dtype, 1 << 22)
    fused = op.FusedReduceNorm(groups.tp.group, dev, dtype, hidden)
    op._FUSED[reducer.group_name], fused.max_rows = fused, op.MAX_ROWS
    gen = torch.Generator(device=dev).manual_seed(rank)
    same = torch.Generator(device=dev).manual_seed(1234)  # (equal on every rank)
    weight = torch.rand(hidden, generator=same, device=dev).to(dtype) + 0.5

    def two_ops(x, r):
        summed = tp_all_reduce(x, reducer.group_name)
        return torch.ops.ostinato.add_rms_norm(summed, r, weight, 1e-5)

    checks = []
    for rows in (1, 2, 3, 8, 16, 17, 33, 64):
        x = torch.randn(rows, hidden, generator=gen, device=dev).to(dtype)
        r = torch.randn(rows, hidden, generator=same, device=dev).to(dtype)
        got, want = fused(x, r, weight, 1e-5), two_ops(x, r)
        checks.append((rows, "eager", all(map(torch.equal, got, want))))
    xs = torch.randn(65, 8, hidden, generator=gen, device=dev).to(dtype)
    r0 = torch.randn(8, hidden, generator=same, device=dev).to(dtype)
    graph, outs = torch.cuda.CUDAGraph(), []
    fused(xs[0], r0, weight, 1e-5)  # (eagerly first)
    with torch.cuda.graph(graph):
        res = r0
        for i in range(65):
            h, res = op.tp_all_reduce_add_rms_norm(  # (PDL: each call may launch early)
                xs[i], res, weight, 1e-5, reducer.group_name, True
            )
            outs.append(h)
    ok = True
    for _ in range(50):
        xs.copy_(torch.randn(xs.shape, generator=gen, device=dev).to(dtype))
        graph.replay()
        res = r0
        for i in range(65):
            h, res = two_ops(xs[i], res)
            ok = ok and torch.equal(h, outs[i])
    checks.append((8, "graph x50", ok))
    fused.release()
    chosen = op.setup_fused_reduce_norm(groups.tp.group, dev, dtype, hidden)
    rows = chosen.max_rows if chosen is not None else 0
    torch.save({"checks": checks, "max_rows": rows}, Path(out) / f"{rank}.pt")
    reducer.release()
    if not shutdown_parallel():
        os._exit(0)


def dump_stacks_after(out: str, seconds: float) -> None:
    """Writes every thread's stack to ``out/stacks.txt`` if this process still runs
    after ``seconds``: a hung GPU test then shows where it waits."""
    faulthandler.dump_traceback_later(seconds, file=open(Path(out) / "stacks.txt", "w"))


def spawned_engine_run(
    model_dir: str, out: str, mode: str, fail: bool, all_reduce: str = "auto"
) -> None:
    """In a process of its own (a stuck NCCL kernel must not outlive it): an LLM with
    tensor_parallel_size=2 that starts its own worker; with ``fail``, rank 1's process
    dies mid-generate. Records the tokens or the error and how long it took in
    ``driver.pt``; its stderr goes to ``stderr.txt`` and the wall time at which
    ``generate`` began to ``began.txt`` (the watchdog may end the process instead)."""
    stderr = os.open(Path(out) / "stderr.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(stderr, 2)
    dump_stacks_after(out, 100)
    backend = (
        FailingAttention("cuda", rank=1, after=1, exit_code=3, min_seq_len=50) if fail else None
    )
    llm = engine(
        model_dir, "cuda", mode, torch.float32, tp=2, all_reduce=all_reduce, backend=backend
    )
    (Path(out) / "began.txt").write_text(repr(time.time()))
    start = time.perf_counter()
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
        result = [o.token_ids for o in outs]
    except Exception as exc:
        result = f"{type(exc).__name__}: {exc}"
    torch.save((result, time.perf_counter() - start), Path(out) / "driver.pt")
    if not fail:
        llm.close()
    os._exit(0)


def static_ubatch_logits(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    """One prefill step with a straddling request, computed plainly and then as the two
    static micro-batches a captured FULL graph holds (views of the persistent buffers
    only, with the capturable dense attention), on every rank like torchrun's; saves both
    logits to ``out/static{rank}.pt``."""
    from fakes import DenseGraphAttention

    from ostinato.ubatch.policy import MicroBatching

    set_env(rank, world, port)
    never = MicroBatching(10**6, 10**6)  # the eager split never applies
    llm = engine(
        model_dir,
        "cpu",
        "none",
        torch.float32,
        tp=world,
        backend=DenseGraphAttention(),
        micro_batching=never,
    )
    # 74 tokens (a captured size splits into equal halves): the 60-token prompt, rows 6
    # to 65, straddles the split at row 37.
    prompts = [*PROMPTS, [(7 * i + 3) % 500 + 1 for i in range(8)]]
    for p in prompts:
        llm.engine.scheduler.add(p, SamplingParams())
    step = llm.engine.scheduler.schedule()
    descriptor = llm.engine.runner.graphs.dispatch(step.num_tokens).descriptor
    plain = llm.engine.runner.execute(step).logits.clone()
    llm.engine.runner.ubatch.graphs = frozenset({descriptor})
    split = llm.engine.runner.execute(step).logits.clone()
    result = {
        "n": step.num_tokens,
        "plain": plain,
        "split": split,
        "ubatched": llm.engine.runner.ubatch.steps,
        "ubatched_replays": llm.engine.runner.ubatch.replays,
    }
    torch.save(result, Path(out) / f"static{rank}.pt")
    llm.close()


def ubatch_timings_agree(rank: int, world: int, port: int, out: str) -> None:
    """``ubatch.tuning.measure`` over a gloo group where each rank times its own numbers
    (rank 1 is slower at the first size, rank 0 at the second); saves the agreed timings
    and choice to ``out/timings{rank}.pt``."""
    import torch.distributed as dist

    from ostinato.batch import BatchDescriptor
    from ostinato.engine.worker.ubatch_tuning import chosen, measure

    set_env(rank, world, port)
    dist.init_process_group("gloo")
    own = {
        (64, False): 10.0 + rank,
        (64, True): 9.0 + 3 * rank,  # 9 on rank 0 (faster), 12 on rank 1 (slower)
        (128, False): 20.0 - rank,
        (128, True): 15.0 - rank,
    }
    sizes = [BatchDescriptor(64), BatchDescriptor(128, 128, True)]
    timings = measure(sizes, lambda d, ub: own[(d.num_tokens, ub)], dist.group.WORLD)
    torch.save((timings, chosen(timings, 1.03)), Path(out) / f"timings{rank}.pt")
    dist.destroy_process_group()


def ubatch_measure_agreement(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    """DP=2 × TP=2 ranks started like torchrun's, each timing the split graphs its own
    way at capture (graphs of the fake platform; the split is twice as fast on replica
    0 and twice as slow on replica 1); saves every rank's agreed timings and chosen
    sizes to ``out/agree{rank}.pt``."""
    from fakes import DenseGraphAttention, FakePlatform

    import ostinato.engine.api.startup as llm_module
    import ostinato.engine.worker.runner as runner_module
    from ostinato.engine.worker.ubatch_steps import UbatchSteps
    from ostinato.ubatch.policy import MicroBatching

    set_env(rank, world, port)
    platform = FakePlatform()
    for module in (llm_module, runner_module):
        module.platform_for_device = lambda device: platform
    replica = rank // 2

    def replay_ms(self, d, ubatched, step_as, meta):
        return (0.5 if replica == 0 else 2.0) if ubatched else 1.0

    UbatchSteps.replay_ms = replay_ms
    llm = engine(
        model_dir,
        "cpu",
        "full",
        torch.float32,
        tp=2,
        dp=2,
        backend=DenseGraphAttention(),
        micro_batching=MicroBatching(2, 4),
    )
    runner = llm.engine.runner
    result = {
        "timings": [(t.descriptor, t.plain_ms, t.ubatched_ms) for t in runner.ubatch.timings],
        "candidates": runner.ubatch.candidates,
        "chosen": runner.ubatch.graphs,
    }
    torch.save(result, Path(out) / f"agree{rank}.pt")
    if not llm.close():
        os._exit(0)


def served_tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Each prompt's tokens from an ``EngineLoop`` serving ``llm``: half the prompts
    submitted at once, the rest after the first has streamed a token (they join running
    steps); beside them a sampled request, and a request aborted after that first token.
    A worker whose scheduler missed any of these would pair its collectives with the
    wrong step, and the serve would hang or fail."""
    from ostinato.engine.core.scheduler import FinishReason
    from ostinato.engine.serve.loop import EngineLoop

    loop = EngineLoop(llm)
    try:
        half = len(prompts) // 2
        handles = [loop.submit(p, params) for p in prompts[:half]]
        doomed = loop.submit(prompts[0], SamplingParams(max_tokens=60, ignore_eos=True))
        sampled = loop.submit(prompts[-1], SamplingParams(max_tokens=6, temperature=0.8))
        first = iter(handles[0])
        tokens = [[next(first)]]
        loop.abort(doomed.id)
        handles += [loop.submit(p, params) for p in prompts[half:]]
        tokens[0] += list(first)
        tokens += [list(h) for h in handles[1:]]
        assert len(list(doomed)) < 60 and doomed.finish_reason is FinishReason.ABORT
        assert 1 <= len(list(sampled)) <= 6
        return tokens
    finally:
        assert loop.stop()


def cpu_plan_key(self, device, key, rows, extra) -> str:
    """``CompileCache.plan_key`` on the CPU, which has no device properties to name:
    a key of everything else."""
    return repr((key, rows, extra))


def layer_plan_agreement(rank: int, world: int, port: int, out: str) -> None:
    """Plan the tiny model's layers with timings of this rank's own (rank 1's unfused
    steps slower at 4 rows, rank 0's faster; rank 1's steps without PDL slower at 2 rows,
    rank 0's faster), rank 0 with its plan already cached; record what each rank chose
    and which variants it timed."""
    set_env(rank, world, port)
    import torch.distributed as dist

    from ostinato.engine.kernels.options import KernelOptions
    from ostinato.engine.model.config import ModelConfig
    from ostinato.engine.model.decoder import DecoderModel
    from ostinato.engine.model.presets import shape
    from ostinato.engine.worker import layer_tuning
    from ostinato.engine.worker.compile_cache import CompileCache

    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = DecoderModel(ModelConfig.from_hf(shape("tiny")), kernels=KernelOptions())
    cache = CompileCache(Path(out) / f"cache{rank}")
    CompileCache.plan_key = cpu_plan_key
    if rank == 0:  # a plan only this rank's cache holds: both must measure anyway
        sizes = [1, 2, 4]
        key = layer_tuning.layer_key(model)
        cache.store_plans({cache.plan_key(None, key, sizes, k): [] for k in ("layers", "no pdl")})
    timed = []

    def timer(rows: int, unfused: bool, pdl: bool) -> float:
        timed.append((rows, unfused, pdl))
        if (rows == 4 and unfused) or (rows == 2 and not pdl):
            return 80.0 if rank == 0 else 120.0
        return 100.0

    layer_tuning.plan_layers(model, [1, 2, 4], timer, cache, dist.group.WORLD)
    chosen = sorted(model.unfused_rows), sorted(model.no_pdl_rows)
    torch.save((chosen, timed), Path(out) / f"{rank}.pt")
    dist.destroy_process_group()


def ahead_agreement(rank: int, world: int, port: int, out: str) -> None:
    """Rank 0 measured a GEMM plan, rank 1 found all of its plans cached: record whether
    each still compiles ahead (its passes run the model, whose all-reduces both join)."""
    set_env(rank, world, port)
    from types import SimpleNamespace

    import torch.distributed as dist

    from ostinato.engine.worker.kernel_plan import KernelPlan

    dist.init_process_group("gloo", rank=rank, world_size=world)
    plan = object.__new__(KernelPlan)
    plan.model = SimpleNamespace(tp=SimpleNamespace(group=dist.group.WORLD))
    plan.ahead = plan._kernels_pending = True
    plan.timings, plan.layer_timings = (["measured"] if rank == 0 else []), []
    plan._ahead_only_after_measuring(planned=True)
    torch.save((plan.ahead, plan.compiles_kernels), Path(out) / f"{rank}.pt")
    dist.destroy_process_group()
