"""The start-up A/B benchmark on the CPU, the tiny model: two trees alternating, each run
named with its tree and round, every-cache-empty runs in folders of their own."""

import argparse
import os

import pytest

from benchmarks.startup_ab import command, compare

pytest.importorskip("tokenizers")


def test_two_trees_alternate_and_empty_caches_are_new_each_run(tmp_path):
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    args = argparse.Namespace(
        trees=[src, os.path.abspath(src)], model="tiny", caches="empty", rounds=1,
        device="cpu", max_tokens=4, timeout=120.0,
    )  # fmt: skip
    runs = compare(args, tmp_path)
    assert [r.name for r in runs] == [
        f"tiny every cache empty, {src}, round 1",
        f"tiny every cache empty, {os.path.abspath(src)}, round 1",
    ]
    for run in runs:
        assert run.returncode == 0, run.tail
        assert 0 < run.answer_s <= run.exit_s and run.phases["total"] >= 0
    assert len(list(tmp_path.glob("empty-*"))) == 2  # (one new cache folder a timed run)


def test_the_command_asks_smollm2_a_question_and_a_shape_for_random_tokens():
    assert "--prompt" in command("smollm2", "cuda", 8)
    big = command("llama-1.5b", "cuda", 8)
    assert big[big.index("--model") + 1] == "llama-1.5b" and "--ignore-eos" in big
