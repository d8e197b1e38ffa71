"""Bounded YAML: every YAML file or value distlab reads goes through here, so hostile input costs nothing.

PyYAML composes an alias as a second reference to its anchor's node, so a "billion laughs" file is a few
hundred bytes and a few dozen nodes, and `safe_load` returns shared references just as cheaply; the cost
comes later, when anything walks the value (an error message's repr, json.dumps, a merge), which then
expands it to gigabytes. And the composer recurses once per nesting level, so `[[[[...]]]]` ten thousand
deep ends in a RecursionError traceback. Here each document is checked before it is constructed:

- at most MAX_DEPTH levels of nesting, counted while composing (before Python's recursion limit is near)
  and again through aliases (an alias to a deep node nests that deep again);
- at most MAX_NODES nodes once every alias is expanded, counted per distinct node (so the count itself is
  cheap) and a recursive alias (`&a [*a]`, which PyYAML accepts) refused outright;
- text only: a NUL byte or bytes that are not UTF-8 name the file and line instead of a codec error.

The bounds are far above any real config, presets file, data table or manifest (the largest, the data
generator's tables, are a few thousand nodes) and far below what hurts: 100k nodes is a few MB in Python.
Every refusal is a YamlInputError (a ValueError: one line, exit 2 from distlab.cli.run_main) whose message
is `<file>:<line>: <reason>`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MAX_DEPTH = 64
MAX_NODES = 100_000


class YamlInputError(ValueError):
    """YAML that cannot be read: not text, not YAML, or beyond the bounds above. `reason` is the message
    without its `<file>:<line>: ` prefix, for callers that name the place their own way."""

    def __init__(self, source: str, line: int | None, reason: str):
        self.source, self.line, self.reason = str(source), line, reason
        super().__init__(f"{source}:{line}: {reason}" if line else f"{source}: {reason}")


class YamlRefusedError(YamlInputError):
    """Input refused before it is judged as YAML: beyond the bounds, or not text. A caller that falls back
    to reading a value as a plain string on a syntax error (--set) must not fall back on these."""


class _Refused(yaml.MarkedYAMLError):
    """A bound crossed, at a place in the text (reported like PyYAML's own errors)."""


class _Bounded:
    """Mixed in front of a Loader class: depth counted while composing, expansion checked before constructing."""

    _depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(problem=f"nested more than {MAX_DEPTH} levels deep",
                               problem_mark=self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_document(self, node):
        _check_expansion(node)
        return super().construct_document(node)


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a document whose aliases, expanded, nest deeper than MAX_DEPTH or exceed MAX_NODES nodes.

    Each distinct node's expanded size is computed once (memo), so a bomb is judged in time proportional
    to its text, not to its expansion. The walk is bounded by MAX_DEPTH, hence safe to recurse."""
    seen: dict[int, tuple[int, int]] = {}  # node -> (expanded size, expanded height)
    open_nodes: set[int] = set()
    too_deep = f"nested more than {MAX_DEPTH} levels deep once aliases are expanded"

    def size(node: yaml.Node, depth: int) -> tuple[int, int]:
        key = id(node)
        if key in seen:  # an alias (or a shared node) met again: as big and as deep as the first time
            total, height = seen[key]
            if depth + height - 1 > MAX_DEPTH:
                raise _Refused(problem=too_deep, problem_mark=node.start_mark)
            return total, height
        if key in open_nodes:
            raise _Refused(problem="a recursive alias (a node that contains itself)", problem_mark=node.start_mark)
        if depth > MAX_DEPTH:
            raise _Refused(problem=too_deep, problem_mark=node.start_mark)
        open_nodes.add(key)
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        else:
            children = []
        total, height = 1, 1
        for child in children:
            child_total, child_height = size(child, depth + 1)
            total, height = total + child_total, max(height, child_height + 1)
            if total > MAX_NODES:
                raise _Refused(problem=f"more than {MAX_NODES} values once aliases are expanded "
                                       "(an alias bomb?)", problem_mark=node.start_mark)
        open_nodes.discard(key)
        seen[key] = total, height
        return total, height

    size(root, 1)


_BOUNDED: dict[type, type] = {}


def _bounded(loader: type) -> type:
    if loader not in _BOUNDED:
        _BOUNDED[loader] = type(f"Bounded{loader.__name__}", (_Bounded, loader), {})
    return _BOUNDED[loader]


def _line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def load(text: str, source: str, loader: type = yaml.SafeLoader, all_documents: bool = False) -> Any:
    """The YAML value of `text` (a list of documents with `all_documents`), through `loader` (a SafeLoader
    subclass: its constructors run as usual) within the bounds. YamlInputError names `source` and the line."""
    def documents(bounded):
        out = []
        while bounded.check_data():
            out.append(bounded.get_data())
        return out

    return _run(text, source, loader, documents if all_documents else lambda bounded: bounded.get_single_data())


def compose(text: str, source: str) -> yaml.Node | None:
    """The node graph of a single-document `text` (for line numbers), within the same bounds."""
    def node(bounded):
        root = bounded.get_single_node()
        if root is not None:
            _check_expansion(root)
        return root

    return _run(text, source, yaml.SafeLoader, node)


def _run(text: str, source: str, loader: type, read):
    """read(a bounded loader over `text`), PyYAML's errors turned into YamlInputError naming source:line."""
    bounded = None
    try:
        bounded = _bounded(loader)(text)  # the reader refuses control characters here
        return read(bounded)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        reason = e.problem or e.context or str(e)
        if isinstance(e, _Refused):
            raise YamlRefusedError(source, mark and mark.line + 1, reason) from None
        raise YamlInputError(source, mark and mark.line + 1, "invalid YAML: " + reason) from None
    except yaml.reader.ReaderError as e:  # a control character: a binary file handed over as text
        raise YamlRefusedError(source, _line_of(text, e.position),
                               f"not text: control character U+{e.character:04X} (a binary file?)") from None
    except yaml.YAMLError as e:
        raise YamlInputError(source, None, f"invalid YAML: {e}") from None
    finally:
        if bounded is not None:
            bounded.dispose()


def read_text(path: str | Path) -> str:
    """A text file's content; a binary one (a NUL byte, or bytes that are not UTF-8) is a YamlInputError
    naming the file and line, instead of a codec error naming neither. OSError as usual for a missing file."""
    data = Path(path).read_bytes()
    nul = data.find(b"\0")
    if nul >= 0:
        raise YamlRefusedError(str(path), data.count(b"\n", 0, nul) + 1, "a binary file (NUL byte), not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise YamlRefusedError(str(path), data.count(b"\n", 0, e.start) + 1,
                             f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def load_file(path: str | Path, loader: type = yaml.SafeLoader, all_documents: bool = False) -> Any:
    """load() of a file's text (read_text: binary files named)."""
    return load(read_text(path), str(path), loader, all_documents)
