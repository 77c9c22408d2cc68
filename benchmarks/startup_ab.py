"""Start-up of two source trees, alternating, in fresh processes on one machine: the
comparison a change to the start needs, since one host's speed drifts by seconds between
calls. Each run is ``ostinato generate`` of one model, timed from exec to the printed
answer (``benchmarks.startup.timed``), with the engine that ``PYTHONPATH`` names first.

    python -m benchmarks.startup_ab --out OUT.json --trees /tmp/base/src,src \\
        [--model smollm2|llama-1.5b|tiny] [--caches empty|filled] [--rounds 3]

``--caches empty``: every run gets a new cache folder (``OSTINATO_CACHE_DIR``: the model
cache, Triton's and Inductor's caches, the plans) and is ended once its answer is out;
``filled``: one folder per tree, filled by a first untimed run that goes to its exit.
Bytecode is written (``PYTHONPYCACHEPREFIX``, one folder for the run) and each tree's own
bytecode by an untimed first run, as on a user's machine after ``pip install``. Runs are
named "<model> <caches>, <tree>, round <r>"; the JSON is ``benchmarks.startup``'s layout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from benchmarks.startup import QUESTION, Run, run_environment, timed
from ostinato.provenance import Provenance


def command(model: str, device: str, max_tokens: int) -> list[str]:
    """The ``generate`` command of ``model`` (SmolLM2 answers a question, a shape preset
    random tokens from four ids)."""
    gen = [sys.executable, "-m", "ostinato.engine", "generate", "--quiet"]
    common = ["--device", device, "--max-tokens", str(max_tokens)]
    if model == "smollm2":
        return [*gen, "--prompt", QUESTION, *common]
    return [*gen, "--model", model, "--prompt-ids", "1,2,3,4", "--ignore-eos", *common]


def environment(tree: str, cache: Path, bytecode: Path) -> dict[str, str]:
    """``startup``'s run environment with ``tree`` first on the path."""
    env = run_environment(cache, bytecode)
    path = os.pathsep.join(p for p in (tree, os.getcwd(), env.get("PYTHONPATH")) if p)
    return env | {"PYTHONPATH": path}


def compare(args: argparse.Namespace, root: Path) -> list[Run]:
    """The timed runs: ``args.rounds`` rounds of every tree in turn, after the untimed
    ones (see the module docstring)."""
    cmd = command(args.model, args.device, args.max_tokens)
    empty = args.caches == "empty"
    folders = {tree: root / f"tree{i}" for i, tree in enumerate(args.trees)}

    def run(tree: str, name: str, cache: Path, stop: bool) -> Run:
        env = environment(tree, cache, root / "bytecode")
        return timed(name, cmd, env, args.timeout, stop_at_answer=stop)

    for tree, folder in folders.items():  # (bytecode; with filled caches, the caches too)
        run(tree, f"untimed first run, {tree}", folder, stop=empty)
    runs = []
    for r in range(1, args.rounds + 1):
        for tree, folder in folders.items():
            cache = Path(tempfile.mkdtemp(dir=root, prefix="empty-")) if empty else folder
            name = f"{args.model} {'every cache empty' if empty else 'caches filled'}"
            runs.append(run(tree, f"{name}, {tree}, round {r}", cache, stop=empty))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trees", required=True, help="two or more source folders, commas")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--caches", choices=("empty", "filled"), default="filled")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    args.trees = [t for t in args.trees.split(",") if t]
    if len(args.trees) < 2 or args.rounds < 1:
        parser.error("--trees: two or more folders; --rounds: at least 1")
    root = Path(tempfile.mkdtemp(prefix="ostinato-startup-ab-"))
    runs = compare(args, root)
    doc = {"provenance": asdict(Provenance.collect()), "runs": [asdict(r) for r in runs]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
