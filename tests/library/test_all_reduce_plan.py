"""The all-reduce plan: which algorithm serves which message size (pure logic, CPU)."""

import pytest

from ostinato.distributed.all_reduce_plan import AllReduceAlgo, AllReducePlan, parse_all_reduce

NCCL, ONE, TWO = AllReduceAlgo.NCCL, AllReduceAlgo.ONE_SHOT, AllReduceAlgo.TWO_SHOT
SIZES = [8192, 65536, 524288, 4 << 20]


def test_the_fastest_algorithm_serves_each_size_and_nccl_serves_above():
    # The measurements on two H200s (µs per all-reduce inside a graph).
    plan = AllReducePlan.from_timings(
        SIZES,
        {NCCL: [9.7, 10.3, 12.8, 33.7], ONE: [6.6, 6.9, 9.8, 30.5], TWO: [6.4, 7.3, 8.0, 20.2]},
    )
    assert plan.max_bytes == (8192, 65536, 4 << 20)
    assert plan.algos == (TWO, ONE, TWO)
    assert plan.choose(16) is TWO
    assert plan.choose(8192) is TWO
    assert plan.choose(8192 + 16) is ONE
    assert plan.choose(65536 + 16) is TWO
    assert plan.choose((4 << 20) + 16) is NCCL
    assert plan.uses_symmetric_memory
    assert plan.describe() == "two-shot <= 8 KiB, one-shot <= 64 KiB, two-shot <= 4 MiB, nccl above"


def test_misaligned_messages_and_an_all_nccl_plan_use_nccl():
    plan = AllReducePlan.only(ONE, 1 << 20)
    assert plan.choose(1024) is ONE
    assert plan.choose(1030) is NCCL  # not a multiple of 16 bytes
    slower = AllReducePlan.from_timings(SIZES[:2], {NCCL: [5.0, 6.0], ONE: [5.0, 9.0]})
    assert slower == AllReducePlan.nccl()  # ties go to NCCL
    assert not slower.uses_symmetric_memory and slower.describe() == "nccl"
    mid = AllReducePlan.from_timings(SIZES[:3], {NCCL: [9.0, 6.0, 9.0], TWO: [5.0, 7.0, 5.0]})
    assert mid.algos == (TWO, NCCL, TWO) and mid.choose(65536) is NCCL


def test_bad_plans_and_choices_are_refused():
    with pytest.raises(ValueError, match="ascend"):
        AllReducePlan((10, 5), (ONE, TWO))
    with pytest.raises(ValueError, match="one algorithm per size"):
        AllReducePlan((10,), ())
    with pytest.raises(ValueError, match="1 timings for 2 sizes"):
        AllReducePlan.from_timings([1, 2], {NCCL: [1.0]})
    with pytest.raises(ValueError, match="ascending"):
        AllReducePlan.from_timings([], {})
    with pytest.raises(ValueError, match="all_reduce: 'fast' is not one of auto, nccl"):
        parse_all_reduce("fast")
