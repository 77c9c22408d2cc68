"""``scripts/kernel_registers.py``: a kernel compiled for sm_90a on this CPU machine and
ptxas's register report read back."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import kernel_registers  # noqa: E402

NORM_TYPES = (
    "*bf16,*bf16,*bf16,*bf16,*bf16,i32,i32,i32,i32,i32,fp32,*bf16,*bf16,*i64,i32,i32,"
    "*bf16,*bf16,i32,i32"
)


def test_the_report_is_read_as_ptxas_writes_it():
    text = (
        "ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
        "ptxas info    : Function properties for k\n"
        "    64 bytes stack frame, 64 bytes spill stores, 32 bytes spill loads\n"
        "ptxas info    : Used 128 registers, used 1 barriers, 64 bytes cumulative stack size\n"
    )
    assert kernel_registers.parse_ptxas(text) == kernel_registers.Registers(128, 64, 32)
    with pytest.raises(ValueError, match="no register report"):
        kernel_registers.parse_ptxas("ptxas fatal : something else")


def _ptxas() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        return Path(get_ptxas(90).path).exists()
    except Exception:  # (a Triton without its NVIDIA tools)
        return False


@pytest.mark.skipif(not _ptxas(), reason="needs Triton's bundled ptxas")
def test_a_norm_kernel_compiles_for_sm90_and_its_registers_are_reported(capsys):
    from ostinato.engine.kernels.rms_norm import _rms_norm_kernel

    plain = kernel_registers.registers(
        _rms_norm_kernel, NORM_TYPES.split(","), {"ADD": 1, "BLOCK": 2048, "USE_PDL": 1,
        "LORA_W": 0, "LORA_W_PAD": 1, "LORA_AHEAD": 0, "SHRINK_W": 0, "SHRINK_CHUNK": 1}, warps=8,
    )  # fmt: skip
    delta = kernel_registers.registers(
        _rms_norm_kernel, NORM_TYPES.split(","), {"ADD": 1, "BLOCK": 2048, "USE_PDL": 1,
        "LORA_W": 16, "LORA_W_PAD": 16, "LORA_AHEAD": 0, "SHRINK_W": 0, "SHRINK_CHUNK": 1}, warps=8,
    )  # fmt: skip
    assert 0 < plain.registers < delta.registers <= 255  # (the delta's tiles take some)
    assert plain.spill_stores == 0
    argv = ["ostinato.engine.kernels.rms_norm:_rms_norm_kernel", "--types", NORM_TYPES,
            "--const", "ADD=1", "BLOCK=2048", "USE_PDL=0", "LORA_W=0", "LORA_W_PAD=1",
            "LORA_AHEAD=0", "SHRINK_W=0", "SHRINK_CHUNK=1", "--warps", "8"]  # fmt: skip
    assert kernel_registers.main(argv) == 0
    assert "registers, spills 0 B stored" in capsys.readouterr().out
    aligned = kernel_registers.main([*argv, "--aligned", "--divisible", "dim", "stride_x"])
    assert aligned == 0 and "registers" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--divisible names no argument"):
        kernel_registers.registers(
            _rms_norm_kernel, NORM_TYPES.split(","), {"ADD": 1, "BLOCK": 2048, "USE_PDL": 1,
            "LORA_W": 0, "LORA_W_PAD": 1, "LORA_AHEAD": 0, "SHRINK_W": 0, "SHRINK_CHUNK": 1},
            warps=8, divisible=frozenset({"nope"}),
        )  # fmt: skip
    with pytest.raises(ValueError, match="--types lists 2 types"):
        kernel_registers.registers(_rms_norm_kernel, ["*bf16", "i32"], {"ADD": 1}, warps=8)


@pytest.mark.skipif(not _ptxas(), reason="needs Triton's bundled ptxas")
def test_a_launch_on_cpu_tensors_is_recorded_and_compiled_as_the_gpu_would():
    # The engine's own launch wrapper, called with CPU tensors, runs nothing: its launch
    # is recorded, then compiled with Triton's specialisation of those arguments (the
    # rows' stride a multiple of 16, pointers aligned), as a GPU launch compiles.
    import torch

    from ostinato.engine.kernels.rms_norm import _rms_norm_kernel, rms_norm_rows

    x, res = torch.randn(8, 1536, dtype=torch.bfloat16), torch.randn(8, 1536, dtype=torch.bfloat16)
    w = torch.randn(1536, dtype=torch.bfloat16)
    out, total = torch.full_like(x, 7.0), torch.full_like(x, 7.0)
    (launch,) = kernel_registers.launched_registers(
        lambda: rms_norm_rows(x, res, w, 1e-5, out, total, True)
    )
    assert launch.kernel == "_rms_norm_kernel" and launch.warps == 8
    assert launch.constexprs["BLOCK"] == 2048 and launch.constexprs["USE_PDL"]
    assert torch.all(out == 7.0)  # (nothing ran)
    named = [p.name for p in _rms_norm_kernel.params if p.is_constexpr]
    consts = {k: launch.constexprs[k] for k in named}
    free = [n for n in _rms_norm_kernel.arg_names if n not in launch.constexprs]
    aligned = frozenset(n for n in free if n.endswith("_ptr")) | {"stride_x", "stride_r", "dim"}
    aligned |= {"stride_o", "stride_t"}
    by_hand = kernel_registers.registers(
        _rms_norm_kernel, NORM_TYPES.split(","), consts, 8, divisible=aligned
    )
    assert launch.report.registers == by_hand.registers
