"""Registers and spills of one of ostinato's Triton kernels, compiled for a GPU on a
machine without one: Triton lowers the kernel to PTX for the target and its bundled
``ptxas -v`` reports what each thread holds. A check before device time is spent: a
tile held in registers that spills shows here.

    python scripts/kernel_registers.py ostinato.engine.kernels.rms_norm:_rms_norm_kernel \\
        --types '*bf16,*bf16,*bf16,*bf16,*bf16,i32,i32,i32,i32,i32,fp32,*bf16,*bf16,*i64,i32,i32' \\
        --const ADD=1 BLOCK=2048 USE_PDL=1 LORA_W=16 LORA_W_PAD=16 LORA_AHEAD=1 --warps 8

``--types``: the kernel's non-constexpr arguments in order (Triton's signature types);
every constexpr argument needs a ``--const``. ``--aligned`` marks every pointer 16-byte
aligned and ``--divisible NAME ...`` those integer arguments multiples of 16, as Triton
specialises a launch whose values are (the GPU's compile of the engine's kernels has
them: without, loads are not vectorised and the counts differ).

From Python, ``launched_registers(lambda: some_launch_wrapper(cpu_tensors...))`` records
the launches the engine's own wrapper makes and compiles each as the GPU would compile
that launch: no signature to type by hand.
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
    kernel: object,
    types: list[str],
    consts: dict[str, object],
    warps: int,
    arch: int = 90,
    divisible: frozenset[str] = frozenset(),
) -> Registers:
    """``kernel`` (a ``triton.jit`` function) compiled for ``sm_{arch}`` with ``warps``,
    the arguments named in ``divisible`` specialised as multiples of 16 (a pointer: 16-byte
    aligned)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    unknown = sorted(set(consts) - set(names))
    if unknown:
        raise ValueError(f"--const names no argument of the kernel: {unknown}; it has {names}")
    free = [n for n in names if n not in consts]
    if len(free) != len(types):
        raise ValueError(f"--types lists {len(types)} types for {len(free)} arguments: {free}")
    signature = {**dict(zip(free, types, strict=True)), **dict.fromkeys(consts, "constexpr")}
    unknown = sorted(divisible - set(free))
    if unknown:
        raise ValueError(f"--divisible names no argument of the kernel: {unknown}; it has {free}")
    source = ASTSource(
        fn=kernel,
        signature={n: signature[n] for n in names},
        constexprs={(names.index(n),): v for n, v in consts.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in sorted(divisible)},
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps}
    )
    return _ptxas(compiled.asm["ptx"], arch)


@dataclass(frozen=True)
class Launch:
    """One Triton launch recorded by ``launched_registers``, and its report."""

    kernel: str
    constexprs: dict[str, object]
    warps: int
    report: Registers


def launched_registers(launch: Callable[[], object], arch: int = 90) -> list[Launch]:
    """Every Triton kernel ``launch()`` launches, compiled for ``sm_{arch}`` as the GPU
    would compile a launch of the same arguments (Triton's own specialisation: pointers
    16-byte aligned and integers that are multiples of 16 marked, the constexprs, the
    launch options), with ``ptxas -v``'s report. Give it CPU tensors: nothing runs, the
    launches are recorded and compiled afterwards."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction

    recorded: list[tuple[JITFunction, tuple[object, ...], dict[str, object]]] = []

    def record(self: JITFunction, *args: object, grid: object, warmup: bool, **kw: object) -> None:
        recorded.append((self, args, kw))

    run = JITFunction.run
    JITFunction.run = record  # type: ignore[method-assign]
    try:
        launch()
    finally:
        JITFunction.run = run  # type: ignore[method-assign]
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    return [_compile_launch(k, args, kw, backend, target, arch) for k, args, kw in recorded]


def _compile_launch(
    kernel: Any,
    args: tuple[object, ...],
    kw: dict[str, object],
    backend: Any,
    target: Any,
    arch: int,
) -> Launch:
    """One recorded launch compiled as ``JITFunction.run`` compiles it."""
    import triton
    from triton.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kw)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kw, bound, specialization, options
    )
    source = ASTSource(kernel, signature, constexprs, attrs)
    compiled = triton.compile(source, target=target, options=options.__dict__)
    names = kernel.arg_names
    consts = {names[path[0]]: value for path, value in constexprs.items() if len(path) == 1}
    report = _ptxas(compiled.asm["ptx"], arch)
    return Launch(kernel.fn.__name__, consts, options.num_warps, report)


def _ptxas(ptx: str, arch: int) -> Registers:
    """``ptxas -v``'s report of ``ptx`` for ``sm_{arch}`` (``sm_90a`` for 90)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.ptx"
        path.write_text(ptx)
        suffix = "a" if arch == 90 else ""
        run = [get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}{suffix}", str(path)]
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
    parser.add_argument("--aligned", action="store_true", help="every pointer 16-byte aligned")
    parser.add_argument(
        "--divisible", nargs="*", default=[], help="integer arguments that are multiples of 16"
    )
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    args = parser.parse_args(argv)
    module, _, name = args.kernel.partition(":")
    kernel = getattr(importlib.import_module(module), name)
    types, consts = args.types.split(","), dict(args.const)
    free = [n for n in kernel.arg_names if n not in consts]
    pointers = {n for n, t in zip(free, types, strict=False) if t.startswith("*")}
    divisible = frozenset(args.divisible) | (frozenset(pointers) if args.aligned else frozenset())
    report = registers(kernel, types, consts, args.warps, args.arch, divisible)
    print(
        f"{args.kernel}: {report.registers} registers, spills {report.spill_stores} B "
        f"stored, {report.spill_loads} B loaded (sm_{args.arch}, {args.warps} warps)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
