"""Decode steps of more than 16 rows with and without programmatic dependent launch for
ostinato's Triton kernels, one run: the default step (``launch.PDL_MAX_ROWS`` = 16, so
these steps launch without PDL) against the same step with the limit lifted, at the
SmolLM2 and 1.5 B shapes. The limit is set here between runs; nothing else differs.

``python -m benchmarks.pdl_rows --out results.json [--batch-sizes 32,128]``
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks import decode
from benchmarks.decode import SMOLLM2_CONFIG, model_config
from ostinato.engine.kernels import launch
from ostinato.provenance import Provenance

VARIANT = "ostinato FULL_AND_PIECEWISE"
UNLIMITED = 1 << 30


@dataclass(frozen=True)
class Timing:
    shape: str
    batch: int
    pdl_max_rows: int
    step_ms: float
    pipelined_ms: float | None


def timings(name: str, model: dict, sizes: tuple[int, ...], limit: int) -> list[Timing]:
    """The default variant's step at ``sizes`` with ``PDL_MAX_ROWS = limit``."""
    launch.PDL_MAX_ROWS = limit
    try:
        cfg = decode.BenchConfig(model=model, batch_sizes=sizes, variants=(VARIANT,))
        result = decode.run(cfg, torch.device("cuda"), log=lambda _: None, profile=False)
    finally:
        launch.PDL_MAX_ROWS = 16
    rows = [r for r in result.rows if r.variant == VARIANT]
    return [Timing(name, r.batch, limit, r.step_ms, r.pipelined_ms) for r in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch-sizes", default="32,128")
    args = parser.parse_args()
    sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    models = {"smollm2": SMOLLM2_CONFIG, "llama-1.5b": "llama-1.5b"}
    out: list[Timing] = []
    for name, model in models.items():
        for limit in (16, UNLIMITED, 16):  # A, B, A: drift shows as A against A
            for t in timings(name, model_config(model), sizes, limit):
                out.append(t)
                print(f"{t.shape:10s} B={t.batch:4d} PDL up to {min(limit, 10**6):7d} rows "
                      f"{t.step_ms:7.3f} ms (piped {t.pipelined_ms or float('nan'):.3f})",
                      flush=True)  # fmt: skip
    doc = {"benchmark": "pdl_rows", "provenance": asdict(Provenance.collect())}
    doc["timings"] = [asdict(t) for t in out]
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
