"""The greedy choice's argmax kernels on the CPU, through Triton's interpreter: the index
torch's ``argmax`` gives, and with ``counts`` each token counted as
``adjust.count_tokens`` counts it (padding rows sharing a row, int32 and int64 rows);
bad counts and an ``out`` on another device refused by name. The GPU's own run:
test_gpu_argmax.py."""

from interpreted import interpreted, needs_triton

_COUNTS = """
import torch
from ostinato.engine.kernels.argmax import argmax_rows
from ostinato.engine.sample.adjust import count_tokens

g = torch.Generator().manual_seed(3)
logits = torch.randint(0, 4, (6, 3000), generator=g).float()  # many ties: the first wins
assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
for dtype in (torch.int64, torch.int32):
    rows = torch.tensor([2, 0, 3, 3, 3, 1], dtype=dtype)  # 3: the padding rows' shared row
    table = torch.rand(4, 3000, generator=g).round()
    want = table.clone()
    tokens = argmax_rows(logits, counts=(table, rows))
    count_tokens(want, rows, logits.argmax(dim=-1))
    assert torch.equal(tokens, logits.argmax(dim=-1)) and torch.equal(table, want), dtype
refused = []
for wrong in (table[:, :2999], table.double(), table.t().contiguous().t(), table.to("meta")):
    try:
        argmax_rows(logits, counts=(wrong, rows))
    except ValueError as e:
        refused.append("counts' table must be" in str(e))
for wrong in (rows[:5], rows.float(), rows.to("meta")):
    try:
        argmax_rows(logits, counts=(table, wrong))
    except ValueError as e:
        refused.append("counts' rows must be" in str(e))
try:
    argmax_rows(logits, out=torch.empty(6, dtype=torch.int64, device="meta"))
except ValueError as e:
    refused.append("out must be contiguous int64 [6] on cpu" in str(e))
assert refused == [True] * 8, refused
print("ok")
"""


@needs_triton
def test_counts_each_token_as_count_tokens_does_and_refuses_bad_counts():
    assert interpreted(_COUNTS, timeout=300).strip().endswith("ok")
