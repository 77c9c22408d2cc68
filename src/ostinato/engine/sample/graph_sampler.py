"""Temperature / top-p sampling of a uniform decode step inside graphs.

The uniform decode graphs end in the LM head and the argmax, so a greedy step is one
replay. A step that samples needs softmax, a sort over the vocabulary and random
draws, which would double a greedy step's cost if every decode graph held them; so each
decode size gets a second, small graph that reads the decode graph's static logits and
per-row temperature and top-p buffers and writes the sampled tokens. A sampled step is
then two replays and no eager kernel: no launch per op, no host work between them.

The random draws come from the engine's generator, registered with each graph (CUDA's
graph-safe RNG): every replay advances the generator as an eager call of the same size
would. So a step whose requests fill its captured size exactly takes the very tokens an
eager ``sample`` takes from the same generator state (GPU-tested). In a padded step the
padding rows draw random numbers too. On CUDA that leaves the real rows' draws alone
while the generator's per-call advance is the same at both sizes (Philox numbers are
indexed by element position; measured: 3 rows padded to 4 drew what eager drew at 3), but
at sizes where the advance differs, later steps draw other numbers; on the CPU the
generator draws in sequence and the padding always shifts them. Either way the tokens
follow the same distribution as eager sampling's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ostinato.engine.sample.sampler import sample, top_p_cut
from ostinato.platform.base import Platform


class GraphSampler:
    """One sampling graph per uniform decode size, captured into the shared pool.

    ``logits(n)``: the first ``n`` rows of the decode graphs' static logits
    (``[n, vocab]``, fixed address per ``n``). Guarantees: ``sample`` returns None for a
    size it has no graph for (the caller samples eagerly); the generator's state after
    ``capture`` is what it was before; at a captured size the tokens equal eager
    ``sample``'s from the same generator state.
    """

    def __init__(
        self,
        platform: Platform,
        pool: Any,
        generator: torch.Generator,
        logits: Callable[[int], torch.Tensor],
        max_rows: int,
        device: torch.device,
    ) -> None:
        self.platform, self.pool, self.generator, self.logits = platform, pool, generator, logits
        self.temperatures = torch.zeros(max_rows, dtype=torch.float32, device=device)  # [R]
        self.top_ps = torch.ones(max_rows, dtype=torch.float32, device=device)  # [R]
        # Pinned staging, two sets used in turn (as ``StepInputs`` does: under
        # asynchronous scheduling the host fills one while the other's copy may still be
        # queued); row 0 temperatures, row 1 top-p; padding rows: greedy, top-p 1.
        pin = device.type == "cuda"
        self.stagings = [
            torch.zeros((2, max_rows), dtype=torch.float32, pin_memory=pin) for _ in range(2)
        ]
        self.hosts = [t.numpy() for t in self.stagings]  # views, made once
        self.turn = 0
        # (size, cut) -> (graph, tokens [size]); cut: with the top-p sort (``sample``)
        self.graphs: dict[tuple[int, bool], tuple[Any, torch.Tensor]] = {}

    def _sample(self, n: int, cut: bool) -> torch.Tensor:
        temperatures, top_ps = self.temperatures[:n], self.top_ps[:n]
        return sample(self.logits(n), temperatures, top_ps, self.generator, False, cut=cut)

    @torch.inference_mode()
    def capture(self, sizes: list[int]) -> None:
        """Captures two graphs for each of ``sizes`` (the decode graphs' padded sizes),
        one with the top-p sort and one without (for steps whose every top_p is 1: the
        sort is most of a sampling graph's time), after the decode graphs (their logits
        buffer must exist)."""
        state = self.generator.get_state()
        for n in sizes:
            for cut in (True, False):
                self._sample(n, cut)  # warm-up: lazy initialisation stays out of the graph
                self.platform.synchronize()
                graph = self.platform.new_graph()
                register = getattr(graph, "register_generator_state", None)
                if register is not None and self.generator.device.type == "cuda":
                    register(self.generator)
                with self.platform.capture(graph, self.pool):
                    tokens = self._sample(n, cut)
                self.graphs[n, cut] = (graph, tokens)
        self.generator.set_state(state)

    def sample(self, padded: int, temperatures: list[float], top_ps: list[float]) -> Any:
        """The tokens of the first ``len(temperatures)`` rows of the last decode step,
        replayed at ``padded`` rows (a view of the graph's output, valid until the
        graph's next replay); None if no graph was captured for ``padded``. Takes the
        tokens eager ``sample`` takes with ``cut`` = whether a sampled row's top_p is
        below 1."""
        entry = self.graphs.get((padded, top_p_cut(temperatures, top_ps)))
        if entry is None:
            return None
        graph, tokens = entry
        n = len(temperatures)
        staging, host = self.stagings[self.turn], self.hosts[self.turn]
        self.turn ^= 1
        host[0, :n] = temperatures
        host[1, :n] = top_ps
        host[0, n:padded] = 0.0
        host[1, n:padded] = 1.0
        self.temperatures[:padded].copy_(staging[0, :padded], non_blocking=True)
        self.top_ps[:padded].copy_(staging[1, :padded], non_blocking=True)
        graph.replay()
        return tokens[:n]
