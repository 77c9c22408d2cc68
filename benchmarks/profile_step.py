"""One decode step (the default variant) replayed from its graph between ``cudaProfilerStart`` and
``cudaProfilerStop``, for a kernel profiler that records only that window (Nsight
Compute with ``--profile-from-start off``, which profiles a graph's kernels one by one):

    ncu --profile-from-start off --csv --section SpeedOfLight --section WarpStateStats \\
        python -m benchmarks.profile_step --config benchmarks/configs/smollm2_135m.json

The model has random weights; the step is ``benchmarks.decode``'s "ostinato
FULL_AND_PIECEWISE" (default kernel options, KV length 512).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.decode import OSTINATO_VARIANTS, BenchConfig, DecodeSetup, model_config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, help="a HF config.json (default: the 1.5 B shape)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1, help="replays inside the window")
    args = parser.parse_args()
    model = model_config(str(args.config) if args.config else "llama-1.5b")
    cfg = BenchConfig(model=model, batch_sizes=(args.batch,))
    setup = DecodeSetup(cfg, torch.device("cuda"), None)
    runner = setup.runner(*OSTINATO_VARIANTS["ostinato FULL_AND_PIECEWISE"])
    with torch.inference_mode():
        runner.capture()
        step = setup.decode_step(runner, args.batch)
        step()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    runner.release()
    print(f"profiled {args.steps} step(s) of {args.batch} row(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
