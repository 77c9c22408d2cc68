import pytest

from ostinato import GraphConfig, GraphMode, default_capture_sizes
from ostinato.config import exact_capture_sizes


def test_default_ladder_shape():
    sizes = default_capture_sizes()
    assert sizes[:4] == [1, 2, 4, 8]
    assert [s for s in sizes if 8 <= s <= 256] == list(range(8, 257, 8))
    assert [s for s in sizes if s > 256] == list(range(272, 513, 16))
    assert sizes[-1] == 512
    assert GraphConfig().sizes == tuple(sizes)
    wide = default_capture_sizes(2048)
    assert wide[: len(sizes)] == sizes  # the same below 512, every 128 above
    assert wide[len(sizes) :] == list(range(640, 2049, 128))
    assert default_capture_sizes(700)[-3:] == [512, 640, 700]


@pytest.mark.parametrize("top", [1, 3, 7, 100, 256, 300, 1000])
def test_ladder_reaches_max_exactly(top):
    sizes = default_capture_sizes(top)
    assert sizes == sorted(set(sizes))
    assert sizes[-1] == top
    assert all(s <= top for s in sizes)


def test_default_ladder_respects_token_budget():
    cfg = GraphConfig(max_num_tokens=100)
    assert cfg.largest_size == 100
    assert max(cfg.sizes) <= 100


def test_explicit_sizes_sorted():
    cfg = GraphConfig(capture_sizes=(8, 1, 4))
    assert cfg.sizes == (1, 4, 8)
    assert cfg.largest_size == 8


def test_mode_from_string():
    assert GraphConfig(mode="full_decode_only").mode is GraphMode.FULL_DECODE_ONLY


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"capture_sizes": (0, 4)}, "capture_sizes: 0 is not positive"),
        ({"capture_sizes": (-2,)}, "capture_sizes: -2 is not positive"),
        ({"capture_sizes": (4, 8, 4)}, r"capture_sizes: duplicate sizes \[4\]"),
        ({"capture_sizes": ()}, "capture_sizes: empty"),
        ({"capture_sizes": (1.5,)}, "capture_sizes: 1.5 is not an int"),
        ({"capture_sizes": "8"}, "capture_sizes: expected a sequence"),
        ({"capture_sizes": (8, 64), "max_num_tokens": 32}, r"\[64\] exceed max_num_tokens=32"),
        ({"mode": "turbo"}, "mode: unknown graph mode 'turbo'"),
        ({"max_capture_size": 0}, "max_capture_size: must be >= 1"),
        # (named sizes have no ladder: the top would be ignored)
        ({"max_capture_size": 8, "capture_sizes": (1, 2)}, r"and capture_sizes=\(1, 2\): give one"),
        ({"max_num_tokens": 0}, "max_num_tokens: must be >= 1"),
        ({"num_warmups": -1}, "num_warmups: must be >= 0"),
    ],
)
def test_invalid_values_name_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GraphConfig(**kwargs)


def test_ladder_length_equals_the_built_ladder():
    from ostinato.config import ladder_length

    for m in [*range(1, 1200), 4096, 16127, 16128, 16129, 16143, 16144]:
        assert ladder_length(m) == len(default_capture_sizes(m)), m
        for exact in (5, 8, 32, 300):
            assert ladder_length(m, exact) == len(exact_capture_sizes(m, exact)), (m, exact)


def test_an_exact_ladder_holds_every_size_to_its_bound_then_the_default_ladder():
    assert exact_capture_sizes(20, 32) == list(range(1, 21))
    assert exact_capture_sizes(64, 32) == [*range(1, 33), 40, 48, 56, 64]
    assert exact_capture_sizes(37, 32) == [*range(1, 33), 37]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            dict(max_capture_size="128"),
            TypeError,
            "max_capture_size: expected an int or None, got .128.",
        ),
        (dict(max_capture_size=10**9), ValueError, "makes a ladder of 7812547 sizes"),
        (dict(capture_sizes=tuple(range(1, 2000))), ValueError, "1999 sizes, more than 1024"),
        (dict(num_warmups=1.5), TypeError, "num_warmups: expected an int"),
        (dict(max_num_tokens="64"), TypeError, "max_num_tokens: expected an int or None"),
        (dict(verify_graphs=1), TypeError, "verify_graphs: expected True or False"),
        (dict(check_addresses="yes"), TypeError, "check_addresses: expected True or False"),
    ],
)
def test_wrong_types_and_absurd_ladders_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        GraphConfig(**kwargs)
