"""The compile cache's own pieces on the CPU: where Inductor and Triton are pointed, and
the small-GEMM plan file (reused, merged, corrupt, unwritable). The plans' reuse by a
second engine is a GPU test (test_gpu_kernel_options)."""

import logging

from ostinato.engine.worker.compile_cache import PLANS, CompileCache


def test_compilers_are_pointed_here_unless_the_user_chose(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/users/own/triton")
    chosen = CompileCache(tmp_path).point_compilers_here()
    assert chosen == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "compile" / "inductor")}
    import os

    assert os.environ["TRITON_CACHE_DIR"] == "/users/own/triton"


def test_plans_are_stored_merged_and_read_back(tmp_path):
    cache = CompileCache(tmp_path)
    assert cache.load_plans() == {}
    cache.store_plans({"a": [0, 1, 2]})
    cache.store_plans({"b": [0, 0]})
    assert CompileCache(tmp_path).load_plans() == {"a": [0, 1, 2], "b": [0, 0]}
    assert [p.name for p in cache.folder.iterdir()] == [PLANS]  # no temporary left


def test_a_corrupt_plan_file_is_named_and_measured_again(tmp_path, caplog):
    cache = CompileCache(tmp_path)
    cache.folder.mkdir(parents=True)
    (cache.folder / PLANS).write_text('{"a": [0, "one"]}')
    with caplog.at_level(logging.WARNING):
        assert cache.load_plans() == {}
    assert PLANS in caplog.text and "measuring plans again" in caplog.text
    cache.store_plans({"a": [0, 1]})
    assert cache.load_plans() == {"a": [0, 1]}


def test_an_unwritable_plan_file_is_a_warning(tmp_path, caplog):
    blocker = tmp_path / "root"
    blocker.write_text("a file where the cache folder should be")
    with caplog.at_level(logging.WARNING):
        CompileCache(blocker).store_plans({"a": [1]})
    assert "plans are not kept" in caplog.text
