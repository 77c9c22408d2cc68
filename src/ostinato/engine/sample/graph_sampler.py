"""Temperature / top-p sampling of a uniform decode step inside graphs.

The uniform decode graphs end in the LM head and the argmax, so a greedy step is one
replay. In FULL mode a decode replays the mixed graph of its size and the LM head runs
after it, so each size also gets a greedy graph (``GREEDY``) over the logits it wrote.
A step that samples needs a softmax, top-p and random draws (on CUDA a few short
kernels, ``kernels.sampling``), so each decode size gets a second, small graph that reads
the decode graph's static logits and per-row temperature and top-p buffers and writes
the sampled tokens. A sampled step is then two replays and no eager kernel: no launch
per op, no host work between them.

On CUDA (``keyed``) every row draws from a key the host staged with the step's values
(``StepSampler``'s: a seeded row's from its seed, the others' from a seeded stream), so
a graph holds no generator: a registered one cost each replay two eager fills and a
launch gap, some 10 µs. An eager step takes its keys from the same stream, so a graph's
tokens are eager's, padded or not. Elsewhere the draws come from the engine's generator,
registered with each graph: every replay advances it as an eager call of the same size
would, so a step whose requests fill its captured size exactly takes the very tokens an
eager ``sample`` takes from the same generator state; in a padded step the padding rows
draw too and shift later draws (the same distribution, other tokens).

A step whose requests set a logit bias or penalties, or a seed, replays an adjusted
variant: it adds the step's bias (a dense ``[rows, vocab]`` buffer, rewritten between
steps where the rows' biases differ from the last step's), subtracts the penalties read
from the output counts' table (``OutputCounts``, through the step's rows) with the
arithmetic of eager steps (``adjust.penalized``), draws a seeded row's numbers from its
key (``sampler.Seeds``; on CUDA every row's), so it too takes eager's tokens, and counts
the tokens it drew in the table (``sampler.sample``'s count; on CUDA in its last
kernel). Its bias costs ``rows * vocab`` float32 (16 MiB at 32 rows of a 128k vocabulary).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ostinato.engine.core.params import MAX_LOGPROBS
from ostinato.engine.kernels.launch import compile_ahead
from ostinato.engine.sample.adjust import OutputCounts, Penalties, add_bias
from ostinato.engine.sample.logprobs import StepLogprobs
from ostinato.engine.sample.rows import StepRows
from ostinato.engine.sample.sampler import Seeds, sample
from ostinato.graph import recorded_apart
from ostinato.platform.base import Held, Platform

# The graphs of each size: (adjusted, cut, seeded). cut None: an adjusted all-greedy step
# (no draw: eager greedy steps draw nothing either, so later draws stay in step with
# eager's). seeded: the seeded rows' keys in place of those drawn from the generator
# (with torch, the hash of every row's key: some 20 passes over [rows, vocab] int64).
VARIANTS = (
    (False, True, False),
    (False, False, False),
    (True, True, False),
    (True, False, False),
    (True, True, True),
    (True, False, True),
    (True, None, False),
)
# On CUDA the sampling kernels cost the same with or without top-p, and every row draws
# from a staged key (seeded or not), so one graph serves a sampled step of either kind:
# 3 variants, not 7.
CUDA_VARIANTS = ((False, True, False), (True, True, False), (True, None, False))
# The argmax alone, for steps whose own graphs end before the LM head (FULL mode's).
GREEDY = (False, None, False)
Key = tuple[int, bool, bool | None, bool]  # (size, adjusted, cut, seeded)


def _values(rows: int, device: torch.device, pin: bool = False) -> torch.Tensor:
    """The bytes of a step's per-row values (``_views``)."""
    return torch.zeros(rows * (4 * 4 + 3 * 8), dtype=torch.uint8, device=device, pin_memory=pin)


def _views(values: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``values``' floats (``[4, rows]`` float32) and ints (``[3, rows]`` int64, after
    the floats: 8-byte aligned, as ``16 * rows`` bytes are)."""
    split = 4 * 4 * rows
    floats = values[:split].view(torch.float32).view(4, rows)
    return floats, values[split:].view(torch.long).view(3, rows)


class GraphSampler:
    """Sampling graphs per uniform decode size (``VARIANTS``, on CUDA ``CUDA_VARIANTS``;
    and ``GREEDY`` with ``greedy``), captured into the shared pool. ``logits(n)``: the
    first ``n`` rows of the static logits the step wrote (``[n, vocab]``, fixed address
    per ``n``).
    Guarantees: ``sample``, ``sample_adjusted`` and ``greedy`` return None for a size
    with no graph (the caller samples eagerly); the generator's state after
    ``capture`` is what it was before; at a captured size the tokens equal eager
    sampling's from the same generator state.
    """

    def __init__(
        self,
        platform: Platform,
        pool: Any,
        generator: torch.Generator,
        logits: Callable[[int], torch.Tensor],
        max_rows: int,
        device: torch.device,
        counts: OutputCounts,
        greedy: bool = False,
    ) -> None:
        self.platform, self.pool, self.generator, self.logits = platform, pool, generator, logits
        self.device, self.counts = device, counts
        self.keyed = device.type == "cuda"  # (``CUDA_VARIANTS``, each row's key staged)
        variants = CUDA_VARIANTS if self.keyed else VARIANTS
        self.variants = (*variants, GREEDY) if greedy else variants
        # Per row: temperature, top-p, presence and frequency penalties; seed key, seeded,
        # row of the output counts. One buffer, so a step's values are one copy.
        self.values = _values(max_rows, device)
        self.floats, self.ints = _views(self.values, max_rows)
        self.bias = self.table = torch.zeros((0, 0), device=device)  # (made by capture)
        self.bias_key: tuple | None = None  # the step whose biases ``bias`` holds
        # Pinned staging, two sets used in turn (as ``StepInputs`` does: under
        # asynchronous scheduling the host fills one while the other's copy may still be
        # queued); the host writes them through numpy views made once.
        pin = device.type == "cuda"
        self.stagings = [_values(max_rows, torch.device("cpu"), pin) for _ in range(2)]
        self.hosts = [tuple(v.numpy() for v in _views(x, max_rows)) for x in self.stagings]
        self.turn = 0
        self.graphs: dict[Key, tuple[Any, torch.Tensor]] = {}  # -> (graph, tokens [size])
        # Log probabilities (``StepLogprobs`` of MAX_LOGPROBS alternatives) per size, of
        # the tokens copied into ``chosen``; on CUDA only ``live_k`` alternatives are
        # computed (a pass over the logits each), written when a step asks for another k.
        self.chosen = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.live_k = torch.full((1,), MAX_LOGPROBS, dtype=torch.long, device=device)
        self.live_k_value = MAX_LOGPROBS
        self.logprob_graphs: dict[int, tuple[Any, StepLogprobs]] = {}
        self.compiled = False  # (the graphs' kernels, by ``prepare``)
        self.prepared: frozenset[int] = frozenset()  # sizes whose work ``prepare`` ran

    def _sample(self, n: int, adjusted: bool, cut: bool | None, seeded: bool) -> torch.Tensor:
        temperatures, top_ps = self.floats[0, :n], self.floats[1, :n]
        penalties = None
        if adjusted:  # (``sample`` counts the tokens it draws in the table, too)
            table, rows = self.table, self.ints[2, :n]
            bias, presence, frequency = self.bias[:n], self.floats[2, :n], self.floats[3, :n]
            penalties = Penalties(bias, presence, frequency, table, rows)
        logits = self.logits(n)
        if cut is None:  # (greedy: no draw, and its own tokens, as the step's argmax)
            return sample(logits, temperatures, top_ps, all_greedy=True, penalties=penalties)
        seeds: Seeds | tuple = ()
        if self.keyed:  # (every row's key; no generator draw)
            seeds = Seeds(self.ints[0, :n], None)
        elif seeded:
            seeds = Seeds(self.ints[0, :n], self.ints[1, :n].bool())
        # (into ``chosen``: the log probabilities' graph reads them there, no copy)
        chosen = self.chosen[:n]
        return sample(
            logits, temperatures, top_ps, self.generator, False, seeds, cut, penalties, chosen
        )

    @torch.inference_mode()
    def capture(self, sizes: list[int], ahead: bool = False, unit: Held | None = None) -> None:
        """Captures every variant for each of ``sizes`` (the padded sizes whose logits
        ``logits`` names), after the step's graphs (their logits buffer must exist).
        ``ahead`` (``KernelOptions.compile_ahead``, CUDA): every graph's kernels compile
        together first (``launch.compile_ahead``: processes or threads), not one after the
        other at each capture's warm-up, unless ``prepare`` compiled them.
        ``unit`` (a background capture's): the buffers (and any compile) inside a
        ``unit()``, then each graph inside one of its own, steps sampling eagerly between
        them; each leaves the generator and the counts as the steps left them."""
        hold = unit or contextlib.nullcontext
        with hold():
            self._own_buffers(sizes)
            with torch.inference_mode(False):
                self.table = self.counts.table  # (made now if not yet: graphs read it there)
            if ahead and not self.compiled:
                with self._steps_state_kept():
                    self._compile_ahead(sizes)
        for n in sizes:
            self._capture_size(n, hold)

    def _capture_size(self, n: int, hold: Held) -> None:
        """Every variant's graph of size ``n`` and its log-probability graph, each inside
        a ``hold()`` of its own (a size's five graphs held a step 5 ms; one, about 1),
        without the warm-up run where ``prepare`` ran ``n``'s work already."""
        warm = n not in self.prepared
        for variant in self.variants:
            sampled = functools.partial(self._sample, n, *variant)
            with hold():
                self.graphs[(n, *variant)] = self._captured(sampled, not self.keyed, warm)
        with hold():
            self.logprob_graphs[n] = self._captured(self._logprobs_of(n), False, warm)

    @contextlib.contextmanager
    def _steps_state_kept(self) -> Iterator[None]:
        """What runs inside counts its draws in the scratch row (a step before it may
        have written its own rows) and leaves the generator's state as it found it."""
        self.ints[2].fill_(self.counts.scratch)
        state = self.generator.get_state()
        try:
            yield
        finally:
            self.generator.set_state(state)

    @torch.inference_mode()
    def prepare(self, sizes: list[int], ahead: bool) -> None:
        """What the captures of ``sizes`` would first do at their warm-ups, done earlier,
        beside steps (before the sampler is handed to them): with ``ahead``, ``capture``'s
        compile-ahead pass; then each graph's work run once eagerly (kernel modules
        loaded, first-call allocations made), so each capture's warm-up is quick. It
        draws from a generator of its own, counts into a table of its own and writes its
        tokens into a buffer of its own, so it touches nothing a step reads or writes."""
        self._own_buffers(sizes)
        self.ints[2].fill_(self.counts.scratch)
        generator, table, chosen = self.generator, self.table, self.chosen
        self.generator = torch.Generator(device=self.device)
        self.table, self.chosen = self.counts.new_table(), torch.zeros_like(chosen)
        try:
            if ahead:
                self._compile_ahead(sizes)
            # (After a compile ahead too: a kernel's first launch loads it, which held
            # the first size's capture for 70 ms on the H200.)
            for n in sizes:
                self._every_graphs_work(n)
        finally:
            self.generator, self.table, self.chosen = generator, table, chosen
        self.compiled = ahead
        self.prepared = self.prepared | frozenset(sizes)

    def _own_buffers(self, sizes: list[int]) -> None:
        """The logit biases (``[rows, vocab]``), made once for the largest of ``sizes``."""
        rows, vocab = self.floats.shape[1], self.logits(sizes[-1]).shape[-1]
        if self.bias.shape != (rows, vocab):
            with torch.inference_mode(False):  # (written between steps, outside it)
                self.bias = torch.zeros((rows, vocab), dtype=torch.float32, device=self.device)

    def _compile_ahead(self, sizes: list[int]) -> None:
        """One pass over what the captures will run, inside ``compile_ahead()``: every
        kernel launch only queues its compilation (the torch ops run, on scratch; the
        generator's state is restored after the captures)."""
        with compile_ahead():
            for n in sizes:
                self._every_graphs_work(n)

    def _every_graphs_work(self, n: int) -> None:
        """What each of size ``n``'s graphs runs, run once eagerly."""
        for variant in self.variants:
            self._sample(n, *variant)
        self._logprobs_of(n)()

    def _logprobs_of(self, n: int) -> Callable[[], StepLogprobs]:
        logits = self.logits(n)
        k = min(MAX_LOGPROBS, logits.shape[-1])
        return lambda: StepLogprobs.of(logits, self.chosen[:n], k, self.live_k)

    def _captured(self, fn: Callable[[], Any], draws: bool, warm: bool) -> tuple[Any, Any]:
        """A graph of ``fn`` in the shared pool and its outputs (inside a background
        start's hold of the step turn, where it has one): one warm-up run first where
        ``warm`` (lazy initialisation stays out of the graph), counting its draws in the
        scratch row and leaving the generator as the steps left it. ``draws``: ``fn``
        draws from the generator, which is registered with the graph and kept as the
        steps left it around the recording too. A graph that draws nothing records with
        the turn let go where the hold allows it and the platform records without running
        (``graph.recorded_apart``: a background start's epilogue units, on CUDA), so steps
        run meanwhile: it reads no value a step writes, only their addresses."""
        if warm:
            # (Not where ``prepare`` ran it: inside a background start's holds of the step
            # turn, 21 of them took 44.6 ms with it, 40 without, on an H200, 1.5 B, B = 8.)
            with self._steps_state_kept():
                fn()
                self.platform.synchronize_outside_capture()  # (on the capture thread)
        if draws or not self.platform.records_apart:
            with self._steps_state_kept():
                return self._recorded(fn, draws)
        with recorded_apart():
            return self._recorded(fn, False)

    def _recorded(self, fn: Callable[[], Any], draws: bool) -> tuple[Any, Any]:
        """``fn`` recorded into a graph of the shared pool (the generator registered with
        it where ``fn`` draws, on CUDA), and its outputs."""
        graph = self.platform.new_graph()
        register = getattr(graph, "register_generator_state", None)
        if draws and register is not None and self.generator.device.type == "cuda":
            register(self.generator)
        with self.platform.capture(graph, self.pool):
            out = fn()
        return graph, out

    def logprobs(self, padded: int, tokens: torch.Tensor, k: int) -> StepLogprobs | None:
        """``StepLogprobs.of`` the last step's logits (replayed at ``padded`` rows) for
        ``tokens`` with ``k`` alternatives (the first ``k`` columns of ``MAX_LOGPROBS``),
        views of the graph's outputs valid until the next replay of any graph in the
        pool; None if no graph was captured for ``padded``."""
        entry = self.logprob_graphs.get(padded)
        if entry is None:
            return None
        n = tokens.shape[0]
        if tokens.data_ptr() != self.chosen.data_ptr():  # (a sampling graph's are there)
            self.chosen[:n].copy_(tokens)
        if k != self.live_k_value:
            self.live_k.fill_(k)
            self.live_k_value = k
        entry[0].replay()
        out = entry[1]
        # Whole rows (the first k columns are the step's): a slice of columns would copy
        # to the host through a kernel that makes it contiguous first, two a step.
        return StepLogprobs(out.chosen[:n], out.top_ids[:n], out.top_values[:n])

    def stage(
        self, rows: StepRows, keys: np.ndarray | None, count_rows: Sequence[int] | None
    ) -> None:
        """Copies a step's per-row values to the buffers its sampling graph reads, for
        every row a graph may hold (beyond the step's own: greedy, top-p 1, no penalty,
        unseeded, counted in the scratch row): ``rows``' floats, and where a graph reads
        them (``keys`` given: every row's on CUDA, else the seeded rows'; or the step
        adjusted) ``keys`` (None: 0) and each row's row of the output counts
        (``count_rows``; None: none penalized). Queued on the device where it is called:
        before the step's own graphs, where the caller can (``StepSampler.prepare``)."""
        n, every = len(rows.params), self.floats.shape[1]
        if keys is None and not rows.adjusted:
            self._stage(every, rows.floats[:2])
            return
        if keys is None:
            keys = mask = np.zeros(n, dtype=np.int64)
        else:
            mask = rows.seeded_rows
        count_rows = count_rows if count_rows is not None else [self.counts.scratch] * n
        self._stage(every, rows.floats, (keys, mask, count_rows))

    def sample(self, padded: int, rows: StepRows) -> Any:
        """The tokens of the first ``len(rows.params)`` rows of the last decode step,
        replayed at ``padded`` rows, from the values ``stage`` copied for ``rows`` (a
        view of the graph's output, valid until the next replay of any graph in the
        pool, whose buffers may share its memory); None if no graph was captured for
        ``padded``. Takes the tokens eager ``sample`` takes with ``cut`` = whether a
        sampled row's top_p is below 1."""
        entry = self.graphs.get(self._key(padded, False, rows.cut, False))
        if entry is None:
            return None
        entry[0].replay()
        return entry[1][: len(rows.params)]

    def greedy(self, padded: int, n: int) -> Any:
        """The argmax of the first ``n`` rows of the last decode step, replayed at
        ``padded`` rows (``sample``'s view); None without a greedy graph of that size."""
        entry = self.graphs.get((padded, *GREEDY))
        if entry is None:
            return None
        entry[0].replay()
        return entry[1][:n]

    def sample_adjusted(self, padded: int, rows: StepRows) -> Any:
        """``sample`` for a step with a logit bias, a penalty or a seeded row: the tokens
        eager sampling takes with ``adjust.eager_adjusted``'s (the rows of the output
        counts that ``stage`` copied count the tokens drawn), the seeded rows drawing
        from the keys ``stage`` copied."""
        cut = None if rows.all_greedy else rows.cut
        seeded = not rows.all_greedy and rows.seeded
        entry = self.graphs.get(self._key(padded, True, cut, seeded))
        if entry is None:
            return None
        n = len(rows.params)
        # The biases of a request never change, so a step with the same rows' biases as
        # the last (the same pairs, which compare by identity first) finds them written.
        key = (padded, rows.bias)
        if key != self.bias_key:
            self.bias[:padded].zero_()
            add_bias(self.bias[:n], rows.params)
            self.bias_key = key
        entry[0].replay()
        return entry[1][:n]

    def _key(self, padded: int, adjusted: bool, cut: bool | None, seeded: bool) -> Key:
        """The graph that samples such a step (on CUDA one serves top-p and seeds or not)."""
        if self.keyed and cut is not None:
            return (padded, adjusted, True, False)
        return (padded, adjusted, cut, seeded)

    def _stage(
        self,
        padded: int,
        floats: Sequence[Sequence[float]] | np.ndarray,
        ints: tuple[Sequence[int] | np.ndarray, ...] | None = None,
    ) -> None:
        """Writes the step's per-row values (``floats``: temperatures, top-p, then the
        penalties; ``ints``: seed keys, seeded flags and rows of the output counts) into
        the device buffers through the next pinned staging; padding rows greedy, top-p
        1, no penalty, unseeded, counted in the scratch row."""
        n = len(floats[0])
        staging, (host_f, host_i) = self.stagings[self.turn], self.hosts[self.turn]
        self.turn ^= 1
        host_f[:, :padded] = 0.0
        host_f[1, :padded] = 1.0
        host_f[: len(floats), :n] = floats
        if ints is not None:
            host_i[:2, :padded] = 0
            host_i[2, :padded] = self.counts.scratch
            host_i[0, :n], host_i[1, :n], host_i[2, :n] = ints
        # One copy of the whole buffer (each copy waits 2-5 µs on the device after the
        # last; a slice of every row would be strided, through a pageable temporary that
        # waits for the device). Without ``ints`` only the floats: the step's graph reads
        # no int, and the device's may be newer than this staging's.
        span = staging if ints is not None else staging[: self.floats.numel() * 4]
        self.values[: span.numel()].copy_(span, non_blocking=True)
