"""``benchmarks.launch_rules``: each rule is the library's launch rules with the
changes it names, in force while its step is built and timed and gone after (the step
timed under a rule must be the step the rule names); nothing is patched."""

from types import SimpleNamespace

import pytest

from benchmarks import launch_rules as bench
from ostinato.engine.kernels.launch_rules import LaunchRules, rules


def test_every_rule_is_the_librarys_rules_with_its_named_changes():
    for name, rule_set in bench.RULES.items():
        assert len({r.name for r in rule_set}) == len(rule_set), name
        assert len({r.rules for r in rule_set}) == len(rule_set), name  # each differs
    assert bench.rule("x", prefetch_k=128).rules == LaunchRules(prefetch_k=128)
    with pytest.raises(TypeError, match="prefetch"):
        bench.rule("x", prefetch=128)  # a misspelt field fails at once
    with pytest.raises(ValueError, match="prefetch_k"):
        bench.rule("x", prefetch_k=100)


def test_a_rule_is_in_force_while_its_step_is_built_and_timed_and_gone_after(monkeypatch):
    seen = []

    def run(cfg, device, log, profile):
        seen.append(rules())
        row = SimpleNamespace(
            variant=bench.VARIANT, batch=1, step_ms=1.0, pipelined_ms=None, kernels_in_layer=None
        )
        return SimpleNamespace(rows=[row], kernels_by_name={})

    monkeypatch.setattr(bench.decode, "run", run)
    planned, apart, _ = bench.RULES["lm-head"]
    for r in (planned, apart):
        (timing,) = bench.timings({}, (1,), r)
        assert seen[-1] is r.rules and timing.rule == r.name
        assert rules() == LaunchRules()  # restored
    with pytest.raises(RuntimeError):
        monkeypatch.setattr(
            bench.decode, "run", lambda *a, **k: (_ for _ in ()).throw(RuntimeError())
        )
        bench.timings({}, (1,), planned)
    assert rules() == LaunchRules()  # restored on a failure too
