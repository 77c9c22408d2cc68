"""The TP breakdown sums the committed kernel census by kind without losing a kernel."""

import json
from pathlib import Path

import pytest

from benchmarks.tp_breakdown import OTHER, breakdowns, kind_of, table

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results" / "tp_h200x2"


@pytest.mark.parametrize(
    "name, kind",
    [
        (
            "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            "all-reduce",
        ),
        (
            "void (anonymous namespace)::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>",
            "all-reduce",
        ),
        ("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT", "GEMM"),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "GEMM"),
        ("_paged_attention_kernel", "attention"),
        ("_rms_norm_kernel", "RMSNorm"),
        ("Memset (Device)", OTHER),
    ],
)
def test_kernel_kinds(name, kind):
    assert kind_of(name) == kind


@pytest.mark.parametrize("tp", [1, 2])
def test_every_kernel_of_the_census_is_counted_once(tp):
    doc = json.loads((RESULTS / f"census_tp_llama-8b_tp{tp}_h200.json").read_text())
    rows = breakdowns(doc)
    assert {r.batch for r in rows} == {1, 8}
    for r in rows:
        (kernels,) = [v for k, v in doc["kernels_by_name"].items() if f" B={r.batch}" in k]
        assert r.busy_us == pytest.approx(sum(k["us_per_step"] for k in kernels))
        assert sum(r.launches.values()) == sum(k["per_step"] for k in kernels)
        census = next(x for x in doc["rows"] if x["batch"] == r.batch)
        assert r.step_ms == census["step_ms"]
    assert "| 2 | 1 |" in table(rows) if tp == 2 else "| 1 | 1 |" in table(rows)
