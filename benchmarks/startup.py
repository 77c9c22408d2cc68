"""Start-up from a fresh process to the printed answer: ``ostinato generate`` with every
cache empty and then filled, the default (FULL graphs captured in the background), a
blocking capture, FULL_AND_PIECEWISE and staged capture, for the default model
(SmolLM2-135M-Instruct, GGUF) and the 1.5 B shape; ``ostinato serve`` of each to its
first completion; and transformers loading the same GGUF file and generating, the peer
a user would otherwise run.

    python -m benchmarks.startup --out OUT/startup.json [--device cuda] [--max-tokens 32]

Each run is a new Python process whose caches live in one folder per scenario
(``OSTINATO_CACHE_DIR``; Inductor's and Triton's caches go under it), its bytecode too
(``PYTHONPYCACHEPREFIX``: written, as on a user's machine), except in the runs named
"no bytecode" (``PYTHONDONTWRITEBYTECODE=1``, as on a host that sets it). That folder
starts empty, so a run with every cache empty also compiles the bytecode of torch,
transformers and the standard library; the runs named "bytecode as installed" find
them compiled first (``compile_installed``), as ``pip install`` leaves a user's machine.
Times are wall seconds read by this parent: ``first_token_s`` when the first streamed token text
appeared on the child's stdout, ``answer_s`` when its throughput line did, ``exit_s``
when it ended (``ostinato serve``'s runs: its first streamed completion, ``served``);
``phases`` is the start-up line the engine printed (open, weights, compile, capture).
``--rounds R`` runs the scenarios R times in turn (the later rounds leave out the
empty-cache ones and name theirs "#2", "#3", ...): the machine's noise shows beside the
differences.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ostinato.provenance import Provenance

QUESTION = "What is the capital of France?"
_PHASES = re.compile(r"start-up ([\d.]+) s \(([^)]*)\)")


@dataclass
class Run:
    """One fresh process: what it was, and when each thing appeared (seconds)."""

    name: str
    command: list[str]
    first_token_s: float | None = None
    answer_s: float | None = None
    exit_s: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    returncode: int = 0
    tail: str = ""


def _phases(line: str) -> dict[str, float]:
    m = _PHASES.search(line)
    if not m:
        return {}
    found = {"total": float(m.group(1))}
    for part in re.split(r"[,;] ", m.group(2)):
        *name, value = part.split() or [""]
        if name:  # "open 0.4" -> open; "kernel plans 19.0" -> kernel_plans
            try:
                found["_".join(name)] = float(value)
            except ValueError:
                pass
    return found


def run_environment(cache: Path, bytecode: Path | None) -> dict[str, str]:
    """This process's environment for a run whose caches all live in ``cache`` (Inductor's
    and Triton's under it: their own variables dropped) and whose bytecode is written to
    ``bytecode`` (None: none written, as on a host that sets ``PYTHONDONTWRITEBYTECODE``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR",
                                                          "TRITON_CACHE_DIR")}  # fmt: skip
    env |= {"OSTINATO_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPYCACHEPREFIX", None)
    if bytecode is None:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    else:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(bytecode)
    return env


def timed(
    name: str,
    command: list[str],
    env: dict[str, str],
    timeout_s: float,
    stop_at_answer: bool = False,
) -> Run:
    """Runs ``command`` and stamps its output as it arrives (raw reads: a streamed answer
    is printed token by token, without newlines). ``stop_at_answer``: the process (and
    its children) killed once the answer is out, what a first start does after it (the
    kernel plans' measurement at close) not waited for; its exit status is then 0."""
    run = Run(name, command)
    start = time.perf_counter()
    proc = subprocess.Popen(  # (a session of its own where its children are to be killed)
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=stop_at_answer,
    )
    assert proc.stdout is not None
    text = ""
    while chunk := os.read(proc.stdout.fileno(), 65536):
        now = time.perf_counter() - start
        text += chunk.decode(errors="replace")
        head, sep, after = text.partition("\n")
        while head.startswith(("model: ", "  downgraded")) and sep:
            if head.startswith("model: "):
                run.phases = _phases(head)
            head, sep, after = after.partition("\n")
        answered = "model: " in text and (head.strip() or after.strip())
        if run.first_token_s is None and (answered or "FIRST_TOKEN" in text):
            run.first_token_s = now
        if run.answer_s is None and re.search(r" tokens in .* tokens/s", text):
            run.answer_s = now
            if stop_at_answer:
                os.killpg(proc.pid, signal.SIGKILL)
                break
    run.returncode = proc.wait(timeout=timeout_s)
    if stop_at_answer and run.answer_s is not None:
        run.returncode = 0
    run.exit_s = time.perf_counter() - start
    run.tail = "\n".join(text.splitlines()[-6:])
    print(f"{name}: first token {run.first_token_s}, answer {run.answer_s}, exit "
          f"{run.exit_s:.1f} s, {run.phases}", flush=True)  # fmt: skip
    return run


PEER = """
import time, sys
start = time.perf_counter()
import torch, transformers
from ostinato.engine.model.presets import smollm2_path
path = smollm2_path()
tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
model = transformers.AutoModelForCausalLM.from_pretrained(
    str(path.parent), gguf_file=path.name, dtype=torch.float32).to(sys.argv[1]).eval()
loaded = time.perf_counter() - start
ids = tok.apply_chat_template([{"role": "user", "content": sys.argv[2]}],
    add_generation_prompt=True, return_tensors="pt")
ids = getattr(ids, "input_ids", ids).to(sys.argv[1])
out = model.generate(ids, max_new_tokens=int(sys.argv[3]), do_sample=False)
print("FIRST_TOKEN (after generate)")
print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
print(f"loaded in {loaded:.1f} s; {out.shape[1] - ids.shape[1]} tokens in x s: x tokens/s")
"""


INSTALLED = "bytecode as installed"
# What the engine's processes import beside the standard library: pip compiles each
# package's bytecode when it installs it.
PACKAGES = (
    "ostinato", "torch", "transformers", "triton", "tokenizers", "safetensors", "gguf",
    "jinja2", "numpy", "tqdm", "huggingface_hub", "sympy", "networkx", "filelock", "fsspec",
    "yaml", "regex", "packaging", "requests", "typing_extensions", "fastapi", "starlette",
    "pydantic", "uvicorn", "httpx", "markupsafe",
)  # fmt: skip


def compile_installed(env: dict[str, str]) -> float:
    """Compiles the standard library and ``PACKAGES`` (those found) into the bytecode
    folder ``env`` names, as a ``pip install`` leaves them; seconds (not part of a run)."""
    import importlib.util
    import sysconfig

    folders = [sysconfig.get_paths()["stdlib"]]
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            folders.extend(spec.submodule_search_locations)
        elif spec is not None and spec.origin:
            folders.append(spec.origin)
    start = time.perf_counter()
    command = [sys.executable, "-m", "compileall", "-q", "-j", "0", *folders]
    subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


FAP = "full_and_piecewise"  # (the default before FULL measured faster)
PORT = "{port}"  # a serve scenario's port, chosen when it runs


def served(
    name: str, command: list[str], env: dict[str, str], timeout_s: float, tokens: int
) -> Run:
    """``ostinato serve`` from exec to its first completion (``tokens`` tokens of a
    4-token prompt, streamed, greedy), asked as soon as its port answers ``/v1/models``
    (retried every 50 ms until then): ``first_token_s`` when the first chunk arrived,
    ``answer_s`` when the completion ended; then stopped with SIGINT (``exit_s``: when it
    had exited)."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [str(port) if part == PORT else part for part in command]
    run, base = Run(name, command), f"http://127.0.0.1:{port}/v1"
    log = tempfile.TemporaryFile()
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    model = _first_model(base, proc, start + timeout_s)
    # Token ids, as the 1.5 B preset's generate runs use (its random model has no
    # tokenizer); EOS ignored, so every run streams ``tokens`` tokens.
    body = {"model": model, "prompt": [1, 2, 3, 4], "max_tokens": tokens, "temperature": 0}
    body |= {"ignore_eos": True}
    with httpx.stream("POST", f"{base}/completions", json=body | {"stream": True}) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line and run.first_token_s is None:
                run.first_token_s = time.perf_counter() - start
    run.answer_s = time.perf_counter() - start
    proc.send_signal(signal.SIGINT)
    run.returncode = proc.wait(timeout=timeout_s)
    run.exit_s = time.perf_counter() - start
    log.seek(0)
    text = log.read().decode(errors="replace")
    run.phases = next((_phases(line) for line in text.splitlines() if "start-up" in line), {})
    run.tail = "\n".join(text.splitlines()[-6:])
    print(f"{name}: first token {run.first_token_s}, answer {run.answer_s}, exit "
          f"{run.exit_s:.1f} s, {run.phases}", flush=True)  # fmt: skip
    return run


def _first_model(base: str, proc: subprocess.Popen, deadline: float) -> str:
    """The first model ``base`` serves, once it answers (``RuntimeError`` if the server
    exits or ``deadline`` passes first)."""
    import httpx

    while time.perf_counter() < deadline and proc.poll() is None:
        try:
            return httpx.get(f"{base}/models", timeout=5).json()["data"][0]["id"]
        except httpx.TransportError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"the server never answered (exit status {proc.poll()})")


def scenarios(args: argparse.Namespace) -> list[tuple[str, list[str], str]]:
    """(name, command, cache folder key): runs sharing a key share a cache folder, in
    order, so the first fills what the later ones read."""
    gen = [sys.executable, "-m", "ostinato.engine", "generate", "--quiet"]
    common = ["--device", args.device, "--max-tokens", str(args.max_tokens)]
    smol = [*gen, "--prompt", QUESTION, *common]
    big = [*gen, "--model", "llama-1.5b", "--prompt-ids", "1,2,3,4", "--ignore-eos", *common]
    serve = [sys.executable, "-m", "ostinato.engine", "serve", "--quiet", "--device", args.device]
    serve += ["--port", PORT]
    return [
        ("smollm2 default, caches empty", smol, "smol"),
        (f"smollm2 default, caches empty, {INSTALLED}", smol, "smol-installed"),
        ("smollm2 default, caches filled", smol, "smol"),
        ("smollm2 blocking, caches filled", [*smol, "--capture", "blocking"], "smol"),
        ("smollm2 blocking, caches empty", [*smol, "--capture", "blocking"], "smol-block"),
        ("smollm2 serve default, caches filled", serve, "smol"),
        ("smollm2 staged, caches filled", [*smol, "--capture", "staged"], "smol"),
        ("smollm2 full_and_piecewise, caches filled", [*smol, "--mode", FAP], "smol"),
        ("smollm2 default, caches filled, no bytecode", smol, "smol"),
        ("smollm2 staged, caches filled, no bytecode", [*smol, "--capture", "staged"], "smol"),
        ("llama-1.5b default, caches empty", big, "big"),
        (f"llama-1.5b default, caches empty, {INSTALLED}", big, "big-installed"),
        ("llama-1.5b default, caches filled", big, "big"),
        ("llama-1.5b blocking, caches filled", [*big, "--capture", "blocking"], "big"),
        ("llama-1.5b serve default, caches filled", [*serve, "--model", "llama-1.5b"], "big"),
        ("llama-1.5b staged, caches filled", [*big, "--capture", "staged"], "big"),
        ("llama-1.5b full_and_piecewise, caches filled", [*big, "--mode", FAP], "big"),
        ("llama-1.5b default, caches filled, no bytecode", big, "big"),
        *[
            (
                f"transformers from_pretrained + generate (same GGUF), bytecode cache {state}",
                [sys.executable, "-c", PEER, args.device, QUESTION, str(args.max_tokens)],
                "peer",
            )
            for state in ("empty", "filled")
        ],
    ]


def with_fills(
    chosen: list[tuple[str, list[str], str]], every: list[tuple[str, list[str], str]]
) -> list[tuple[str, list[str], str]]:
    """``chosen`` with, before a run on filled caches whose folder no earlier chosen run
    fills, the run that fills it in ``every`` (its key's first, on empty caches): else a
    fresh folder's first "filled" run would start with every cache empty."""
    out: list[tuple[str, list[str], str]] = []
    for run in chosen:
        if "filled" in run[0] and all(key != run[2] for _, _, key in out):
            out.append(next(s for s in every if s[2] == run[2]))
        out.append(run)
    return out


def planned(args: argparse.Namespace) -> list[tuple[str, list[str], str]]:
    """The scenarios ``--only`` names and ``--skip`` does not, each filled-cache run
    after one that fills its folder (``with_fills``, unless ``--root`` names a folder),
    ``--rounds`` times over (the later rounds without the empty-cache ones, each name
    marked with its round)."""
    parts, every = args.only, scenarios(args)
    chosen = [s for s in every if parts is None or any(p in s[0] for p in parts)]
    chosen = [s for s in chosen if not any(p in s[0] for p in args.skip)]
    if args.root is None:
        chosen = with_fills(chosen, every)
    later = [s for s in chosen if " empty" not in s[0]]  # (caches, or the peer's bytecode)
    again = [(f"{n} #{r}", c, k) for r in range(2, args.rounds + 1) for n, c, k in later]
    return chosen + again


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--only",
        action="append",
        default=None,
        help="run the scenarios whose name contains this text (repeatable; names hold commas)",
    )
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        help="leave out the scenarios whose name contains this text (repeatable; after --only)",
    )
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="the scenarios' cache folders (default: a new temporary folder); a later run "
        "given the same folder finds the caches an earlier one filled (to compare trees: "
        "PYTHONPATH names the tree whose engine the runs start)",
    )
    args = parser.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="ostinato-startup-"))
    runs = []
    for name, command, key in planned(args):
        bytecode = None if "no bytecode" in name else root / key / "bytecode"
        env = run_environment(root / key, bytecode)
        if INSTALLED in name:
            compiled = compile_installed(env)
            print(f"{name}: bytecode compiled in {compiled:.1f} s first", flush=True)
        if PORT in command:
            runs.append(served(name, command, env, args.timeout, args.max_tokens))
        else:
            runs.append(timed(name, command, env, args.timeout))
    doc = {"provenance": asdict(Provenance.collect()), "runs": [asdict(r) for r in runs]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
