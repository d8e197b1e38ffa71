"""The package's shape, as a reader relies on it: no import cycles, a reason for every deferred import,
strategy files that read in one sitting and hold only their parallelism."""

import ast
from pathlib import Path

import pytest

import distlab

PACKAGE = Path(distlab.__file__).parent
STRATEGY_FILES = ("single", "ddp", "fsdp", "zero", "pipeline", "ds_pipeline")
SHARED_STRATEGY_MODULES = {"distlab.strategies", "distlab.strategies.base", "distlab.strategies.split",
                           "distlab.strategies.staged", "distlab.strategies.deepspeed_runtime"}
MAX_STRATEGY_LINES = 350


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
    assert other <= SHARED_STRATEGY_MODULES, f"{stem} imports another strategy: {other - SHARED_STRATEGY_MODULES}"
    measuring = {m for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                 for m in _imported(node, name) if m.startswith("distlab.measure")}
    assert measuring == set(), f"{stem} measures by itself instead of through its meter: {measuring}"
