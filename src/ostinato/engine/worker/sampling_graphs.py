"""A runner's sampling graphs: one ``GraphSampler`` graph per uniform decode size, in the
step graphs' pool, reading the logits those graphs leave.

Their kernels loaded (``load_kernels``, where a start runs beside the steps), made
(``make``: the sampler and the sizes to capture, nothing captured), prepared
(``prepare``: their kernels compiled ahead where the start compiles ahead, then their work
run once; touching nothing a step reads, so a background start does it beside the steps),
then captured (``capture``, after the step graphs whose outputs they read).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ostinato.engine.sample.adjust import OutputCounts
from ostinato.engine.sample.graph_sampler import GraphSampler
from ostinato.modes import GraphMode
from ostinato.platform.base import Held

if TYPE_CHECKING:
    from ostinato.engine.worker.runner import ModelRunner

# A sampler made but not captured, with the sizes to capture (None: no sampling graphs).
SamplingGraphs = tuple[GraphSampler, list[int]] | None


def make(runner: ModelRunner, generator: torch.Generator, counts: OutputCounts) -> SamplingGraphs:
    """A sampling graph per uniform decode size of one token per request, reading that
    size's static logits: the decode graphs' outputs where the mode has decode graphs;
    in FULL mode, where decodes replay the mixed graphs and the LM head runs after them,
    a buffer the LM head writes (``runner.sample_logits``, allocated here); the penalties
    read and count in ``counts``. None where there are no FULL graphs, or for verify
    steps of several tokens per request, which verification samples."""
    graphs = runner.graphs
    if graphs.dispatcher.uniform_decode_query_len != 1:
        return None
    try:
        full = graphs.dispatcher.keys(GraphMode.FULL)
    except ValueError:  # no FULL graphs in this mode
        return None
    sizes = sorted(d.num_tokens for d in full if d.uniform_decode)

    def logits(n: int) -> torch.Tensor:
        if runner.sample_logits is not None:
            return runner.sample_logits[:n]
        return runner.manager.outputs.view(n)[0]

    if not sizes:
        sizes = sorted({d.num_tokens for d in full if d.num_tokens <= runner.limits.max_num_seqs})
        if not sizes:
            return None
        shape = (sizes[-1], runner.model.config.vocab_size)
        dtype = runner.model.lm_head.weight.dtype
        runner.sample_logits = torch.zeros(shape, dtype=dtype, device=runner.device)
    platform, pool = runner.manager.platform, runner.manager.pool
    greedy = runner.sample_logits is not None  # (no argmax in the step's own graphs)
    sampler = GraphSampler(
        platform, pool, generator, logits, sizes[-1], runner.device, counts, greedy
    )
    return sampler, sizes


def load_kernels(runner: ModelRunner) -> None:
    """On CUDA, imports the sampling kernels' module and settles its Triton cache keys
    (``jit_keys.settle``): a background start does it before its step graphs, while the
    steps run eagerly, not as ``prepare`` compiles ahead beside graph replays (the
    parse held a step's launch 5-11 ms at a time there, on an H100)."""
    if runner.device.type == "cuda":
        from ostinato.engine.kernels import jit_keys, sampling  # noqa: F401 (loaded)

        jit_keys.settle()


def prepare(runner: ModelRunner, made: SamplingGraphs) -> None:
    """``GraphSampler.prepare`` for ``made``'s graphs (compiled ahead where ``runner``'s
    start compiles ahead), touching nothing a step reads: what ``capture`` then need not
    do while it holds the step turn."""
    if made is not None:
        made[0].prepare(made[1], runner.kernel_plan.ahead)


def capture(
    runner: ModelRunner,
    generator: torch.Generator,
    counts: OutputCounts,
    made: SamplingGraphs = None,
    unit: Held | None = None,
) -> GraphSampler | None:
    """``make``'s graphs (or ``made``, what it returned earlier) captured: the sampler, or
    None where there are none. ``unit``: each size's graphs inside a ``unit()`` of
    their own (``GraphSampler.capture``)."""
    made = made or make(runner, generator, counts)
    if made is None:
        return None
    sampler, sizes = made
    sampler.capture(sizes, ahead=runner.kernel_plan.ahead, unit=unit)
    return sampler
