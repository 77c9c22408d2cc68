"""Registers and spills of one of ostinato's Triton kernels, compiled for a GPU on a
machine without one: Triton lowers the kernel to PTX for the target and its bundled
``ptxas -v`` reports what each thread holds. A check before device time is spent: a
tile held in registers that spills shows here.

    python scripts/kernel_registers.py ostinato.engine.kernels.rms_norm:_rms_norm_kernel \\
        --types '*bf16,*bf16,*bf16,*bf16,*bf16,i32,i32,i32,i32,i32,fp32,*bf16,*bf16,*i64,i32,i32' \\
        --const ADD=1 BLOCK=2048 USE_PDL=1 LORA_W=16 LORA_W_PAD=16 LORA_AHEAD=1 --warps 8

``--types``: the kernel's non-constexpr arguments in order (Triton's signature types);
every constexpr argument needs a ``--const``.
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Registers:
    """What ``ptxas -v`` reported for the kernel."""

    registers: int
    spill_stores: int
    spill_loads: int


def parse_ptxas(text: str) -> Registers:
    """The registers and spill bytes in ``ptxas -v``'s report (its stderr)."""
    used = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if used is None or spills is None:
        raise ValueError(f"no register report in ptxas's output:\n{text}")
    return Registers(int(used.group(1)), int(spills.group(1)), int(spills.group(2)))


def registers(
    kernel: object, types: list[str], consts: dict[str, object], warps: int, arch: int = 90
) -> Registers:
    """``kernel`` (a ``triton.jit`` function) compiled for ``sm_{arch}`` with ``warps``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    names = kernel.arg_names
    unknown = sorted(set(consts) - set(names))
    if unknown:
        raise ValueError(f"--const names no argument of the kernel: {unknown}; it has {names}")
    free = [n for n in names if n not in consts]
    if len(free) != len(types):
        raise ValueError(f"--types lists {len(types)} types for {len(free)} arguments: {free}")
    signature = {**dict(zip(free, types, strict=True)), **dict.fromkeys(consts, "constexpr")}
    source = ASTSource(
        fn=kernel,
        signature={n: signature[n] for n in names},
        constexprs={(names.index(n),): v for n, v in consts.items()},
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps}
    )
    with tempfile.TemporaryDirectory() as folder:
        ptx = Path(folder) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        suffix = "a" if arch == 90 else ""
        run = [get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}{suffix}", str(ptx)]
        out = subprocess.run(
            run + ["-o", str(Path(folder) / "k.cubin")], capture_output=True, text=True
        )
    if out.returncode != 0:
        raise RuntimeError(f"ptxas failed:\n{out.stderr}")
    return parse_ptxas(out.stderr)


def _const(text: str) -> tuple[str, object]:
    name, _, value = text.partition("=")
    if not value:
        raise argparse.ArgumentTypeError(f"--const {text!r}: expected NAME=VALUE")
    return name, float(value) if "." in value else int(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "kernel", help="module:function, e.g. ostinato.engine.kernels.rms_norm:_rms_norm_kernel"
    )
    parser.add_argument(
        "--types", required=True, help="comma-separated types of the other arguments"
    )
    parser.add_argument("--const", nargs="*", type=_const, default=[], help="NAME=VALUE")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    args = parser.parse_args(argv)
    module, _, name = args.kernel.partition(":")
    kernel = getattr(importlib.import_module(module), name)
    report = registers(kernel, args.types.split(","), dict(args.const), args.warps, args.arch)
    print(
        f"{args.kernel}: {report.registers} registers, spills {report.spill_stores} B "
        f"stored, {report.spill_loads} B loaded (sm_{args.arch}, {args.warps} warps)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
