"""build_graph_runtime: the one place that resolves the mode (auto included), builds the
dispatcher and the manager, and reads warm-ups and checks from the config."""

import pytest
import torch
from fakes import FakePlatform

from ostinato import (
    AttentionGraphSupport,
    Dispatcher,
    GraphConfig,
    GraphMode,
    build_graph_runtime,
    choose_compiler,
)
from ostinato.platform import CpuPlatform

X = torch.ones(64, 3)


def step(d):
    return X[: d.num_tokens] * 2


@pytest.mark.parametrize(
    "platform, piecewise, expected",
    [
        (CpuPlatform(), True, GraphMode.NONE),
        (FakePlatform(), False, GraphMode.FULL),
        (FakePlatform(), True, GraphMode.FULL_AND_PIECEWISE),
    ],
)
def test_auto_mode(platform, piecewise, expected):
    rt = build_graph_runtime(
        step,
        GraphConfig(mode="auto", capture_sizes=(1, 2, 4)),
        piecewise_available=piecewise,
        platform=platform,
        pool=1,
        progress=False,
    )
    assert rt.mode is expected and rt.resolution.reasons == ()
    assert rt.dispatcher.mode is expected


def test_downgrade_is_reported_and_config_checks_reach_the_manager():
    cfg = GraphConfig(
        mode="full", capture_sizes=(2, 4), num_warmups=3, verify_graphs=True, check_addresses=True
    )
    rt = build_graph_runtime(
        step,
        cfg,
        attention=AttentionGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE,
        platform=FakePlatform(),
        pool=1,
        progress=False,
        max_num_reqs=4,
    )
    assert rt.mode is GraphMode.FULL_DECODE_ONLY and rt.resolution.reasons
    assert rt.manager.num_warmups == 3 and rt.manager.check.mode == "capture"
    rt.manager.capture()
    d = rt.dispatch(3, uniform_decode=True)
    assert d.mode is GraphMode.FULL and d.padded_tokens == 4
    assert torch.equal(rt.manager.run(d, 3), X[:3] * 2)


def test_compiler_choice():
    graphs, cpu = FakePlatform(), CpuPlatform()
    assert choose_compiler("auto", None, graphs) == "inductor"
    assert choose_compiler("auto", GraphMode.FULL, graphs) is None
    assert choose_compiler("auto", GraphMode.FULL_AND_PIECEWISE, cpu) is None
    assert choose_compiler("eager", GraphMode.FULL, cpu) == "eager"
    with pytest.raises(ValueError, match="compiler"):
        choose_compiler("tvm", None, graphs)


def test_a_dispatcher_needs_a_resolved_mode():
    with pytest.raises(ValueError, match="auto"):
        Dispatcher(GraphConfig(mode="auto"))
