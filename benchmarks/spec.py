"""``python -m benchmarks spec``: speculative decoding on a real chat model.

SmolLM2-135M-Instruct (the default model) answers B chat prompts, greedy, up to
``new_tokens`` each; for every proposer (none, n-gram, self-draft of the first N layers,
oracle) and every k: tokens/s of ``generate`` (one warm-up call first), the acceptance
rate, and target steps per generated token. The oracle's drafts are the plain run's
tokens, so it measures the verify path without draft cost. Every speculative run's tokens
are checked against the plain run's. ``--quick`` (or no CUDA): the tiny random model on
the CPU, B = 1, 2.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.ready import ready
from ostinato.engine.cli.args import DefaultsHelp, OneLineParser, int_list
from ostinato.provenance import Provenance

QUESTIONS = [
    "What is the capital of France?",
    "List three primary colors.",
    "Explain what a CUDA graph is in one sentence.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Name the planets of the solar system in order.",
    "How do I reverse a list in Python?",
    "Give me a synonym for happy.",
]


@dataclass
class SpecRow:
    """One proposer at one k and batch size (k = 0: no speculation)."""

    proposer: str
    k: int
    batch: int
    tokens: int
    seconds: float
    tokens_per_s: float
    acceptance_rate: float
    target_steps_per_token: float
    same_tokens_as_plain: bool
    draft_ms_per_call: float = float("nan")  # self-draft: one k-token proposal, wall time
    # Per request, the index of its first token that differs from plain decoding's (-1:
    # none): late, isolated divergences point at rounding near-ties, early ones at a bug.
    first_difference: list[int] = field(default_factory=list)


@dataclass
class SpecResult:
    """Every number of one run."""

    model: str
    mode: str
    dtype: str
    new_tokens: int
    draft_layers: int
    rows: list[SpecRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class OracleProposer:
    """A proposer plug-in (``SpeculativeConfig("custom", k, proposer=...)``) that drafts
    the tokens known to follow each prompt: a reference run's, so a benchmark measures
    the verify path without draft cost.

    ``known`` is kept by reference and read at every call, so a caller may update it
    between ``generate`` calls (on a GPU, plain decoding's rounding, and so its tokens,
    can depend on the batch)."""

    def __init__(self, known: dict[tuple[int, ...], list[int]]) -> None:
        self.known = known

    def __call__(self, requests: list[Any], n: list[int]) -> list[list[int]]:
        out = []
        for r, k in zip(requests, n, strict=True):
            future = self.known.get(tuple(r.prompt), ())
            out.append(list(future[len(r.output) : len(r.output) + k]))
        return out


def proposer_names(draft_layers: int) -> list[str]:
    """The speculative rows of a run, in order, as printed and as ``--proposers`` takes
    them."""
    self_draft = f"self:{draft_layers}"
    return ["ngram", self_draft, f"{self_draft} eager", "oracle"]


def _prompts(llm: Any, batch: int) -> list[Any]:
    if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
        return [[1 + (i * 7 + j) % 50 for j in range(12)] for i in range(batch)]
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(batch)]
    return [llm.chat_prompt([{"role": "user", "content": q}]) for q in questions]


def _first_difference(got: list[int], want: list[int]) -> int:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return i
    return -1 if len(got) == len(want) else min(len(got), len(want))


@dataclass
class _Run:
    """What every measurement of one benchmark run shares."""

    args: argparse.Namespace
    prompts: dict[int, list[Any]]
    params: Any
    result: SpecResult
    provenance: Provenance
    # Plain decoding's tokens per batch size, and the oracle's drafts (the proposer reads
    # this dict at every step; filled per batch size from ``plain``).
    plain: dict[int, list[list[int]]] = field(default_factory=dict)
    known: dict[tuple[int, ...], list[int]] = field(default_factory=dict)


def _measure(run: _Run, llm: Any, proposer: str, k: int) -> None:
    """Times ``llm`` at every batch size and appends its rows (written after each)."""
    for b in run.args.batch_sizes:
        if proposer.startswith("oracle"):
            run.known.clear()
            run.known.update(
                {tuple(p): t for p, t in zip(run.prompts[b], run.plain[b], strict=True)}
            )
        llm.generate(run.prompts[b], run.params)  # warm-up
        before = (llm.spec_stats.verifications, llm.spec_stats.tokens)
        stats0 = asdict(llm.spec_stats)
        start = time.perf_counter()
        outs = llm.generate(run.prompts[b], run.params)
        seconds = time.perf_counter() - start
        tokens = [o.token_ids for o in outs]
        run.plain.setdefault(b, tokens)
        produced = sum(len(t) for t in tokens)
        st = llm.spec_stats
        drafted = st.drafted - stats0["drafted"]
        accepted = st.accepted - stats0["accepted"]
        verifications = st.verifications - before[0]
        # Target steps per request: one per verification, one per plain decode, one
        # for the prefill; per generated token.
        plain_tokens = produced - (st.tokens - before[1])
        steps = verifications + plain_tokens
        row = SpecRow(
            proposer,
            k,
            b,
            produced,
            seconds,
            produced / seconds,
            accepted / drafted if drafted else 0.0,
            steps / produced,
            tokens == run.plain[b],
            first_difference=[
                _first_difference(a, p) for a, p in zip(tokens, run.plain[b], strict=True)
            ],
        )
        drafter = llm.engine.drafter
        if drafter is not None and drafter.calls:
            row.draft_ms_per_call = drafter.seconds / drafter.calls * 1e3
            drafter.calls, drafter.seconds = 0, 0.0
        run.result.rows.append(row)
        if run.args.out:  # after every row: a run cut short keeps what it measured
            write_result(run.args.out, run.result, run.provenance)
        _print_row(row)


def _print_row(row: SpecRow) -> None:
    print(
        f"{row.proposer:10s} k={row.k} B={row.batch:3d} {row.tokens_per_s:9.1f} tok/s  acceptance "
        f"{row.acceptance_rate:5.0%}  target steps/token {row.target_steps_per_token:5.2f}"
        + ("" if math.isnan(row.draft_ms_per_call) else f"  draft {row.draft_ms_per_call:.2f} ms")
        + (
            ""
            if row.same_tokens_as_plain
            else f"  (tokens differ from plain; first at {row.first_difference})"
        ),
        flush=True,
    )


NOTES = (
    "self:N replays its k-step draft loop from one graph per batch size on CUDA; "
    "'self:N eager' runs the same loop eagerly; draft_ms_per_call compares them",
    "oracle: drafts are plain decoding's tokens at the same batch size (on a GPU the "
    "rounding, and so the tokens, of plain decoding can depend on the batch)",
    "EOS ignored: every request generates new_tokens tokens (short chat answers would "
    "otherwise make tokens/s measure the prefill)",
)


def run(args: argparse.Namespace) -> SpecResult:
    """Runs every proposer, k and batch size; returns all numbers."""
    from ostinato.engine import LLM, SamplingParams, SpeculativeConfig

    cuda = torch.cuda.is_available() and not args.quick
    kw: dict[str, Any] = dict(
        mode=args.mode,
        device="cuda" if cuda else "cpu",
        dtype=args.dtype,
        max_num_seqs=max(args.batch_sizes),
        progress=False,
    )
    # EOS ignored: chat answers to short questions end after a few tokens, and tokens/s
    # would then measure the prefill, not decoding.
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    plain_llm = ready(LLM(args.model, **kw))
    result = SpecResult(
        plain_llm.source_name,
        plain_llm.mode.name,
        str(plain_llm.dtype),
        args.new_tokens,
        args.draft_layers,
    )
    plain: dict[int, list[list[int]]] = {}
    prompts = {b: _prompts(plain_llm, b) for b in args.batch_sizes}

    # The oracle replays plain decoding's tokens of the same batch size (filled in per
    # batch size below; the proposer reads this dict at every step).
    known: dict[tuple[int, ...], list[int]] = {}
    provenance = Provenance.collect()  # once: it runs git

    run = _Run(args, prompts, params, result, provenance, plain, known)
    _measure(run, plain_llm, "none", 0)
    plain_llm.close()
    for k in args.k:
        configs = [
            SpeculativeConfig("ngram", k),
            SpeculativeConfig("self", k, args.draft_layers),
            SpeculativeConfig("self", k, args.draft_layers, draft_graphs=False),
            SpeculativeConfig("custom", k, proposer=OracleProposer(known)),
        ]
        names = proposer_names(args.draft_layers)
        for name, spec in zip(names, configs, strict=True):
            if args.proposers and name not in args.proposers:
                continue
            llm = ready(LLM(args.model, speculative=spec, **kw))
            _measure(run, llm, name, k)
            llm.close()
    result.notes += NOTES
    return result


def main(argv: list[str]) -> int:
    """``python -m benchmarks spec`` with ``argv``; returns the exit status."""
    parser = OneLineParser(
        prog="python -m benchmarks spec",
        description=__doc__,
        formatter_class=DefaultsHelp,
    )
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32])
    parser.add_argument("--k", type=int_list, default=[2, 4], help="draft tokens per step")
    parser.add_argument("--draft-layers", type=int, default=8, help="layers of the self-draft")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--mode", default="auto")
    parser.add_argument("--dtype", default=None, help="default: the engine's for the model")
    parser.add_argument("--quick", action="store_true", help="the tiny model on the CPU")
    parser.add_argument(
        "--proposers",
        type=lambda t: [p.strip() for p in t.split(",") if p.strip()],
        default=[],
        help="only these (comma-separated names as printed, e.g. 'ngram,oracle')",
    )
    parser.add_argument("--out", type=Path, help="write the JSON result here")
    args = parser.parse_args(argv)
    if any(k < 1 or k > 16 for k in args.k):
        parser.error(f"argument --k: each k must be in 1..16, got {args.k}")
    if args.quick or not torch.cuda.is_available():
        args.model, args.batch_sizes, args.new_tokens, args.draft_layers = "tiny", [1, 2], 16, 2
        print("CPU form (--quick or no CUDA): the tiny random model, B = 1, 2")
    names = proposer_names(args.draft_layers)
    unknown = [p for p in args.proposers if p not in names]
    if unknown:
        parser.error(
            f"argument --proposers: {', '.join(map(repr, unknown))} not among {', '.join(names)}"
        )
    result = run(args)
    if args.out:
        write_result(args.out, result, Provenance.collect())
        print(f"wrote {args.out}")
    return 0


def write_result(path: Path, result: SpecResult, provenance: Provenance) -> None:
    """Writes ``result`` as JSON with the run's provenance."""
    doc = {"benchmark": "speculative", "provenance": asdict(provenance)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**doc, **asdict(result)}, indent=2) + "\n")
