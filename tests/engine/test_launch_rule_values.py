"""``LaunchRules``: one frozen value, checked where it is set, in force for a block and
restored after; what the launch choices read follows it."""

from dataclasses import FrozenInstanceError, replace

import pytest

from ostinato.engine.kernels import attention_launch as a
from ostinato.engine.kernels import gemm_launch as g
from ostinato.engine.kernels.launch_rules import LaunchRules, rules, rules_in_force


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(pdl_max_rows=-1), "pdl_max_rows: an int >= 0"),
        (dict(unsplit_stages=5), "unsplit_stages: 3 or 4"),
        (dict(smem_max_tiles=3), "smem_max_tiles: 1 or 2"),
        (dict(attention_max_splits=32), "attention_max_splits: a power of two up to 16"),
        (dict(attention_max_splits=6), "attention_max_splits"),
        (dict(prefetch_k=96), "prefetch_k: a power of two of 64-column cache lines"),
        (dict(split_attention_warps=3), "split_attention_warps"),
        (dict(early_tile=8), "early_tile: at least 16"),
        (dict(resident_wide=1.5), "resident_wide: an int"),
    ],
)
def test_a_bad_rule_names_itself(change, match):
    with pytest.raises(ValueError, match=match):
        LaunchRules(**change)


def test_the_rules_are_frozen_and_put_in_force_for_a_block_only():
    default = rules()
    assert default == LaunchRules()
    with pytest.raises(FrozenInstanceError):
        default.prefetch_k = 128  # type: ignore[misc]
    other = replace(default, pdl_max_rows=4)
    with rules_in_force(other) as inside:
        assert rules() is inside is other
        with rules_in_force(LaunchRules()):
            assert rules().pdl_max_rows == 16
        assert rules() is other
    assert rules() is default
    with pytest.raises(KeyError), rules_in_force(other):
        raise KeyError("a failed run")
    assert rules() is default
    with pytest.raises(TypeError, match="a LaunchRules, got dict"):
        with rules_in_force({"pdl_max_rows": 4}):  # type: ignore[arg-type]
            pass


def test_the_launch_choices_follow_the_rules_in_force():
    # The 1.5 B shape's QKV: resident at one row by default, not with no resident rows.
    assert g.resident_config(2048, 2, 12 << 20, 1) is not None
    with rules_in_force(LaunchRules(resident_max_rows=0)):
        assert g.resident_config(2048, 2, 12 << 20, 1) is None
        assert g.stats_granule(1) == g.GRANULE
    with rules_in_force(LaunchRules(resident_max_bytes=8 << 20)):
        assert g.resident_config(2048, 2, 12 << 20, 1) is None
    # SmolLM2's O at 4 rows: in shared memory by default, the K loop without.
    assert g.smem_config(576, 1, 4, 576 * 576 * 2) is not None
    with rules_in_force(LaunchRules(smem_max_rows=0)):
        assert g.smem_config(576, 1, 4, 576 * 576 * 2) is None
    deep = g.CONFIGS[g.pick_config(576, 576, 132) - 1]
    assert deep.num_stages == 4
    with rules_in_force(LaunchRules(unsplit_stages=3)):
        assert g.CONFIGS[g.pick_config(576, 576, 132) - 1].num_stages == 3
    assert g.k_step(8192, 8) == 256
    with rules_in_force(LaunchRules(long_split_k=1 << 30)):
        assert g.k_step(8192, 8) == g.BLOCK_K
    assert a.splits_for(1, 3, 132) == 16
    with rules_in_force(LaunchRules(attention_max_splits=4)):
        assert a.splits_for(1, 3, 132) == 4
    with rules_in_force(LaunchRules(unsplit_attention_warps=8)):
        assert a.launch_for(1).num_warps == 8
