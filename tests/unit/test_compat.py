"""distlab.compat is the one door to private torch/DeepSpeed symbols: every one it lists exists in the
installed versions, and no other module of the package reaches a private attribute of them."""

import ast
import re
from pathlib import Path

import pytest

from distlab import compat

PACKAGE = Path(compat.__file__).parent
# Underscore attributes that belong to distlab's own objects or to Python itself, not to torch/DeepSpeed.
OWN_PRIVATE = {"_replace", "_asdict", "_fields", "_paused", "_originals", "_wrap", "_key", "_value", "_step",
               "_state_options", "_state_file", "_owned_state", "_send_tensor", "_recv_tensor", "_loss_fn",
               "_ds_loss", "_clipped", "_collectives", "_sources", "_exit_code"}


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "compat.py")


def test_every_listed_symbol_exists_in_the_installed_versions():
    assert compat.missing_symbols() == [], "a torch/DeepSpeed upgrade removed symbols distlab relies on"


def test_every_listed_symbol_is_checked_against_a_version():
    for sym in compat.SYMBOLS:
        assert sym.package in ("torch", "deepspeed") and re.fullmatch(r"\d+\.\d+\.\d+", sym.checked), sym
        assert sym.used_for, sym


def test_a_missing_symbol_raises_naming_it_and_the_versions():
    sym = compat.PrivateSymbol("torch", "torch", "_no_such_thing_", False, "2.13.0", "a test")
    assert not compat.is_present(sym)
    err = compat._missing(sym)
    assert isinstance(err, compat.PrivateAPIMissing)
    assert "torch._no_such_thing_" in str(err) and "2.13.0" in str(err) and "a test" in str(err)


def _private_attributes(tree: ast.AST):
    """(line, name) of `x._name` where x is not self/cls, and of getattr/setattr/hasattr(x, "_name")."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "timer", "trace")):
                yield node.lineno, node.attr
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                and node.args[1].value.startswith("_") and not node.args[1].value.startswith("__")):
            yield node.lineno, node.args[1].value


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_symbol_outside_compat(path):
    tree = ast.parse(path.read_text(), str(path))
    own = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    found = [f"{path.name}:{line}: {name}" for line, name in _private_attributes(tree)
             if name not in OWN_PRIVATE and name not in own]
    # the internal names compat lists may not be read anywhere else either, underscored or not
    text = path.read_text()
    internal = sorted(n for n in compat.NAMES if not n.startswith("_") and re.search(rf"[.\"']{n}\b", text))
    assert found == [] and internal == [], f"go through distlab.compat: {found + internal}"
