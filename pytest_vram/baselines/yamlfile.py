"""The careful reader of a baseline file: node by node with the safe YAML loader.

Files are data: they are read with a safe loader and checked node by node, so a malformed or
hand-broken file is an error that names the file and line. Slow, exact, and any file goes: a
hand edit, other quoting, flow style. :mod:`pytest_vram.baselines.file` uses it where the fast
reader of the writer's layout cannot read a file, and for the few lines it hands over.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode

from pytest_vram.baselines.errors import BaselineFileError
from pytest_vram.record.figures import FigureError, check_figure, check_figure_name, check_nodeid

__all__ = ["ParsedFile", "parse"]

# libyaml's safe loader where PyYAML was built with it: ten times faster.
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_TOP_KEYS = ("device", "environment", "tests")
# The tags a safe loader builds; anything else (python/object, custom tags) is refused.
_SAFE_TAGS = frozenset(
    f"tag:yaml.org,2002:{name}"
    for name in ("null", "bool", "int", "float", "str", "binary", "timestamp", "seq", "map")
)
_MAP_TAG = "tag:yaml.org,2002:map"
_STR_TAG = "tag:yaml.org,2002:str"
_INT_TAG = "tag:yaml.org,2002:int"


class ParsedFile(NamedTuple):
    """What a file holds. A file without a ``device:`` field (allowed when it has no entries)
    takes its name's stem as its device."""

    device: str
    environment: dict[str, Any]
    entries: dict[str, dict[str, int]]
    has_device: bool


def parse(path: Path, text: str) -> ParsedFile:
    """The file ``text`` read from ``path``; BaselineFileError names the line of any fault."""
    return _Reader(path, text).read()


class _Reader:
    """Reads the YAML node tree, where every value knows its line."""

    def __init__(self, path: Path, text: str) -> None:
        self.path = path
        self.text = text
        # A YAML error at the end of the file points one line past it. Lines as YAML counts
        # them: splitlines() would also break at form feeds and other separators.
        self.last_line = max(1, text.count("\n") + (not text.endswith("\n")))

    def fail(self, what: str, node: Node | None = None) -> BaselineFileError:
        where = str(self.path) if node is None else f"{self.path}:{self.line(node)}"
        return BaselineFileError(f"{where}: malformed baseline file: {what}")

    def line(self, node: Node) -> int:
        return min(node.start_mark.line + 1, self.last_line)

    def read(self) -> ParsedFile:
        loader = _SafeLoader(self.text)
        try:
            root = loader.get_single_node()
            return self._file(loader, root)
        except yaml.YAMLError as exc:
            raise self._yaml_error(exc) from None
        finally:
            loader.dispose()

    def _yaml_error(self, exc: yaml.YAMLError) -> BaselineFileError:
        line = None
        problem = getattr(exc, "problem", None)
        context = getattr(exc, "context", None)
        problem_mark = getattr(exc, "problem_mark", None)
        context_mark = getattr(exc, "context_mark", None)
        if problem_mark is not None:
            line = problem_mark.line + 1
            # At the end of the file, the line where the unclosed thing began says more.
            if line > self.last_line and context_mark is not None:
                line = context_mark.line + 1
        elif context_mark is not None:
            line = context_mark.line + 1
        elif isinstance(exc, yaml.reader.ReaderError):
            line = self.text.count("\n", 0, exc.position) + 1
            character = exc.character  # libyaml gives its code, the Python reader the text
            if isinstance(character, int):
                character = chr(character)
            problem = f"{exc.reason} (character {character!r})"
        if line is not None and context and context_mark is not None:
            problem = f"{problem} ({context} on line {min(context_mark.line + 1, self.last_line)})"
        where = str(self.path) if line is None else f"{self.path}:{min(line, self.last_line)}"
        return BaselineFileError(
            f"{where}: malformed baseline file: {problem or exc}; fix or delete the file, "
            "then run with --vram-update-baselines"
        )

    def _check_tags(self, node: Node) -> None:
        if node.tag not in _SAFE_TAGS:
            raise self.fail(f"the tag {node.tag!r} is not allowed in a baseline file", node)

    def _pairs(self, node: Node, what: str) -> list[tuple[Node, Node]]:
        """The key and value nodes of a mapping, with keys checked: scalar, unique."""
        self._check_tags(node)
        if not isinstance(node, MappingNode) or node.tag != _MAP_TAG:
            raise self.fail(what, node)
        seen: dict[Any, Node] = {}
        for key, _ in node.value:
            if not isinstance(key, ScalarNode):
                raise self.fail("a key must be a plain value", key)
            if key.value in seen:
                raise self.fail(
                    f"duplicate key {key.value!r} (first on line {self.line(seen[key.value])}); "
                    "the second would silently replace the first",
                    key,
                )
            seen[key.value] = key
        return node.value

    def _scalar(self, loader: Any, node: Node) -> Any:
        self._check_tags(node)
        if not isinstance(node, ScalarNode):
            return None
        # The two kinds nearly every scalar is, built directly: a tenth of the load time.
        if node.tag == _STR_TAG:
            return node.value
        if node.tag == _INT_TAG:
            return loader.construct_yaml_int(node)
        return loader.construct_object(node)

    def _key(self, loader: Any, node: Node, what: str) -> str:
        value = self._scalar(loader, node)
        if not isinstance(value, str) or not value:
            raise self.fail(f"{what} must be text, got {value!r}", node)
        return value

    def _file(self, loader: Any, root: Node | None) -> ParsedFile:
        if root is None:  # an empty file
            return ParsedFile(self.path.stem, {}, {}, has_device=False)
        parts: dict[str, Node] = {}
        for key, value in self._pairs(
            root, "expected a mapping with 'device' and 'tests' at the top"
        ):
            name = self._scalar(loader, key)
            if name not in _TOP_KEYS:
                # An update rewrites the file with the keys it knows: refuse to drop others.
                raise self.fail(
                    f"unknown key {name!r} at the top; expected {', '.join(_TOP_KEYS)}", key
                )
            parts[name] = value
        entries = self._entries(loader, parts.get("tests"))
        environment = self._environment(loader, parts.get("environment"))
        device_node = parts.get("device")
        if device_node is None:
            if entries:
                raise self.fail(
                    "no 'device' field: add the device class its figures were measured on, "
                    f"such as `device: {self.path.stem}`"
                )
            device = self.path.stem
        else:
            device = self._scalar(loader, device_node)
            if isinstance(device, bool) or not isinstance(device, (str, int, float)):
                raise self.fail(f"'device' must be a device class, got {device!r}", device_node)
            device = str(device).strip()
            if not device:
                raise self.fail("'device' is empty", device_node)
        return ParsedFile(device, environment, entries, has_device=device_node is not None)

    def _entries(self, loader: Any, node: Node | None) -> dict[str, dict[str, int]]:
        if node is None or (isinstance(node, ScalarNode) and node.tag.endswith(":null")):
            return {}
        entries: dict[str, dict[str, int]] = {}
        for key, value in self._pairs(node, "'tests' must map test node ids to figures"):
            try:
                nodeid = check_nodeid(self._scalar(loader, key))
            except FigureError as exc:
                raise self.fail(str(exc), key) from None
            figures: dict[str, int] = {}
            for name_node, figure in self._pairs(
                value, f"the entry of {nodeid!r} must map figure names to bytes"
            ):
                # The checks of pytest_vram.record.figures, at the line of the name or figure.
                try:
                    name = check_figure_name(self._scalar(loader, name_node))
                except FigureError as exc:
                    raise self.fail(f"{nodeid!r}: {exc}", name_node) from None
                try:
                    figures[name] = check_figure(name, self._scalar(loader, figure))
                except FigureError as exc:
                    raise self.fail(f"{nodeid!r}: {exc}", figure) from None
            entries[nodeid] = figures
        return entries

    def _environment(self, loader: Any, node: Node | None) -> dict[str, Any]:
        if node is None or (isinstance(node, ScalarNode) and node.tag.endswith(":null")):
            return {}
        environment: dict[str, Any] = {}
        for key, value in self._pairs(node, "'environment' must be a mapping"):
            name = self._key(loader, key, "an environment field")
            if not isinstance(value, ScalarNode):
                raise self.fail(f"environment field {name!r} must be a plain value", value)
            environment[name] = self._scalar(loader, value)
        return environment
