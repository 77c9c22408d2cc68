"""Our decoder vs Hugging Face transformers on the same random weights (CPU, float32)."""

import pytest
import torch
from hf_models import write_checkpoint

from ostinato.engine import LLM, ModelConfig, SamplingParams

transformers = pytest.importorskip("transformers")


@pytest.fixture(params=["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def checkpoint(request, tmp_path):
    hf = write_checkpoint(
        request.param, tmp_path, tie_word_embeddings=request.param.startswith("Qwen2")
    )
    return request.param, hf, tmp_path


def _llm(path, **kw):
    return LLM(
        path,
        device="cpu",
        dtype=torch.float32,
        max_model_len=128,
        max_num_seqs=8,
        progress=False,
        **kw,
    )


def test_config_read_from_checkpoint(checkpoint):
    arch, hf, path = checkpoint
    cfg = ModelConfig.from_dir(path)
    assert cfg.architecture == arch
    assert cfg.qkv_bias is (arch == "Qwen2ForCausalLM")
    assert cfg.qk_norm is (arch == "Qwen3ForCausalLM")
    assert cfg.tie_word_embeddings is (arch == "Qwen2ForCausalLM")


def test_last_token_logits_match_hf(checkpoint):
    arch, hf, path = checkpoint
    llm = _llm(path)
    prompts = [[1, 5, 9, 200, 3], [7], list(range(10, 40))]
    from ostinato.engine.scheduler import ScheduledRequest, Step

    reqs = [llm.scheduler.add(p, SamplingParams()) for p in prompts]
    step = llm.scheduler.schedule()
    assert [s.request for s in step.scheduled] == reqs
    ours = llm.runner.execute(step)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].float()
        torch.testing.assert_close(ours[i], want, atol=1e-4, rtol=1e-4)
    assert isinstance(step.scheduled[0], ScheduledRequest) and isinstance(step, Step)


def test_greedy_generation_matches_hf_generate(checkpoint):
    arch, hf, path = checkpoint
    llm = _llm(path)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p]),
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert o.token_ids == ref[0, len(p) :].tolist()
