"""``benchmarks.launch_rules``: a rule's settings hold inside ``applied`` and are gone
after it (the step timed under a rule must be the step the rule names). The module
imports the Triton kernels whose settings it changes, so this runs where Triton is."""

import pytest
import torch

pytest.importorskip("triton")
from benchmarks.launch_rules import RULES, Rule, applied  # noqa: E402
from ostinato.engine.model.config import ModelConfig  # noqa: E402
from ostinato.engine.model.decoder import DecoderModel  # noqa: E402
from ostinato.engine.model.presets import SHAPES  # noqa: E402


def test_the_rope_rule_computes_cos_and_sin_each_step_and_restores_the_table():
    model = DecoderModel(ModelConfig.from_hf(SHAPES["tiny"]), max_positions=64)
    positions = torch.tensor([3, 9, 63])
    looked_up = model.rope(positions, torch.float32)
    assert looked_up[0].stride(0) == 2 * model.config.head_dim  # views of one lookup
    (computed_rule,) = (r for r in RULES["rope-table"] if not r.rope_table)
    with applied(computed_rule):
        computed = model.rope(positions, torch.float32)
    assert computed[0].is_contiguous()  # made anew, not a view of the table
    assert all(torch.equal(a, b) for a, b in zip(looked_up, computed, strict=True))
    assert model.rope(positions, torch.float32)[0].stride(0) == looked_up[0].stride(0)
    with applied(Rule("defaults")):
        assert model.rope(positions, torch.float32)[0].stride(0) == looked_up[0].stride(0)


def test_the_lm_head_rules_set_the_plan_and_the_size_bound_and_restore_them():
    from ostinato.engine.worker import gemm_tuning

    planned, apart, any_size = RULES["lm-head"]
    defaults = (gemm_tuning.PLAN_LM_HEAD, gemm_tuning.SMALL_WEIGHT_BYTES)
    with applied(apart):
        assert not gemm_tuning.PLAN_LM_HEAD
    with applied(any_size):
        assert gemm_tuning.PLAN_LM_HEAD and gemm_tuning.SMALL_WEIGHT_BYTES > 501 << 20
    with applied(planned):
        assert gemm_tuning.PLAN_LM_HEAD
        assert gemm_tuning.SMALL_WEIGHT_BYTES == defaults[1]
    assert (gemm_tuning.PLAN_LM_HEAD, gemm_tuning.SMALL_WEIGHT_BYTES) == defaults


def test_the_static_outputs_rule_has_decode_steps_copy_their_outputs_and_restores_it():
    from ostinato import BatchDescriptor, GraphMode, forward_context
    from ostinato.engine.worker import runner

    rows = (torch.zeros(2, 5), torch.zeros(2, dtype=torch.int64))  # [2, vocab], [2]
    in_place, copied = RULES["static-outputs"]
    with forward_context(GraphMode.FULL, BatchDescriptor(2, uniform_decode=True), None, rows):
        with applied(copied):
            assert runner._static_rows() == (None, None)
        with applied(in_place):
            logits, greedy = runner._static_rows()
        assert logits is rows[0] and greedy is rows[1]
