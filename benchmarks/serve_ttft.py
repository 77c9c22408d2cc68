"""Where a lone request's time to first token goes, layer by layer, measured in one run:

    python -m benchmarks.serve_ttft --out OUT/ttft.json [--model llama-1.5b --random-weights]

The same prompt (``--prompt-len`` random ids) through, in turn:

1. ``offline``: ``LLM.generate`` for one token;
2. ``engine_loop``: an ``EngineLoop`` on that engine, in this process (submit, then the
   handle's first token);
3. ``engine_process``: an ``EngineProcess`` (the engine in a child process, as
   ``ostinato serve`` runs it);
4. ``http_raw`` and ``http_openai``: ``ostinato serve`` as a process, a streamed
   completion read as raw server-sent events (httpx) and through the official ``openai``
   client, from sending the request to the first event with a token.

Each is the median of ``--repeats`` requests, one at a time, on an otherwise idle
engine; the differences between rows are what each layer adds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.ready import ready
from benchmarks.serve_load import MODEL_NAME, Server, engine_args, fixed_jobs


def median_ms(run_once: Callable[[list[int]], None], prompts: list[list[int]]) -> float:
    times = []
    for prompt in prompts:
        start = time.perf_counter()
        run_once(prompt)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])  # the first pays for anything lazy


def first_of(handle: Any) -> None:
    for _ in handle:
        break
    for _ in handle:  # drain (the request ends itself: max_tokens)
        pass


def engine_rows(kwargs: dict[str, Any], prompts: list[list[int]]) -> dict[str, float]:
    from ostinato.engine import LLM, EngineLoop, EngineProcess, SamplingParams

    one, two = SamplingParams(max_tokens=1, ignore_eos=True), SamplingParams(max_tokens=2)
    llm = ready(LLM(**kwargs))
    rows = {"offline": median_ms(lambda p: llm.generate([p], one), prompts)}
    loop = EngineLoop(llm)
    rows["engine_loop"] = median_ms(lambda p: first_of(loop.submit(p, two)), prompts)
    loop.stop()
    llm.close()
    process = EngineProcess(kwargs, describe=False)
    rows["engine_process"] = median_ms(lambda p: first_of(process.submit(p, two)), prompts)
    process.stop()
    return rows


async def _raw(client: Any, base: str, prompt: list[int]) -> None:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "stream": True}
    async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                return


async def _openai(client: Any, prompt: list[int]) -> None:
    stream = await client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0, stream=True
    )
    async for _ in stream:
        break
    await stream.close()


def http_rows(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float]:
    import httpx
    import openai

    server = Server(engine_args(args), args.out.with_suffix(".server.log"))
    try:
        client = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key="none", max_retries=0)

        async def timed(call: Callable[[list[int]], Any]) -> float:
            times = []
            for prompt in prompts:
                start = time.perf_counter()
                await call(prompt)
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times[1:])

        async def both() -> dict[str, float]:
            async with httpx.AsyncClient() as raw_client:
                raw = await timed(lambda p: _raw(raw_client, server.base, p))
            return {"http_raw": raw, "http_openai": await timed(lambda p: _openai(client, p))}

        return asyncio.run(both())
    finally:
        server.stop()


def main() -> None:
    from ostinato.provenance import Provenance

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--vocab-cap", type=int, default=30000, help="prompt ids below this")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    jobs = fixed_jobs(args.repeats, args.prompt_len, 1, args.vocab_cap, seed=5)
    prompts = [j.prompt for j in jobs]
    kwargs = dict(
        model=args.model,
        random_weights=args.random_weights,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        progress=False,
    )
    rows = {**engine_rows(kwargs, prompts), **http_rows(args, prompts)}
    report = {
        "provenance": asdict(Provenance.collect()),
        "model": args.model or "smollm2-135m",
        "args": {k: str(v) for k, v in vars(args).items()},
        "median_ms": rows,
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
