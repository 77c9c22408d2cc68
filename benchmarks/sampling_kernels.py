"""Device time of the sampling kernels (``kernels.sampling``) against the torch ops they
replaced, per vocabulary, batch size and launch option; CUDA only.

    python -m benchmarks.sampling_kernels --out OUT/kernels.json

Each system runs 20 times inside one CUDA graph (so launches cost what they cost in the
engine's sampling graphs), the graph replayed five times after a warm replay; the best
replay's time per call is reported, in µs. ``torch`` is the sampler before the kernels:
softmax, a sort of the whole row for top-p, the exponential race, argmax; for log
probabilities, ``log_softmax``, the chosen token's entry and ``topk``.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch


def timed(fn: Callable[[], object], reps: int = 20) -> float:
    """Best µs per call of ``fn`` over five replays of a graph of ``reps`` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / reps)
    return round(best, 2)


def torch_sample(
    logits: torch.Tensor, t: torch.Tensor, top_p: torch.Tensor, cut: bool
) -> torch.Tensor:
    """The torch sampler the kernels replaced (``cut``: some top_p is below 1, so the sort
    runs; decided by the caller, as a graph cannot read the device)."""
    probs = torch.softmax(logits.float() / t[:, None], dim=-1)
    if cut:
        probs, order = probs.sort(dim=-1, descending=True)
        keep = (probs.cumsum(dim=-1) - probs) < top_p[:, None]
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        choice = (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
        return order.gather(1, choice[:, None]).squeeze(1)
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)


def torch_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> object:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(1, tokens[:, None]), logp.topk(k, dim=-1)


def cases(vocab: int, rows: int) -> list[tuple[str, Callable, Callable]]:
    """(name, the torch ops, the kernels) for one vocabulary and batch size, bf16 logits."""
    from ostinato.engine.kernels import sampling

    device = torch.device("cuda")
    logits = (torch.randn(rows, vocab, device=device) * 3).bfloat16()
    t = torch.full((rows,), 0.8, device=device)
    keys = torch.randint(0, 1 << 32, (rows,), device=device)
    tokens = torch.randint(0, vocab, (rows,), device=device)
    out = []
    for p in (1.0, 0.95):
        top_p = torch.full((rows,), p, device=device)
        out.append(
            (
                f"sample top_p={p}",
                functools.partial(torch_sample, logits, t, top_p, p < 1),
                functools.partial(sampling.sample_rows, logits, t, top_p, keys),
            )
        )
    logprobs = (
        functools.partial(torch_logprobs, logits, tokens, 5),
        functools.partial(sampling.row_logprobs, logits, tokens, 5),
    )
    return [*out, ("logprobs k=5", *logprobs)]


def measure(args: argparse.Namespace) -> list[dict]:
    from ostinato.engine.kernels import sampling

    rows_out = []
    for vocab in args.vocabs:
        for rows in args.batch_sizes:
            for name, torch_ops, kernels in cases(vocab, rows):
                row = {"vocab": vocab, "rows": rows, "case": name, "torch_us": timed(torch_ops)}
                for chunk in args.chunks:
                    for warps in args.warps:
                        sampling.CHUNK, sampling.WARPS = chunk, warps
                        row[f"chunk{chunk}_warps{warps}_us"] = timed(kernels)
                rows_out.append(row)
                print(row, flush=True)
    return rows_out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocabs", default="151936,49152")
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--chunks", default="1024,2048,4096")
    parser.add_argument("--warps", default="4,8")
    args = parser.parse_args(argv)
    for name in ("vocabs", "batch_sizes", "chunks", "warps"):
        setattr(args, name, [int(v) for v in getattr(args, name).split(",")])
    if not torch.cuda.is_available():
        parser.error("the sampling kernels need CUDA")
    from ostinato.provenance import Provenance

    rows = measure(args)
    provenance = asdict(Provenance.collect())
    doc = {"benchmark": "sampling_kernels", "provenance": provenance, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
