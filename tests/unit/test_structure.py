"""The package's shape, as a reader relies on it: layers that imports only go down through, no import
cycles (between modules, and between packages and top-level modules, deferred imports included), a reason
for every deferred import, package docstrings that list exactly the modules they hold, and strategy files
(every module the strategy registry names) that read in one sitting and hold only their parallelism.

Each check is a function of its inputs, with a test that plants a violation and shows the check reports it."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import distlab
from distlab import strategies

PACKAGE = Path(distlab.__file__).parent
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
     "pretrained", "model_build", "tiny_base", "lm_loss", "schedule", "master_weights"},
    {"measure", "results"},  # watching a run from outside, and the one results vocabulary
    {"strategies"},  # how the loop is distributed
    # the loop; memory before running, and one real step's (step_memory); writing and running launches
    {"train", "planning", "step_memory", "launch"},
    # the chapter features built on those; the pipeline sweeps chapter 04 and the benchmarks both run
    {"workers", "lan", "slurm", "inference", "pipeline_sweeps", "lessons"},
    # the top: each chapter's plumbing, benchmarks, the user's commands (and __main__, their entry point), the book
    {"chapters", "bench", "commands", "publish", "__main__"},
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


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def unit_cycles(graph: dict[str, set[str]]) -> list[str]:
    """One line per group of packages and top-level modules that import each other round a cycle (a strongly
    connected group of `graph` with each module replaced by its unit), with the imports that close it. Two
    packages of one layer count as much as any: one of them must not import the other."""
    units: dict[str, set[str]] = {}
    for name, deps in graph.items():
        units.setdefault(unit(name), set()).update(unit(d) for d in deps if unit(d) != unit(name))
    reach = {u: _reachable(units, u) for u in units}
    groups = sorted({tuple(sorted(v for v in units if v in reach[u] and u in reach[v]))
                     for u in units if u in reach[u]})
    out = []
    for group in groups:
        # the imports between the group's units, each by its deepest module (not the packages on the way)
        edges = [f"{a} -> {b}" for a, deps in sorted(graph.items()) if unit(a) in group for b in sorted(deps)
                 if unit(b) in group and unit(b) != unit(a) and not any(d.startswith(b + ".") for d in deps)]
        out.append(f"{', '.join(group)}: {'; '.join(edges)}")
    return out


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_packages_or_top_level_modules_import_each_other():
    cycles = unit_cycles(full_import_graph())
    assert cycles == [], ("packages and top-level modules that import each other round a cycle (move what they share "
                          "into a module below them all):\n" + "\n".join(cycles))


def test_the_package_cycle_check_finds_packages_of_one_layer_and_a_deferred_cycle():
    # bench and chapters, both on top, importing each other (as they did: ch04's sweeps, ch05's balance runs)
    graph = {"distlab.bench.pipeline_bubble": {"distlab", "distlab.chapters", "distlab.chapters.ch04"},
             "distlab.chapters.ch05": {"distlab", "distlab.bench", "distlab.bench.lan_balance"},
             "distlab.chapters.ch04": {"distlab", "distlab.measure", "distlab.measure.bubble"},
             "distlab.measure.bubble": {"distlab"}, "distlab": set()}
    assert unit_cycles(graph) == ["bench, chapters: distlab.bench.pipeline_bubble -> distlab.chapters.ch04; "
                                  "distlab.chapters.ch05 -> distlab.bench.lan_balance"]
    # three top-level modules round a cycle (config -> models was a deferred import: the check reads the graph
    # with deferred imports, which still depend)
    graph = {"distlab.config": {"distlab.models"}, "distlab.models": {"distlab.pretrained"},
             "distlab.pretrained": {"distlab.config"}, "distlab.paths": set()}
    assert unit_cycles(graph) == ["config, models, pretrained: distlab.config -> distlab.models; "
                                  "distlab.models -> distlab.pretrained; distlab.pretrained -> distlab.config"]
    # one way only, and modules of one package importing each other (the module-level check's business): none
    graph = {"distlab.bench.a": {"distlab.bench.b"}, "distlab.bench.b": {"distlab.bench.a"},
             "distlab.chapters.ch05": {"distlab.bench.a"}}
    assert unit_cycles(graph) == []


def test_imports_only_go_down_the_layers():
    violations = layer_violations(full_import_graph(), LAYER_OF)
    assert violations == [], "imports that go up a layer:\n" + "\n".join(violations)


def test_the_layer_check_finds_an_upward_import_and_an_unplaced_module():
    layer_of = {"distlab": 0, "config": 0, "train": 3, "lan": 4}
    graph = {"distlab.config": {"distlab.lan.hosts"}, "distlab.train": {"distlab.config"}, "distlab.new": set()}
    assert layer_violations(graph, layer_of) == ["distlab.config (layer 0) -> distlab.lan.hosts (layer 4)",
                                                 "distlab.new: 'new' is in no layer (add it to LAYERS)"]


# A package's docstring lists what it holds, one entry a line: indented at most four spaces (after a layer
# number such as `2.` in distlab's own listing), the module's name, a subpackage's with a trailing `/`, then two
# or more spaces (one after a `/`) and what it holds. Prose may name modules too; only entries count.
ENTRY = re.compile(r"^[ ]{0,4}(?:\d+\.[ ]+)?(?P<name>[A-Za-z_]\w*)(?:(?P<package>/)[ ]+|[ ]{2,})\S", re.M)


def listed_entries(doc: str) -> dict[str, bool]:
    """name -> whether it is listed as a subpackage, for every entry of a package docstring."""
    return {m["name"]: bool(m["package"]) for m in ENTRY.finditer(doc)}


def held_by(init: Path) -> dict[str, bool]:
    """name -> whether it is a subpackage, for every module and subpackage the package of `init` holds
    (`__main__` aside: it is the package's command, which the docstring shows as such)."""
    held = {p.stem: False for p in init.parent.glob("*.py") if p.stem not in ("__init__", "__main__")}
    held.update({p.parent.name: True for p in init.parent.glob("*/__init__.py")})
    return held


def listing_problems(package: str, doc: str, held: dict[str, bool]) -> list[str]:
    """What a package docstring's entries get wrong against what the package holds: a module it does not list,
    an entry naming nothing it holds, a module listed as a subpackage or the other way round."""
    def kind(subpackage: bool) -> str:
        return "subpackage" if subpackage else "module"

    listed = listed_entries(doc)
    out = [f"{package}: {kind(sub)} {name} is not listed" for name, sub in sorted(held.items()) if name not in listed]
    for name, sub in sorted(listed.items()):
        if name not in held:
            out.append(f"{package}: lists {name}, which it does not hold")
        elif sub != held[name]:
            out.append(f"{package}: lists {name} as a {kind(sub)}, which is a {kind(held[name])}")
    return out


def package_docstring_problems(packages: dict[str, Path]) -> list[str]:
    out = []
    for name, init in sorted(packages.items()):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        out += listing_problems(name, doc, held_by(init))
    return out


def test_every_package_docstring_lists_exactly_the_modules_it_holds():
    # distlab's own docstring too: its layers list every top-level module and package
    packages = {module_name(p): p for p in PACKAGE.rglob("__init__.py")}
    problems = package_docstring_problems(packages)
    assert problems == [], "package docstrings that do not list what their package holds:\n" + "\n".join(problems)


def test_an_entry_is_a_name_then_two_spaces_and_prose_is_none():
    doc = """Prose that names alpha, or beta  with two spaces, deep in a sentence, lists nothing.

2. alpha/     a subpackage, after a layer number
   beta       a module
              a continued line  with two spaces, indented deeper than an entry
  gamma  the third:

      python -m pkg.gamma up
delta  unindented"""
    assert listed_entries(doc) == {"alpha": True, "beta": False, "gamma": False, "delta": False}


def test_the_docstring_check_finds_an_unlisted_module_and_an_entry_of_nothing(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""Holds alpha, and beta (named in prose only).\n\n'
                                     '  alpha    the first\n  monitor  a module that is not there\n'
                                     '  sub      a subpackage listed as a module\n"""\n')
    for name in ("alpha.py", "beta.py", "__main__.py", "sub/__init__.py"):
        (pkg / name).write_text("")
    assert package_docstring_problems({"pkg": pkg / "__init__.py"}) == [
        "pkg: module beta is not listed", "pkg: lists monitor, which it does not hold",
        "pkg: lists sub as a module, which is a subpackage"]


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def undeclared_deferred_imports(source: str, filename: str) -> list[str]:
    """`file:line: import` for every import inside a function without a `# deferred: <reason>` comment on its
    lines or the line above."""
    lines = source.splitlines()
    tree = ast.parse(source, filename)
    undeclared = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for node in ast.walk(fn):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                block = lines[node.lineno - 1:node.end_lineno]
                above = lines[node.lineno - 2] if node.lineno >= 2 else ""
                if not any("# deferred:" in line for line in block + [above]):
                    undeclared.append(f"{Path(filename).name}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return undeclared


@pytest.mark.parametrize("name", sorted(MODULES), ids=str)
def test_every_function_level_import_says_why_it_is_deferred(name):
    path = MODULES[name]
    undeclared = undeclared_deferred_imports(path.read_text(), str(path))
    assert undeclared == [], "a function-level import needs a `# deferred: <reason>` comment (or move it up)"


def test_the_deferred_import_check_finds_an_import_without_a_reason():
    source = """import json


def load():
    import torch  # deferred: slow to import

    # deferred: only a build needs it
    from transformers import AutoModel
    import yaml
    return json, torch, AutoModel, yaml
"""
    assert undeclared_deferred_imports(source, "lib/mod.py") == ["mod.py:9: import yaml"]


def strategy_modules(registry: dict[str, str]) -> list[str]:
    """The modules a strategy registry (name -> "module:Class", as distlab.strategies holds it) names, each once."""
    return sorted({target.split(":")[0] for target in registry.values()})


STRATEGY_FILES = strategy_modules(strategies._REGISTRY)


def strategy_file_problems(stem: str, source: str) -> list[str]:
    """What keeps a strategy file from reading in one sitting and holding only its parallelism: more than
    MAX_STRATEGY_LINES lines, an import of another strategy (a composition imports those it composes), a
    measurement of its own (a strategy measures through the meter the loop hands it)."""
    name = f"distlab.strategies.{stem}"
    out = []
    if len(source.splitlines()) > MAX_STRATEGY_LINES:
        out.append(f"{stem}: {len(source.splitlines())} lines, more than {MAX_STRATEGY_LINES}")
    imported = {m for node in ast.walk(ast.parse(source)) if isinstance(node, (ast.Import, ast.ImportFrom))
                for m in _imported(node, name)}
    allowed = SHARED_STRATEGY_MODULES | COMPOSED_FROM.get(stem, set())
    other = sorted(m for m in imported if m.startswith("distlab.strategies") and m not in allowed)
    if other:
        out.append(f"{stem} imports another strategy: {', '.join(other)}")
    measuring = sorted(m for m in imported if m.startswith("distlab.measure"))
    if measuring:
        out.append(f"{stem} measures by itself instead of through its meter: {', '.join(measuring)}")
    return out


def test_the_strategy_files_are_the_registry_s_and_every_other_strategies_module_is_shared():
    assert strategy_modules({"zero2": "zero:Zero2Strategy", "zero3": "zero:Zero3Strategy", "ddp": "ddp:DDP"}) == [
        "ddp", "zero"]
    held = {m for m in MODULES if m.startswith("distlab.strategies.")}
    registered = {f"distlab.strategies.{stem}" for stem in STRATEGY_FILES}
    assert registered <= held, f"the registry names modules that are not there: {registered - held}"
    assert held - registered - SHARED_STRATEGY_MODULES == set(), "neither a registered strategy nor shared"


@pytest.mark.parametrize("stem", STRATEGY_FILES)
def test_a_strategy_file_reads_in_one_sitting_and_holds_only_its_parallelism(stem):
    assert strategy_file_problems(stem, MODULES[f"distlab.strategies.{stem}"].read_text()) == []


def test_the_strategy_check_finds_a_long_file_another_strategy_and_its_own_measuring():
    source = "from distlab.strategies.base import Strategy\nfrom distlab.strategies.ddp import DDPStrategy\n" \
             "from distlab.measure import comm\n" + "\n" * MAX_STRATEGY_LINES
    assert strategy_file_problems("fsdp", source) == [
        f"fsdp: {MAX_STRATEGY_LINES + 3} lines, more than {MAX_STRATEGY_LINES}",
        "fsdp imports another strategy: distlab.strategies.ddp",
        "fsdp measures by itself instead of through its meter: distlab.measure, distlab.measure.comm"]
    # a composition imports what it composes, and nothing else
    composed = "from distlab.strategies import fsdp, tp\nfrom distlab.strategies.zero import Zero3Strategy\n"
    assert strategy_file_problems("fsdp_tp", composed) == ["fsdp_tp imports another strategy: distlab.strategies.zero"]


def _modules_loaded_by(statement: str) -> set[str]:
    """Every module a fresh interpreter has loaded after `statement` (distlab's and its dependencies')."""
    code = f"{statement}; import sys; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


@pytest.mark.slow  # a fresh interpreter importing the training stack: ~3 s
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
