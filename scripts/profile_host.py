"""Where host time goes in one eager and one PIECEWISE decode step (cProfile), on CUDA."""

import cProfile
import pstats
import sys

import torch

from benchmarks.decode import BenchConfig, DecodeSetup
from ostinato.engine.model.presets import shape
from ostinato.modes import GraphMode

cfg = BenchConfig(model=shape("tiny"), batch_sizes=(1,))
setup = DecodeSetup(cfg, torch.device("cuda"))
for mode, compiler in ((GraphMode.NONE, None), (GraphMode.PIECEWISE, "inductor")):
    runner = setup.runner(mode, compiler)
    with torch.inference_mode():
        runner.capture()
        step = setup.decode_step(runner, 1)
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            step()
        torch.cuda.synchronize()
        prof.disable()
    print(f"===== {mode.name}: per step (50 steps) =====")
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(18)
