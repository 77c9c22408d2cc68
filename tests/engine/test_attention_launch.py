"""AttentionLaunch on the CPU: the attention kernel's launch settings are refused by name
before Triton would fail to compile them."""

import pytest

from ostinato.engine.kernels.attention_launch import BLOCK_N, AttentionLaunch


def test_the_defaults_are_the_kernel_s_settings():
    assert AttentionLaunch() == AttentionLaunch(block_n=BLOCK_N, num_warps=4, num_stages=3)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"block_n": 8}, "block_n"),
        ({"block_n": 48}, "block_n"),
        ({"num_warps": 0}, "num_warps"),
        ({"num_warps": 3}, "num_warps"),
        ({"num_stages": 0}, "num_stages"),
    ],
)
def test_a_setting_triton_cannot_compile_is_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=f"AttentionLaunch.{field}: "):
        AttentionLaunch(**kwargs)
