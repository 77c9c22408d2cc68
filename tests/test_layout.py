"""The house: the import graph of the package, drawn from the source (every import,
including those inside functions), has no cycle and respects the layers."""

import ast
import functools
import re
from collections import defaultdict
from dataclasses import fields
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# The library's layers, lowest first: a module may import its own layer and lower ones.
LIBRARY_LAYERS = [
    {"modes", "batch", "context", "errors", "mathutil", "turns", "provenance", "param_updates"}
    | {"replay_check", "cache_root", "compile_artifacts", "switch_interval", "early_context"}
    | {"steps_first"},
    {"platform"},
    {"graph", "pool", "capture_report", "guard", "tensor_views"},
    {"config", "resolution", "dispatcher", "capture_planner"},
    {"runtime", "manager", "background", "graph_outputs", "piecewise", "distributed", "ubatch"}
    | {"replay_stats", "whole_compile", "recapture"},
    {"callable_graphs", "adaptive_ladder", "staged", "backend", ""},
]
# Side by side, neither imports the other.
SIBLINGS = [
    (
        {"graph", "pool", "capture_report", "guard", "tensor_views"},
        {"config", "resolution", "dispatcher"},
    ),
    ({"distributed"}, {"ubatch"}),
]


@functools.cache
def modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "ostinato").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


@functools.cache  # parsed once for every test (read-only)
def import_graph() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    edges[name].add(target if target in mods else base)
            elif isinstance(node, ast.Import):
                edges[name].update(a.name for a in node.names)
    return {k: {t for t in v if t in mods and t != k} for k, v in edges.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def top(name: str) -> str:
    """The library part a module belongs to: ``graph`` for ``ostinato.graph``,
    ``distributed`` for ``ostinato.distributed.groups``, ``""`` for the package itself."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_the_library_never_imports_the_engine():
    for name, targets in import_graph().items():
        if not name.startswith("ostinato.engine"):
            engine = sorted(t for t in targets if t.startswith("ostinato.engine"))
            assert not engine, f"{name} imports {engine}"


def test_library_layers_import_only_downwards():
    rank = {part: i for i, layer in enumerate(LIBRARY_LAYERS) for part in layer}
    for name, targets in import_graph().items():
        if name.startswith("ostinato.engine"):
            continue
        assert top(name) in rank, f"{name}: place it in a layer of LIBRARY_LAYERS"
        for t in targets:
            assert rank[top(t)] <= rank[top(name)], f"{name} imports the higher {t}"


def test_siblings_do_not_import_each_other():
    for name, targets in import_graph().items():
        for left, right in SIBLINGS:
            for mine, other in ((left, right), (right, left)):
                if top(name) in mine and not name.startswith("ostinato.engine"):
                    bad = sorted(t for t in targets if top(t) in other)
                    assert not bad, f"{name} imports its sibling {bad}"


def test_kernels_are_leaves():
    # A kernel owns its constants: it imports other kernels, never its callers.
    for name, targets in import_graph().items():
        if name.startswith("ostinato.engine.kernels"):
            callers = sorted(
                t
                for t in targets
                if t.startswith("ostinato.engine") and not t.startswith("ostinato.engine.kernels")
            )
            assert not callers, f"{name} imports {callers}"


def test_the_library_needs_only_torch_and_tqdm():
    # numpy, safetensors, gguf and transformers are the engine's (the `engine` extra);
    # torch_npu is imported only on Ascend machines, behind a guard.
    import sys

    allowed = {"torch", "tqdm", "torch_npu", "ostinato"} | set(sys.stdlib_module_names)
    for name, path in modules().items():
        if name.startswith("ostinato.engine"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert roots <= allowed, f"{name} imports {sorted(roots - allowed)}"


def test_importing_the_library_loads_no_engine_dependency():
    import subprocess
    import sys

    code = (
        "import sys; import torch; before = set(sys.modules); import ostinato, "
        "ostinato.piecewise, ostinato.distributed, ostinato.ubatch; "
        "new = set(sys.modules) - before; "
        "roots = {m.split('.')[0] for m in new}; "
        "print(sorted(roots & {'transformers', 'gguf', 'safetensors', 'numpy'}) "
        "+ sorted(m for m in new if m.startswith('ostinato.engine')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# The engine's sub-packages, lowest first: a sub-package imports its own layer's modules
# and lower layers' only (and, in one layer, siblings never both ways).
ENGINE_LAYERS = [
    {"kernels", "core"},
    {"model", "sample", "parallel"},
    {"loading", "worker"},
    {"spec"},
    {"api"},
    {"serve"},
    {"cli", "__main__", ""},
]


def engine_part(name: str) -> str | None:
    """The engine sub-package of a module: ``worker`` for ``ostinato.engine.worker.runner``,
    ``""`` for ``ostinato.engine`` itself, None outside the engine."""
    parts = name.split(".")
    if parts[:2] != ["ostinato", "engine"]:
        return None
    return parts[2] if len(parts) > 2 else ""


def engine_graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for name, targets in import_graph().items():
        mine = engine_part(name)
        if mine is None:
            continue
        for t in targets:
            theirs = engine_part(t)
            if theirs is not None and theirs != mine and mine != "":
                edges[mine].add(theirs)
    return edges


def test_engine_sub_packages_are_layered_with_no_loop():
    rank = {part: i for i, layer in enumerate(ENGINE_LAYERS) for part in layer}
    edges = engine_graph()
    for mine, targets in edges.items():
        assert mine in rank, f"ostinato.engine.{mine}: place it in a layer of ENGINE_LAYERS"
        for t in targets:
            assert rank[t] <= rank[mine], f"ostinato.engine.{mine} imports the higher {t}"
    assert find_cycle(edges) is None


# The length rules hold for every wing and for the tests and scripts beside them.
CODE = [SRC / "ostinato", *(SRC.parent / d for d in ("benchmarks", "tests", "scripts"))]
DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _functions_and_classes():
    for path in (p for root in CODE for p in root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, DEFINITIONS):
                yield path, node, node.end_lineno - node.lineno + 1


def _is_kernel(node: ast.AST) -> bool:
    """A Triton or Gluon kernel: its body is one device function, read as a whole."""
    decorators = getattr(node, "decorator_list", [])
    return any(ast.unparse(d).split("(")[0].endswith(".jit") for d in decorators)


def test_no_function_over_80_lines_outside_kernels():
    long = [
        f"{path.relative_to(SRC.parent)}:{node.name} ({n} lines)"
        for path, node, n in _functions_and_classes()
        if not isinstance(node, ast.ClassDef) and n > 80 and not _is_kernel(node)
    ]
    assert not long, f"split these: {long}"


def test_a_function_over_60_lines_says_why():
    # Over 60 lines needs a reason, written in the function as a comment that begins
    # "# Over 60 lines:" (kernels are read whole and exempt).
    unexplained = []
    for path, node, n in _functions_and_classes():
        if isinstance(node, ast.ClassDef) or n <= 60 or _is_kernel(node):
            continue
        lines = path.read_text().splitlines()[node.lineno - 1 : node.end_lineno]
        if not any(line.strip().startswith("# Over 60 lines:") for line in lines):
            unexplained.append(f"{path.relative_to(SRC.parent)}:{node.name} ({n} lines)")
    assert not unexplained, f"split these or say why they are long: {unexplained}"


def _undocumented(tree: ast.Module, documented_methods: set[str]) -> list[ast.AST]:
    """Public module-level functions and classes without a docstring, and public methods
    without one that are neither properties, nor overrides (a method of that name is
    documented in another class of the package), nor named in their class's docstring."""
    missing: list[ast.AST] = []
    for node in tree.body:
        if not isinstance(node, DEFINITIONS) or node.name.startswith("_"):
            continue
        if ast.get_docstring(node) is None:
            missing.append(node)
        if not isinstance(node, ast.ClassDef):
            continue
        told = ast.get_docstring(node) or ""
        for m in node.body:
            if (
                isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                and not m.name.startswith("_")
                and ast.get_docstring(m) is None
                and m.name not in documented_methods
                and f"``{m.name}" not in told
                and not any(ast.unparse(d) == "property" for d in m.decorator_list)
            ):
                missing.append(m)
    return missing


def test_every_public_class_and_function_says_what_it_guarantees():
    trees = {p: ast.parse(p.read_text()) for p in (SRC / "ostinato").rglob("*.py")}
    documented = {
        m.name
        for tree in trees.values()
        for c in ast.walk(tree)
        if isinstance(c, ast.ClassDef)
        for m in c.body
        if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(m)
    }
    missing = [
        f"{path.relative_to(SRC)}:{node.lineno} {node.name}"
        for path, tree in trees.items()
        for node in _undocumented(tree, documented | {"forward", "__call__"})
    ]
    assert not missing, f"write a docstring (what it guarantees) for: {missing}"


def test_the_docstring_rule_finds_what_lacks_one():
    source = '''
def f(): pass
class A:
    """``g`` is told."""
    def g(self): pass
    def h(self): pass
    def over(self): pass
    @property
    def p(self): pass
def _private(): pass
'''
    assert [n.name for n in _undocumented(ast.parse(source), {"over"})] == ["f", "h"]


def test_no_class_over_500_lines():
    big = [
        f"{path.relative_to(SRC.parent)}:{node.name} ({n} lines)"
        for path, node, n in _functions_and_classes()
        if isinstance(node, ast.ClassDef) and n > 500
    ]
    assert not big, f"split these by concern: {big}"


def test_the_llm_facade_stays_thin():
    lines = (SRC / "ostinato" / "engine" / "api" / "llm.py").read_text().count("\n")
    assert lines <= 300, f"engine/api/llm.py has {lines} lines: move the work into the Engine"


def test_launch_rules_are_one_value():
    # A rule of how kernels launch is a field of ``LaunchRules``, read where they launch,
    # not a module constant beside it; the benchmark that varies them patches nothing.
    from ostinato.engine.kernels.launch_rules import LaunchRules

    names = {f.name.upper() for f in fields(LaunchRules)}
    for path in sorted((SRC / "ostinato" / "engine").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            targets = (
                node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            )
            bad = sorted(t.id for t in targets if isinstance(t, ast.Name) and t.id in names)
            assert not bad, f"{path.relative_to(SRC)} defines launch rules {bad} as constants"
    bench = (SRC.parent / "benchmarks" / "launch_rules.py").read_text()
    assert "mock" not in bench and "setattr" not in bench


def test_test_files_have_unique_names():
    # pytest imports test files by their base name (rootdir-relative, no packages): two
    # of one name stop the whole run at collection.
    names = [p.name for p in (SRC.parent / "tests").rglob("test_*.py")]
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"test files share a name: {twice}"


BENCHMARKS = SRC.parent / "benchmarks"
# What benchmarks may import of the engine besides ``ostinato.engine`` itself: its public
# tuning hooks, each named for what it offers.
BENCHMARK_HOOKS = {
    "ostinato.engine.cli.args": "the command line's option types, so flags fail alike",
    "ostinato.engine.model.presets": "the model shapes and the default model's file",
}
# The benchmarks that time the engine's parts directly (a step of the runner, the
# launch rules, micro-batched steps) and so import its internals: at most three.
BENCHMARKS_ON_INTERNALS = {"decode.py", "launch_rules.py", "ubatch.py"}


def _engine_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("ostinato.engine")}


def test_benchmarks_use_public_api_and_the_named_hooks():
    assert len(BENCHMARKS_ON_INTERNALS) <= 3
    allowed = {"ostinato.engine", *BENCHMARK_HOOKS}
    for path in sorted(BENCHMARKS.glob("*.py")):
        if path.name in BENCHMARKS_ON_INTERNALS:
            continue
        bad = sorted(_engine_imports(path) - allowed)
        assert not bad, f"benchmarks/{path.name} imports engine internals {bad}"


def test_the_readme_stays_under_200_lines_without_commit_hashes():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert len(text.splitlines()) < 200
    words = re.findall(r"\b[0-9a-f]{7,40}\b", text)
    hashes = [w for w in words if re.search("[a-f]", w) and re.search("[0-9]", w)]
    assert not hashes, f"README names commits {hashes}"


def test_graphs_are_captured_only_by_the_platform():
    # A capture elsewhere would not hold ``exclusive_device``, which keeps captures in a
    # process from overlapping and an engine's build out of them.
    capture = re.compile(r"\bcapture_begin\(|\btorch\.(cuda|npu)\.graph\(")
    outside = [
        str(path.relative_to(SRC))
        for path in sorted((SRC / "ostinato").rglob("*.py"))
        if "platform" not in path.relative_to(SRC).parts and capture.search(path.read_text())
    ]
    assert not outside, f"capture through Platform.capture instead: {outside}"


def test_triton_kernels_are_launched_only_through_launch():
    # ``kernels.launch.launch`` is where a launch compiles ahead (``compile_ahead``) and
    # where a thread beside the steps pauses for them (``ostinato.steps_first``); a
    # ``kernel[grid](...)`` elsewhere would do neither.
    here = SRC / "ostinato" / "engine" / "kernels" / "launch.py"
    outside = [
        f"{path.relative_to(SRC)}:{node.lineno}"
        for path in sorted((SRC / "ostinato").rglob("*.py"))
        if path != here
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
    ]
    assert not outside, f"launch through kernels.launch.launch instead: {outside}"


def test_the_switch_interval_is_set_only_by_its_holders():
    # Threads that lower it overlap (a capture thread beside a serving loop, engines in
    # one server); set anywhere else, one thread's restore would undo another's lower.
    setter = re.compile(r"\bsys\.setswitchinterval\(")
    home = SRC / "ostinato" / "switch_interval.py"
    elsewhere = [
        str(path.relative_to(SRC))
        for path in sorted((SRC / "ostinato").rglob("*.py"))
        if path != home and setter.search(path.read_text())
    ]
    assert not elsewhere, f"hold it through ostinato.switch_interval instead: {elsewhere}"


def _pdl_launchers() -> tuple[set[str], dict[str, bool], dict[str, set[str]]]:
    """Over the engine's kernels: the functions that launch with ``launch_pdl=``; whether
    each function calls ``pdl_for`` itself; and each function's callers (by name, within
    the kernels)."""
    calls: dict[str, set[str]] = {}
    launches: set[str] = set()
    for path in sorted((SRC / "ostinato" / "engine" / "kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            inner = [n for n in ast.walk(node) if isinstance(n, ast.Call)]
            calls[node.name] = {n.func.id for n in inner if isinstance(n.func, ast.Name)}
            if any(k.arg == "launch_pdl" for n in inner for k in n.keywords):
                launches.add(node.name)
    callers: dict[str, set[str]] = defaultdict(set)
    for caller, named in calls.items():
        for callee in named:
            callers[callee].add(caller)
    return launches, {f: "pdl_for" in named for f, named in calls.items()}, callers


def test_every_pdl_launch_takes_its_flag_through_pdl_for():
    # ``pdl_for`` is where the launch rules and a step measured faster without PDL
    # (``launch.without_pdl``) turn it off: a launch whose flag bypasses it keeps PDL on
    # there (the small GEMM's did). So each launching function calls it, or every caller
    # does, transitively (a private helper handed the gated flag).
    launchers, gates, callers = _pdl_launchers()

    def gated(f: str, seen: frozenset[str]) -> bool:
        if gates.get(f, False):
            return True
        up = callers.get(f, set()) - seen
        return bool(up) and all(gated(c, seen | {f}) for c in up)

    assert len(launchers) >= 10, f"launch_pdl= found in {sorted(launchers)} alone"
    ungated = sorted(f for f in launchers if not gated(f, frozenset()))
    assert not ungated, f"launched with PDL without pdl_for on the way: {ungated}"
