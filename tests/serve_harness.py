"""`ostinato serve` as a real process for the serving tests: started on a free port of
127.0.0.1, waited for until ``/health`` answers, stopped with Ctrl-C; and the readings
of its ``/metrics`` the tests assert on."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(args: list[str], ready_within_s: float = 240.0) -> Iterator[str]:
    """``ostinato serve ARGS`` running; yields its base URL (``http://127.0.0.1:PORT``).
    Fails the test with the server's output if it exits or never answers."""
    with serving_process(args, ready_within_s) as (_, base):
        yield base


@contextmanager
def serving_process(
    args: list[str], ready_within_s: float = 240.0
) -> Iterator[tuple[subprocess.Popen, str]]:
    """``served``, yielding the process too (stopped with Ctrl-C after, if still alive)."""
    port = free_port()
    command = [sys.executable, "-m", "ostinato.engine", "serve", "--port", str(port), *args]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + ready_within_s
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited: {proc.stdout.read()}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail(f"the server did not answer /health in {ready_within_s:.0f} s")
    failed = False
    try:
        yield proc, base
    except BaseException:
        failed = True
        raise
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if failed and not proc.stdout.closed:  # (pytest shows it with the failure)
            print(f"the server's output:\n{proc.stdout.read()}")


def metric(server: str, name: str) -> float:
    """The value of series ``name`` (with its labels, if any) in ``/metrics``."""
    for line in httpx.get(f"{server}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def metric_sum(server: str, prefix: str) -> float:
    """The sum of every series whose name (labels included) starts with ``prefix``."""
    lines = httpx.get(f"{server}/metrics").text.splitlines()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith(prefix))


def wait_for_abort(server: str, before: float) -> None:
    """Waits until one more request was aborted than ``before`` and none runs."""
    deadline = time.time() + 30
    while time.time() < deadline:
        aborted = metric(server, "ostinato_aborted_requests_total")
        if aborted == before + 1 and metric(server, "ostinato_running_requests") == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"aborted {aborted}, expected {before + 1}")


def all_blocks_free(server: str) -> bool:
    health = httpx.get(f"{server}/health").json()
    return health["free_kv_blocks"] == health["kv_blocks"] - 1  # (block 0 is the null block)


def served_token_ids(args: list[str], prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy token ids from ``ostinato serve ARGS``, asked all at once by
    the ``openai`` client (a stream per prompt, each from a thread of its own, so they
    share steps); the server is stopped afterwards."""
    import openai

    with served(args) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        got: dict[int, list[int]] = {}

        def ask(i: int) -> None:
            stream = client.completions.create(
                model=model, prompt=prompts[i], max_tokens=max_tokens, temperature=0, stream=True
            )
            got[i] = [t for chunk in stream for t in chunk.choices[0].model_extra["token_ids"]]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert all(i in got for i in range(len(prompts))), "a stream did not finish"
        return [got[i] for i in range(len(prompts))]


def graphs_ready(base: str, within_s: float = 120.0) -> bool:
    """Whether the server at ``base`` says its graphs are ready (``/health``: a
    background capture ended) within ``within_s`` seconds."""
    deadline = time.time() + within_s
    while httpx.get(f"{base}/health").json()["graphs"] != "ready":
        if time.time() > deadline:
            return False
        time.sleep(0.2)
    return True
