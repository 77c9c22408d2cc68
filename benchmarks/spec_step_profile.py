"""Where a speculative step's time goes, against a plain decode step.

For plain decoding and the oracle proposer (k drafts, all accepted) at batch size B, one
``generate`` of ``new_tokens`` tokens after a warm-up, with every step's phases timed:
the host's scheduling (drafts included), ``execute`` (staging and launch), the wait for the
sampled tokens, acceptance and bookkeeping, and the device time of the step's forward pass
(CUDA events around the graph replay). Random weights of SmolLM2-135M's shape unless
``--model`` names another.

    PYTHONPATH=src python -m benchmarks.spec_step_profile --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from wall_timers import WallTimers

from ostinato.engine import LLM, SamplingParams
from ostinato.engine.spec.speculative import SpeculativeConfig
from ostinato.provenance import Provenance

SMOLLM2_SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}


@dataclass
class PhaseRow:
    """Median microseconds per step of each phase, and the step's wall time."""

    system: str
    dtype: str
    batch: int
    steps: int
    tokens_per_s: float
    wall_us_per_step: float
    phases_us: dict[str, float] = field(default_factory=dict)
    ahead_steps: int = 0


class Timers(WallTimers):
    """Wall seconds of wrapped calls (``spans``), and device time of wrapped forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def wrap_device(self, obj: object, attr: str) -> None:
        inner = getattr(obj, attr)

        def timed(*a, **kw):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = inner(*a, **kw)
            end.record()
            self.events.append((start, end))
            return out

        setattr(obj, attr, timed)


def profile(model, dtype, batch, spec, ahead, new_tokens, device):
    kw = dict(mode="auto", device=device, dtype=dtype, max_num_seqs=max(batch, 1), progress=False)
    llm = LLM(model, speculative=spec, async_scheduling=ahead, **kw)
    prompts = [[1 + (i * 7 + j) % 400 for j in range(64)] for i in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up
    timers = Timers()
    ahead = llm.verify_ahead_loop
    timers.wrap(llm.engine.scheduler, "schedule", "schedule")
    timers.wrap(llm.engine.scheduler, "schedule_ahead", "schedule_ahead")
    timers.wrap(llm.engine.scheduler, "resolve", "resolve")
    timers.wrap(llm.engine.runner, "execute", "execute")
    if ahead is not None:
        timers.wrap(ahead, "launch_verify", "launch_verify (execute inside)")
        timers.wrap(ahead, "settle", "settle (wait inside)")
    timers.wrap(llm.engine.loop, "wait_copy", "wait for tokens")
    timers.wrap(llm.engine.sampler, "verify", "verify (waits)")
    cuda = device == "cuda"
    if cuda:
        timers.wrap_device(llm.engine.runner, "run_logits")
        torch.cuda.synchronize()
    ahead_before = llm.spec_stats.ahead_steps
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    steps = len(timers.spans["execute"])
    phases = {k: statistics.median(v) * 1e6 for k, v in timers.spans.items()}
    if cuda:
        torch.cuda.synchronize()
        fwd = [s.elapsed_time(e) * 1e3 for s, e in timers.events]
        phases["device forward (median)"] = statistics.median(fwd)
    produced = sum(len(o.token_ids) for o in outs)
    name = "plain" if spec is None else f"oracle k={spec.k}" + (" ahead" if ahead else " in turn")
    row = PhaseRow(
        name,
        dtype,
        batch,
        steps,
        produced / seconds,
        seconds * 1e6 / steps,
        phases,
        ahead_steps=llm.spec_stats.ahead_steps - ahead_before,
    )
    llm.close()
    return outs, row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from ostinato.engine.model.config import ModelConfig

    model = args.model or ModelConfig.from_hf(SMOLLM2_SHAPE)
    rows = []
    for dtype in args.dtypes.split(","):
        for b in map(int, args.batch_sizes.split(",")):
            outs, row = profile(model, dtype, b, None, True, args.new_tokens, args.device)
            print(json.dumps(asdict(row)), flush=True)
            rows.append(row)
            known = {tuple(o.prompt_token_ids): o.token_ids for o in outs}
            spec = SpeculativeConfig("oracle", args.k, oracle=known)
            for ahead in (True, False):
                _, srow = profile(model, dtype, b, spec, ahead, args.new_tokens, args.device)
                rows.append(srow)
                print(json.dumps(asdict(srow)), flush=True)
                ratio = srow.tokens_per_s / row.tokens_per_s
                print(f"{srow.system} {dtype} B={b}: {ratio:.2f}x plain", flush=True)
    if args.out:
        out = {
            "benchmark": "spec_step_profile",
            "provenance": asdict(Provenance.collect()),
            "rows": [asdict(r) for r in rows],
        }
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
