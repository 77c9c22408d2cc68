"""Wall time of a slice of the CPU test suite with 1 and 2 torch threads, on an idle
machine and beside busy processes (one pure-Python spinner per core): what the suite's
and the CPU engine's thread choice is for. Writes JSON.

    python -m benchmarks.suite_threads --out benchmarks/results/threads_cpu/suite_threads.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ostinato.provenance import Provenance

TESTS = ["tests/test_engine.py", "tests/test_async_scheduling.py"]


@dataclass
class Run:
    threads: int
    busy_processes: int
    seconds: float
    passed: bool


def _spin(stop: float) -> None:
    while time.time() < stop:
        pass


def _run(threads: int, busy: int, limit_s: float) -> Run:
    spinners = [mp.Process(target=_spin, args=(time.time() + limit_s,)) for _ in range(busy)]
    for s in spinners:
        s.start()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
            env=env,
            capture_output=True,
            timeout=limit_s,
        )
        passed = done.returncode == 0
    except subprocess.TimeoutExpired:
        passed = False
    seconds = time.perf_counter() - start
    for s in spinners:
        s.terminate()
        s.join()
    return Run(threads, busy, seconds, passed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--limit-s", type=float, default=600.0, help="per run")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    runs = []
    for busy in (0, cores):
        for threads in (1, cores):
            run = _run(threads, busy, args.limit_s)
            print(run, flush=True)
            runs.append(asdict(run))
    doc = {"provenance": asdict(Provenance.collect()), "cores": cores, "tests": TESTS, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
