"""``ostinato.graphed`` on models nobody here wrote, against eager and
``torch.compile(mode="reduce-overhead")``, over one stream of random batch sizes:

    python -m benchmarks.graphed_models --out OUT/graphed.json [--models resnet50,bert]

Models, random weights: torchvision's ResNet-50, MobileNetV3-Large and ViT-B/16 (224x224
images, class logits); transformers' BERT-base and DistilBERT (random lengths too, by
sequence buckets; last hidden state) and GPT-2 (logits), from their default configs.
FULL_AND_PIECEWISE does not apply to them: none holds an op that must run outside a graph.
``ostinato default`` is what ``graphed(model)`` does without options (beyond the largest
batch and the sequence buckets the stream needs); ``ostinato FULL+inductor`` compiles the
model whole first (``compiler="inductor"``, a dynamic batch) and captures Inductor's
kernels; ``ostinato backend`` is ``torch.compile(model, backend="ostinato")`` with the same
options; ``ostinato default copies`` is the default with ``copy_outputs=True`` (a copy of
every output a call, the caller's to keep; the default lends them until the next call, as
reduce-overhead does);
``ostinato every size`` is the default with a graph for every batch size up to the largest
(``capture_sizes``), as reduce-overhead records each size it sees (the default has one for
every size up to 32, so the two differ only above 32, ``--max-batch``).

The stream: ``--calls`` calls over ``--distinct`` batch sizes (16 by default, the warm-up
target's stream; 0: a size drawn anew for each call, some 28 distinct sizes in 64 calls, as
runs before this option had). For each model and system the stream runs three times: the
first pass is the warm-up (compilation, capture; its total seconds are reported), the second
settles what the first left half done (reduce-overhead records a size's graph at its second
call), the third is timed call by call (mean ms per call, and per batch size). A staged system
(``ostinato default``) serves its first pass from graphs of the model as it is while its
upgrade compiles; the later passes wait for the upgrade to end first (``upgrade_s``: from
the end of the first pass, ``notes``: what moved), so that they time the graphs it keeps.
Then batch 1 and 8 are timed alone (``--repeats`` calls each), and every size of the
stream alone (``--size-repeats``; the per-size ratios against reduce-overhead come from
these medians, not from the stream's one or two calls a size), the peak memory each system
added is read, per phase, and then outputs are compared with eager (the reference's memory
outside every phase). ``--tiny`` shrinks every
model (for a CPU smoke run).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

SYSTEMS = (
    "eager",
    "reduce-overhead",
    "ostinato default",
    "ostinato default copies",
    "ostinato every size",
    "ostinato FULL+inductor",
    "ostinato backend",
)


@dataclass(frozen=True)
class Workload:
    """A model as a function of batched tensors, and its inputs for a batch and length."""

    name: str
    fn: Callable[..., torch.Tensor]
    inputs: Callable[[int, int], tuple[torch.Tensor, ...]]
    seq_buckets: tuple[int, ...] | None  # None: the length is fixed


@dataclass
class SystemRow:
    model: str
    system: str
    warmup_s: float
    mean_ms: float
    ms_by_batch: dict[int, float]
    ms_b1: float
    ms_b8: float
    max_abs_diff: float  # against eager, over the checked calls
    peak_mib: float
    peak_mib_by_phase: dict[str, float]  # first pass, upgrade (staged), the rest
    peak_reserved_mib: float  # the caching allocator's reserve: graph pools included
    median_ms_by_size: dict[int, float]  # each size of the stream alone, length 64
    graphs: int | None = None  # ostinato: graphs captured
    upgrade_s: float | None = None  # staged: the upgrade's wait after the first pass
    notes: list[str] = field(default_factory=list)
    leftover_mib: float = 0.0  # allocated after the system was dropped, above before it


@dataclass(frozen=True)
class Where:
    """Where a workload's model and inputs live, and how big the model is."""

    device: str
    dtype: torch.dtype
    tiny: bool

    def ready(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(device=self.device, dtype=self.dtype).eval()

    def images(self, batch: int, _: int) -> tuple[torch.Tensor, ...]:
        side = 64 if self.tiny else 224
        return (torch.randn(batch, 3, side, side, device=self.device, dtype=self.dtype),)

    def ids(self, batch: int, length: int) -> tuple[torch.Tensor, ...]:
        return (torch.randint(0, 1000, (batch, length), device=self.device),)

    def ids_and_mask(self, batch: int, length: int) -> tuple[torch.Tensor, ...]:
        mask = torch.ones(batch, length, dtype=torch.long, device=self.device)
        return (*self.ids(batch, length), mask)


SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128)
LENGTHS = (32, 64, 128)  # sequence buckets of the text models


def resnet50(at: Where) -> Workload:
    net = at.ready(_torchvision().models.resnet50())
    return Workload("resnet50", net, at.images, None)


def mobilenet(at: Where) -> Workload:
    net = at.ready(_torchvision().models.mobilenet_v3_large())
    return Workload("mobilenet", net, at.images, None)


def vit(at: Where) -> Workload:
    tv = _torchvision()
    net = at.ready(tv.models.vit_b_16(image_size=64 if at.tiny else 224))
    return Workload("vit", net, at.images, None)


def _torchvision() -> Any:
    try:
        import torchvision
    except ImportError as exc:
        raise SystemExit(
            "resnet50, mobilenet and vit are torchvision's: pip install torchvision"
        ) from exc
    return torchvision


def bert(at: Where) -> Workload:
    import transformers as tf

    net = at.ready(tf.BertModel(tf.BertConfig(**(SMALL if at.tiny else {}))))

    def hidden(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return net(input_ids=ids, attention_mask=mask).last_hidden_state

    return Workload("bert", hidden, at.ids_and_mask, LENGTHS)


def distilbert(at: Where) -> Workload:
    import transformers as tf

    small = dict(n_layers=2, dim=64, n_heads=2, hidden_dim=128)
    net = at.ready(tf.DistilBertModel(tf.DistilBertConfig(**(small if at.tiny else {}))))

    def hidden(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return net(input_ids=ids, attention_mask=mask).last_hidden_state

    return Workload("distilbert", hidden, at.ids_and_mask, LENGTHS)


def gpt2(at: Where) -> Workload:
    import transformers as tf

    cfg = tf.GPT2Config(**(dict(n_layer=2, n_embd=64, n_head=2) if at.tiny else {}))
    net = at.ready(tf.GPT2LMHeadModel(cfg))
    return Workload("gpt2", lambda ids: net(input_ids=ids, use_cache=False).logits, at.ids, LENGTHS)


MODELS = {
    "resnet50": resnet50,
    "mobilenet": mobilenet,
    "vit": vit,
    "bert": bert,
    "distilbert": distilbert,
    "gpt2": gpt2,
}


def workloads(names: list[str], at: Where) -> list[Workload]:
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise ValueError(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    found = []
    for name in names:
        torch.manual_seed(0)  # the same weights in every run
        found.append(MODELS[name](at))
    return found


def system(w: Workload, name: str, max_batch: int) -> tuple[Callable[..., Any], Any]:
    """The callable of system ``name`` for ``w`` (and the ``Graphed`` for ostinato)."""
    if name == "eager":
        return w.fn, None
    if name == "reduce-overhead":
        return torch.compile(w.fn, mode="reduce-overhead"), None
    import ostinato

    options: dict[str, Any] = {"max_batch_size": max_batch, "seq_buckets": w.seq_buckets}
    if name == "ostinato backend":
        return torch.compile(w.fn, backend="ostinato", options=options), None
    if name == "ostinato FULL+inductor":
        options |= {"mode": "full", "compiler": "inductor"}
    elif name == "ostinato default copies":
        # Every output copied, the caller's to keep (the default lends the graphs' own
        # memory until the next call, as reduce-overhead does).
        options |= {"copy_outputs": True}
    elif name == "ostinato every size":
        del options["max_batch_size"]  # (a ladder, or the sizes: one of the two)
        options |= {"capture_sizes": list(range(1, max_batch + 1))}
    elif name != "ostinato default":
        raise ValueError(f"--systems: unknown {name!r}; choose from {', '.join(SYSTEMS)}")
    fast = ostinato.graphed(w.fn, **options)
    return fast, fast


def timed(fn: Callable[..., Any], args: tuple[torch.Tensor, ...]) -> tuple[Any, float]:
    sync()
    start = time.perf_counter()
    with torch.inference_mode():
        out = fn(*args)
    sync()
    return out, (time.perf_counter() - start) * 1e3


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_system(
    w: Workload, name: str, stream: list[tuple[int, int]], args: argparse.Namespace
) -> SystemRow:
    base, base_reserved = clean_slate()
    fn, graphed = system(w, name, args.max_batch)
    inputs = [w.inputs(b, n) for b, n in stream]
    warmup = sum(timed(fn, x)[1] for x in inputs) / 1e3
    phases: dict[str, float] = {}  # the allocated peak of each phase
    reserved: dict[str, float] = {}  # and the reserved one
    phases["first pass"], reserved["first pass"] = _peaks(base, base_reserved)
    upgrade_s, notes = _upgrade(graphed)
    phases["upgrade"], reserved["upgrade"] = _peaks(base, base_reserved)
    for x in inputs:  # (settled: every size of the stream at its steady state)
        timed(fn, x)
    by_batch: dict[int, list[float]] = {}
    for (b, _), x in zip(stream, inputs, strict=True):
        by_batch.setdefault(b, []).append(timed(fn, x)[1])
    ms = medians(fn, w, (1, 8), args.repeats)
    per_size = medians(fn, w, sorted(by_batch), args.size_repeats)
    phases["rest"], reserved["rest"] = _peaks(base, base_reserved)
    # After the peaks: the eager reference and its float32 difference are the benchmark's
    # memory (GPT-2's logits at B = 32: GBs), not the system's.
    diff = 0.0
    for x in inputs[:8]:
        got, want = timed(fn, x)[0], timed(w.fn, x)[0]
        diff = max(diff, (got.float() - want.float()).abs().max().item())
    graphs = _graphs(graphed, name)
    if graphed is not None:
        graphed.release()  # (its graphs and buffers: the next system starts without them)
    every = [t for ts in by_batch.values() for t in ts]
    return SystemRow(
        w.name,
        name,
        warmup,
        statistics.mean(every),
        {b: statistics.mean(ts) for b, ts in sorted(by_batch.items())},
        ms[1],
        ms[8],
        diff,
        max(phases.values()),
        phases,
        max(reserved.values()),
        per_size,
        graphs,
        upgrade_s,
        notes,
    )


def clean_slate() -> tuple[int, int]:
    """Frees what earlier systems left (graphs, Dynamo's caches, cached blocks: without
    the collection a staged system's cycles outlived it and were freed during the next
    system's run, which then counted their release against its own peak) and restarts
    the peaks; returns the bytes allocated and reserved now (0, 0 without CUDA)."""
    gc.collect()
    torch._dynamo.reset()
    if not torch.cuda.is_available():
        return 0, 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def medians(
    fn: Callable[..., Any], w: Workload, sizes: Sequence[int], repeats: int
) -> dict[int, float]:
    """Per batch size, the median ms of ``repeats`` calls on one input (length 64), after
    three untimed calls: reduce-overhead records a new shape's graph within them."""
    found = {}
    for b in sizes:
        x = w.inputs(b, 64)
        for _ in range(3):
            timed(fn, x)
        found[b] = statistics.median(timed(fn, x)[1] for _ in range(repeats))
    return found


def _peaks(base: int, base_reserved: int) -> tuple[float, float]:
    """The peaks since the last call (MiB; 0 without CUDA): allocated above ``base``, and
    reserved by the caching allocator above ``base_reserved`` (allocated tensors, blocks
    cached for reuse and the graphs' private pools, which the allocated peak does not
    see between replays)."""
    if not torch.cuda.is_available():
        return 0.0, 0.0
    allocated = (torch.cuda.max_memory_allocated() - base) / 2**20
    reserved = (torch.cuda.max_memory_reserved() - base_reserved) / 2**20
    torch.cuda.reset_peak_memory_stats()
    return allocated, reserved


def _upgrade(graphed: Any) -> tuple[float | None, list[str]]:
    """A staged ``graphed``'s wait for its upgrade (seconds) and each signature's upgrade
    line; (None, []) for any other system."""
    if graphed is None or graphed.options.capture != "staged":
        return None, []
    start = time.perf_counter()
    graphed.wait_for_upgrades()
    waited = time.perf_counter() - start
    stats = graphed.stats()
    lines = [f"{s.key}: {s.upgrade}" for s in stats.signatures if s.upgrade]
    if lines:  # (the artifacts: what this process compiled, against what it loaded)
        lines.append(f"compiled: {stats.compiled_loaded} loaded, {stats.compiled_kept} kept")
    return (waited, lines) if lines else (None, [])  # (none without graphs: the CPU)


def _graphs(graphed: Any, name: str) -> int | None:
    """Graphs captured by an ostinato system (the backend's: every graphed it made)."""
    import gc

    import ostinato

    if name == "ostinato backend":
        gc.collect()  # (the graphs of earlier models, dropped with Dynamo's reset)
        found = ostinato.compiled_graphs()
    else:
        found = [graphed] if graphed is not None else []
    if not found:
        return None
    stats = [st for g in found for s in g.stats().signatures for st in (s.stats, s.upgraded) if st]
    return sum(1 for st in stats for k in st.buckets if k.capture_seconds)


def write(args: argparse.Namespace, dtype: torch.dtype, rows: list[SystemRow]) -> None:
    from ostinato.provenance import Provenance

    report = {
        "provenance": asdict(Provenance.collect()),
        "dtype": str(dtype),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": [asdict(r) for r in rows],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


def batch_stream(rng: random.Random, calls: int, largest: int, distinct: int) -> list[int]:
    """``calls`` batch sizes in random order: ``distinct`` sizes drawn from ``1..largest``,
    each called alike often (every one at least once where ``calls >= distinct``); with
    ``distinct`` 0, a size drawn anew for each call."""
    if distinct <= 0:
        return [rng.randint(1, largest) for _ in range(calls)]
    if distinct > largest:
        raise ValueError(f"--distinct: {distinct} sizes cannot be drawn from 1..{largest}")
    sizes = rng.sample(range(1, largest + 1), distinct)
    stream = [sizes[i % distinct] for i in range(calls)]
    rng.shuffle(stream)
    return stream


def call_stream(
    w: Workload, rng: random.Random, calls: int, largest: int, distinct: int
) -> list[tuple[int, int]]:
    """(batch, length) for each call: ``batch_stream``'s sizes, then a length drawn from 8
    to ``w``'s longest sequence bucket for each (0 where its length is fixed)."""
    top = max(w.seq_buckets) if w.seq_buckets else 0
    batches = batch_stream(rng, calls, largest, distinct)
    return [(b, rng.randint(8, top) if top else 0) for b in batches]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--calls", type=int, default=64, help="calls in the stream")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument(
        "--distinct",
        type=int,
        default=16,
        help="distinct batch sizes in the stream, drawn from 1..--max-batch, each called "
        "alike often (the warm-up target's stream; 0: any size at each call)",
    )
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument(
        "--size-repeats", type=int, default=10, help="timed calls per size for the per-size medians"
    )
    parser.add_argument(
        "--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU"
    )
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    rng = random.Random(0)
    rows = []
    for w in workloads(args.models.split(","), Where(device, dtype, args.tiny)):
        stream = call_stream(w, rng, args.calls, args.max_batch, args.distinct)
        before = clean_slate()[0]  # (the model's weights)
        for name in args.systems.split(","):
            rows.append(run_system(w, name, stream, args))
            rows[-1].leftover_mib = (clean_slate()[0] - before) / 2**20
            report(rows[-1], rows)
            write(args, dtype, rows)  # after every row: a run cut short keeps what it measured


def report(row: SystemRow, rows: list[SystemRow]) -> None:
    """Prints ``row``; for an ostinato system, also its per-size time against
    reduce-overhead's on the same model (the worst and the best size)."""
    print(
        f"{row.model:9s} {row.system:16s} warm-up {row.warmup_s:7.2f} s  mean {row.mean_ms:7.3f} ms"
        f"  B=1 {row.ms_b1:7.3f}  B=8 {row.ms_b8:7.3f} ms  |diff| {row.max_abs_diff:.3g}",
        flush=True,
    )
    phases = ", ".join(f"{k} {v:.0f}" for k, v in row.peak_mib_by_phase.items())
    print(
        f"{'':26s} peak {row.peak_mib:.0f} MiB ({phases}); reserved {row.peak_reserved_mib:.0f}"
        f"; left allocated once dropped {row.leftover_mib:.0f}",
        flush=True,
    )
    if row.upgrade_s is not None:
        print(f"{'':26s} upgrade ended {row.upgrade_s:.1f} s after the first pass")
        print("\n".join(f"{'':26s} {note}" for note in row.notes), flush=True)
    ro = next((r for r in rows if r.model == row.model and r.system == "reduce-overhead"), None)
    if ro is None or not row.system.startswith("ostinato"):
        return
    ratios = {b: ms / ro.median_ms_by_size[b] for b, ms in row.median_ms_by_size.items()}
    worst, best = max(ratios, key=ratios.__getitem__), min(ratios, key=ratios.__getitem__)
    print(
        f"{'':26s} per size alone / reduce-overhead: {ratios[worst]:.2f}x at B={worst} "
        f"(worst), {ratios[best]:.2f}x at B={best} (best)",
        flush=True,
    )


if __name__ == "__main__":
    main()
