"""``ostinato::silu_mul`` on the CPU: its arithmetic, its errors, and its registration
(schema, fake tensor, torch.compile); the CUDA kernel is in test_gpu_engine.py."""

import pytest
import torch
import torch.nn.functional as F

from ostinato.engine.model.silu_mul_op import silu_mul_reference


def test_float32_equals_silu_of_the_gate_times_the_up_half():
    x = torch.randn(3, 5, 16)
    gate, up = x[..., :8], x[..., 8:]
    assert torch.equal(torch.ops.ostinato.silu_mul(x), F.silu(gate) * up)


def test_bfloat16_rounds_once_as_the_fused_kernel_does():
    x = torch.randn(64, 512, dtype=torch.bfloat16) * 4
    got = torch.ops.ostinato.silu_mul(x)
    gate, up = x.float().chunk(2, dim=-1)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (F.silu(gate) * up).bfloat16())
    # Eager torch rounds twice (after the SiLU, after the product): not always the same.
    eager = F.silu(x[:, :256]) * x[:, 256:]
    assert not torch.equal(got, eager)


@pytest.mark.parametrize("shape", [(4, 7), (5,), ()])
def test_an_odd_or_missing_last_dim_is_refused_by_name(shape):
    with pytest.raises(ValueError, match=r"silu_mul: the last dim holds \[gate \| up\]"):
        torch.ops.ostinato.silu_mul(torch.ones(shape))


def test_op_registration_passes_torch_opcheck():
    torch.library.opcheck(
        torch.ops.ostinato.silu_mul.default,
        (torch.randn(4, 32),),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


def test_compiled_model_keeps_the_op_and_its_values():
    def mlp(x, w):
        return torch.ops.ostinato.silu_mul(x @ w) * 2

    x, w = torch.randn(6, 8), torch.randn(8, 32)
    compiled = torch.compile(mlp, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, w), silu_mul_reference(x @ w) * 2)
