"""The package's shape, as a reader relies on it: layers that imports only go down through, no import
cycles, a reason for every deferred import, package docstrings that name every module they hold, and
strategy files that read in one sitting and hold only their parallelism."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import distlab

PACKAGE = Path(distlab.__file__).parent
STRATEGY_FILES = ("single", "ddp", "fsdp", "zero", "pipeline", "ds_pipeline", "tp", "fsdp_tp")
SHARED_STRATEGY_MODULES = {"distlab.strategies", "distlab.strategies.base", "distlab.strategies.split",
                           "distlab.strategies.staged", "distlab.strategies.deepspeed_runtime"}
# A composition of parallelisms is written from the strategies it composes, and only from those.
COMPOSED_FROM = {"fsdp_tp": {"distlab.strategies.fsdp", "distlab.strategies.tp"}}
MAX_STRATEGY_LINES = 350

# The layers, bottom up: a module may import its own layer and those below, never one above. A top-level
# module or package is named once; every module inside a package is in the package's layer.
LAYERS = (
    # core: what a training run is made of; torch-free where it can be (config, paths, provenance, ...)
    {"distlab", "attention", "batching", "checkpoint", "cli", "compat", "config", "data", "device", "dropout",
     "faults", "generate", "jsonio", "keyfacts", "layer_split", "metrics", "models", "paths", "prepare", "provenance",
     "yaml_input", "markdown", "machine", "preemption", "folder_lock", "safe_load", "sharded_load",
     "pretrained"},
    {"measure", "results"},  # watching a run from outside, and the one results vocabulary
    {"strategies"},  # how the loop is distributed
    {"train", "planning", "launch"},  # the loop; memory before running; writing and running launches
    {"workers", "lan", "slurm", "inference"},  # the chapter features built on those
    # the top: each chapter's plumbing, benchmarks, the user's commands (and their documented aliases), the book
    {"chapters", "bench", "commands", "publish", "infer", "scaling", "report", "matrix", "accept", "monitor"},
)
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imported(node: ast.AST, current: str) -> list[str]:
    """distlab modules an import statement loads (the packages on the way included)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            base = ".".join(current.split(".")[:-node.level] + ([base] if base else []))
        names = [base] + [f"{base}.{a.name}" for a in node.names]
    out = []
    for name in names:
        if not name.startswith("distlab"):
            continue
        parts = name.split(".")
        out += [m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in MODULES]
    return out


def _module_level_imports(tree: ast.Module):
    """Imports that run when the module is imported: not inside functions, not under TYPE_CHECKING."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        elif isinstance(node, ast.ClassDef):
            stack.extend(node.body)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        # a submodule importing its siblings passes through its own package, which is already importing
        graph[name] = {m for node in _module_level_imports(tree) for m in _imported(node, name)} - {name} - ancestors
    return graph


def _all_imports(tree: ast.Module):
    """Every import statement, deferred ones included (a deferred import still depends), except those under
    TYPE_CHECKING, which never run."""
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip]


def unit(module: str) -> str:
    """The top-level module or package a module belongs to ("distlab" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_violations(graph: dict[str, set[str]], layer_of: dict[str, int]) -> list[str]:
    """`a -> b` for every import of a module in a higher layer; a module in no layer is a violation too."""
    out = []
    for name, deps in sorted(graph.items()):
        if unit(name) not in layer_of:
            out.append(f"{name}: {unit(name)!r} is in no layer (add it to LAYERS)")
            continue
        out += [f"{name} (layer {layer_of[unit(name)]}) -> {dep} (layer {layer_of[unit(dep)]})"
                for dep in sorted(deps) if layer_of.get(unit(dep), -1) > layer_of[unit(name)]]
    return out


def full_import_graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = {m for node in _all_imports(tree) for m in _imported(node, name)} - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_only_go_down_the_layers():
    violations = layer_violations(full_import_graph(), LAYER_OF)
    assert violations == [], "imports that go up a layer:\n" + "\n".join(violations)


def test_the_layer_check_finds_an_upward_import_and_an_unplaced_module():
    layer_of = {"distlab": 0, "config": 0, "train": 3, "lan": 4}
    graph = {"distlab.config": {"distlab.lan.hosts"}, "distlab.train": {"distlab.config"}, "distlab.new": set()}
    assert layer_violations(graph, layer_of) == ["distlab.config (layer 0) -> distlab.lan.hosts (layer 4)",
                                                 "distlab.new: 'new' is in no layer (add it to LAYERS)"]


def package_docstring_omissions(packages: dict[str, Path]) -> list[str]:
    """`package: module` for every module or subpackage a package holds that its docstring does not name."""
    out = []
    for name, init in sorted(packages.items()):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        held = sorted({p.stem for p in init.parent.glob("*.py")} - {"__init__", "__main__"}
                      | {p.parent.name for p in init.parent.glob("*/__init__.py")})
        out += [f"{name}: {m}" for m in held if not re.search(rf"(?<![\w.]){re.escape(m)}\b", doc)]
    return out


def test_every_package_docstring_names_every_module_it_holds():
    packages = {module_name(p): p for p in PACKAGE.rglob("__init__.py")}
    omissions = package_docstring_omissions(packages)
    assert omissions == [], "modules their package's docstring does not name:\n" + "\n".join(omissions)


def test_the_docstring_check_finds_an_unnamed_module(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text('"""Holds alpha: the first."""\n')
    (tmp_path / "pkg" / "alpha.py").write_text("")
    (tmp_path / "pkg" / "beta.py").write_text("")
    assert package_docstring_omissions({"pkg": tmp_path / "pkg" / "__init__.py"}) == ["pkg: beta"]


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("name", sorted(MODULES), ids=str)
def test_every_function_level_import_says_why_it_is_deferred(name):
    path = MODULES[name]
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines), str(path))
    undeclared = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for node in ast.walk(fn):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                block = lines[node.lineno - 1:node.end_lineno]
                above = lines[node.lineno - 2] if node.lineno >= 2 else ""
                if not any("# deferred:" in line for line in block + [above]):
                    undeclared.append(f"{path.name}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert undeclared == [], "a function-level import needs a `# deferred: <reason>` comment (or move it up)"


@pytest.mark.parametrize("stem", STRATEGY_FILES)
def test_a_strategy_file_reads_in_one_sitting_and_holds_only_its_parallelism(stem):
    name = f"distlab.strategies.{stem}"
    path = MODULES[name]
    assert len(path.read_text().splitlines()) <= MAX_STRATEGY_LINES
    tree = ast.parse(path.read_text(), str(path))
    other = {m for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
             for m in _imported(node, name) if m.startswith("distlab.strategies")}
    allowed = SHARED_STRATEGY_MODULES | COMPOSED_FROM.get(stem, set())
    assert other <= allowed, f"{stem} imports another strategy: {other - allowed}"
    measuring = {m for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                 for m in _imported(node, name) if m.startswith("distlab.measure")}
    assert measuring == set(), f"{stem} measures by itself instead of through its meter: {measuring}"


def _modules_loaded_by(statement: str) -> set[str]:
    """Every module a fresh interpreter has loaded after `statement` (distlab's and its dependencies')."""
    code = f"{statement}; import sys; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


def test_the_training_loop_loads_no_chapter_feature_and_no_publishing():
    loaded = {m for m in _modules_loaded_by("import distlab.train") if m.startswith("distlab")}
    features = ("distlab.lan", "distlab.slurm", "distlab.inference", "distlab.publish", "distlab.launch",
                "distlab.workers", "distlab.planning", "distlab.chapters", "distlab.bench", "distlab.commands")
    assert not {m for m in loaded if m.startswith(features)}, sorted(loaded)
    assert "distlab.train" in loaded


def test_the_planner_is_torch_free_arithmetic():
    loaded = _modules_loaded_by("import distlab.planning.plan, distlab.planning.advice, distlab.planning.zero_paper")
    assert "distlab.planning.plan" in loaded
    assert not {m for m in loaded if m == "torch" or m.startswith("torch.")}
