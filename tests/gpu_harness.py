"""The engine harness shared by the GPU tests: the tiny engine, its prompts, and a
lock-step driver that runs an eager and a graphed engine on the same schedule; and the
reference of the small GEMM's row statistics, as the kernels lay them out."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from ostinato.engine import LLM, SamplingParams

PROMPTS = [[1 + i, 2 + 3 * i, 3, 4 + i * i % 97] * (1 + i % 3) for i in range(8)]


def tiny_engine(mode: str, dtype: torch.dtype, **kw) -> LLM:
    """The tiny random Llama (seed 3, so every engine has the same weights), its graphs
    captured before the first step (``capture="auto"`` would capture FULL graphs in the
    background, so which steps replay would hang on timing)."""
    base = dict(max_model_len=256, max_num_seqs=8, progress=False, seed=3, capture="blocking")
    return LLM("tiny", mode=mode, dtype=dtype, **{**base, **kw})


def pin_fused_layers(monkeypatch) -> None:
    """The graphs' layer plan fused at every size, PDL where the kernels ask. The plan is
    a timing (``worker.layer_tuning``): a size where the unfused layers measure faster
    runs them, whose bf16 rounding and kernels differ from the fused layers' eager steps."""
    from ostinato.engine.worker import kernel_plan

    def fused_everywhere(model, *args, **kwargs):
        model.unfused_rows = model.no_pdl_rows = frozenset()  # (PDL as the kernels ask)
        return []

    monkeypatch.setattr(kernel_plan, "plan_layers", fused_everywhere)


def greedy_tokens(llm: LLM, max_tokens: int = 32) -> list[list[int]]:
    """Greedy token ids for ``PROMPTS``."""
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [o.token_ids for o in outs]


def lockstep(eager: LLM, graphs: LLM, tolerance: float, seed: int = 11) -> set[str]:
    """Queues the same 12 random requests on both engines and steps them together,
    asserting each step's logits agree within ``tolerance`` (relative norm); both take
    eager's greedy tokens. Returns the runtime modes the graphed engine dispatched."""
    for llm in (eager, graphs):
        r = random.Random(seed)
        for _ in range(12):
            llm.engine.scheduler.add(
                [r.randrange(1, 1000) for _ in range(r.randint(1, 40))],
                SamplingParams(max_tokens=r.randint(1, 20), ignore_eos=True),
            )
    modes_seen: set[str] = set()
    steps = 0
    while eager.has_work:
        se, sg = eager.engine.scheduler.schedule(), graphs.engine.scheduler.schedule()
        assert [s.request.id for s in se.scheduled] == [s.request.id for s in sg.scheduled]
        dispatch = graphs.engine.runner.graphs.dispatch(sg.num_tokens, sg.uniform_decode)
        modes_seen.add(dispatch.mode.name)
        le, lg = (
            eager.engine.runner.execute(se).logits.float(),
            graphs.engine.runner.execute(sg).logits.float(),
        )
        err = ((lg - le).norm() / le.norm()).item()
        assert err < tolerance, (dispatch, err)
        tokens = le.argmax(-1).tolist()
        eager.engine.scheduler.update(se, tokens)
        graphs.engine.scheduler.update(sg, tokens)
        steps += 1
    assert steps > 10
    return modes_seen


def row_stats_of(h: torch.Tensor) -> torch.Tensor:
    """The row statistics of ``h`` (``[m, n]``): per row and ``stats_granule(m)``
    columns, the float32 sum of squares (``[m, stats_columns(n, m)]``)."""
    from ostinato.engine.kernels.gemm_launch import stats_columns, stats_granule

    m, n = h.shape
    g = stats_granule(m)
    padded = F.pad(h.float(), (0, stats_columns(n, m) * g - n))
    return padded.square().view(m, -1, g).sum(-1)


def stats_rows(stats: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """The ``m`` rows of statistics of ``n`` columns in a ``[MAX_ROWS, stats_columns(n)]``
    buffer, as the kernels lay them out (row after row)."""
    from ostinato.engine.kernels.gemm_launch import stats_columns

    t = stats_columns(n, m)
    return stats.view(-1)[: m * t].view(m, t)
