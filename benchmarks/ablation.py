"""What a part of the decode step costs, measured by deleting it: the most that fusing it
away or making it free could save. The step's outputs are then wrong (a deleted part
leaves its buffers unwritten); only its time is read. The parts:

- ``merge``: attention's split merge kernel (the partials stay unmerged);
- ``greedy``: the greedy argmax after the LM head (its tokens left unwritten);
- ``rope``: the step's cos and sin (left unwritten: the kernels that compute them from
  the positions are gone);
- ``final-norm``: the final RMSNorm before the LM head.

Each is A/B/A against the unchanged step in one run (``launch_rules.timings_under``).

``python -m benchmarks.ablation --out results.json [--parts merge,greedy]
[--shape llama-1.5b|smollm2] [--batch-sizes 1,8]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from unittest import mock

import torch

from benchmarks.decode import SMOLLM2_CONFIG, model_config
from benchmarks.launch_rules import timings_under
from ostinato.engine.kernels import paged_attention
from ostinato.engine.model import decoder
from ostinato.engine.worker import runner
from ostinato.provenance import Provenance


def _no_merge() -> contextlib.AbstractContextManager:
    return mock.patch.object(paged_attention, "_merge_splits", lambda *args: None)


def _no_greedy() -> contextlib.AbstractContextManager:
    def unwritten(logits: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        return torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)

    return mock.patch.object(runner, "greedy_tokens", unwritten)


def _no_rope() -> contextlib.AbstractContextManager:
    def rope(self: decoder.DecoderModel, positions: torch.Tensor, dtype: torch.dtype):
        shape = (positions.shape[0], 1, 2 * self.inv_freq.shape[0])
        empty = torch.empty(shape, dtype=dtype, device=positions.device)
        return empty, empty

    return mock.patch.object(decoder.DecoderModel, "rope", rope)


def _no_final_norm() -> contextlib.AbstractContextManager:
    def forward(self: decoder.DecoderModel, input_ids, positions, num_layers=None):
        x = self.embed(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        residual, stats = None, None
        for layer in self.layers[:num_layers]:
            x, residual, stats = layer(x, residual, cos, sin, stats)
        return x

    return mock.patch.object(decoder.DecoderModel, "forward", forward)


PARTS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "merge": _no_merge,
    "greedy": _no_greedy,
    "rope": _no_rope,
    "final-norm": _no_final_norm,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--shape", default="llama-1.5b")
    parser.add_argument("--parts", default=",".join(PARTS))
    args = parser.parse_args()
    sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; known: {sorted(PARTS)}")
    model = model_config(SMOLLM2_CONFIG if args.shape == "smollm2" else args.shape)
    doc = {"benchmark": "ablation", "shape": args.shape, "parts": parts}
    doc["provenance"] = asdict(Provenance.collect())
    doc["timings"] = []
    runs = [("whole step", contextlib.nullcontext)]
    runs += [(f"without {p}", PARTS[p]) for p in parts] + runs
    for name, settings in runs:
        for t in timings_under(model, sizes, name, settings()):
            doc["timings"].append(asdict(t))
            piped = t.pipelined_ms or float("nan")
            print(f"{name:24s} B={t.batch:3d} {t.step_ms:7.3f} ms (piped {piped:.3f})", flush=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")  # what a time limit leaves
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
