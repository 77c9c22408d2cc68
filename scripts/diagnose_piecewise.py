"""Compare SmolLM2 logits: eager vs piecewise (inductor / eager pieces), fp32 and bf16."""

import gc
import sys

import torch

sys.path.insert(0, "tests")
from smollm2 import QUESTION  # noqa: E402

from ostinato.engine import LLM, SamplingParams  # noqa: E402


def logits(mode, dtype, compiler="auto", model=None):
    llm = LLM(
        model,
        mode=mode,
        dtype=dtype,
        compiler=compiler,
        max_model_len=256,
        max_num_seqs=4,
        max_capture_size=16,
        progress=False,
    )
    p = llm.chat_prompt(QUESTION)
    reqs = [llm.scheduler.add(p, SamplingParams()), llm.scheduler.add(p[:7], SamplingParams())]
    out = llm.runner.execute(llm.scheduler.schedule()).logits.clone()
    llm.scheduler.abort(reqs)
    (ans,) = llm.chat(QUESTION, SamplingParams(max_tokens=12))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return out, ans.text


for dtype in (torch.float32, torch.bfloat16):
    ref, text = logits("none", dtype)
    print(dtype, "none", repr(text), flush=True)
    for mode, compiler in [
        ("piecewise", "eager"),
        ("piecewise", "inductor"),
        ("full_and_piecewise", "inductor"),
    ]:
        out, text = logits(mode, dtype, compiler)
        err = ((out - ref).norm() / ref.norm()).item()
        print(dtype, mode, compiler, f"rel err {err:.4g}", repr(text), flush=True)
