"""The garbage collector's pauses during another benchmark: runs ``python -m
benchmarks.gc_pauses [--over MS] MODULE [ARGS...]`` as ``python -m MODULE ARGS...`` and prints
every collection that took longer than ``--over`` ms (default 3): when (the clock the engine's
log lines use), the generation, the ms, the thread that paid it and the objects it freed. A
collection holds the GIL, so one on any thread is a gap between the steps of a step loop."""

from __future__ import annotations

import argparse
import atexit
import datetime
import gc
import runpy
import sys
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Pause:
    at: str
    generation: int
    ms: float
    thread: str
    collected: int  # objects freed (a long young collection: their finalizers' time)


def watch(over_ms: float) -> list[Pause]:
    """Starts recording collections over ``over_ms`` into the list returned."""
    started: dict[int, float] = {}
    pauses: list[Pause] = []

    def timed(phase: str, info: dict) -> None:
        me = threading.get_ident()
        if phase == "start":
            started[me] = time.perf_counter()
            return
        ms = 1e3 * (time.perf_counter() - started.pop(me, time.perf_counter()))
        if ms > over_ms:
            at = datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]
            thread = threading.current_thread().name
            pauses.append(Pause(at, info["generation"], round(ms, 2), thread, info["collected"]))

    gc.callbacks.append(timed)
    return pauses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gc_pauses", description=__doc__)
    parser.add_argument("--over", type=float, default=3.0, help="ms (default 3)")
    parser.add_argument("module", help="the module to run, as python -m runs it")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = parser.parse_args(argv)
    pauses = watch(a.over)
    atexit.register(lambda: print(f"gc pauses over {a.over:g} ms:", *pauses, sep="\n  "))
    sys.argv = [a.module, *a.args]
    runpy.run_module(a.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
