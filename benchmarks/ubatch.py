"""``python -m benchmarks ubatch``: a tensor-parallel step with and without micro-batch overlap.

Every rank (one process per local GPU, started as ``torchrun`` would) runs the engine's
whole step (``ModelRunner.execute``: staging, dispatch, replay, logits) on random weights
of ``--shape``: prefill steps of 512, 2048 and 8192 tokens (requests of 512 tokens, FULL
graphs) and decode steps of B = 128 and 256 requests at KV length 512 (FULL_DECODE_ONLY
graphs), each three ways: plain graphs ("off"); every size captured as two overlapped
micro-batches ("on", ``MicroBatching(measure=False)``); and the default policy ("auto"),
which times both graphs of each size at capture and keeps the split only where it is
measurably faster, so "auto" is what the dispatcher really runs. Beside each step it
times the step's all-reduces alone (two per layer of the step's hidden-state size, in
one graph, or eagerly without graphs), so the table says what share of the step is
communication: where that share is small there is little to hide. The NCCL settings in
the environment (``NCCL_P2P_DISABLE=1`` moves the all-reduces off NVLink, as between GPUs
without it) are recorded. ``--quick`` runs the tiny model on the CPU with two gloo ranks,
eagerly (no graphs there), to check the harness.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from benchmarks import TIMED_SHAPES
from ostinato.engine.cli.args import DefaultsHelp, OneLineParser, int_list, positive_int
from ostinato.provenance import Provenance

PREFILL_REQUEST = 512  # tokens per request of a prefill step
KV_LEN = 512  # cached tokens per request of a decode step


VARIANTS = ("off", "on", "auto")  # plain; always split; split where measured faster


@dataclass
class UbatchRow:
    """One step: ``kind`` "prefill" or "decode", ``tokens`` rows, ``variant`` one of
    ``VARIANTS``; device ms of the step and of its all-reduces alone."""

    kind: str
    tokens: int
    variant: str
    step_ms: float
    comm_ms: float
    ubatched: bool  # the step really ran as micro-batches

    @property
    def comm_share(self) -> float:
        """The all-reduces' time over the step's (without overlap)."""
        return self.comm_ms / self.step_ms if self.step_ms else float("nan")


@dataclass
class UbatchResult:
    """Every number of one run."""

    provenance: Provenance
    shape: str
    tp: int
    dtype: str
    rows: list[UbatchRow] = field(default_factory=list)
    # The "auto" runner's capture-time measurement: kind, tokens, plain and split replay
    # ms, whether the split was kept.
    measured: list[tuple[str, int, float, float, bool]] = field(default_factory=list)
    nccl_env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class UbatchConfig:
    """What to measure."""

    shape: str
    tp: int
    prefill_tokens: tuple[int, ...]
    decode_batches: tuple[int, ...]
    dtype: str
    repeats: int
    quick: bool


def _steps(setup: Any, kind: str, tokens: int) -> Any:
    """The ``ScheduledBatch`` of a prefill of ``tokens`` tokens (requests of 512) or of
    a decode of ``tokens`` requests at position KV_LEN."""
    from ostinato.engine.core.params import SamplingParams
    from ostinato.engine.core.scheduler import Request, ScheduledBatch, ScheduledRequest

    if kind == "decode":
        return setup.decode_batch([7] * tokens)
    step = ScheduledBatch([])
    length = min(PREFILL_REQUEST, tokens)
    for r in range(tokens // length):
        req = Request(r, [1 + r] * length, SamplingParams())
        req.blocks = setup.blocks(r)
        step.scheduled.append(ScheduledRequest(req, req.prompt, 0))
    return step


def _comm_ms(setup: Any, rows: int, repeats: int, cuda: bool) -> float:
    """Device ms of the step's all-reduces alone: two per layer of ``[rows, hidden]``."""
    from benchmarks.decode import time_step

    x = torch.zeros(rows, setup.config.hidden_size, dtype=setup.dtype, device=setup.device)
    count = 2 * setup.config.num_layers

    def reduce_all() -> None:
        for _ in range(count):
            setup.tp.all_reduce(x)

    if not cuda:
        return time_step(reduce_all, 1, repeats, False)[0]
    reduce_all()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        reduce_all()
    return time_step(graph.replay, 2, repeats, True)[0]


def run_rank(cfg: UbatchConfig, device: torch.device, tp: Any, log: Any) -> UbatchResult:
    """Every row, on this rank (all ranks run this in lock-step)."""
    from benchmarks.decode import BenchConfig, DecodeSetup
    from ostinato.config import GraphConfig
    from ostinato.engine.core.limits import EngineLimits
    from ostinato.engine.model.presets import shape
    from ostinato.engine.worker.runner import ModelRunner
    from ostinato.modes import GraphMode
    from ostinato.ubatch.policy import MicroBatching

    cuda = device.type == "cuda"
    model = shape(cfg.shape)
    bench = replace(
        BenchConfig(model=model), batch_sizes=cfg.decode_batches, kv_len=KV_LEN, dtype=cfg.dtype
    )
    setup = DecodeSetup(bench, device, tp)
    max_tokens = max(max(cfg.prefill_tokens), max(cfg.decode_batches))
    limits = EngineLimits(setup.max_b, max_tokens, setup.max_len, 16)
    result = UbatchResult(Provenance.collect(), cfg.shape, cfg.tp, cfg.dtype)
    result.nccl_env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    # The default thresholds (32 decode, 512 prefill tokens) select every size measured
    # on the GPU; the quick sizes are smaller.
    auto = MicroBatching(2, 2) if cfg.quick else MicroBatching()
    policies = {"off": None, "on": replace(auto, measure=False), "auto": auto}
    kinds = (
        ("prefill", GraphMode.FULL, cfg.prefill_tokens),
        ("decode", GraphMode.FULL_DECODE_ONLY, cfg.decode_batches),
    )
    with torch.inference_mode():
        for kind, mode, sizes in kinds:
            graphs = GraphConfig(
                mode=mode if cuda else GraphMode.NONE,
                capture_sizes=tuple(sizes),
            )
            for variant, policy in policies.items():
                runner = ModelRunner(
                    setup.model,
                    setup.cache,
                    setup.backend,
                    limits,
                    graphs,
                    device,
                    progress=False,
                    micro_batching=policy,
                )
                _time_runner(runner, setup, kind, sizes, variant, cfg, result, log)
                runner.release()
    return result


def _time_runner(
    runner: Any,
    setup: Any,
    kind: str,
    sizes: list[int],
    variant: str,
    cfg: UbatchConfig,
    result: UbatchResult,
    log: Any,
) -> None:
    """Capture ``runner``'s graphs (recording what its measurement chose), then time a
    step of each of ``sizes`` into ``result``."""
    from benchmarks.decode import time_step

    cuda = setup.device.type == "cuda"
    runner.capture()
    for t in runner.ubatch.timings:
        kept = t.descriptor in runner.ubatch.graphs
        n = t.descriptor.num_tokens
        result.measured.append((kind, n, t.plain_ms, t.ubatched_ms, kept))
        log(
            f"{kind:7s} {n:5d} tokens  measured at capture: plain {t.plain_ms:.3f}"
            f" ms, split {t.ubatched_ms:.3f} ms -> {'split' if kept else 'plain'}"
        )
    for n in sizes:
        step = _steps(setup, kind, n)
        before = runner.ubatch.steps
        ms, _ = time_step(lambda: runner.execute(step), 2, cfg.repeats, cuda)  # noqa: B023
        comm = _comm_ms(setup, n, cfg.repeats, cuda)
        row = UbatchRow(kind, n, variant, ms, comm, runner.ubatch.steps > before)
        result.rows.append(row)
        log(
            f"{kind:7s} {n:5d} tokens  overlap {variant:4s} {ms:8.3f} ms  "
            f"all-reduces alone {row.comm_ms:7.3f} ms ({row.comm_share:4.0%})"
            f"  {'split' if row.ubatched else 'plain'}"
        )


def _worker(rank: int, cfg: UbatchConfig, port: int, out: str) -> None:
    from ostinato.distributed import ParallelConfig, init_parallel, shutdown_parallel
    from ostinato.distributed.groups import local_launch_env

    os.environ.update(local_launch_env(rank, cfg.tp, port))
    kind = "cpu" if cfg.quick else "cuda"
    groups = init_parallel(ParallelConfig(tensor_parallel_size=cfg.tp), kind)

    def log(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    result = run_rank(cfg, groups.device, groups.tp, log)
    if rank == 0:
        torch.save(result, out)
    if not shutdown_parallel():
        os._exit(0)  # rank 0's result is saved; do not wait in a hung teardown


def run(cfg: UbatchConfig) -> UbatchResult:
    """Rank 0's result, the ranks spawned on this host."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.pt")
        mp.spawn(_worker, args=(cfg, port, out), nprocs=cfg.tp)
        return torch.load(out, weights_only=False)


@dataclass(frozen=True)
class Speedup:
    """One step size: plain ms over the always-split ("on") and the measured-policy
    ("auto") ms, the communication share of the plain step, and whether "auto" split."""

    kind: str
    tokens: int
    on: float
    auto: float
    comm_share: float
    auto_split: bool


def speedups(result: UbatchResult) -> list[Speedup]:
    """One ``Speedup`` per step size that has all three variants."""
    by = {(r.kind, r.tokens, r.variant): r for r in result.rows}
    out = []
    for r in result.rows:
        if r.variant != "off":
            continue
        on, auto = by.get((r.kind, r.tokens, "on")), by.get((r.kind, r.tokens, "auto"))
        if on and auto:
            share = r.comm_share
            s = Speedup(
                r.kind,
                r.tokens,
                r.step_ms / on.step_ms,
                r.step_ms / auto.step_ms,
                share,
                auto.ubatched,
            )
            out.append(s)
    return out


def document(result: UbatchResult) -> dict[str, Any]:
    """The JSON document of ``result``."""
    doc = asdict(result)
    for row, r in zip(doc["rows"], result.rows, strict=True):
        row["comm_share"] = r.comm_share
    doc["speedups"] = [asdict(s) for s in speedups(result)]
    return doc


def load(path: Path) -> UbatchResult:
    """The result a JSON document of ``document`` holds (to plot it again)."""
    doc = json.loads(path.read_text())
    result = UbatchResult(
        Provenance(**doc["provenance"]),
        doc["shape"],
        doc["tp"],
        doc["dtype"],
        [UbatchRow(**{k: v for k, v in r.items() if k != "comm_share"}) for r in doc["rows"]],
        [tuple(m) for m in doc["measured"]],
        doc["nccl_env"],
        doc["notes"],
    )
    return result


def plot(result: UbatchResult, path: Path) -> None:
    """Bars of plain and overlapped step time per step, communication share above."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ups = speedups(result)
    by = {(r.kind, r.tokens, r.variant): r.step_ms for r in result.rows}
    labels = [f"{s.kind} {s.tokens}" for s in ups]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    xs = range(len(labels))
    names = {"off": "plain graphs", "on": "always split", "auto": "split where measured faster"}
    tops = [0.0] * len(ups)
    for i, variant in enumerate(VARIANTS):
        ms = [by[(s.kind, s.tokens, variant)] / by[(s.kind, s.tokens, "off")] for s in ups]
        tops = [max(t, m) for t, m in zip(tops, ms, strict=True)]
        ax.bar([x + (i - 1) * 0.27 for x in xs], ms, 0.27, label=names[variant])
    for x, s in zip(xs, ups, strict=True):
        ax.annotate(
            f"on {s.on:.2f}x\nauto {s.auto:.2f}x\ncomm {s.comm_share:.0%}",
            (x, tops[x] + 0.02),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels)
    ax.set_ylabel("step time / plain step time")
    ax.set_ylim(0, max(tops, default=1.0) + 0.35)
    ax.axhline(1.0, color="grey", linewidth=0.5)
    p = result.provenance
    env = " ".join(f"{k}={v}" for k, v in sorted(result.nccl_env.items()))
    ax.set_title(
        f"{result.shape} TP={result.tp} {result.dtype} {env}\n{p.device}, torch {p.torch}, "
        f"{p.commit[:7]}",
        fontsize=9,
    )
    ax.legend(loc="upper right", fontsize=8, ncols=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _parser() -> OneLineParser:
    parser = OneLineParser(
        prog="python -m benchmarks ubatch",
        description=__doc__,
        formatter_class=DefaultsHelp,
    )
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (>= 2)")
    parser.add_argument("--shape", choices=TIMED_SHAPES, default="llama-8b")
    parser.add_argument("--prefill-tokens", type=int_list, default=[512, 2048, 8192])
    parser.add_argument("--decode-batches", type=int_list, default=[128, 256])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--repeats", type=positive_int, default=20)
    parser.add_argument("--quick", action="store_true", help="tiny model, CPU, gloo, eager")
    parser.add_argument("--out", type=Path, help="write the JSON result here")
    parser.add_argument("--plot", type=Path, help="write a PNG plot here (needs matplotlib)")
    parser.add_argument(
        "--from-json", type=Path, help="measure nothing: plot this earlier --out to --plot"
    )
    return parser


def main(argv: list[str]) -> int:
    """``python -m benchmarks ubatch ...``; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.from_json:
        if not args.plot:
            parser.error("argument --from-json: needs --plot")
        plot(load(args.from_json), args.plot)
        print(f"wrote {args.plot}")
        return 0
    if args.tp < 2:
        parser.error("argument --tp: micro-batch overlap needs >= 2 ranks")
    quick = args.quick or not torch.cuda.is_available()
    if not quick and torch.cuda.device_count() < args.tp:
        parser.error(f"argument --tp: {args.tp} ranks, {torch.cuda.device_count()} GPU(s)")
    if any(n < 2 or n % 2 for n in args.prefill_tokens + args.decode_batches):
        parser.error("sizes: every step size must be even and >= 2 (it splits in halves)")
    if quick:
        cfg = UbatchConfig("tiny", args.tp, (32, 64), (8, 16), "float32", 3, True)
    else:
        cfg = UbatchConfig(
            args.shape,
            args.tp,
            tuple(args.prefill_tokens),
            tuple(args.decode_batches),
            args.dtype,
            args.repeats,
            False,
        )
    if quick:
        print("python -m benchmarks ubatch: --quick (or no CUDA): the tiny model, CPU, eager")
    result = run(cfg)
    for s in speedups(result):
        print(
            f"{s.kind:7s} {s.tokens:5d}: plain / always split {s.on:5.2f}x, plain / auto "
            f"{s.auto:5.2f}x ({'split' if s.auto_split else 'plain'}), communication "
            f"{s.comm_share:4.0%} of the step"
        )
    if args.out:
        args.out.write_text(json.dumps(document(result), indent=2) + "\n")
        print(f"wrote {args.out}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0
