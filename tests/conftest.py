import atexit
import os
import shutil
import tempfile

import pytest
import torch

# The suite never reads or fills the user's caches (converted models, compiled kernels):
# one fresh folder per session, shared by the engine's worker processes, removed at exit;
# or OSTINATO_TEST_CACHE_DIR, which the GPU suite's per-file sessions share.
if os.environ.get("OSTINATO_TEST_CACHE_DIR"):
    os.environ["OSTINATO_CACHE_DIR"] = os.environ["OSTINATO_TEST_CACHE_DIR"]
else:
    _CACHE = tempfile.mkdtemp(prefix="ostinato-test-cache-")
    os.environ["OSTINATO_CACHE_DIR"] = _CACHE
    atexit.register(shutil.rmtree, _CACHE, True)

# The suite runs beside other work on small machines: torch's default of a thread per
# core then oversubscribes them and every test slows down many times over. Half the
# cores (at most 4), unless OMP_NUM_THREADS says otherwise; the engine's own worker
# processes limit themselves (ostinato.engine.api.arguments.limit_cpu_threads).
if not os.environ.get("OMP_NUM_THREADS"):
    from ostinato.engine.api.arguments import MAX_CPU_THREADS, available_cores

    torch.set_num_threads(max(1, min(MAX_CPU_THREADS, available_cores() // 2)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fake_graphs(monkeypatch):
    """The test double for graphs (``fakes.FakePlatform``), the one every engine part
    builds its graphs on for the test."""
    from fakes import FakePlatform, engine_on

    from ostinato import use_platform

    platform = FakePlatform()
    engine_on(monkeypatch, platform)
    with use_platform(platform):
        yield platform


@pytest.fixture
def cpu_keys(monkeypatch):
    """``CompileCache.plan_key`` names the CUDA device; on the CPU a key of everything
    else stands in."""
    from dist_workers import cpu_plan_key

    from ostinato.engine.worker.compile_cache import CompileCache

    monkeypatch.setattr(CompileCache, "plan_key", cpu_plan_key)


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """A random Llama checkpoint (float32, safetensors) and transformers' model of it,
    one per test module: the reference the engine's CPU tests compare with."""
    from hf_models import write_checkpoint

    path = tmp_path_factory.mktemp("llama")
    return path, write_checkpoint("LlamaForCausalLM", path)
