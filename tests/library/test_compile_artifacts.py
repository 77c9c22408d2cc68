"""Compiled functions kept across processes (``compile_artifacts``), with Inductor on the
CPU: a first process compiles ahead of time and keeps what it made, a second one loads
it and compiles nothing; artifacts serve only calls their guards accept; a broken
artifact is named, removed and made again; an unwritable folder is a warning."""

import functools
import inspect
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from fakes import FakePlatform
from torch.utils._pytree import tree_flatten

import ostinato
from ostinato import compile_artifacts
from ostinato.compile_artifacts import ArtifactStore, artifact_key, identity
from ostinato.whole_compile import CallTree, WholeCompiled

pytestmark = pytest.mark.skipif(
    not compile_artifacts.supported(), reason="this torch cannot save compiled functions"
)


class Scaled(torch.nn.Module):
    """A module called with a keyword tensor and a constant, as ``graphed`` calls one."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.a = torch.nn.Linear(width, 2 * width)
        self.b = torch.nn.Linear(2 * width, width)

    def forward(self, x, mask=None, scale=1.0):
        y = self.b(torch.nn.functional.gelu(self.a(x))) * scale
        return {"out": y if mask is None else y * mask}


class Activation(torch.nn.Module):
    """A function held by a module, as transformers' activations hold theirs."""

    def __init__(self, act=torch.nn.functional.gelu) -> None:
        super().__init__()
        self.act = act

    def forward(self, x):
        return self.act(x)


def wrapped(forward):
    """A decorator, as transformers' models wrap their ``forward``."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        return forward(self, *args, **kwargs)

    return wrapper


class Activated(Scaled):
    """``Scaled`` as a transformers model is made: a wrapped ``forward``, an activation
    module holding a function. Traced through a closure over it, Dynamo guards on the
    wrapped code's and the function's identity: guards it cannot save."""

    def __init__(self, width: int = 16, act=torch.nn.functional.gelu) -> None:
        super().__init__(width)
        self.activation = Activation(act)

    @wrapped
    def forward(self, x, mask=None, scale=1.0):
        # (transformers' chunked feed-forward reads its function's signature so)
        assert len(inspect.signature(self.activation.forward).parameters) == 1
        y = self.b(self.activation(self.a(x))) * scale
        return {"out": y if mask is None else y * mask}


def plain(x):
    return x * 2


def _whole(model: torch.nn.Module, store: ArtifactStore | None) -> WholeCompiled:
    x = torch.randn(4, 16)
    leaves, spec = tree_flatten(((x,), {"mask": x, "scale": 0.5}))
    constants = tuple(None if i in (0, 1) else v for i, v in enumerate(leaves))
    tree = CallTree(model, constants, (0, 1), spec)
    key = artifact_key(model, ("family", spec, constants), "inductor", torch.device("cpu"))
    return WholeCompiled(tree, "inductor", None, store, key)


def _check(whole: WholeCompiled, model: torch.nn.Module, sizes=(8, 1, 5), plus=0.0) -> None:
    """``whole`` answers as ``model`` does (``plus`` added: ``outputs_of``'s closure)."""
    with torch.no_grad():
        for n in sizes:
            x, mask = torch.randn(n, 16), torch.rand(n, 16)
            want = model(x, mask=mask, scale=0.5)["out"] + plus
            torch.testing.assert_close(whole(x, mask)["out"], want, atol=1e-5, rtol=1e-5)


def outputs_of(model: torch.nn.Module, scale: float = 0.5):
    """A closure over a module and a constant, as users wrap a model for ``graphed``."""

    def out(x, mask):
        return {"out": model(x, mask=mask, scale=scale)["out"] + sum(i for i in range(3))}

    return out


def test_what_names_a_function_across_processes():
    one, other = identity(Scaled()), identity(Scaled(32))
    assert one == identity(Scaled()) and one != other  # shapes, not values
    assert identity(Scaled().to(torch.float64)) != one
    assert identity(plain) == identity(plain) and identity(plain) is not None
    # A closure is named by its code and what it captured: modules by their shapes,
    # constants by value; a captured tensor (or an FX graph's generated code) by nothing.
    assert identity(outputs_of(Scaled())) == identity(outputs_of(Scaled()))
    assert identity(outputs_of(Scaled())) != identity(outputs_of(Scaled(32)))
    assert identity(outputs_of(Scaled())) != identity(outputs_of(Scaled(), 2.0))
    # The functions a module holds, by name (their identity guards are not kept).
    assert identity(Activated()) == identity(Activated())
    assert identity(Activated()) != identity(Activated(act=torch.relu))
    assert identity(lambda x: x) is not None and identity(lambda x: x) != identity(plain)
    weight = torch.ones(3)
    assert identity(lambda x: x * weight) is None
    assert identity(torch.fx.symbolic_trace(Scaled())) is None
    model, again = Scaled(), Scaled(32)
    assert identity(model.forward) != identity(again.forward)  # (the bound object counts)
    # Nested code (the generator above) by its digest, not its address: the same in
    # another process.
    code = "import test_compile_artifacts as t; print(t.identity(t.outputs_of(t.Scaled())))"
    assert _in_process(code) == str(identity(outputs_of(Scaled())))
    family = ("family",)
    key = artifact_key(Scaled(), family, "inductor", torch.device("cpu"))
    assert key == artifact_key(Scaled(), family, "inductor", torch.device("cpu"))
    assert key != artifact_key(Scaled(), ("other",), "inductor", torch.device("cpu"))
    assert artifact_key(lambda x: x * weight, family, "inductor", torch.device("cpu")) is None


def _in_process(code: str, *args: str) -> str:
    """The last line ``code`` prints in a new Python process, with this folder importable."""
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)])}
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())  # (a guard: Dynamo's global state)
    run = [sys.executable, "-c", code, *args]
    out = subprocess.run(run, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    torch.manual_seed(0)
    model = Scaled().eval()
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    whole = _whole(model, ArtifactStore(tmp_path))
    _check(whole, model)
    # A dynamic batch, and a batch of one (which Dynamo specializes): two artifacts.
    assert whole.loaded == 0 and whole.saved == 2
    code = (
        "import json, sys, torch; import test_compile_artifacts as t; "
        "from ostinato.compile_artifacts import ArtifactStore; "
        "m = t.Scaled().eval(); m.load_state_dict(torch.load(sys.argv[1] + '/weights.pt')); "
        "w = t._whole(m, ArtifactStore(sys.argv[1])); t._check(w, m, (3, 1, 16)); "
        "print(json.dumps([w.loaded, w.saved]))"
    )
    assert json.loads(_in_process(code, str(tmp_path))) == [2, 0]  # compiled nothing


def _closure_whole(model: torch.nn.Module, store: ArtifactStore | None) -> WholeCompiled:
    fn = outputs_of(model)
    x = torch.randn(4, 16)
    leaves, spec = tree_flatten(((x, x), {}))
    tree = CallTree(fn, (None, None), (0, 1), spec)
    key = artifact_key(fn, ("family", spec), "inductor", torch.device("cpu"))
    return WholeCompiled(tree, "inductor", None, store, key)


def test_a_closure_over_a_model_is_loaded_by_the_next_process_and_reads_its_weights(tmp_path):
    # The second process's model has other weights: a loaded function reads the module's
    # parameters at each call (a baked-in copy of the first one's would fail here).
    torch.manual_seed(0)
    model = Scaled().eval()
    whole = _closure_whole(model, ArtifactStore(tmp_path))
    _check(whole, model, plus=3)
    assert whole.loaded == 0 and whole.saved == 2
    code = (
        "import json, sys, torch; import test_compile_artifacts as t; "
        "from ostinato.compile_artifacts import ArtifactStore; torch.manual_seed(1); "
        "m = t.Scaled().eval(); w = t._closure_whole(m, ArtifactStore(sys.argv[1])); "
        "t._check(w, m, (3, 1, 16), plus=3); print(json.dumps([w.loaded, w.saved]))"
    )
    assert json.loads(_in_process(code, str(tmp_path))) == [2, 0]


def test_a_closure_over_a_model_holding_its_activation_is_kept(tmp_path):
    # Traced through the closure, the activation's identity is guarded by ID_MATCH,
    # which Dynamo cannot save: such a function (BERT's, on the H200) kept nothing.
    torch.manual_seed(0)
    model = Activated().eval()
    whole = _closure_whole(model, ArtifactStore(tmp_path))
    _check(whole, model, plus=3)
    assert whole.loaded == 0 and whole.saved >= 1
    code = (
        "import json, sys, torch; import test_compile_artifacts as t; "
        "from ostinato.compile_artifacts import ArtifactStore; torch.manual_seed(1); "
        "m = t.Activated().eval(); w = t._closure_whole(m, ArtifactStore(sys.argv[1])); "
        "t._check(w, m, (3, 1, 16), plus=3); print(json.dumps([w.loaded, w.saved]))"
    )
    assert json.loads(_in_process(code, str(tmp_path))) == [whole.saved, 0]


def test_a_broken_artifact_is_named_removed_and_made_again(tmp_path):
    model = Scaled().eval()
    _check(_whole(model, ArtifactStore(tmp_path)), model, (8,))
    (kept,) = (tmp_path / "compiled").iterdir()
    kept.write_bytes(b"not a compiled function")
    again = _whole(model, ArtifactStore(tmp_path))
    with pytest.warns(UserWarning, match="cannot be used.*removed"):
        _check(again, model, (8,))
    assert again.loaded == 0 and again.saved == 1
    assert kept.exists() and kept.read_bytes() != b"not a compiled function"


def test_an_unwritable_folder_is_one_warning_and_the_answers_stay_right(tmp_path):
    root = tmp_path / "a-file"
    root.write_text("")  # (a folder cannot be made under it)
    model = Scaled().eval()
    whole = _whole(model, ArtifactStore(root))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _check(whole, model)
    assert len([w for w in seen if "not kept" in str(w.message)]) == 1
    assert whole.saved == 0


def test_graphed_keeps_a_named_compilers_functions_where_asked(tmp_path):
    model = Scaled().eval()
    fast = ostinato.graphed(
        model, max_batch_size=8, compiler="inductor", platform=FakePlatform(), cache_dir=tmp_path
    )
    # (The test double's replay re-runs the ops it saw dispatched, which compiled code
    # bypasses: the answers are checked above and on the GPU, the wiring here.)
    with torch.no_grad():
        fast(torch.randn(5, 16))
    assert fast.options.store.folder == tmp_path / "compiled"
    assert list((tmp_path / "compiled").glob("*.aot"))
    off = ostinato.graphed(model, compiler="inductor", platform=FakePlatform(), cache_dir=False)
    assert off.options.store is None
    with pytest.raises(TypeError, match="cache_dir"):
        ostinato.graphed(model, cache_dir=3)
    # A folder named where nothing would be kept is refused, not ignored.
    for kwargs in (
        {"compiler": "eager"},
        {"compiler": "auto", "capture": "first_use"},
        {"compiler": "inductor", "splitting_ops": ("aten::softmax",)},
    ):
        with pytest.raises(ValueError, match="cache_dir: nothing to keep"):
            ostinato.graphed(model, cache_dir=tmp_path, **kwargs)
    weight = torch.ones(16)
    with pytest.raises(ValueError, match="cache_dir: nothing to keep: fn has no name"):
        ostinato.graphed(lambda x: model(x) * weight, compiler="inductor", cache_dir=tmp_path)
    ostinato.graphed(lambda x: model(x), compiler="inductor", cache_dir=tmp_path)
    ostinato.graphed(model, cache_dir=tmp_path)  # (staged, Inductor's upgrade: kept)


def test_a_compiled_function_that_fails_leaves_the_call_to_the_usual_compile(
    tmp_path, monkeypatch, caplog
):
    # torch's ahead-of-time path is experimental: where what it made fails, the call is
    # answered by the in-process compilation, once, and nothing is kept.
    model = Scaled().eval()
    whole = _whole(model, ArtifactStore(tmp_path))

    def broken(*args):
        raise RuntimeError("made badly")

    monkeypatch.setattr(whole, "_ahead_of_time", lambda tensors: broken)
    calls = []
    real = whole._compiled
    monkeypatch.setattr(whole, "_compiled", lambda *t: calls.append(1) or real(*t))
    with caplog.at_level("WARNING", logger="ostinato.whole_compile"):
        _check(whole, model, (8, 3))
    assert "made badly" in caplog.text and len(calls) == 2  # one answer per call
    assert whole.saved == 0 and not (tmp_path / "compiled").exists()


EDITED = """
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)

    def forward(self, x, mask=None, scale=1.0):
        return {"out": self.a(x) * FACTOR}
"""
RUN_EDITED = (
    "import json, sys, torch, warnings; sys.path.insert(0, sys.argv[1]); import edited; "
    "from test_compile_artifacts import _whole; "
    "from ostinato.compile_artifacts import ArtifactStore; "
    "torch.manual_seed(0); m = edited.Net().eval(); x = torch.randn(4, 16); "
    "w = _whole(m, ArtifactStore(sys.argv[1])); "
    "warnings.simplefilter('ignore')\n"
    "with torch.no_grad(): got = w(x, x)['out']; want = m(x)['out']\n"
    "print(json.dumps([w.loaded, w.saved, torch.allclose(got, want, atol=1e-5)]))"
)


def test_an_edited_forward_is_compiled_anew(tmp_path):
    # The key names the class and its shapes, not its code: an artifact traced from a
    # forward that has changed since is refused by its recorded source checksums.
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)])}
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    seen = []
    for factor in ("2.0", "2.0", "3.0"):
        (tmp_path / "edited.py").write_text(EDITED.replace("FACTOR", factor))
        run = [sys.executable, "-c", RUN_EDITED, str(tmp_path)]
        out = subprocess.run(run, capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        seen.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert seen == [[0, 1, True], [1, 0, True], [0, 1, True]]


def test_a_key_holds_a_bounded_number_of_artifacts(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_artifacts, "MAX_PER_KEY", 1)
    model = Scaled().eval()
    whole = _whole(model, ArtifactStore(tmp_path))
    _check(whole, model)  # two variants made (a dynamic batch and a batch of one)
    assert whole.saved == 1 and len(list((tmp_path / "compiled").iterdir())) == 1


def test_a_flat_call_is_rebuilt_without_the_pytree_walk_and_a_nested_one_with_it(monkeypatch):
    # Dynamo's trace of tree_unflatten guards on the identity of tuple and dict, which
    # torch 2.11 cannot save with a compiled function (seen on an H200 with BERT): a call
    # of plain leaves must not walk the tree; a nested one still needs it.
    import ostinato.whole_compile as whole_compile

    seen = []

    def fn(*args, **kwargs):
        seen.append((args, kwargs))
        return args[0]

    x = torch.ones(2)
    flat_leaves, flat = tree_flatten(((x, 3), {"mask": x, "scale": 0.5}))
    nested_leaves, nested = tree_flatten((([x, x],), {"mask": x}))
    assert whole_compile.flat_keywords(flat) == ("mask", "scale")
    assert whole_compile.flat_keywords(nested) is None
    assert whole_compile.flat_keywords(tree_flatten(((x,), {}))[1]) == ()
    walked = []
    real = whole_compile.tree_unflatten
    monkeypatch.setattr(whole_compile, "tree_unflatten", lambda *a: walked.append(1) or real(*a))
    y = torch.zeros(2)
    CallTree(fn, (None, 3, None, 0.5), (0, 2), flat)(y, x)
    assert not walked
    assert seen[-1][0] == (y, 3) and seen[-1][1] == {"mask": x, "scale": 0.5}
    CallTree(fn, (None, None, None), (0, 1, 2), nested)(y, x, x)
    assert walked == [1] and seen[-1][0][0][0] is y and seen[-1][1]["mask"] is x
