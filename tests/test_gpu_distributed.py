"""Two GPUs (NCCL): tensor-parallel graphs, with the all-reduces captured inside FULL
graphs and inside the compiled pieces of FULL_AND_PIECEWISE, compute what one GPU does."""

import pytest
import torch
import torch.multiprocessing as mp
from dist_workers import (
    PROMPTS,
    dp_generate,
    dp_prompts,
    engine,
    free_port,
    tp_logits_and_tokens,
)
from hf_models import write_checkpoint

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
    reqs = [llm.scheduler.add(p, SamplingParams()) for p in PROMPTS]
    logits = llm.runner.execute(llm.scheduler.schedule())
    llm.scheduler.abort(reqs)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    return logits.cpu(), [o.token_ids for o in outs]


@pytest.mark.parametrize("mode", ["none", "full", "full_and_piecewise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tp2_matches_one_gpu(model_dir, tmp_path, mode, dtype):
    mp.spawn(
        tp_logits_and_tokens,
        args=(2, free_port(), str(model_dir), str(tmp_path), "cuda", mode, dtype),
        nprocs=2,
    )
    want_logits, want_tokens = one_gpu(model_dir, mode, dtype)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"{rank}.pt", map_location="cpu")
        err = ((got["logits"] - want_logits).norm() / want_logits.norm()).item()
        assert err < (1e-4 if dtype == torch.float32 else 2e-2), err
        if dtype == torch.float32:
            assert got["tokens"] == want_tokens


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
