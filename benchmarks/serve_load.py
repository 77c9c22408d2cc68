"""Load on ``ostinato serve``: N concurrent streaming clients against the server, beside
offline ``LLM.generate`` at batch size N on the same model, measured in one run; then
requests arriving at fixed rates.

    python -m benchmarks.serve_load --out OUT/serve.json [--model llama-1.5b --random-weights]

Every phase reports the field's metrics (``summarize``): time to first token (TTFT), time
per output token after the first (TPOT, per request), inter-token latency (ITL, per
token), end-to-end latency (sent to last token), each as mean / p50 / p90 / p99 ms, and
request and output-token throughput over the phase's wall time.

For each N of ``--clients`` two closed-loop phases run against one server process:

- ``fixed``: N clients each send ``--requests-per-client`` requests one after the other,
  every prompt ``--prompt-len`` random tokens and every output ``--output-len`` tokens
  (``ignore_eos``). Offline, the same requests run as waves of N through ``generate``.
  The throughput ratio (server over offline) is the headline, over the whole phase and
  over its steady window (``steady_ratio``: from the last client's first token to the
  first client's last, when all N clients are busy; the whole phase also holds the
  ramp-down, when the clients that drifted behind finish with fewer beside them).
- ``mixed``: 3N requests of random prompt (16..512) and output (16..256) lengths with
  real stops; one in ten clients hangs up after a few tokens. Time to first token and
  inter-token latency percentiles come from here (a chunk of k tokens arriving ``g``
  seconds after the last counts k gaps of ``g / k``).

Then for each rate of ``--request-rates`` (requests per second; ``inf``: all at once) an
open-loop phase, ``rate``: ``--rate-requests`` requests of random prompt and output
lengths sent at the times of a seeded Poisson process, whether or not earlier ones have
finished, as a service's users arrive.

Clients run in several processes (``--client-procs``) so that parsing the streams does not
become the bottleneck being measured; each row records how busy the busiest one was
(``client_busy``, CPU seconds per second: near 1.0 it was the bottleneck). They read the
streams with httpx and parse each event's JSON, as the field's load generators do: the
official ``openai`` client (which the tests drive the server with) spent about 15 times
``json.loads``'s time on each event, making its typed object (``results/serve_host_h200/
client_parse_cpu.txt``), and at 64 streams on the H200 host its busiest process was 0.78
busy. Every
completed response is compared with the offline greedy output of its prompt (a hung-up one
with its prefix), after each N every KV block must be free again (``/health``), and
``/metrics``' graph counters are recorded, with the HTTP process's CPU seconds per second
(``server_cpu``: near 1.0 its event loop set the pace) and the server's own split of the
time to first tokens (``first_token_split_ms``: arrival to the engine's accepting the request,
the engine's queue and prefill; the client's TTFT beyond the server's is the HTTP
connection's and the client's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.ready import ready

MODEL_NAME = "served"
# What a phase reads of ``/metrics``: the engine's series, the HTTP process's CPU seconds
# and its collector's runs.
SERIES = ("ostinato_", "process_cpu_seconds_total", "python_gc_collections_total")


@dataclass
class Job:
    """One request: prompt ids, output length, and when (after how many chunks) its
    client hangs up (None: it reads to the end)."""

    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    hang_up_after: int | None = None


@dataclass
class Reply:
    """What one client saw of one request (monotonic seconds, comparable across
    processes)."""

    job: int
    client: int = 0  # which closed-loop client sent it (unique across processes)
    tokens: list[int] = field(default_factory=list)
    sent: float = 0.0
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens)
    finish: str | None = None
    hung_up: bool = False
    error: str | None = None


def fixed_jobs(n: int, prompt_len: int, output_len: int, vocab: int, seed: int) -> list[Job]:
    rng = random.Random(seed)
    return [
        Job([rng.randrange(10, vocab) for _ in range(prompt_len)], output_len, True)
        for _ in range(n)
    ]


def mixed_jobs(n: int, vocab: int, seed: int, hang_ups: bool = True) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(16, 512))]
        hang_up = rng.randint(1, 8) if hang_ups and i % 10 == 9 else None
        jobs.append(Job(prompt, rng.randint(16, 256), False, hang_up))
    return jobs


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the phase starts at which each of ``n`` requests is sent: a Poisson
    process of ``rate`` requests per second (every one at 0 for an infinite rate)."""
    if math.isinf(rate):
        return [0.0] * n
    rng, at, times = random.Random(seed), 0.0, []
    for _ in range(n):
        times.append(at)
        at += rng.expovariate(rate)
    return times


@dataclass
class Phase:
    """One phase against the server: ``clients`` closed-loop clients (each sends its next
    request when the last has ended), or with ``rate`` set, requests sent open-loop at
    that many per second."""

    name: str
    jobs: list[Job]
    clients: int = 0
    rate: float | None = None

    @property
    def label(self) -> str:
        return f"{self.name}@{self.clients}" if self.rate is None else f"rate@{self.rate:g}"


async def _one(client: Any, who: int, index: int, job: Job) -> Reply:
    reply = Reply(index, who, sent=time.monotonic())
    body = {
        "model": MODEL_NAME,
        "prompt": job.prompt,
        "max_tokens": job.max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": job.ignore_eos,
    }
    try:
        async with client.stream("POST", "completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:300]
                reply.error = f"HTTP {response.status_code}: {text}"
                return reply
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue  # (the blank lines between events)
                if line == "data: [DONE]":
                    continue  # (read on to the response's end: the connection is kept)
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    reply.error = f"stream error: {chunk['error']}"
                    break
                choice = chunk["choices"][0]
                ids = choice.get("token_ids") or []
                if ids:
                    reply.chunks.append((time.monotonic(), len(ids)))
                    reply.tokens += ids
                reply.finish = choice.get("finish_reason") or reply.finish
                if job.hang_up_after is not None and len(reply.chunks) >= job.hang_up_after:
                    reply.hung_up = True
                    break  # (leaving the stream closes the connection: a hang-up)
    except Exception as exc:  # recorded: the run reports failed requests, never hides them
        reply.error = f"{type(exc).__name__}: {exc}"
    return reply


Queue = list[tuple[int, Job]]  # (index in the phase, job): one client's requests in order
Timed = list[tuple[float, int, Job]]  # (seconds after the start, index in the phase, job)


async def _clients(base: str, queues: dict[int, Queue]) -> list[Reply]:
    """One closed-loop client per queue (keyed by client id), all at once."""
    client = _http_client(base)

    async def one_client(who: int, queue: Queue) -> list[Reply]:
        return [await _one(client, who, index, job) for index, job in queue]

    done = await asyncio.gather(*(one_client(w, q) for w, q in queues.items()))
    await client.aclose()
    return [r for replies in done for r in replies]


async def _open_loop(base: str, timed: Timed) -> list[Reply]:
    """Each request sent at its time, whatever the others are doing (its own client id:
    its index)."""
    client = _http_client(base)
    start = time.monotonic()

    async def fire(at: float, index: int, job: Job) -> Reply:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        return await _one(client, index, index, job)

    replies = await asyncio.gather(*(fire(*t) for t in timed))
    await client.aclose()
    return list(replies)


def _http_client(base: str) -> Any:
    """One process's connection pool to the server (``base``: its ``/v1/`` URL), as
    many connections as its streams want."""
    import httpx

    unbounded = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=base.rstrip("/") + "/", timeout=600, limits=unbounded)


def _client_process(
    base: str,
    queues: dict[int, Queue] | None,
    timed: Timed | None,
    ready: Any,
    out: Any,
    cpus: frozenset[int] | None,
) -> None:
    import httpx  # noqa: F401  (imported before the clock starts)

    if cpus:
        os.sched_setaffinity(0, cpus)

    ready.wait()  # every client process is up: they start together
    wall, cpu = time.perf_counter(), time.process_time()
    work = _clients(base, queues) if queues is not None else _open_loop(base, timed or [])
    replies = asyncio.run(work)
    busy = (time.process_time() - cpu) / (time.perf_counter() - wall)
    out.put((replies, busy))


@dataclass
class Load:
    """What the clients saw, and how busy the busiest client process was (CPU seconds
    per second: near 1.0, the clients themselves were the bottleneck)."""

    replies: list[Reply]
    client_busy: float


def run_load(
    base: str, jobs: list[Job], n_clients: int, procs: int, cpus: frozenset[int] | None = None
) -> Load:
    """``n_clients`` closed-loop clients over ``jobs`` (client c sends jobs c, c + N,
    c + 2N, ... one after the other), spread over ``procs`` processes that start
    together (on ``cpus`` where given)."""
    procs = max(1, min(procs, n_clients))
    queues = {c: list(enumerate(jobs))[c::n_clients] for c in range(n_clients)}
    work = [({c: q for c, q in queues.items() if c % procs == p}, None) for p in range(procs)]
    return _in_processes(base, work, cpus)


def run_rate(
    base: str,
    jobs: list[Job],
    rate: float,
    procs: int,
    seed: int,
    cpus: frozenset[int] | None = None,
) -> Load:
    """``jobs`` sent open-loop at ``rate`` per second (``arrivals``), spread round-robin
    over ``procs`` processes that start together (on ``cpus`` where given)."""
    procs = max(1, min(procs, len(jobs)))
    times = arrivals(len(jobs), rate, seed)
    timed = [(at, i, job) for i, (at, job) in enumerate(zip(times, jobs, strict=True))]
    return _in_processes(base, [(None, timed[p::procs]) for p in range(procs)], cpus)


def _in_processes(
    base: str,
    work: list[tuple[dict[int, Queue] | None, Timed | None]],
    cpus: frozenset[int] | None,
) -> Load:
    ctx = mp.get_context("spawn")
    ready, out = ctx.Barrier(len(work)), ctx.Queue()
    children = [
        ctx.Process(target=_client_process, args=(base, queues, timed, ready, out, cpus))
        for queues, timed in work
    ]
    for c in children:
        c.start()
    results = [out.get() for _ in children]
    for c in children:
        c.join()
    replies = sorted((r for rs, _ in results for r in rs), key=lambda r: r.job)
    return Load(replies, max(busy for _, busy in results))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def steady_window(replies: list[Reply]) -> tuple[float, float] | None:
    """The span in which every client was busy: from the last client's first token to
    the first client's last token (None if some client never overlapped the others)."""
    by_client: dict[int, list[Reply]] = {}
    for r in replies:
        if r.chunks:
            by_client.setdefault(r.client, []).append(r)
    if not by_client:
        return None
    start = max(min(r.chunks[0][0] for r in rs) for rs in by_client.values())
    end = min(max(r.chunks[-1][0] for r in rs) for rs in by_client.values())
    return (start, end) if end > start else None


def turnaround_ms(replies: list[Reply]) -> list[float]:
    """Per client, from the last token of one response to sending the next request."""
    gaps, by_client = [], {}
    for r in sorted(replies, key=lambda r: r.sent):
        last = by_client.get(r.client)
        if last is not None and last.chunks:
            gaps.append((r.sent - last.chunks[-1][0]) * 1e3)
        by_client[r.client] = r
    return gaps


def distribution(values: list[float]) -> dict[str, float | None]:
    """Mean and p50 / p90 / p99 of ``values`` (None each where there are none)."""
    mean = sum(values) / len(values) if values else None
    return {"mean": mean, **{f"p{q}": percentile(values, q / 100) for q in (50, 90, 99)}}


def summarize(replies: list[Reply], closed_loop: bool = True) -> dict[str, Any]:
    """The field's metrics over one phase: request and output-token throughput over its
    wall time (closed loop: also over its steady window, every client busy), and TTFT,
    TPOT (per completed request: after its first token, ms per token), ITL (per token)
    and end-to-end latency (sent to last token, completed requests) in ms, and each
    client's turnaround."""
    done = [r for r in replies if r.chunks]
    completed = [r for r in done if not r.hung_up and not r.error]
    wall = max(r.chunks[-1][0] for r in done) - min(r.sent for r in replies) if done else 0.0
    tokens = sum(len(r.tokens) for r in replies)
    ttft = [(r.chunks[0][0] - r.sent) * 1e3 for r in done]
    tpot = [
        (r.chunks[-1][0] - r.chunks[0][0]) * 1e3 / (len(r.tokens) - r.chunks[0][1])
        for r in completed
        if len(r.tokens) > r.chunks[0][1]
    ]
    itl = []
    for r in done:
        for (t0, _), (t1, k) in zip(r.chunks, r.chunks[1:], strict=False):
            itl += [(t1 - t0) * 1e3 / k] * k
    gaps = turnaround_ms(replies) if closed_loop else []
    return {
        "requests": len(replies),
        "completed": len(completed),
        "errors": sum(1 for r in replies if r.error),
        "hung_up": sum(1 for r in replies if r.hung_up),
        "tokens": tokens,
        "wall_s": wall,
        "output_throughput": tokens / wall if wall else 0.0,  # tokens/s
        "request_throughput": len(completed) / wall if wall else 0.0,  # requests/s
        "ttft_ms": distribution(ttft),
        "tpot_ms": distribution(tpot),
        "itl_ms": distribution(itl),
        "e2e_latency_ms": distribution([(r.chunks[-1][0] - r.sent) * 1e3 for r in completed]),
        "tokens_per_chunk": tokens / max(1, sum(len(r.chunks) for r in done)),
        "steady": _steady(replies) if closed_loop else None,
        "turnaround_ms": distribution(gaps),
    }


def _steady(replies: list[Reply]) -> dict[str, float] | None:
    window = steady_window(replies)
    if window is None:
        return None
    start, end = window
    tokens = sum(k for r in replies for t, k in r.chunks if start < t <= end)
    return {"seconds": end - start, "tokens": tokens, "output_throughput": tokens / (end - start)}


def cpu_set(text: str) -> frozenset[int] | None:
    """The CPUs of a list such as ``0-3,8`` (taskset's form); None for an empty one."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"a CPU list such as 0-3,8: got {text!r}")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus) or None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``ostinato serve`` as a child process on 127.0.0.1."""

    def __init__(
        self, engine_args: list[str], log: Path, cpus: frozenset[int] | None = None
    ) -> None:
        """``cpus``: the server's (and so its engine process's) CPUs, where given."""
        import httpx

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "ostinato.engine", "serve", "--port", str(self.port)]
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            command + engine_args,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=os.environ,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        self.started = time.monotonic()
        while self.proc.poll() is None:
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        if self.proc.poll() is not None:
            raise RuntimeError(f"the server exited; see {log}")
        self.ready_s = time.monotonic() - self.started  # answering (graphs may be capturing)
        while self.health()["graphs"] != "ready":  # timed phases replay, as offline does
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited; see {log}")
            time.sleep(0.2)

    def health(self) -> dict[str, Any]:
        import httpx

        return httpx.get(f"{self.base}/health").json()

    def blocks_free(self, timeout_s: float = 20.0) -> bool:
        """Whether every KV block is free again within ``timeout_s`` (aborts of hung-up
        requests land at the next step boundary)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            h = self.health()
            if h["free_kv_blocks"] == h["kv_blocks"] - 1:
                return True
            time.sleep(0.2)
        return False

    def metrics(self) -> dict[str, float]:
        import httpx

        found = {}
        for line in httpx.get(f"{self.base}/metrics").text.splitlines():
            if line.startswith(SERIES) and " " in line:
                name, value = line.rsplit(" ", 1)
                found[name] = float(value)
        return found

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def memory_share(args: argparse.Namespace) -> dict[str, float]:
    """The engines' ``gpu_memory_utilization`` where their KV cache is sized from free
    device memory (CUDA); on the CPU the engine refuses it, so nothing."""
    import torch

    cuda = torch.cuda.is_available()
    return {"gpu_memory_utilization": args.gpu_memory_utilization} if cuda else {}


def capture_sizes(args: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    """The offline engine's ``capture_sizes`` where the benchmark names them (as the
    server's ``--capture-sizes``), else nothing: the default ladder."""
    if not args.capture_sizes:
        return {}
    return {"capture_sizes": tuple(int(n) for n in args.capture_sizes.split(","))}


def engine_args(args: argparse.Namespace) -> list[str]:
    """``ostinato serve``'s engine options from a benchmark's own: model, random
    weights, max model length, memory share and capture sizes."""
    engine = ["--max-model-len", str(args.max_model_len), "--quiet"]
    engine += ["--served-model-name", MODEL_NAME]  # what the requests name
    if memory_share(args):
        engine += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.model:
        engine += ["--model", args.model]
    if args.random_weights:
        engine.append("--random-weights")
    if args.capture_sizes:
        engine += ["--capture-sizes", args.capture_sizes]
    return engine


def counter_delta(before: dict[str, float], after: dict[str, float], prefix: str) -> float:
    """How much every series named ``prefix...`` (labels included) grew between two
    scrapes (``Server.metrics``)."""
    return sum(v - before.get(k, 0.0) for k, v in after.items() if k.startswith(prefix))


def graph_counters(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Steps from graphs and eagerly, padded versus real rows, the engine's steps,
    tokens, seconds in steps and seconds handing tokens on, and the HTTP process's CPU
    seconds and full collections, during a phase."""

    def delta(prefix: str) -> float:
        return counter_delta(before, after, prefix)

    real, padded = delta("ostinato_graph_real_rows_total"), delta("ostinato_graph_padded_rows")
    return {
        "graph_steps": delta("ostinato_graph_replays_total"),
        "eager_steps": delta("ostinato_eager_steps_total"),
        "padding_fraction": 1 - real / padded if padded else 0.0,
        "engine_steps": delta("ostinato_engine_steps_total"),
        "engine_tokens": delta("ostinato_engine_tokens_total"),
        "engine_busy_s": delta("ostinato_engine_busy_seconds_total"),
        "engine_publish_s": delta("ostinato_engine_publish_seconds_total"),
        "server_cpu_s": delta("process_cpu_seconds_total"),
        "server_full_collections": delta('python_gc_collections_total{generation="2"}'),
    }


def offline(llm: Any, jobs: list[Job], batch: int) -> tuple[list[list[int]], float]:
    """Greedy outputs of ``jobs`` through ``generate`` in waves of ``batch``; seconds."""
    from ostinato.engine import SamplingParams

    outputs, seconds = [], 0.0
    for i in range(0, len(jobs), batch):
        wave = jobs[i : i + batch]
        params = [SamplingParams(max_tokens=j.max_tokens, ignore_eos=j.ignore_eos) for j in wave]
        start = time.perf_counter()
        outs = llm.generate([j.prompt for j in wave], params)
        seconds += time.perf_counter() - start
        outputs += [o.token_ids for o in outs]
    return outputs, seconds


def first_token_ms(llm: Any, prompt_len: int, vocab: int, repeats: int = 10) -> float:
    """Median milliseconds of one offline request of ``prompt_len`` random ids for one
    token: the engine's share of a lone client's time to first token."""
    from ostinato.engine import SamplingParams

    times = []
    for job in fixed_jobs(repeats, prompt_len, 1, vocab, seed=7):
        start = time.perf_counter()
        llm.generate([job.prompt], SamplingParams(max_tokens=1, ignore_eos=True))
        times.append((time.perf_counter() - start) * 1e3)
    return percentile(times, 0.5) or 0.0


def compare(replies: list[Reply], want: list[list[int]]) -> dict[str, int]:
    """Completed responses equal to the offline greedy output; hung-up ones a prefix."""
    exact = prefix = differ = 0
    for r in replies:
        w = want[r.job]
        if r.error:
            continue
        if r.hung_up:
            prefix += r.tokens == w[: len(r.tokens)]
            differ += r.tokens != w[: len(r.tokens)]
        else:
            exact += r.tokens == w
            differ += r.tokens != w
    return {"completed_equal": exact, "hung_up_prefix_equal": prefix, "differ": differ}


def run_server_phases(
    args: argparse.Namespace, plan: list[Phase], log: Path
) -> tuple[list[dict[str, Any]], float]:
    """Every phase against one server, in order; the replies and counters of each."""
    engine = ["--max-num-seqs", str(max_num_seqs(plan)), *engine_args(args)]
    server = Server(engine, log, cpu_set(args.server_cpus))
    clients = cpu_set(args.client_cpus)
    results: list[dict[str, Any]] = []
    base = f"{server.base}/v1"
    try:
        warm = fixed_jobs(8, 32, 16, args.vocab_cap, seed=99)
        run_load(base, warm, 8, 1)  # first requests pay for lazy imports
        for i, phase in enumerate(plan):
            before = server.metrics()
            if phase.rate is None:
                load = run_load(base, phase.jobs, phase.clients, args.client_procs, clients)
            else:
                load = run_rate(base, phase.jobs, phase.rate, args.client_procs, i, clients)
            free = server.blocks_free()
            after = server.metrics()
            counters = graph_counters(before, after) | first_token_split(before, after)
            results.append(
                {"replies": load.replies, "client_busy": load.client_busy, "blocks_free": free}
                | counters
            )
            seen = summarize(load.replies, phase.rate is None)
            print(
                f"{phase.label}: {seen['output_throughput']:.0f} tok/s, "
                f"{seen['request_throughput']:.2f} req/s, {seen['errors']} errors"
            )
    finally:
        server.stop()
    return results, server.ready_s


def first_token_split(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The server's mean time to first tokens in a phase and where it went, in ms per
    request (``/metrics``' histograms): ``accept`` (arrival to the engine's accepting it),
    the engine's ``queue`` and ``prefill``; None where no request counted."""
    split: dict[str, float | None] = {}
    for part, name in (
        ("server_ttft", "time_to_first_token"),
        ("accept", "request_accept"),
        ("queue", "request_queue"),
        ("prefill", "request_prefill"),
    ):
        seconds, n = (
            counter_delta(before, after, f"ostinato_{name}_seconds_{k}") for k in ("sum", "count")
        )
        split[part] = 1e3 * seconds / n if n else None
    return {"first_token_split_ms": split}


def max_num_seqs(plan: list[Phase]) -> int:
    """The server's (and the offline engine's) sequences: the most clients of a phase."""
    return max([p.clients for p in plan] + [8])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--clients", default="1,8,32,64")
    # 16: at 64 clients the fixed phase runs ~4 s on an H200; with 4 it ran ~1 s, and its
    # ramp-up and ramp-down weighed on the ratio (0.755 against 0.828 in one call).
    parser.add_argument("--requests-per-client", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="CUDA only")
    parser.add_argument(
        "--client-procs",
        type=int,
        default=max(1, min(12, (os.cpu_count() or 1) - 4)),
        help="processes the clients run in (default: the cores but 4, at most 12)",
    )
    # On one host the clients' processes and the server's share the cores; these keep them
    # apart (taskset's lists, e.g. 0-3 and 4-15), as clients on other hosts would be.
    parser.add_argument("--server-cpus", default="", help="the server's CPUs (default: any)")
    parser.add_argument("--client-cpus", default="", help="the clients' CPUs (default: any)")
    parser.add_argument("--vocab-cap", type=int, default=30000, help="prompt ids below this")
    parser.add_argument(
        "--request-rates", default="4,16,64", help="open-loop phases: requests per second (inf)"
    )
    parser.add_argument("--rate-requests", type=int, default=128)
    parser.add_argument(
        "--capture-sizes",
        default="",
        help="both engines' capture sizes, e.g. 1,2,4 (default: the ladder)",
    )
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plan = plan_of(args)
    served, ready_s = run_server_phases(args, plan, args.out.with_suffix(".server.log"))
    report = offline_and_report(args, plan, served)
    report["server_ready_s"] = ready_s
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report["summary"], indent=2))


def plan_of(args: argparse.Namespace) -> list[Phase]:
    """The phases: for each N of ``--clients`` the fixed and mixed closed-loop ones, then
    one open-loop phase per rate of ``--request-rates`` (none for an empty list)."""
    plan = []
    for n in (int(c) for c in args.clients.split(",")):
        per = n * args.requests_per_client
        jobs = fixed_jobs(per, args.prompt_len, args.output_len, args.vocab_cap, n)
        plan.append(Phase("fixed", jobs, clients=n))
        plan.append(Phase("mixed", mixed_jobs(max(8, 3 * n), args.vocab_cap, 1000 + n), n))
    for i, rate in enumerate(float(r) for r in args.request_rates.split(",") if r.strip()):
        jobs = mixed_jobs(args.rate_requests, args.vocab_cap, 2000 + i, hang_ups=False)
        plan.append(Phase("rate", jobs, rate=rate))
    return plan


def _row(llm: Any, phase: Phase, got: dict[str, Any], batch: int) -> dict[str, Any]:
    """One phase's row: the server's metrics, its outputs against offline greedy ones
    and, closed loop, its throughput over offline ``generate`` in waves of N."""
    closed = phase.rate is None
    want, _ = offline(llm, phase.jobs, phase.clients if closed else batch)  # the reference
    server = summarize(got["replies"], closed)
    ratio = steady_ratio = offline_rate = None
    if closed:  # the timing: the requests the server completed, as waves of N
        kept = [i for i, r in enumerate(got["replies"]) if not r.hung_up]
        _, seconds = offline(llm, [phase.jobs[i] for i in kept], phase.clients)
        offline_rate = sum(len(want[i]) for i in kept) / seconds
        ratio = server["output_throughput"] / offline_rate
        if server["steady"]:
            steady_ratio = server["steady"]["output_throughput"] / offline_rate
    counters = ("client_busy", "graph_steps", "eager_steps", "padding_fraction")
    counters += ("first_token_split_ms", "server_full_collections")
    engine = {k: got[k] for k in got if k.startswith("engine_")}
    if engine.get("engine_steps"):  # how the phase's wall time went in the engine
        wall = server["wall_s"]
        engine["engine_busy"] = engine["engine_busy_s"] / wall
        engine["engine_publish"] = engine["engine_publish_s"] / wall
        engine["tokens_per_step"] = engine["engine_tokens"] / engine["engine_steps"]
        # The HTTP process's CPU seconds per second (its reader thread included): near
        # 1.0 its event loop, not the engine, set the pace.
        engine["server_cpu"] = got["server_cpu_s"] / wall
    return {
        "phase": phase.name,
        "clients": phase.clients if closed else None,
        "rate": phase.rate,
        "server": server,
        "offline_output_throughput": offline_rate,
        "ratio": ratio,
        "steady_ratio": steady_ratio,
        "correctness": compare(got["replies"], want),
        "blocks_free_after": got["blocks_free"],
        **{k: got[k] for k in counters},
        **engine,
    }


def _split_line(row: dict[str, Any]) -> str:
    """A phase's wait for first tokens in one line: the clients' mean TTFT, the server's
    and its parts (``first_token_split_ms``), and the HTTP process's CPU per second."""
    split = row["first_token_split_ms"]
    parts = " ".join(f"{k} {v:.1f}" if v is not None else f"{k} -" for k, v in split.items())
    cpu = row.get("server_cpu")
    busy = f", server_cpu {cpu:.2f}" if cpu is not None else ""
    return f"clients {row['server']['ttft_ms']['mean']:.1f}: {parts}{busy}"


def offline_and_report(
    args: argparse.Namespace, plan: list[Phase], served: list[dict[str, Any]]
) -> dict[str, Any]:
    """Runs every phase offline (closed loop: waves of N) in this process and puts both
    side by side; an open-loop phase's offline run is its correctness reference only."""
    from ostinato.engine import LLM
    from ostinato.provenance import Provenance

    llm = LLM(
        args.model,
        random_weights=args.random_weights,
        max_num_seqs=max_num_seqs(plan),
        max_model_len=args.max_model_len,
        progress=False,
        **memory_share(args),
        **capture_sizes(args),
    )
    ready(llm)
    offline(llm, fixed_jobs(8, 32, 16, args.vocab_cap, seed=99), 8)  # warm-up
    first_ms = first_token_ms(llm, args.prompt_len, args.vocab_cap)
    rows, summary = [], {}
    for phase, got in zip(plan, served, strict=True):
        row = _row(llm, phase, got, max_num_seqs(plan))
        rows.append(row)
        if row["ratio"] is not None:
            summary[phase.label] = round(row["ratio"], 3)
        if row["steady_ratio"] is not None:
            summary[f"{phase.label} steady"] = round(row["steady_ratio"], 3)
        if phase.rate is not None:
            summary[f"{phase.label} ttft p50 ms"] = row["server"]["ttft_ms"]["p50"]
        summary[f"{phase.label} first tokens ms"] = _split_line(row)
    llm.close()
    return {
        "provenance": asdict(Provenance.collect()),
        "model": args.model or "smollm2-135m",
        "random_weights": args.random_weights,
        "args": {k: str(v) for k, v in vars(args).items()},
        "summary": summary,
        "offline_first_token_ms": first_ms,
        "rows": rows,
    }


if __name__ == "__main__":
    main()
