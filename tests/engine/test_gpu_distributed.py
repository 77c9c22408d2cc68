"""Two GPUs (NCCL): tensor-parallel graphs, with the all-reduces captured inside FULL
graphs and inside the compiled pieces of FULL_AND_PIECEWISE, compute what one GPU does."""

import time

import pytest
import torch
import torch.multiprocessing as mp
from dist_workers import (
    PROMPTS,
    assert_same_draws,
    dp_generate,
    dp_prompts,
    engine,
    free_port,
    fused_reduce_norm_checks,
    sampled_outputs,
    spawned_engine_run,
    symmetric_all_reduce_checks,
    tp_logits_and_tokens,
    tp_sampled,
)
from hf_models import write_checkpoint

from ostinato.distributed.watchdog import EXIT_CODE
from ostinato.engine import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    write_checkpoint("LlamaForCausalLM", path, rope_theta=500000.0)
    return path


def one_gpu(model_dir, mode, dtype):
    llm = engine(str(model_dir), "cuda", mode, dtype)
    reqs = [llm.engine.scheduler.add(p, SamplingParams()) for p in PROMPTS]
    logits = llm.engine.runner.execute(llm.engine.scheduler.schedule()).logits
    llm.engine.scheduler.abort(reqs)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    return logits.float().cpu(), [o.token_ids for o in outs]


@pytest.mark.parametrize(
    "mode, dtype, all_reduce",
    [
        (mode, dtype, "nccl")
        for mode in ("none", "full", "full_and_piecewise")
        for dtype in (torch.float32, torch.bfloat16)
    ]
    + [  # each symmetric-memory algorithm in each graph mode and dtype at least once
        ("full", torch.float32, "one-shot"),
        ("full_and_piecewise", torch.float32, "two-shot"),
        ("full", torch.bfloat16, "two-shot"),
        ("full_and_piecewise", torch.bfloat16, "one-shot"),
        ("full_and_piecewise", torch.bfloat16, "auto"),
        ("full", torch.bfloat16, "auto"),
        ("none", torch.float32, "auto"),
    ],
)
def test_tp2_matches_one_gpu(model_dir, tmp_path, mode, dtype, all_reduce):
    mp.spawn(
        tp_logits_and_tokens,
        args=(2, free_port(), str(model_dir), str(tmp_path), "cuda", mode, dtype, all_reduce),
        nprocs=2,
    )
    want_logits, want_tokens = one_gpu(model_dir, mode, dtype)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"{rank}.pt", map_location="cpu")
        err = ((got["logits"] - want_logits).norm() / want_logits.norm()).item()
        assert err < (1e-4 if dtype == torch.float32 else 2e-2), err
        if dtype == torch.float32:
            assert got["tokens"] == want_tokens


@pytest.mark.parametrize("mode", ["none", "full"])
def test_tp2_draws_with_every_sampling_parameter_as_one_gpu(model_dir, tmp_path, mode):
    # Penalties, bias, top-p, a seed and logprobs (float32), in the sampling graphs with
    # mode="full": every rank draws one GPU's tokens and reports its alternatives.
    args = (2, free_port(), str(model_dir), str(tmp_path), "cuda", mode)
    mp.spawn(tp_sampled, args=args, nprocs=2)
    want = sampled_outputs(
        engine(str(model_dir), "cuda", mode, torch.float32), PROMPTS + dp_prompts(0)
    )
    for rank in (0, 1):
        assert_same_draws(torch.load(tmp_path / f"{rank}.pt"), want)


@pytest.mark.parametrize("mode", ["full", "full_and_piecewise"])
def test_dp2_with_different_batches_matches_running_alone(model_dir, tmp_path, mode):
    mp.spawn(
        dp_generate, args=(2, free_port(), str(model_dir), str(tmp_path), "cuda", mode), nprocs=2
    )
    alone = engine(str(model_dir), "cuda", mode, torch.float32)
    for rank, max_tokens in ((0, 12), (1, 4)):
        want = alone.generate(
            dp_prompts(rank), SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        )
        assert torch.load(tmp_path / f"{rank}.pt") == [o.token_ids for o in want]


def spawned_checks(worker, tmp_path, count: int) -> dict:
    """Runs ``worker`` on two ranks; every check each rank recorded passed, and there were
    ``count`` of them; rank 1's record."""
    mp.spawn(worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"{rank}.pt", weights_only=False)
        bad = [c for c in got["checks"] if not c[-1]]
        assert not bad, bad
        assert len(got["checks"]) == count
    return got


def test_symmetric_all_reduce_equals_nccl_eager_in_graphs_and_compiled(tmp_path):
    got = spawned_checks(symmetric_all_reduce_checks, tmp_path, 3 * (4 * 2 + 1))
    print("measured plan:", got["plan"], got["us"])


def test_all_reduce_fused_with_the_norm_equals_the_two_ops_eager_and_in_graphs(tmp_path):
    got = spawned_checks(fused_reduce_norm_checks, tmp_path, 9)
    print("fused all-reduce + norm chosen up to rows:", got["max_rows"])


def in_own_process(target, args, timeout_s, what, out) -> int:
    """Runs ``target(*args)`` in a process of its own (a stuck NCCL kernel must not
    outlive it) and returns its exit code; fails the test if it does not end within
    ``timeout_s``, with the stacks the process dumped and the files it wrote to ``out``
    by then."""
    proc = mp.get_context("spawn").Process(target=target, args=args)
    proc.start()
    proc.join(timeout=timeout_s)
    if proc.is_alive():
        proc.kill()
        stacks = out / "stacks.txt"
        dumped = stacks.read_text() if stacks.exists() else "(no stacks dumped)"
        wrote = sorted(p.name for p in out.iterdir())
        pytest.fail(f"{what} hung; it wrote {wrote}; its stacks:\n{dumped}")
    return proc.exitcode


def run_driver(model_dir, tmp_path, mode, fail, all_reduce="auto"):
    """The driver's tokens or error, and the seconds from the start of ``generate`` to
    its end: its return, or the watchdog's exit (the error then is its stderr)."""
    args = (str(model_dir), str(tmp_path), mode, fail, all_reduce)
    code = in_own_process(spawned_engine_run, args, 150, "the driver process", tmp_path)
    if code == EXIT_CODE:
        began = float((tmp_path / "began.txt").read_text())
        return (tmp_path / "stderr.txt").read_text(), time.time() - began
    assert code == 0, (code, (tmp_path / "stderr.txt").read_text()[-3000:])
    return torch.load(tmp_path / "driver.pt", weights_only=False)


@pytest.mark.parametrize("mode", ["full", "full_and_piecewise"])
def test_llm_started_alone_drives_a_second_gpu(model_dir, tmp_path, mode):
    tokens, _ = run_driver(model_dir, tmp_path, mode, fail=False)
    _, want = one_gpu(model_dir, mode, torch.float32)
    assert tokens == want


def test_ostinato_serve_with_tensor_parallel_size_2_answers_as_one_gpu(model_dir):
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from serve_harness import served_token_ids

    # float32: a request's greedy tokens do not depend on the rows batched with it.
    prompts = PROMPTS + dp_prompts(0)
    llm = engine(str(model_dir), "cuda", "full_and_piecewise", torch.float32)
    want = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8))]
    llm.close()
    args = ["--model", str(model_dir), "--device", "cuda", "--dtype", "float32", "--quiet"]
    args += ["--max-model-len", "128", "--max-num-seqs", "4", "--gpu-memory-utilization", "0.3"]
    got = served_token_ids([*args, "--tensor-parallel-size", "2"], prompts, max_tokens=8)
    assert got == want


@pytest.mark.parametrize("all_reduce", ["nccl", "auto"])
def test_a_dead_worker_gpu_is_named_not_waited_for(model_dir, tmp_path, all_reduce):
    # Piecewise: attention runs between the graphs, so the worker dies mid-step while
    # rank 0's graphs wait in an all-reduce that will never complete.
    # Its NCCL all-reduces end when the watchdog aborts the communicators, and the engine
    # raises; a symmetric-memory all-reduce spins for good, and the watchdog ends the
    # process instead (either way the error names the rank, within a bounded time).
    error, seconds = run_driver(model_dir, tmp_path, "full_and_piecewise", True, all_reduce)
    assert isinstance(error, str) and "rank 1 failed" in error, error
    # A process that dies with NCCL kernels in flight can hang in its exit (pipe open, no
    # exit code): then the silence of its heartbeat names it.
    assert "its process exited" in error or "no sign of life" in error, error
    assert seconds < 60, (error, seconds)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["none", "full"])
def test_micro_batched_tp2_equals_plain(model_dir, tmp_path, mode, dtype):
    # Every rank started like torchrun's: a straddling prefill (eager: above the largest
    # capture size), then decodes of 4 requests. With mode="full" the FULL sizes of 4
    # tokens and up are captured micro-batched, both micro-batches and both streams in
    # one graph, and the decodes replay them.
    from ostinato.ubatch.policy import MicroBatching

    # With graphs, the overlapped graph is also checked against the same overlapped
    # micro-batches run eagerly ("ubatch_eager"). The graphed run measures every
    # candidate size both ways at capture and (min_speedup ~0) keeps every split.
    prompts = PROMPTS + dp_prompts(0)
    policy = MicroBatching(2, 4, min_speedup=1e-9)
    runs = [("plain", mode, False), ("ubatch", mode, policy)]
    if mode != "none":
        runs.append(("ubatch_eager", "none", policy))
    for tag, run_mode, policy in runs:
        args = (2, free_port(), str(model_dir), str(tmp_path), "cuda", run_mode, dtype, "auto")
        mp.spawn(tp_logits_and_tokens, args=args + (policy, prompts, tag), nprocs=2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rank in (0, 1):
        plain = torch.load(tmp_path / f"plain{rank}.pt")
        for tag, _, _ in runs[1:]:
            ub = torch.load(tmp_path / f"{tag}{rank}.pt")
            assert ub["ubatched"] > 0 and plain["ubatched"] == 0
            if tag == "ubatch" and mode == "full":
                assert ub["ubatched_replays"] > 0
                # Timed on each rank, agreed (the slower rank's) on both: same choice.
                assert ub["candidates"] and ub["ubatched_graphs"] == ub["candidates"]
                assert sorted(t[0] for t in ub["timings"]) == ub["candidates"]
                assert all(t[1] > 0 and t[2] > 0 for t in ub["timings"])
                assert ub["timings"] == torch.load(tmp_path / "ubatch0.pt")["timings"]
            err = ((ub["logits"] - plain["logits"]).norm() / plain["logits"].norm()).item()
            assert err < tol, (tag, err)
            if dtype == torch.float32:
                assert ub["tokens"] == plain["tokens"], tag
