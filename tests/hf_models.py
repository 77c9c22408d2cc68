"""Small random Hugging Face checkpoints written to a folder, for parity tests."""

from __future__ import annotations

from pathlib import Path

import torch

SMALL = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)


def write_checkpoint(arch: str, folder: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    """Saves a random ``arch`` model (float32) with safetensors; returns the HF model."""
    import transformers

    config_cls = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
    }[arch]
    kwargs = {**SMALL, **overrides}
    if arch == "Qwen2ForCausalLM":
        kwargs.pop("head_dim")
        kwargs["hidden_size"] = 128  # Qwen2 derives head_dim = hidden / heads = 16
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).float().eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so they are tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def cpu_engine(folder: Path, **kw):
    """An ``LLM`` over the checkpoint in ``folder`` on the CPU in float32, small limits."""
    from ostinato.engine import LLM

    base = dict(device="cpu", dtype=torch.float32, max_model_len=96, max_num_seqs=4)
    return LLM(str(folder), progress=False, **{**base, **kw})


def assert_greedy_matches_hf(llm, hf, prompts, max_tokens, pad_token_id=0):
    """Greedy tokens of our engine equal ``hf.generate``'s for each prompt (EOS ignored)."""
    from ostinato.engine import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p]),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad_token_id,
            )
        assert o.token_ids == ref[0, len(p) :].tolist()


ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(hf, folder: Path, seed: int, rank: int = 8, modules=None, **config):
    """A PEFT LoRA adapter of ``hf`` with random A and B (PEFT zeroes B at creation:
    drawn here so it changes the output), saved to ``folder``; returns the PEFT model
    (wrapping a copy of ``hf``) that computes it."""
    import copy

    import peft

    lora = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=modules or ALL_MODULES, **config
    )
    model = peft.get_peft_model(copy.deepcopy(hf), lora)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
    model.save_pretrained(folder)
    return model.eval()


def peft_greedy(model, prompt: list[int], n: int) -> list[int]:
    """``model``'s greedy continuation of ``prompt`` (``n`` tokens, EOS ignored)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt], device=device),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
