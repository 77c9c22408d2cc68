"""The ``ostinato`` command line: ``demo`` and ``generate``."""

from __future__ import annotations

import argparse
import sys


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids: {text!r} is not a list of integers like '1,2,3'"
        ) from exc


def _generate(args: argparse.Namespace) -> int:
    from ostinato.engine import LLM, SamplingParams

    prompts: list[list[int]] | list[str] = args.prompt_ids or args.prompt or [[1, 2, 3, 4]]
    llm = LLM(
        args.model,
        mode=args.mode,
        device=args.device,
        max_model_len=args.max_model_len,
        progress=not args.quiet,
    )
    print(
        f"model: {llm.config.architecture} ({args.model or 'embedded tiny config, random weights'})"
        f"; device: {llm.device}; graph mode: {llm.mode.name}; "
        f"start-up {llm.startup_seconds:.1f} s; {llm.capture_report.summary()}"
    )
    for why in llm.runner.resolution.reasons:
        print(f"  downgraded: {why}")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        ignore_eos=args.ignore_eos,
    )
    try:
        outputs = llm.generate(prompts, params)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for prompt, out in zip(prompts, outputs, strict=True):
        print(
            f"prompt {prompt} -> {out.text if out.text is not None else out.token_ids} "
            f"({out.finish_reason.value})"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs the ``ostinato`` command with ``argv``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="ostinato")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="capture a tiny model's ladder and check replay against eager")
    gen = sub.add_parser("generate", help="generate tokens with the reference engine")
    gen.add_argument(
        "--model",
        help="model directory (config.json, *.safetensors); "
        "default: the embedded tiny Llama with random weights",
    )
    gen.add_argument(
        "--prompt-ids",
        type=_token_ids,
        action="append",
        help="a prompt as token ids, e.g. '1,2,3' (repeatable)",
    )
    gen.add_argument("--prompt", action="append", help="a text prompt (needs a tokenizer)")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument(
        "--mode",
        default="auto",
        help="graph mode: auto, none, full, "
        "full_decode_only, ... (auto: full on CUDA, none on CPU)",
    )
    gen.add_argument("--device", default=None)
    gen.add_argument("--max-model-len", type=int, default=1024)
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    sub.add_parser(
        "bench", help="decode-step benchmark (see `ostinato bench --help`)", add_help=False
    )
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["bench"]:
        from ostinato.bench import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "demo":
        from ostinato.demo import main as demo_main

        return demo_main()
    if args.prompt_ids and args.prompt:
        parser.error("give --prompt-ids or --prompt, not both")
    return _generate(args)


if __name__ == "__main__":
    sys.exit(main())
