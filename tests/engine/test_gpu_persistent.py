"""GPU tests of the persistent decode kernel (``KernelOptions(persistent_layers=True)``):
a whole step of 1 to 16 rows (decode, and prefill rows mixed in) against the per-layer
kernels on SmolLM2's shape, its graph replay bitwise its eager run, the step's kernel
count, and steps of more rows left to the layers."""

from dataclasses import replace

import pytest
import torch

from ostinato.engine import KernelOptions
from ostinato.modes import GraphMode

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
PERSISTENT = KernelOptions(persistent_layers=True)


def _setup(batch_sizes=(1, 8, 16), **config):
    # SmolLM2-135M's shape with random weights (benchmarks/configs), 30 layers.
    import json
    from pathlib import Path

    from benchmarks.decode import BenchConfig, DecodeSetup

    path = Path(__file__).parents[2] / "benchmarks" / "configs" / "smollm2_135m.json"
    model = {**json.loads(path.read_text()), **config}
    cfg = replace(BenchConfig(model=model), batch_sizes=batch_sizes, kv_len=300)
    return DecodeSetup(cfg, DEVICE)


def _logits(setup, mode, kernels, step):
    runner = setup.runner(mode, None, kernels=kernels)
    with torch.inference_mode():
        runner.capture()
        out = runner.execute(step).logits.clone()
    used = runner.layer_stack is not None
    runner.release()
    return out, used


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("batch", [1, 8, 16])
def test_a_persistent_decode_step_matches_the_per_layer_kernels(batch):
    setup = _setup()
    step = setup.decode_batch(list(range(3, 3 + batch)))
    snapshot = [t.clone() for t in setup.cache.k + setup.cache.v]
    ref, _ = _logits(setup, GraphMode.FULL, None, step)
    for t, saved in zip(setup.cache.k + setup.cache.v, snapshot, strict=True):
        t.copy_(saved)
    got, used = _logits(setup, GraphMode.FULL, PERSISTENT, step)
    assert used
    err = _rel(got, ref)
    print(f"batch {batch}: relative error {err:.2e}")
    assert err < 2e-2, err
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


def test_a_persistent_step_replayed_is_bitwise_its_eager_run():
    # 8 rows, a captured size: the eager run has the replay's rows (and so its splits).
    setup = _setup()
    step = setup.decode_batch([5, 9, 11, 2, 7, 1, 4, 6])
    eager, _ = _logits(setup, GraphMode.NONE, PERSISTENT, step)
    replayed, used = _logits(setup, GraphMode.FULL, PERSISTENT, step)
    assert used and torch.equal(eager, replayed)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_biases_and_head_norms_run_in_the_persistent_kernel(arch):
    setup = _setup(batch_sizes=(4,), architectures=[arch])
    assert setup.config.qkv_bias or setup.config.qk_norm
    step = setup.decode_batch([5, 9, 11, 2])
    snapshot = [t.clone() for t in setup.cache.k + setup.cache.v]
    ref, _ = _logits(setup, GraphMode.FULL, None, step)
    for t, saved in zip(setup.cache.k + setup.cache.v, snapshot, strict=True):
        t.copy_(saved)
    got, used = _logits(setup, GraphMode.FULL, PERSISTENT, step)
    assert used and _rel(got, ref) < 2e-2, _rel(got, ref)


def test_a_persistent_decode_step_is_a_handful_of_kernels():
    from benchmarks.census import kernel_census

    setup = _setup(batch_sizes=(8,))
    runner = setup.runner(GraphMode.FULL, None, kernels=PERSISTENT)
    with torch.inference_mode():
        runner.capture()
        census = kernel_census(setup.decode_step(runner, 8))
    runner.release()
    names = [k.name for k in census.by_name]
    assert "_decode_layers_kernel" in names, names
    assert "_paged_attention_kernel" not in names and "_gemm_kernel" not in names, names
    assert census.kernels <= 20, names


def test_the_engine_generates_the_same_greedy_tokens_with_the_persistent_kernel():
    # Prompts of up to 16 tokens prefill through the kernel too; bf16 sums in another
    # order, so the engines run in lock step on the per-layer engine's tokens.
    from gpu_harness import lockstep, tiny_engine

    plain = tiny_engine("full_and_piecewise", torch.bfloat16)
    persistent = tiny_engine("full_and_piecewise", torch.bfloat16, kernels=PERSISTENT)
    assert persistent.runner.layer_stack is not None
    lockstep(plain, persistent, tolerance=3e-2)
