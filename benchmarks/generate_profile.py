"""Where a ``generate`` token's time goes on the host: ``LLM.generate`` of one request at
random weights (SmolLM2's shape and the 1.5 B preset, bf16, FULL_AND_PIECEWISE), its ms
per token, a cProfile of one call (by cumulative and by own time) and a torch profiler
trace of a shorter one (CPU and CUDA, gzipped; the profiler slows the step, so read it for
order, not for time).

``python -m benchmarks.generate_profile --out DIR [--tokens 256]``
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import json
import pstats
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.decode import SMOLLM2_CONFIG, model_config
from ostinato.engine import LLM, SamplingParams
from ostinato.provenance import Provenance

PROMPT = [list(range(1, 21))]  # one request of 20 tokens


def generate_seconds(llm: LLM, prompt: list[int], tokens: int) -> float:
    """Wall seconds of one ``generate`` call of ``prompt`` for exactly ``tokens`` new
    tokens, the device idle before and after."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate([prompt], params)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def ms_per_token(llm: LLM, tokens: int) -> float:
    return generate_seconds(llm, PROMPT[0], tokens) / tokens * 1e3


def profile(name: str, tokens: int, out: Path) -> dict[str, object]:
    """Writes ``prof_NAME.txt`` and ``trace_NAME.json.gz``; returns ms per token (two
    calls after a warm-up)."""
    model = model_config(SMOLLM2_CONFIG if name == "smollm2" else name)
    llm = LLM(model, random_weights=True, dtype="bfloat16", device="cuda",
              mode="full_and_piecewise", progress=False)  # fmt: skip
    ms_per_token(llm, tokens)  # warm-up
    times = [ms_per_token(llm, tokens) for _ in range(2)]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(PROMPT, params)
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(70)
    stats.sort_stats("tottime").print_stats(40)
    (out / f"prof_{name}.txt").write_text(text.getvalue())
    cpu, cuda = torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA
    with torch.profiler.profile(activities=[cpu, cuda]) as trace:
        llm.generate(PROMPT, SamplingParams(max_tokens=32, ignore_eos=True))
    raw = out / f"trace_{name}.json"
    trace.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    del llm
    torch.cuda.empty_cache()
    return {"ms_per_token": min(times), "tokens_per_s": 1e3 / min(times)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": "generate_profile", "provenance": asdict(Provenance.collect())}
    for name in ("smollm2", "llama-1.5b"):
        doc[name] = profile(name, args.tokens, args.out)
        print(name, doc[name], flush=True)
    (args.out / "generate_profile_h200.json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
