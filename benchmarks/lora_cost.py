"""What LoRA adapters add to a decode step: ``LLM.generate`` on a preset shape (random
weights), every row on a rank-``--rank`` adapter (two adapters, alternating rows), and
steps with no LoRA row, against an engine built without LoRA.

    python -m benchmarks.lora_cost --out OUT/lora.json [--model llama-1.5b]
        [--batch-sizes 1,8] [--rank 16] [--repeats 3] [--kernels]

Three engines live side by side (a small fixed KV cache each): ``base`` (no LoRA),
``specialised`` (``enable_lora``; steps without a LoRA row replay graphs without the
LoRA GEMMs) and ``unspecialised`` (``specialize_lora=False``: every graph has them).
A step's time is ``sampling_cost.step_ms``'s difference of two generates. Every
(engine, rows) case is warmed, then timed ``--repeats`` times, the cases interleaved
round by round; the median is reported with its ratio to the base engine's. With
``--kernels`` (CUDA), each case's device kernels of one decode step too, kernels inside
graph replays included (``census.difference`` of two profiled generates): what the
adapter rows' extra time is made of.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.census import KernelCensus, difference, kernel_census
from benchmarks.ready import ready
from benchmarks.sampling_cost import parse, step_ms, step_parser, write_rows

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Row:
    """One (batch size, case): the median step and its ratio to the base engine's."""

    batch: int
    case: str
    step_ms: float
    vs_base: float
    runs_ms: list[float]


def write_adapter(config: Any, folder: Path, rank: int, seed: int, scale: float = 0.01) -> None:
    """A random PEFT LoRA adapter (entries of std ``scale``) of every projection of a model
    of ``config``."""
    from safetensors.torch import save_file

    h, q = config.hidden_size, config.num_heads * config.head_dim
    kv, inter = config.num_kv_heads * config.head_dim, config.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (fan_in, fan_out) in shapes.items():
            block = "self_attn" if module in MODULES[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * scale
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                "target_modules": list(MODULES), "bias": "none"}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(settings))


def engines(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """The three engines, the LoRA ones with two adapters of ``args.rank``."""
    from ostinato.engine import LLM

    cuda = torch.cuda.is_available()
    common = dict(
        mode=args.mode,
        dtype=torch.bfloat16 if cuda else torch.float32,
        max_num_seqs=max(args.batch_sizes),
        max_model_len=args.prompt_len + args.long + 16,
        num_blocks=max(args.batch_sizes) * (args.prompt_len + args.long + 32) // 16 + 8,
        progress=False,
    )
    built = {"base": LLM(args.model, **common)}
    for i in range(2):
        write_adapter(built["base"].config, folder / f"a{i}", args.rank, seed=i)
    lora = dict(enable_lora=True, max_lora_rank=args.rank, lora_modules=(
        f"a0={folder / 'a0'}", f"a1={folder / 'a1'}"))  # fmt: skip
    built["specialised"] = LLM(args.model, **common, **lora)
    built["unspecialised"] = LLM(args.model, **common, **lora, specialize_lora=False)
    return {name: ready(llm) for name, llm in built.items()}


CASES = [("base", False), ("specialised", False), ("specialised", True),
         ("unspecialised", False), ("unspecialised", True)]  # fmt: skip


def adapters(b: int) -> dict[bool, list[str] | None]:
    """A case's ``lora`` argument for ``b`` rows: none, or the two adapters alternating."""
    return {False: None, True: [f"a{i % 2}" for i in range(b)]}


def label(engine: str, lora: bool) -> str:
    """A case as the rows name it."""
    return f"{engine}, {'every row on an adapter' if lora else 'no LoRA row'}"


def measure(built: dict[str, Any], args: argparse.Namespace) -> list[Row]:
    from ostinato.engine import SamplingParams

    params = SamplingParams(max_tokens=args.long, ignore_eos=True)
    prompt = list(range(100, 100 + args.prompt_len))
    rows = []
    for b in args.batch_sizes:
        prompts = [prompt] * b
        names = adapters(b)
        runs: dict[tuple[str, bool], list[float]] = {case: [] for case in CASES}
        for round_ in range(-1, args.repeats):  # round -1 warms every case
            short, long = (2, 4) if round_ < 0 else (args.short, args.long)
            for engine, lora in CASES:
                t = step_ms(built[engine], prompts, params, short, long, lora=names[lora])
                if round_ >= 0:
                    runs[(engine, lora)].append(t)
        base = statistics.median(runs[("base", False)])
        for (engine, lora), times in runs.items():
            case = label(engine, lora)
            median = statistics.median(times)
            rows.append(Row(b, case, median, median / base, times))
            print(f"B={b:3d} {case:45s} {median:7.3f} ms/step  {median / base:5.3f}x", flush=True)
    return rows


@dataclass(frozen=True)
class KernelRow:
    """One (batch size, case): the device kernels of one decode step."""

    batch: int
    case: str
    census: KernelCensus


def decode_census(
    llm: Any, prompts: list[list[int]], short: int, steps: int, lora: Any
) -> KernelCensus:
    """The device kernels of one decode step: a generate of ``steps`` tokens more than
    ``short``, less one of ``short`` (both profiled)."""
    from ostinato.engine import SamplingParams

    def profiled(n: int) -> KernelCensus:
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        return kernel_census(lambda: llm.generate(prompts, params, lora=lora), steps=1)

    return difference(profiled(short + steps), profiled(short), steps)


def kernel_rows(built: dict[str, Any], args: argparse.Namespace, steps: int = 8) -> list[KernelRow]:
    """Each case's ``decode_census`` (after ``measure`` warmed every case)."""
    prompt = list(range(100, 100 + args.prompt_len))
    rows = []
    for b in args.batch_sizes:
        names = adapters(b)
        for engine, lora in CASES:
            mix = decode_census(built[engine], [prompt] * b, args.short, steps, names[lora])
            case = label(engine, lora)
            rows.append(KernelRow(b, case, mix))
            top = ", ".join(f"{k.name[:40]} {k.per_step:.0f}x {k.us_per_step:.0f}" for k in
                            sorted(mix.by_name, key=lambda k: -k.us_per_step)[:6])  # fmt: skip
            print(f"B={b:3d} {case:45s} {mix.kernels:6.0f} kernels {mix.busy_us:7.1f} µs busy: "
                  f"{top}", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = step_parser(__doc__, "1,8")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument(
        "--kernels", action="store_true", help="also each case's device kernels (CUDA)"
    )
    args = parse(parser, argv)
    if args.kernels and not torch.cuda.is_available():
        parser.error("--kernels profiles device kernels: it needs CUDA")
    with tempfile.TemporaryDirectory() as folder:
        built = engines(args, Path(folder))
        try:
            rows = measure(built, args)
            kernels = kernel_rows(built, args) if args.kernels else []
            mode = built["base"].mode.name
        finally:
            for llm in built.values():
                llm.close()
    extra = {"kernels": [asdict(r) for r in kernels]} if kernels else {}
    write_rows(args, "lora_cost", mode, rows, rank=args.rank, **extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
