import pytest

from ostinato import GraphMode


@pytest.mark.parametrize(
    "mode, decode, mixed, separate",
    [
        (GraphMode.NONE, GraphMode.NONE, GraphMode.NONE, False),
        (GraphMode.PIECEWISE, GraphMode.PIECEWISE, GraphMode.PIECEWISE, False),
        (GraphMode.FULL, GraphMode.FULL, GraphMode.FULL, False),
        (GraphMode.FULL_DECODE_ONLY, GraphMode.FULL, GraphMode.NONE, True),
        (GraphMode.FULL_AND_PIECEWISE, GraphMode.FULL, GraphMode.PIECEWISE, True),
    ],
)
def test_decode_and_mixed_split(mode, decode, mixed, separate):
    assert mode.decode_mode() is decode
    assert mode.mixed_mode() is mixed
    assert mode.separate_routine() is separate
    assert mode.is_runtime_mode() is (not separate)
    assert decode.is_runtime_mode() and mixed.is_runtime_mode()


def test_full_and_piecewise_queries():
    assert GraphMode.FULL_AND_PIECEWISE.has_full_graphs()
    assert GraphMode.FULL_AND_PIECEWISE.has_piecewise_graphs()
    assert GraphMode.FULL_DECODE_ONLY.has_full_graphs()
    assert not GraphMode.FULL_DECODE_ONLY.has_piecewise_graphs()
    assert not GraphMode.NONE.has_full_graphs()
    assert not GraphMode.PIECEWISE.has_full_graphs()


@pytest.mark.parametrize(
    "text, mode",
    [
        ("full", GraphMode.FULL),
        ("FULL", GraphMode.FULL),
        (" Full_And_Piecewise ", GraphMode.FULL_AND_PIECEWISE),
        ("full-decode-only", GraphMode.FULL_DECODE_ONLY),
        ("none", GraphMode.NONE),
        (GraphMode.PIECEWISE, GraphMode.PIECEWISE),
    ],
)
def test_parse_accepts_names(text, mode):
    assert GraphMode.parse(text) is mode


@pytest.mark.parametrize("bad", ["fulll", "", 3, None])
def test_parse_rejects_unknown(bad):
    with pytest.raises(ValueError, match="mode: unknown graph mode.*FULL_AND_PIECEWISE"):
        GraphMode.parse(bad)
