"""The decode-step benchmark: ostinato's modes vs eager, reduce-overhead and the floor."""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks import DEFAULT_SHAPE
from benchmarks.baseline import StaticCacheDecoder
from benchmarks.census import KernelLaunches, kernel_census
from ostinato.config import GraphConfig
from ostinato.distributed.groups import TensorParallel
from ostinato.engine.core.kv_cache import KVCache
from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.core.params import SamplingParams
from ostinato.engine.core.scheduler import Request, ScheduledBatch, ScheduledRequest
from ostinato.engine.kernels.gemm_launch import MAX_ROWS
from ostinato.engine.kernels.launch import pdl_for
from ostinato.engine.kernels.launch_rules import LaunchRules, rules, rules_in_force
from ostinato.engine.kernels.options import KernelOptions
from ostinato.engine.model.all_reduce_norm_op import FusedReduceNorm, setup_fused_reduce_norm
from ostinato.engine.model.attention import AttentionBackend, TritonAttention
from ostinato.engine.model.backends import default_backend
from ostinato.engine.model.config import ModelConfig
from ostinato.engine.model.decoder import DecoderModel
from ostinato.engine.model.linear import plan_entry
from ostinato.engine.model.presets import shape
from ostinato.engine.sample.sampler import sample
from ostinato.engine.worker.deferred_plans import rules_won
from ostinato.engine.worker.gemm_tuning import GemmTiming
from ostinato.engine.worker.layer_tuning import LayerTiming
from ostinato.engine.worker.runner import ModelRunner
from ostinato.mathutil import ceil_div
from ostinato.modes import GraphMode

OSTINATO_VARIANTS = {
    "eager": (GraphMode.NONE, None),
    "ostinato FULL": (GraphMode.FULL, None),
    "ostinato PIECEWISE": (GraphMode.PIECEWISE, "inductor"),
    "ostinato FULL_AND_PIECEWISE": (GraphMode.FULL_AND_PIECEWISE, "inductor"),
}


@dataclass(frozen=True)
class KernelVariant:
    """A CUDA-only variant with other kernels (FULL_AND_PIECEWISE unless ``mode`` says
    FULL): the attention fusions off (``TritonAttention(fused=False)``: RoPE in the
    model, two ``index_copy_`` K/V writes) or other ``KernelOptions`` (the layers
    unfused, PDL off, measured GEMM plans), to measure what each changes."""

    fused: bool = True
    kernels: KernelOptions = KernelOptions()
    mode: GraphMode = GraphMode.FULL_AND_PIECEWISE
    # The launch rules in force while the variant is built and captured (its graphs keep
    # what they captured); None: the rules in force.
    rules: LaunchRules | None = None


_LAYERS_UNFUSED = KernelOptions(pdl=False, fused_layers=False)  # the default until fusion
KERNEL_VARIANTS = {
    "ostinato FULL_AND_PIECEWISE unfused": KernelVariant(fused=False, kernels=_LAYERS_UNFUSED),
    "ostinato FULL_AND_PIECEWISE layers-unfused": KernelVariant(kernels=_LAYERS_UNFUSED),
    "ostinato FULL_AND_PIECEWISE layers-unfused pdl+small-gemm": KernelVariant(
        kernels=KernelOptions(small_gemm=True, fused_layers=False)
    ),
    "ostinato FULL_AND_PIECEWISE no-pdl": KernelVariant(kernels=KernelOptions(pdl=False)),
    "ostinato FULL_AND_PIECEWISE small-gemm": KernelVariant(kernels=KernelOptions(small_gemm=True)),
    # The same choices under the engine's default mode, FULL:
    "ostinato FULL small-gemm": KernelVariant(
        kernels=KernelOptions(small_gemm=True), mode=GraphMode.FULL
    ),
    "ostinato FULL layers-unfused pdl": KernelVariant(
        kernels=KernelOptions(fused_layers=False), mode=GraphMode.FULL
    ),
    "ostinato FULL layers-unfused pdl+small-gemm": KernelVariant(
        kernels=KernelOptions(small_gemm=True, fused_layers=False), mode=GraphMode.FULL
    ),
    "ostinato FULL no-pdl": KernelVariant(kernels=KernelOptions(pdl=False), mode=GraphMode.FULL),
    # The default with the GEMM plans by rule instead of measured (what a first start
    # decodes on while it measures them):
    "ostinato FULL rules-gemm": KernelVariant(
        kernels=KernelOptions(small_gemm=False), mode=GraphMode.FULL
    ),
    # An unfused layer's K/V written by a kernel of its own after the QKV projection:
    "ostinato FULL rope-kv-apart": KernelVariant(
        mode=GraphMode.FULL, rules=LaunchRules(rope_kv_unfused=False)
    ),
    # The QKV kernel with the K/V write launched as ``rope_config``'s rule says:
    "ostinato FULL qkv-by-rule": KernelVariant(
        mode=GraphMode.FULL, rules=LaunchRules(qkv_on_plan=False)
    ),
    # That, and the embedding and RoPE rows by torch's lookups (under tensor parallelism
    # the vocabulary shard's masked lookup in torch ops):
    "ostinato FULL tp-kernels-apart": KernelVariant(
        mode=GraphMode.FULL, rules=LaunchRules(rope_kv_unfused=False, embed_rope=False)
    ),
}
REDUCE_OVERHEAD = "torch.compile reduce-overhead"
# Every variant with a runner of ours (``variant_runner``), and with reduce-overhead too.
RUNNER_VARIANTS = (*OSTINATO_VARIANTS, *KERNEL_VARIANTS)
ALL_VARIANTS = (*RUNNER_VARIANTS, REDUCE_OVERHEAD)
AGAIN = " again"
"""A runner variant's name with this suffix (``"ostinato FULL again"``) starts that variant a
second time in the same process, with plans of its own: the spread between the two is the
run's noise between identical starts, which a comparison of variants must exceed."""
# Variants also timed through the engine's whole step (staging, sampling, read-back).
ENGINE_STEP_VARIANTS = ("eager", "ostinato FULL", "ostinato FULL_AND_PIECEWISE")
BLOCK = 16


SMOLLM2_CONFIG = str(Path(__file__).parent / "configs" / "smollm2_135m.json")


def fused_all_reduce_norm(
    tp: TensorParallel, device: torch.device, dtype: torch.dtype, hidden: int
) -> FusedReduceNorm | None:
    """The all-reduce fused with the norm, measured as the engine sets it up with
    ``all_reduce="auto"`` (for ``parallel``'s workers; None where it measured slower)."""
    assert tp.group is not None and tp.symmetric_group is not None
    return setup_fused_reduce_norm(tp.group, device, dtype, hidden)


def model_config(name: str) -> dict[str, Any]:
    """A preset shape by name (``presets.SHAPES``), or an HF config file (``*.json``)."""
    return json.loads(Path(name).read_text()) if name.endswith(".json") else shape(name)


@dataclass(frozen=True)
class BenchConfig:
    """What to measure: the model (HF config dict), batch sizes, KV length, dtype, variants."""

    model: dict[str, Any] = field(default_factory=lambda: shape(DEFAULT_SHAPE))
    batch_sizes: tuple[int, ...] = (1, 8, 32, 128)
    kv_len: int = 512
    dtype: str = "bfloat16"
    variants: tuple[str, ...] = ALL_VARIANTS
    warmup: int = 10
    repeats: int = 50
    # Every variant is timed this many times, all of them in turn, the last round reported:
    # a process's first variant read ~1% slow at its first timing (RESULTS.md, the default
    # against every kernel option).
    rounds: int = 2
    seed: int = 0
    all_reduce: tuple[str, ...] = ("nccl",)  # under --tp: each choice is a separate run


@dataclass
class Row:
    """One variant at one batch size."""

    variant: str
    batch: int
    step_ms: float
    host_us: float
    floor_ms: float
    x_floor: float
    x_reduce_overhead: float | None = None
    kernels: float | None = None  # device kernels per step (CUDA, when profiled)
    kernels_per_layer: float | None = None
    busy_us: float | None = None  # their summed device time per step
    kernels_in_layer: int | None = None  # inside one decoder layer (KernelCensus.in_layer)
    pipelined_ms: float | None = None  # per step, steps back to back (CUDA; pipelined_ms())
    earlier_ms: list[float] = field(default_factory=list)  # step_ms of the earlier rounds


@dataclass
class VariantCost:
    """What a variant costs before its first step."""

    variant: str
    compile_s: float
    capture_s: float
    graph_pool_mib: float
    graph_device_mib: float
    num_graphs: int
    note: str = ""

    @property
    def startup_s(self) -> float:
        """Compile plus capture seconds."""
        return self.compile_s + self.capture_s


@dataclass(frozen=True)
class StepPlan:
    """What a variant's decode step of ``rows`` rows runs as its start left it: the plan
    entry (0: cuBLAS, else 1 + an index into ``small_gemm.CONFIGS``) of the first layer's
    projections and of the LM head, whether its layers run fused and launch with PDL, and
    whether a start's recapture check kept the rules' graph at this size (and gave it the
    rules' kernels back): the GEMM timings alone do not say what runs."""

    rows: int
    qkv: int
    o: int
    gate_up: int
    down: int
    lm_head: int
    fused: bool
    pdl: bool
    rules_kept: bool = False

    def line(self) -> str:
        """``8: 19/0/0/17/11 unfused`` (``no-pdl`` added where PDL is off, ``rules'
        graph`` where the recapture check kept it)."""
        entries = (self.qkv, self.o, self.gate_up, self.down, self.lm_head)
        layers = "fused" if self.fused else "unfused"
        pdl = "" if self.pdl else " no-pdl"
        kept = " rules' graph" if self.rules_kept else ""
        return f"{self.rows}: {'/'.join(map(str, entries))} {layers}{pdl}{kept}"


def step_plans(
    model: DecoderModel, sizes: Sequence[int], rules_kept: frozenset[int] = frozenset()
) -> list[StepPlan]:
    """The ``StepPlan`` of each of ``sizes`` the small GEMM covers (at most ``MAX_ROWS``),
    smallest first; ``rules_kept``: the sizes where the recapture check kept the rules'
    graphs (``deferred_plans.rules_won``)."""
    layer = model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj, model.lm_head)
    plans = []
    for r in sorted({s for s in sizes if s <= MAX_ROWS}):
        entries = [plan_entry(linear.plan, r) for linear in linears]
        pdl = pdl_for(model.kernels.pdl, r) and r not in model.no_pdl_rows
        plans.append(StepPlan(r, *entries, layer.fuses(r), pdl, r in rules_kept))
    return plans


@dataclass
class BenchResult:
    """Every number of one run, with what it was measured against."""

    config: BenchConfig
    device: str
    copy_bandwidth_gbps: float
    weight_bytes_per_step: int
    kv_bytes_per_token: int
    tensor_parallel_size: int = 1
    rows: list[Row] = field(default_factory=list)
    costs: list[VariantCost] = field(default_factory=list)
    profile: dict[str, list[tuple[str, float]]] = field(default_factory=dict)
    # Per "variant B=b" (B = 1 and the largest): every kernel name's launches per step.
    kernels_by_name: dict[str, list[KernelLaunches]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # Per variant with small_gemm: the start-up measurement of cuBLAS vs the Triton GEMM.
    small_gemm: dict[str, list[GemmTiming]] = field(default_factory=dict)
    # Per variant with fused layers in graphs: the start-up timing of fused vs unfused layers.
    layer_plan: dict[str, list[LayerTiming]] = field(default_factory=dict)
    # Per variant on CUDA: what each timed size of at most 16 rows runs (``StepPlan``).
    step_plans: dict[str, list[StepPlan]] = field(default_factory=dict)
    # Under --tp with "auto": per-call µs of each all-reduce algorithm in a captured graph,
    # by message size in bytes ({"sizes": [...], "nccl": [...], "one-shot": [...], ...}).
    all_reduce_us: dict[str, list[float]] = field(default_factory=dict)


def copy_bandwidth_gbps(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times) / 1e9


def pipelined_ms(step: Callable[[], Any], steps: int = 20, rounds: int = 5) -> float:
    """Median device ms per step over ``rounds`` runs of ``steps`` back-to-back steps
    (no synchronisation between them): while the host issues a step faster than the
    device runs one, the device never waits for it, so this is the replay's own time,
    free of the host's jitter that the isolated timing includes."""
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return statistics.median(times)


def time_step(
    step: Callable[[], Any], warmup: int, repeats: int, cuda: bool
) -> tuple[float, float]:
    """(median device ms, median host µs) of one step, each step run in isolation."""
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    device_ms, host_us = [], []
    for _ in range(repeats):
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        if cuda:
            end.record()
            end.synchronize()
            device_ms.append(start.elapsed_time(end))
        else:
            device_ms.append((t1 - t0) * 1e3)
        host_us.append((t1 - t0) * 1e6)
    return statistics.median(device_ms), statistics.median(host_us)


class DecodeSetup:
    """The model, one KV cache, and B requests each holding ``kv_len`` cached tokens."""

    def __init__(
        self, cfg: BenchConfig, device: torch.device, tp: TensorParallel | None = None
    ) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = getattr(torch, cfg.dtype)
        self.tp = tp or TensorParallel()
        torch.manual_seed(cfg.seed)
        self.config = ModelConfig.from_hf(cfg.model)
        self.max_len = cfg.kv_len + BLOCK
        with torch.device(device):
            model = DecoderModel(self.config, self.tp, max_positions=self.max_len)
            self.model = model.to(self.dtype).eval()
        if device.type == "cuda":
            # The float32 build's blocks (32 GB at the 8 B shape) stay reserved once freed,
            # and the graphs' private pools cannot reuse them: handed back here.
            torch.cuda.empty_cache()
        c = self.config
        self.max_b = max(cfg.batch_sizes)
        self.blocks_per_seq = ceil_div(self.max_len, BLOCK)
        self.cache = KVCache(
            c.num_layers,
            self.max_b * self.blocks_per_seq + 1,
            BLOCK,
            c.num_kv_heads // self.tp.size,
            c.head_dim,
            self.dtype,
            device,
        )
        for t in self.cache.k + self.cache.v:
            t.normal_()  # real data: attention must not read zeros
        self.backend = default_backend(device)

    def weight_bytes_per_step(self, batch: int) -> int:
        """Every weight once, except the embedding table, of which only B rows are read."""
        m = self.model
        total = sum(p.numel() * p.element_size() for p in m.parameters())
        embed = m.embed_tokens.weight
        if not self.config.tie_word_embeddings:
            total -= embed.numel() * embed.element_size()
        return total + batch * embed.shape[1] * embed.element_size()

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes one cached token occupies over all layers (on this rank)."""
        c = self.config
        heads = c.num_kv_heads // self.tp.size
        return 2 * c.num_layers * heads * c.head_dim * self.dtype.itemsize

    def runner(
        self,
        mode: GraphMode,
        compiler: str | None,
        backend: AttentionBackend | None = None,
        kernels: KernelOptions | None = None,
        graphs: GraphConfig | None = None,
    ) -> ModelRunner:
        """A ModelRunner over the shared weights and cache in ``mode`` (with the default
        attention backend unless ``backend``, the model's kernels launched as ``kernels``
        say, and the graphs ``graphs`` configures, by default ``mode``'s ladder)."""
        limits = EngineLimits(self.max_b, 2048, self.max_len, BLOCK)
        return ModelRunner(
            self.model_with(kernels or KernelOptions()),
            self.cache,
            backend or self.backend,
            limits,
            graphs or GraphConfig(mode=mode),
            self.device,
            progress=False,
            compiler=compiler,
        )

    def model_with(self, kernels: KernelOptions) -> DecoderModel:
        """The model built with ``kernels`` (resolved for the device), holding the same
        weights as ``model``: no second copy."""
        kernels = kernels.resolved(self.device)
        if kernels == self.model.kernels:
            return self.model
        with torch.device("meta"):
            model = DecoderModel(self.config, self.tp, kernels, self.max_len)
        model.load_state_dict(self.model.state_dict(), assign=True)
        model.inv_freq = self.model.inv_freq  # neither is in the state dict
        model.rope_table = self.model.rope_table
        if self.config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        return model.eval()

    def decode_step(self, runner: ModelRunner, batch: int) -> Callable[[], torch.Tensor]:
        """One decode step of ``batch`` requests at position kv_len: copy-in, run, logits
        (inside the graph where the decode graph covers the LM head)."""
        pos = self.cfg.kv_len
        tables = (
            torch.arange(batch)[:, None] * self.blocks_per_seq
            + 1
            + torch.arange(self.blocks_per_seq)[None, :]
        ).to(torch.int32)
        inputs = runner.inputs
        slots = tables[:, pos // BLOCK].long() * BLOCK + pos % BLOCK
        inputs.write_rows(torch.full((batch,), pos), torch.arange(batch), slots, tables)
        pin = self.device.type == "cuda"
        host_ids = (
            torch.randint(0, self.config.vocab_size, (batch,)).pin_memory()
            if pin
            else torch.randint(0, self.config.vocab_size, (batch,))
        )
        meta = runner.metadata(batch, [1] * batch, [pos + 1] * batch)
        rows = torch.arange(batch, device=self.device)

        def step() -> torch.Tensor:
            dispatch = runner.graphs.dispatch(batch, uniform_decode=True)
            inputs.input_ids[:batch].copy_(host_ids, non_blocking=True)
            return runner.run_logits(dispatch, batch, meta, rows)

        return step

    def blocks(self, r: int) -> list[int]:
        """The KV blocks of request ``r`` (block 0 is the null block)."""
        return list(range(1 + r * self.blocks_per_seq, 1 + (r + 1) * self.blocks_per_seq))

    def decode_batch(self, tokens: list[int]) -> ScheduledBatch:
        """A uniform decode of ``len(tokens)`` requests at position kv_len, request ``r``
        in ``blocks(r)`` taking ``tokens[r]``."""
        step = ScheduledBatch([])
        for r, token in enumerate(tokens):
            req = Request(r, [1] * self.cfg.kv_len, SamplingParams(), output=[token])
            req.blocks, req.num_cached = self.blocks(r), self.cfg.kv_len
            step.scheduled.append(ScheduledRequest(req, [token], self.cfg.kv_len))
        return step

    def engine_step(self, runner: ModelRunner, batch: int) -> Callable[[], list[int]]:
        """The engine's real step for a uniform decode of ``batch`` requests at position
        kv_len: ``ModelRunner.execute`` (staging, dispatch, replay, logits), greedy
        sampling and the read-back of the tokens, as ``LLM`` runs it synchronously."""
        rng = torch.Generator().manual_seed(self.cfg.seed)
        tokens = torch.randint(0, self.config.vocab_size, (batch,), generator=rng).tolist()
        step = self.decode_batch(tokens)
        zeros = torch.zeros(batch, device=self.device)

        def run() -> list[int]:
            logits = runner.execute(step).logits
            return sample(logits, zeros, zeros, all_greedy=True).tolist()

        return run

    def reduce_overhead_step(self, batch: int) -> tuple[Callable[[], torch.Tensor], float]:
        """The baseline's step for ``batch`` and the seconds its first calls took: the
        model's modules as before the fusions (no GEMM plans, no PDL), compiled by torch."""
        dec = StaticCacheDecoder(self.model_with(_LAYERS_UNFUSED), batch, self.max_len)
        for name, buf in dec.named_buffers():
            if name[0] in "kv" and name[1:].isdigit():
                buf.normal_()
        compiled = torch.compile(dec, mode="reduce-overhead", fullgraph=True)
        ids = torch.randint(0, self.config.vocab_size, (batch, 1), device=self.device)
        pos = torch.tensor([self.cfg.kv_len], device=self.device)
        start = time.perf_counter()
        with torch.no_grad():
            for _ in range(3):  # compile, then the warm-up and recording runs of cudagraphs
                compiled(ids, pos)
        torch.cuda.synchronize()
        first = time.perf_counter() - start

        def step() -> torch.Tensor:
            with torch.no_grad():
                return compiled(ids, pos)

        return step, first


def run(
    cfg: BenchConfig,
    device: torch.device,
    log: Callable[[str], None] = print,
    profile: bool = True,
    tp: TensorParallel | None = None,
) -> BenchResult:
    """Runs every variant at every batch size; returns all numbers. Under tensor
    parallelism every rank runs this in lock-step; the floor is this rank's shard of the
    weights and KV cache, and the reduce-overhead baseline (single-GPU) is skipped."""
    cuda = device.type == "cuda"
    setup = DecodeSetup(cfg, device, tp)
    bw = copy_bandwidth_gbps(device) if cuda else float("nan")
    result = BenchResult(
        cfg,
        torch.cuda.get_device_name(device) if cuda else "cpu",
        bw,
        setup.weight_bytes_per_step(1),
        setup.kv_bytes_per_token,
        setup.tp.size,
    )
    log(
        f"copy bandwidth {bw:.0f} GB/s; weights {setup.weight_bytes_per_step(1) / 1e9:.2f} GB "
        f"per step; KV {setup.kv_bytes_per_token} B per token"
    )

    def floor_ms(b: int) -> float:
        nbytes = setup.weight_bytes_per_step(b) + b * cfg.kv_len * setup.kv_bytes_per_token
        return nbytes / (bw * 1e9) * 1e3 if cuda else float("nan")

    # Every timing comes before the first profile: after a profiler session with CUDA
    # graphs, torch leaves CUPTI attached and every later launch costs the host more (on
    # the H200 an isolated step's host time of 20 to 110 µs rose to 99 to 225 µs:
    # benchmarks.profiler_effect, RESULTS.md).
    runners: list[tuple[str, ModelRunner]] = []
    with torch.inference_mode():
        for name in cfg.variants:
            with variant_rules(name):
                runner = variant_runner(setup, name, cuda)
                if runner is not None:
                    _capture_variant(setup, runner, name, result)
                    runners.append((name, runner))
        _time_rounds(setup, runners, result, floor_ms, log)
    if REDUCE_OVERHEAD in cfg.variants and cuda and setup.tp.size == 1:
        _time_reduce_overhead(setup, result, floor_ms, log)
    with torch.inference_mode():
        for name, runner in runners:
            if profile and cuda:
                _profile_variant(setup, runner, name, result, log)
            runner.release()
    ro = {r.batch: r.step_ms for r in result.rows if r.variant == REDUCE_OVERHEAD}
    for r in result.rows:
        if r.batch in ro:
            r.x_reduce_overhead = r.step_ms / ro[r.batch]
    return result


def base_variant(name: str) -> str:
    """The variant ``name`` starts: ``name`` without ``AGAIN``."""
    return name.removesuffix(AGAIN)


def variant_rules(name: str) -> contextlib.AbstractContextManager[LaunchRules]:
    """The launch rules variant ``name`` is built and captured under (its graphs keep
    what they captured): its own where it names some, else those in force."""
    variant = KERNEL_VARIANTS.get(base_variant(name))
    return rules_in_force(variant.rules if variant and variant.rules else rules())


def variant_runner(setup: DecodeSetup, name: str, cuda: bool) -> ModelRunner | None:
    """The runner of variant ``name``; None for reduce-overhead (timed apart) and for
    variants of CUDA kernels off CUDA. ``name`` may end in ``AGAIN``."""
    name = base_variant(name)
    if name == REDUCE_OVERHEAD:
        return None
    if name in KERNEL_VARIANTS:
        if not cuda:
            return None  # variants of CUDA kernels
        variant = KERNEL_VARIANTS[name]
        return setup.runner(
            variant.mode,
            "inductor" if variant.mode is GraphMode.FULL_AND_PIECEWISE else None,
            TritonAttention(fused=variant.fused, pdl=variant.kernels.resolved(setup.device).pdl),
            variant.kernels,
        )
    mode, compiler = OSTINATO_VARIANTS[name]
    return setup.runner(mode, compiler)


def _capture_variant(
    setup: DecodeSetup, runner: ModelRunner, name: str, result: BenchResult
) -> None:
    """Captures ``runner``'s graphs; records what that cost and what its plans measured."""
    cuda = setup.device.type == "cuda"
    start = time.perf_counter()
    report = runner.capture()
    if cuda:
        torch.cuda.synchronize()
    capture_s = time.perf_counter() - start - runner.compile_seconds
    if runner.kernel_plan.timings:
        result.small_gemm[name] = runner.kernel_plan.timings
    if runner.kernel_plan.layer_timings:
        result.layer_plan[name] = runner.kernel_plan.layer_timings
        unfused, no_pdl = sorted(runner.model.unfused_rows), sorted(runner.model.no_pdl_rows)
        print(f"{name}: measured slower: fused layers at rows {unfused}, PDL at rows {no_pdl}")
    if cuda and runner.graphs.mode is not GraphMode.NONE:
        kept = rules_won(runner.deferred_plans.recaptured)
        plans = result.step_plans[name] = step_plans(runner.model, setup.cfg.batch_sizes, kept)
        lines = "; ".join(p.line() for p in plans)
        print(f"{name}: steps run (qkv/o/gate_up/down/lm_head plan entries, 0 cuBLAS): {lines}")
    result.costs.append(
        VariantCost(
            name,
            runner.compile_seconds,
            capture_s,
            report.pool_bytes / 2**20,
            report.device_bytes / 2**20,
            report.num_graphs,
            "; ".join(runner.resolution.reasons),
        )
    )


def _time_rounds(
    setup: DecodeSetup,
    runners: list[tuple[str, ModelRunner]],
    result: BenchResult,
    floor_ms: Callable[[int], float],
    log: Callable[[str], None],
) -> None:
    """``BenchConfig.rounds`` rounds, each timing every variant in turn at every size; the
    last round's rows go into ``result``, each with the earlier rounds' step times."""
    earlier: dict[tuple[str, int], list[float]] = {}
    for r in range(setup.cfg.rounds):
        last = r == setup.cfg.rounds - 1
        if setup.cfg.rounds > 1:
            log(f"round {r + 1} of {setup.cfg.rounds}" + (" (reported)" if last else ""))
        for name, runner in runners:
            for row in _time_variant(setup, runner, name, floor_ms, log):
                if last:
                    row.earlier_ms = earlier.get((row.variant, row.batch), [])
                    result.rows.append(row)
                else:
                    earlier.setdefault((row.variant, row.batch), []).append(row.step_ms)


def _time_variant(
    setup: DecodeSetup,
    runner: ModelRunner,
    name: str,
    floor_ms: Callable[[int], float],
    log: Callable[[str], None],
) -> list[Row]:
    """Times ``runner``'s (captured) step at every size."""
    cfg, cuda = setup.cfg, setup.device.type == "cuda"
    rows = []
    for b in cfg.batch_sizes:
        step = setup.decode_step(runner, b)
        ms, host = time_step(step, cfg.warmup, cfg.repeats, cuda)
        row = Row(name, b, ms, host, floor_ms(b), ms / floor_ms(b))
        if cuda:
            row.pipelined_ms = pipelined_ms(step)
        rows.append(row)
        log(f"{name:32s} B={b:4d} {ms:8.3f} ms  host {host:8.1f} us")
        if name in ENGINE_STEP_VARIANTS:
            label = f"{name} engine step"
            ms, host = time_step(setup.engine_step(runner, b), cfg.warmup, cfg.repeats, cuda)
            rows.append(Row(label, b, ms, host, floor_ms(b), ms / floor_ms(b)))
            log(f"{label:32s} B={b:4d} {ms:8.3f} ms  host {host:8.1f} us")
    return rows


def _profile_variant(
    setup: DecodeSetup,
    runner: ModelRunner,
    name: str,
    result: BenchResult,
    log: Callable[[str], None],
) -> None:
    """Counts the kernels of ``runner``'s step at every size into the rows that
    ``_time_variant`` timed (CUDA)."""
    cfg = setup.cfg
    rows = {r.batch: r for r in result.rows if r.variant == name}
    for b in cfg.batch_sizes:
        step = setup.decode_step(runner, b)
        c = kernel_census(step)
        row = rows[b]
        row.kernels, row.busy_us = c.kernels, c.busy_us
        row.kernels_per_layer = c.per_layer(cfg.model["num_hidden_layers"])
        row.kernels_in_layer = c.in_layer(cfg.model["num_hidden_layers"])
        if b in (1, max(cfg.batch_sizes)) and name != "eager":
            result.kernels_by_name[f"{name} B={b}"] = list(c.by_name)
        log(f"{name:32s} B={b:4d} {c.kernels:.0f} kernels a step")
        if name == "ostinato FULL" and b in (1, max(cfg.batch_sizes)):
            result.profile[f"{name} B={b}"] = top_kernels(step)


def _time_reduce_overhead(
    setup: DecodeSetup,
    result: BenchResult,
    floor_ms: Callable[[int], float],
    log: Callable[[str], None],
) -> None:
    """Times torch.compile(mode="reduce-overhead") at every size (compiled per size)."""
    cfg = setup.cfg
    total_first = 0.0
    for b in cfg.batch_sizes:
        step, first = setup.reduce_overhead_step(b)
        total_first += first
        ms, host = time_step(step, cfg.warmup, cfg.repeats, True)
        result.rows.append(Row(REDUCE_OVERHEAD, b, ms, host, floor_ms(b), ms / floor_ms(b)))
        log(
            f"{REDUCE_OVERHEAD:32s} B={b:4d} {ms:8.3f} ms  host {host:8.1f} us "
            f"(first calls {first:.1f} s)"
        )
    result.costs.append(
        VariantCost(
            REDUCE_OVERHEAD,
            total_first,
            0.0,
            float("nan"),
            float("nan"),
            len(cfg.batch_sizes),
            "compile + record per batch size; graph memory not separable from its compile",
        )
    )


def top_kernels(step: Callable[[], Any], n: int = 6) -> list[tuple[str, float]]:
    """The ``n`` device kernels with the most time over 5 steps, with their share in %."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events) or 1.0
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    return [(e.key[:90], round(100 * e.device_time_total / total, 1)) for e in events[:n]]


def quick_config() -> BenchConfig:
    """A CPU-sized run: the tiny model, eager only."""
    return BenchConfig(
        model=shape("tiny"),
        batch_sizes=(1, 8),
        kv_len=64,
        dtype="float32",
        variants=("eager",),
        warmup=2,
        repeats=5,
    )
