"""Where opening the default model goes on a model-cache hit or miss: ``open_model`` of
SmolLM2-135M-Instruct under cProfile in a fresh process, after timing ``import torch``
and CRC-32 (the entry's checksum) on this host.

    OSTINATO_CACHE_DIR=/tmp/c python -m benchmarks.open_profile --out OUT/open.txt

Run it twice with the same ``OSTINATO_CACHE_DIR``: the first run converts (a miss), the
second reads the entry (a hit). Writes the timings and the 40 functions with the most
cumulative time (cProfile slows Python-heavy work: read shares, not seconds).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time
import zlib
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    import torch  # noqa: F401 - timed

    lines = [f"import torch {time.perf_counter() - start:.2f} s"]
    from ostinato.engine.loading.model_cache import ModelCache
    from ostinato.engine.loading.source import open_model

    data = os.urandom(64 << 20)
    start = time.perf_counter()
    zlib.crc32(data)
    lines.append(f"crc32 {64 / (time.perf_counter() - start):.0f} MB/s")
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    open_model(None, cache=ModelCache.from_arg(None))
    profile.disable()
    lines.append(f"open_model {time.perf_counter() - start:.2f} s (under cProfile)")
    stats = io.StringIO()
    pstats.Stats(profile, stream=stats).sort_stats("cumulative").print_stats(40)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n\n" + stats.getvalue())
    print("\n".join(lines))


if __name__ == "__main__":
    main()
