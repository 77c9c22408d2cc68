"""``python -m benchmarks``: decode-step time of every mode against eager, reduce-overhead
and the bandwidth floor."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks import DEFAULT_SHAPE, TIMED_SHAPES
from ostinato.distributed.all_reduce_plan import parse_all_reduce
from ostinato.engine import ModelConfig
from ostinato.engine.cli.args import DefaultsHelp, OneLineParser, int_list, positive_int
from ostinato.engine.model.presets import shape


def main(argv: list[str] | None = None) -> int:
    """Runs ``python -m benchmarks`` with ``argv``; returns the exit status. ``python -m benchmarks
    e2e ...`` runs the end-to-end ``generate`` benchmark instead, ``python -m benchmarks spec
    ...`` the speculative-decoding one, ``python -m benchmarks ubatch ...`` the micro-batch
    overlap one."""
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["e2e"]:
        from benchmarks import e2e

        return e2e.main(argv[1:])
    if argv[:1] == ["ubatch"]:
        from benchmarks import ubatch

        return ubatch.main(argv[1:])
    if argv[:1] == ["spec"]:
        from benchmarks import spec

        return spec.main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if any(b < 1 for b in args.batch_sizes):
        parser.error(f"argument --batch-sizes: sizes must be >= 1, got {args.batch_sizes}")
    if args.plot_from is not None and not args.plot_from.is_file():
        parser.error(f"argument --plot-from: {args.plot_from} is not a file")
    if args.config is not None and not args.config.is_file():
        parser.error(f"argument --config: {args.config} is not a file")
    if args.config is not None and args.shape is not None:
        parser.error("argument --shape: not with --config, which names the model")

    from benchmarks import decode, report

    if args.plot_from:
        return _plot_from(args, parser)
    cuda = torch.cuda.is_available()
    cfg, device = _config(args, parser)
    if args.tp > 1:
        if not cuda or args.quick:
            parser.error("argument --tp: tensor parallelism needs CUDA GPUs (and no --quick)")
        from benchmarks.parallel import run_parallel

        try:
            result = run_parallel(cfg, args.tp, profile=not args.no_profile)
        except ValueError as exc:
            parser.error(str(exc))
    else:
        result = decode.run(cfg, device, profile=not args.no_profile)
    print(report.table(result))
    if args.out:
        report.write_json(result, args.out)
        print(f"wrote {args.out}")
    if args.plot:
        report.plot(report.document(result), args.plot)
        print(f"wrote {args.plot}")
    return 0


def _plot_from(args: argparse.Namespace, parser: OneLineParser) -> int:
    """``--plot-from``: the plot of an earlier JSON result, nothing measured."""
    from benchmarks import report

    if not args.plot:
        parser.error("--plot-from needs --plot OUT.png")
    # (every other option shapes a measurement, and nothing is measured)
    kept = {"plot_from", "plot", "help"}
    given = [
        a.option_strings[0]
        for a in parser._actions
        if a.dest not in kept and getattr(args, a.dest, a.default) != a.default
    ]
    if given:
        parser.error(f"argument --plot-from: plots a result only; not with {', '.join(given)}")
    try:
        document = json.loads(args.plot_from.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        parser.error(f"argument --plot-from: {args.plot_from} is not JSON ({exc})")
    report.plot(document, args.plot)
    print(f"wrote {args.plot}")
    return 0


def _parser() -> OneLineParser:
    parser = OneLineParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=DefaultsHelp,
    )
    parser.add_argument(
        "--batch-sizes", type=int_list, default=[1, 8, 32, 128], help="batch sizes to time"
    )
    parser.add_argument(
        "--kv-len", type=positive_int, default=512, help="cached tokens per sequence"
    )
    parser.add_argument(
        "--config",
        type=Path,
        help="a HF config.json for the model (default: a 1.5 B Llama shape with random weights)",
    )
    parser.add_argument(
        "--variants",
        help="comma-separated subset of the variants; one ending in ' again' starts that"
        " variant a second time (the spread is the run's noise between identical starts)",
    )
    parser.add_argument("--repeats", type=positive_int, default=50, help="timed steps per size")
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=2,
        help="times every variant is timed, all in turn; the last round is reported "
        "(a process's first variant read ~1%% slow at its first timing)",
    )
    parser.add_argument("--out", type=Path, help="write the JSON result here")
    parser.add_argument("--plot", type=Path, help="write a PNG plot here (needs matplotlib)")
    parser.add_argument("--plot-from", type=Path, help="plot an earlier JSON result and exit")
    parser.add_argument(
        "--quick", action="store_true", help="CPU-sized: the tiny model, eager only"
    )
    parser.add_argument("--no-profile", action="store_true", help="skip the kernel profile")
    parser.add_argument(
        "--tp",
        type=positive_int,
        default=1,
        help="tensor-parallel ranks (one process per local GPU, NCCL)",
    )
    parser.add_argument(
        "--all-reduce",
        default=None,
        help="with --tp above 1: comma-separated all-reduce choices to compare, each a full "
        "run (nccl, auto = measured NCCL vs symmetric-memory per size, one-shot, two-shot; "
        "default: nccl)",
    )
    parser.add_argument(
        "--shape",
        choices=TIMED_SHAPES,
        help=f"random-weight model shape (default {DEFAULT_SHAPE}; not with --config)",
    )
    return parser


def _config(args: argparse.Namespace, parser: OneLineParser) -> tuple[Any, torch.device]:
    """The benchmark's configuration and device from the options (``parser.error`` names
    a bad one)."""
    from benchmarks import decode

    cuda = torch.cuda.is_available()
    if args.quick or not cuda:
        cfg = decode.quick_config()
        why = (
            "--quick asked for"
            if cuda
            else f"no CUDA device (torch {torch.__version__}, cuda available: False)"
        )
        print(f"graphs are off: {why}; showing the tiny model in eager mode only")
        device = torch.device("cuda" if cuda else "cpu")
    else:
        cfg = decode.BenchConfig(model=shape(args.shape or DEFAULT_SHAPE))
        device = torch.device("cuda")
    sizes = tuple(args.batch_sizes)
    cfg = replace(
        cfg,
        batch_sizes=sizes if not args.quick and cuda else cfg.batch_sizes,
        kv_len=args.kv_len if cuda and not args.quick else cfg.kv_len,
        repeats=args.repeats if cuda and not args.quick else cfg.repeats,
        rounds=args.rounds,
    )
    if args.config:
        try:
            model = json.loads(args.config.read_text())
            ModelConfig.from_hf(model)
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
            parser.error(f"argument --config: {args.config}: {exc}")
        cfg = replace(cfg, model=model)
    if args.variants:
        names = tuple(v.strip() for v in args.variants.split(","))
        known = decode.ALL_VARIANTS
        unknown = [n for n in names if decode.base_variant(n) not in known]
        if unknown:
            parser.error(
                f"--variants: unknown {unknown}; choose from {list(known)}, each also"
                f" with{decode.AGAIN!r} to start it a second time"
            )
        if decode.REDUCE_OVERHEAD + decode.AGAIN in names:
            parser.error(f"--variants: {decode.REDUCE_OVERHEAD!r} is timed once, apart")
        if len(set(names)) < len(names):
            parser.error(f"--variants: a name given twice; add{decode.AGAIN!r} to start it again")
        cfg = replace(cfg, variants=names)
    if args.all_reduce is None:
        return cfg, device
    if args.tp == 1:  # (one rank reduces nothing: the choice would be ignored)
        parser.error("argument --all-reduce: only with --tp above 1")
    choices = tuple(c.strip() for c in args.all_reduce.split(","))
    for c in choices:
        try:
            parse_all_reduce(c)
        except ValueError as exc:
            parser.error(f"argument --all-reduce: {exc}")
    cfg = replace(cfg, all_reduce=choices)
    return cfg, device


if __name__ == "__main__":
    sys.exit(main())
