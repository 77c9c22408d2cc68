"""The piecewise backend on CPU: the split, compiled == eager, errors, capture logic."""

import pytest
import torch
from fakes import FakePlatform

from ostinato import BatchDescriptor, GraphMode, capture_phase, forward_context
from ostinato.engine.cli.demo import TinyModel
from ostinato.engine.core.kv_cache import KVCache
from ostinato.engine.model.attention import AttentionMetadata, TorchAttention
from ostinato.engine.model.attention_op import StepAttention
from ostinato.engine.model.config import ModelConfig
from ostinato.engine.model.decoder import DecoderModel
from ostinato.engine.model.presets import shape
from ostinato.piecewise import CompiledModel, NoSplittingOpError, PiecewiseBackend

LAYERS = 3


def model():
    torch.manual_seed(0)
    cfg = ModelConfig.from_hf({**shape("tiny"), "num_hidden_layers": LAYERS})
    return DecoderModel(cfg).eval()


class Step:
    """Inputs and attention metadata for one prefill of n tokens into fresh blocks."""

    def __init__(self, cache_layers=LAYERS):
        self.cache = KVCache(cache_layers, 16, 16, 2, 32, torch.float32, torch.device("cpu"))
        self.ids = torch.zeros(64, dtype=torch.long)
        self.pos = torch.full((64,), -1, dtype=torch.long)
        self.req = torch.zeros(64, dtype=torch.int32)
        self.slots = torch.zeros(64, dtype=torch.long)
        self.tables = torch.arange(1, 5, dtype=torch.int32)[None]

    def fill(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids[:n] = torch.randint(0, 1000, (n,), generator=g)
        self.pos[:n] = torch.arange(n)
        self.slots[:n] = torch.arange(n) + 16

    def context(self, mode, n, padded=None):
        p = padded or n
        meta = AttentionMetadata(self.pos[:p], self.req[:p], self.slots[:p], self.tables, [n], [n])
        d = BatchDescriptor(p)
        return forward_context(mode, d, StepAttention(meta, self.cache, TorchAttention()))

    def run(self, fn, mode, n, padded=None):
        p = padded or n
        with torch.inference_mode(), self.context(mode, n, padded):
            return fn(self.ids[:p], self.pos[:p])[:n].clone()


def test_split_at_every_attention_call():
    backend = PiecewiseBackend(compiler="eager", platform=FakePlatform(), pool=1)
    step = Step()
    step.fill(8, 0)
    step.run(CompiledModel(model(), backend), GraphMode.NONE, 8)
    pieces = backend.stats.pieces
    # Each layer's attention runs between pieces. Compiled, the layers run unfused, so
    # their norm and QKV projection are inside the pieces: the fused QKV op (a splitting
    # op, it names the layer's cache) is not called.
    assert len(pieces) == 2 * LAYERS + 1
    assert [p.is_splitting_op for p in pieces] == [i % 2 == 1 for i in range(2 * LAYERS + 1)]
    splits = [p.ops[0] for p in pieces if p.is_splitting_op]
    assert splits == ["ostinato.attention"] * LAYERS
    assert "decoder.py" in pieces[0].source and "embed_tokens" in pieces[0].source
    assert len(backend.wrappers) == LAYERS + 1
    assert backend.wrappers[-1].options.weak_ref_output
    assert not any(w.options.weak_ref_output for w in backend.wrappers[:-1])


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_compiled_equals_eager_in_none_mode_one_compile_for_all_sizes(compiler):
    m = model()
    backend = PiecewiseBackend(compiler=compiler, platform=FakePlatform(), pool=1)
    compiled = CompiledModel(m, backend)
    step = Step()
    for n in (17, 1, 5, 32, 2):
        step.fill(n, n)
        want = step.run(m, GraphMode.NONE, n)
        got = step.run(compiled, GraphMode.NONE, n)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert backend.stats.compiles == 1
    assert backend.num_graphs == 0, "NONE mode captures nothing"


def test_piecewise_capture_then_replay_equals_eager():
    m = model()
    platform = FakePlatform()
    backend = PiecewiseBackend(compiler="eager", platform=platform, pool=1)
    compiled = CompiledModel(m, backend)
    step = Step()
    step.fill(8, 1)
    step.run(compiled, GraphMode.NONE, 8)  # compile
    with capture_phase():
        step.run(compiled, GraphMode.PIECEWISE, 8)
    assert backend.num_graphs == LAYERS + 1
    graphs = len(platform.graphs)
    for seed in (2, 3):
        step.fill(8, seed)
        want = step.run(m, GraphMode.NONE, 8)
        got = step.run(compiled, GraphMode.PIECEWISE, 8)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(platform.graphs) == graphs, "replays capture nothing new"
    assert all(g.replays == 2 for g in platform.graphs)


def test_piecewise_outside_capture_phase_is_refused():
    backend = PiecewiseBackend(compiler="eager", platform=FakePlatform(), pool=1)
    compiled = CompiledModel(model(), backend)
    step = Step()
    step.fill(4, 0)
    step.run(compiled, GraphMode.NONE, 4)
    from ostinato import CaptureNotAllowedError

    with pytest.raises(CaptureNotAllowedError, match="piece submod_0"):
        step.run(compiled, GraphMode.PIECEWISE, 4)


def test_model_without_splitting_op_is_a_clear_error():
    backend = PiecewiseBackend(compiler="eager", platform=FakePlatform(), pool=1)
    compiled = CompiledModel(TinyModel(layers=1).eval(), backend)
    with pytest.raises(NoSplittingOpError, match="no splitting op.*ostinato.attention"):
        compiled(torch.zeros(4, dtype=torch.long))


def test_bad_compiler_name():
    with pytest.raises(ValueError, match="compiler"):
        PiecewiseBackend(compiler="tvm", platform=FakePlatform(), pool=1)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_identical_layers_are_compiled_once(compiler):
    torch.manual_seed(0)
    cfg = ModelConfig.from_hf({**shape("tiny"), "num_hidden_layers": 5})
    m = DecoderModel(cfg).eval()
    backend = PiecewiseBackend(compiler=compiler, platform=FakePlatform(), pool=1)
    compiled = CompiledModel(m, backend)
    step = Step(cache_layers=5)
    for n in (9, 3):
        step.fill(n, n)
        want = step.run(m, GraphMode.NONE, n)
        got = step.run(compiled, GraphMode.NONE, n)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # 6 graphable pieces: the first (embedding + layer 0 up to attention), four identical
    # middle ones (a layer's rest + the next layer up to attention), and the last.
    assert len(backend.wrappers) == 6
    assert (backend.stats.piece_compiles, backend.stats.piece_reuses) == (3, 3)


def test_more_compiled_models_than_dynamo_keeps_variants_all_compile():
    # Dynamo keeps at most 8 compiled variants per code object; a process that builds
    # engine after engine (tests, benchmarks, a server reloading) must never reach it.
    step = Step()
    step.fill(4, 0)
    for i in range(10):
        backend = PiecewiseBackend(compiler="eager", platform=FakePlatform(), pool=1)
        m = model().to(torch.float64 if i % 2 else torch.float32)
        step.cache = KVCache(
            LAYERS, 16, 16, 2, 32, m.embed_tokens.weight.dtype, torch.device("cpu")
        )
        step.run(CompiledModel(m, backend), GraphMode.NONE, 4)
        assert backend.stats.compiles == 1


def test_a_dropped_compiled_model_frees_its_module_and_backend():
    # Dynamo keeps every backend it is given and its compiled code in a cycle the garbage
    # collector cannot see; an engine's weights and graphs must still go with the engine.
    import gc
    import weakref

    step = Step()
    step.fill(4, 0)
    refs = []
    for release in (False, True):
        backend = PiecewiseBackend(compiler="eager", platform=FakePlatform(), pool=1)
        m = model()
        compiled = CompiledModel(m, backend)
        step.run(compiled, GraphMode.NONE, 4)
        if release:
            compiled.release()
        refs.append((weakref.ref(m), weakref.ref(backend)))
        del compiled, m, backend
    gc.collect()
    assert all(r() is None for pair in refs for r in pair)
