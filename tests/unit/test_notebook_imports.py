"""Every notebook call one step from its import: a reader who sees `x.f(...)` in a chapter finds `f` defined in
the module `x` the notebook imported, not imported there from somewhere else (a re-export), and a name a
notebook imports with `from m import f` is defined in `m`.

Read from the stored notebooks' code cells with ast, no kernel: the notebook's own cells as one namespace, each
`%%writefile` script on its own. Only modules under lib/ (distlab's) are checked; torch, pandas and the
scripts a notebook writes are not. A chapter may call its own chapter module (`ch04` in notebook 04), never
another chapter's: what chapters share lives below them (distlab.launch.scripts, distlab.lessons). A notebook
that rebinds a module's name (`plan = ...` after `from distlab.planning import plan`) fails too.

Run it by hand for the list of problems: `python tests/unit/test_notebook_imports.py`."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "lib"
NOTEBOOKS = ROOT / "notebooks"


# ------------------------------------------------------------------------------------ the modules, read

def module_file(name: str, roots: list[Path]) -> Path | None:
    """The source file of module `name` under one of `roots` (a package's __init__.py), or None."""
    rel = Path(*name.split("."))
    for root in roots:
        for candidate in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def top_level_names(source: str) -> tuple[set[str], dict[str, str]]:
    """(names a module defines at top level by def, class or assignment; name -> what for names it only
    imports). Blocks that run at import (if, try, with, for) count; function and class bodies do not."""
    defined: set[str] = set()
    imported: dict[str, str] = {}

    def targets(node: ast.AST):
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                defined.add(n.id)

    stack = list(ast.parse(source).body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                targets(t)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets(node.target)
        elif isinstance(node, ast.Import):
            for a in node.names:
                imported[a.asname or a.name.split(".")[0]] = f"import {a.name}"
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                imported[a.asname or a.name] = f"from {'.' * node.level}{node.module or ''} import {a.name}"
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            targets(node.target)
            stack.extend(node.body + node.orelse)
        elif isinstance(node, (ast.If, ast.While)):
            stack.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            stack.extend(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            stack.extend(node.body)
    return defined, {k: v for k, v in imported.items() if k not in defined}


class Modules:
    """Modules under `roots`, each read once."""

    def __init__(self, roots: list[Path]):
        self.roots = roots
        self._names: dict[str, tuple[set[str], dict[str, str]]] = {}

    def exists(self, name: str) -> bool:
        return module_file(name, self.roots) is not None

    def problem(self, module: str, attr: str) -> str | None:
        """Why `module.attr` is not one step from the import (None: `attr` is defined in `module`, or is its
        submodule)."""
        if self.exists(f"{module}.{attr}"):
            return None
        if module not in self._names:
            self._names[module] = top_level_names(module_file(module, self.roots).read_text(encoding="utf-8"))
        defined, imported = self._names[module]
        if attr in defined:
            return None
        if attr in imported:
            return f"{module}.{attr} is a re-export ({imported[attr]}): import it from where it is defined"
        return f"{module}.{attr} is not defined in {module}"


# ------------------------------------------------------------------------------------ the notebooks, read

def code_units(nb: dict) -> list[tuple[str, str]]:
    """(label, Python source) for what a notebook runs: its own code cells as one unit (line magics and shell
    lines dropped), and each `%%writefile` cell as a script of its own (the magic line dropped)."""
    cells, scripts = [], []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        lines = src.splitlines()
        if lines and lines[0].startswith("%%writefile"):
            scripts.append((f"cell {i} (script)", "\n".join(lines[1:])))
        elif not (lines and lines[0].startswith("%%")):
            kept = ["" if line.lstrip().startswith(("%", "!")) else line for line in lines]
            cells.append((i, "\n".join(kept)))
    # one namespace, with each cell's line numbers kept apart: cell i's line n reads `cell i line n`
    return [("cells", "\n".join(f"# cell {i}\n{src}" for i, src in cells))] + scripts


def _cell_of(source: str, lineno: int) -> str:
    cell = "?"
    for n, line in enumerate(source.splitlines()[:lineno], 1):
        m = re.match(r"# cell (\d+)$", line)
        if m:
            cell, start = m.group(1), n
    return f"cell {cell} line {lineno - start}" if cell != "?" else f"line {lineno}"


def unit_problems(label: str, source: str, modules: Modules, own_chapter: str | None = None) -> list[str]:
    """Every call (or use) in `source` of a name through a module it imported that is not defined there, every
    `from m import f` of an `f` that `m` only re-exports, every other chapter module imported, and every
    imported module name the code rebinds (then `x.f` is not the module's)."""
    tree = ast.parse(source)
    where = (lambda n: _cell_of(source, n.lineno)) if label == "cells" else (lambda n: f"{label} line {n.lineno}")
    bound: dict[str, str] = {}  # local name -> module (for `import a.b` without `as`: "a" -> "a")
    out: list[tuple[int, str]] = []  # (line, problem): reported in the order of the code
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if not modules.exists(a.name):
                    continue
                if a.asname:
                    bound[a.asname] = a.name
                else:
                    bound[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and modules.exists(node.module):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if modules.exists(full):
                    bound[a.asname or a.name] = full
                else:
                    why = modules.problem(node.module, a.name)
                    if why:
                        out.append((node.lineno, f"{where(node)}: from {node.module} import {a.name}: {why}"))
    chapter = re.compile(r"\.chapters\.(ch\d\d)$")
    for name, module in sorted(bound.items()):
        m = chapter.search(module)
        if m and own_chapter is not None and m.group(1) != own_chapter:
            out.append((0, f"{label}: imports {module}, another chapter's module (import what it shares from "
                           "below the chapters)"))
    for node in ast.walk(tree):
        stores = ([node.id] if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)) else
                  [node.name] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else
                  [a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)]
                  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else [])
        for name in stores:
            if name in bound:
                out.append((node.lineno, f"{where(node)}: rebinds {name!r}, the module {bound[name]} it imported"))
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # `x.a` inside `x.a.b`
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        chain, base = [], node
        while isinstance(base, ast.Attribute):
            chain.insert(0, base.attr)
            base = base.value
        if not isinstance(base, ast.Name) or base.id not in bound:
            continue
        module = bound[base.id]
        for attr in chain:  # down the submodules, then the one name the module must define
            if modules.exists(f"{module}.{attr}"):
                module = f"{module}.{attr}"
                continue
            why = modules.problem(module, attr)
            if why:
                out.append((node.lineno, f"{where(node)}: {base.id}.{'.'.join(chain[:chain.index(attr) + 1])}: {why}"))
            break
    return [problem for _, problem in sorted(out, key=lambda p: p[0])]


def notebook_problems(nb_path: Path, roots: list[Path]) -> list[str]:
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    modules = Modules(roots)
    own = f"ch{nb_path.name[:2]}" if re.match(r"\d\d_", nb_path.name) else None
    return [f"{nb_path.name}: {p}" for label, src in code_units(nb) for p in unit_problems(label, src, modules, own)]


# ------------------------------------------------------------------------------------ the tests

NOTEBOOK_PATHS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOK_PATHS, ids=lambda p: p.stem)
def test_every_notebook_call_is_one_step_from_its_import(notebook):
    problems = notebook_problems(notebook, [LIB])
    assert problems == [], "\n".join(problems)


def _write_nb(path: Path, *cells: str) -> Path:
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "source": c, "outputs": [], "execution_count": None}
                    for c in cells], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb), encoding="utf-8")
    return path


@pytest.fixture
def fake_lib(tmp_path):
    """pkg.low defines f and K; pkg.facade re-exports them (and defines g); pkg.chapters holds two chapters."""
    lib = tmp_path / "lib"
    (lib / "pkg" / "chapters").mkdir(parents=True)
    (lib / "pkg" / "__init__.py").write_text("")
    (lib / "pkg" / "low.py").write_text("K = 1\n\n\ndef f():\n    return K\n")
    (lib / "pkg" / "facade.py").write_text("from pkg.low import K, f  # noqa: F401\nfrom pkg import low\n\n\n"
                                           "def g():\n    return f()\n")
    (lib / "pkg" / "chapters" / "__init__.py").write_text("")
    for ch in ("ch01", "ch02"):
        (lib / "pkg" / "chapters" / f"{ch}.py").write_text("def draw():\n    pass\n")
    return lib


def test_a_call_through_a_re_export_fails_and_the_defining_module_passes(tmp_path, fake_lib):
    bad = _write_nb(tmp_path / "02_bad.ipynb",
                    "%matplotlib inline\nfrom pkg import facade\nfrom pkg.chapters import ch01, ch02",
                    "facade.f()\nfacade.g()\nx = facade.K\nch02.draw()\nch01.draw()",
                    "%%writefile {work}/s.py\nimport pkg.facade as fa\nfa.K\nfa.low.f()\nfa.missing()")
    assert notebook_problems(bad, [fake_lib]) == [
        "02_bad.ipynb: cells: imports pkg.chapters.ch01, another chapter's module (import what it shares from "
        "below the chapters)",
        "02_bad.ipynb: cell 1 line 1: facade.f: pkg.facade.f is a re-export (from pkg.low import f): import it "
        "from where it is defined",
        "02_bad.ipynb: cell 1 line 3: facade.K: pkg.facade.K is a re-export (from pkg.low import K): import it "
        "from where it is defined",
        "02_bad.ipynb: cell 2 (script) line 2: fa.K: pkg.facade.K is a re-export (from pkg.low import K): import "
        "it from where it is defined",
        "02_bad.ipynb: cell 2 (script) line 3: fa.low: pkg.facade.low is a re-export (from pkg import low): "
        "import it from where it is defined",
        "02_bad.ipynb: cell 2 (script) line 4: fa.missing: pkg.facade.missing is not defined in pkg.facade"]
    good = _write_nb(tmp_path / "02_good.ipynb", "from pkg import facade, low\nfrom pkg.chapters import ch02",
                     "low.f()\nfacade.g()\nlow.K\nch02.draw()")
    assert notebook_problems(good, [fake_lib]) == []


def test_a_name_imported_from_a_re_export_or_a_rebound_module_fails(tmp_path, fake_lib):
    nb = _write_nb(tmp_path / "03_x.ipynb", "from pkg.facade import f, g\nfrom pkg import low",
                   "low = 3\nfor low in range(2):\n    pass")
    assert notebook_problems(nb, [fake_lib]) == [
        "03_x.ipynb: cell 0 line 1: from pkg.facade import f: pkg.facade.f is a re-export (from pkg.low import "
        "f): import it from where it is defined",
        "03_x.ipynb: cell 1 line 1: rebinds 'low', the module pkg.low it imported",
        "03_x.ipynb: cell 1 line 2: rebinds 'low', the module pkg.low it imported"]


if __name__ == "__main__":
    for path in NOTEBOOK_PATHS:
        print("\n".join(notebook_problems(path, [LIB])))
