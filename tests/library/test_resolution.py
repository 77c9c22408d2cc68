import pytest

from ostinato import AttentionGraphSupport as S
from ostinato import GraphMode as M
from ostinato import resolve_mode


@pytest.mark.parametrize(
    "requested, support, piecewise, q, expected",
    [
        (M.FULL, S.ALWAYS, True, 1, M.FULL),
        (M.FULL_AND_PIECEWISE, S.ALWAYS, True, 1, M.FULL_AND_PIECEWISE),
        (M.FULL, S.UNIFORM_BATCH, True, 1, M.FULL_AND_PIECEWISE),
        (M.FULL, S.UNIFORM_BATCH, False, 1, M.FULL_DECODE_ONLY),
        (M.FULL, S.UNIFORM_SINGLE_TOKEN_DECODE, True, 1, M.FULL_AND_PIECEWISE),
        (M.FULL, S.UNIFORM_SINGLE_TOKEN_DECODE, True, 3, M.PIECEWISE),
        (M.FULL_DECODE_ONLY, S.UNIFORM_SINGLE_TOKEN_DECODE, False, 3, M.NONE),
        (M.FULL_DECODE_ONLY, S.UNIFORM_BATCH, False, 3, M.FULL_DECODE_ONLY),
        (M.FULL, S.NEVER, True, 1, M.PIECEWISE),
        (M.FULL, S.NEVER, False, 1, M.NONE),
        (M.FULL_AND_PIECEWISE, S.NEVER, True, 1, M.PIECEWISE),
        (M.FULL_DECODE_ONLY, S.NEVER, True, 1, M.NONE),
        (M.PIECEWISE, S.NEVER, True, 1, M.PIECEWISE),
        (M.PIECEWISE, S.ALWAYS, False, 1, M.NONE),
        (M.FULL_AND_PIECEWISE, S.ALWAYS, False, 1, M.FULL_DECODE_ONLY),
        (M.NONE, S.NEVER, False, 1, M.NONE),
    ],
)
def test_downgrade_rules(requested, support, piecewise, q, expected):
    r = resolve_mode(requested, support, piecewise_available=piecewise, uniform_decode_query_len=q)
    assert r.mode is expected
    assert r.requested is requested
    assert bool(r.reasons) == (expected is not requested)


def test_never_upgrades_and_reasons_logged(caplog):
    # A mode is a pair (decode mode, mixed mode); neither part may ever get stronger.
    rank = {M.NONE: 0, M.PIECEWISE: 1, M.FULL: 2}
    for requested in M:
        for support in S:
            for pw in (True, False):
                r = resolve_mode(requested, support, piecewise_available=pw)
                assert rank[r.mode.decode_mode()] <= rank[requested.decode_mode()]
                assert rank[r.mode.mixed_mode()] <= rank[requested.mixed_mode()]
                if not pw:
                    assert not r.mode.has_piecewise_graphs()
                if support is S.NEVER:
                    assert not r.mode.has_full_graphs()
    caplog.clear()
    with caplog.at_level("WARNING"):
        resolve_mode(M.FULL, S.NEVER, piecewise_available=False)
    assert "attention backend cannot run inside a full graph" in caplog.text


def test_platform_without_graphs_runs_none():
    r = resolve_mode(M.FULL_AND_PIECEWISE, platform_has_graphs=False)
    assert r.mode is M.NONE
    assert "no graph support" in r.reasons[0]
