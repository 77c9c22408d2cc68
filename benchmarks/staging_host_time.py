"""Host time of staging one decode step (``StepInputs.write``) on the CPU, at B = 1, 8,
32 and 128 requests of 17 KV blocks each: the best of 5 bursts of 300 writes.

    PYTHONPATH=src python -m benchmarks.staging_host_time
"""

from __future__ import annotations

import time

import torch

from ostinato.engine import SamplingParams
from ostinato.engine.core.limits import EngineLimits
from ostinato.engine.core.scheduler import Request, ScheduledBatch, ScheduledRequest
from ostinato.engine.worker.inputs import StepInputs


def main() -> None:
    limits = EngineLimits(
        max_num_seqs=128, max_num_batched_tokens=2048, max_model_len=272, block_size=16
    )
    for batch in (1, 8, 32, 128):
        inputs = StepInputs(limits, torch.device("cpu"))
        requests = [
            Request(
                i,
                [1] * 128,
                SamplingParams(),
                output=[5] * 100,
                blocks=list(range(1 + 17 * i, 18 + 17 * i)),
            )
            for i in range(batch)
        ]
        step = ScheduledBatch([ScheduledRequest(r, [7], 227) for r in requests])
        for _ in range(50):
            inputs.write(step, batch)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(300):
                inputs.write(step, batch)
            best = min(best, (time.perf_counter() - start) / 300 * 1e6)
        print(f"B={batch:4d} write {best:7.1f} us")


if __name__ == "__main__":
    main()
