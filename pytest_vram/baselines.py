"""The baseline store: one YAML file per device class, entries keyed by test node id.

Files are data: they are read with a safe loader and checked node by node, so a malformed or
hand-broken file is an error that names the file and line. A file's name is the slug of its
``device:`` field (``NVIDIA H100 80GB HBM3`` lives in ``nvidia-h100-80gb-hbm3.yaml``); the store
finds a device class's file by that name, so a file can neither hide under another name nor be
replaced by a new file of the same name. Writes go to a temporary file renamed over the old one,
so an interrupted run never leaves half a file; writers of one file take a lock beside it.

A file the writer wrote ends with the line ``# end of baselines``, which its header announces:
a file that starts with that header and lacks the line was cut short (a full disk, an
interrupted copy or checkout), and is an error rather than a file with fewer entries. Files of
earlier versions, without the announcement, are read as they are and get it when next written.
A file in the writer's layout is read by :mod:`pytest_vram.baselinescan`, two million entries
in seconds; anything else (a hand edit, other quoting) by the careful reader below.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode

from pytest_vram import baselinescan
from pytest_vram.atomic import TEMPORARY_SUFFIX, make_directory, write_atomic
from pytest_vram.figures import (
    LARGER_IS_BETTER,
    FigureError,
    check_figure,
    check_figure_name,
    check_nodeid,
)
from pytest_vram.locking import held
from pytest_vram.report.text import percent_text
from pytest_vram.units import Tolerance, format_delta, format_size

__all__ = [
    "COMPARED_FIGURES",
    "END_LINE",
    "GITIGNORE_PATTERNS",
    "BaselineFile",
    "BaselineFileError",
    "BaselineStore",
    "FigureChange",
    "compare_with_entry",
    "file_name_for",
    "locked",
    "make_directory",
    "temporary_files_of",
]

# The figures a regression is judged on, with the words messages use for them.
COMPARED_FIGURES = {
    "peak_allocated": "peak allocated",
    "single_step_peak": "single-step peak",
    "idle": "idle allocated",
    "leak_growth": "leak-check growth",
    "max_size": "largest size that fits",
}

# libyaml's safe loader and dumper where PyYAML was built with it: ten times faster.
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_SafeDumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

#: The last line of a file the writer wrote; a file whose header announces it and that does
#: not end with it was cut short.
END_LINE = "# end of baselines"
_HEADER = (
    "# pytest-vram baselines: peak memory per test, in bytes, for one device class.\n"
    "# Update after an intended change with: pytest --vram-update-baselines\n"
    f"# A whole file ends with the line: {END_LINE}\n"
)
_DUMP_STYLE: dict[str, Any] = {"sort_keys": False, "default_flow_style": False, "width": 1000}
# libyaml writes a key of more than 128 characters as `? KEY` then `: VALUE`; the writer too.
_SIMPLE_KEY_CHARS = 128
# The head of a file in the writer's layout (comments, device, environment) is short.
_MAX_HEAD_LINES = 10_000
#: A load that takes longer than this many seconds says so on stderr.
PROGRESS_AFTER_S = 1.0
_TOP_KEYS = ("device", "environment", "tests")
# The tags a safe loader builds; anything else (python/object, custom tags) is refused.
_SAFE_TAGS = frozenset(
    f"tag:yaml.org,2002:{name}"
    for name in ("null", "bool", "int", "float", "str", "binary", "timestamp", "seq", "map")
)
_MAP_TAG = "tag:yaml.org,2002:map"
_STR_TAG = "tag:yaml.org,2002:str"
_INT_TAG = "tag:yaml.org,2002:int"

# What the writer leaves beside a baseline file: its lock, and while it writes, a temporary
# file (named by pytest_vram.atomic). A killed writer can leave the temporary file; these
# patterns keep both out of git.
LOCK_SUFFIX = ".lock"
GITIGNORE_PATTERNS = (f".*{LOCK_SUFFIX}", f".*{TEMPORARY_SUFFIX}")


class BaselineFileError(Exception):
    """A baseline file that cannot be read; the message names the file and line."""


@functools.lru_cache(maxsize=64)  # asked twice per measured test
def file_name_for(device_class: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3.yaml``."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_class.lower()).strip("-")
    return f"{slug or 'device'}.yaml"


@dataclass
class BaselineFile:
    path: Path
    device: str
    environment: dict[str, Any] = field(default_factory=dict)
    entries: dict[str, dict[str, int]] = field(default_factory=dict)

    def dump(self) -> str:
        """The file's text: sorted and stable, as libyaml would write the same document, with
        the header and closing line that tell a whole file from one cut short."""
        head = {
            "device": self.device,
            "environment": dict(sorted(stored_environment(self.environment).items())),
        }
        parts = [_HEADER, yaml.dump(head, Dumper=_SafeDumper, **_DUMP_STYLE)]
        parts.append("tests:\n" if self.entries else "tests: {}\n")
        parts.extend(_dump_entry(nodeid, self.entries[nodeid]) for nodeid in sorted(self.entries))
        parts.append(f"{END_LINE}\n")
        return "".join(parts)

    def write(self) -> None:
        """Replace the file atomically: a reader sees the old file or the new one, never half."""
        # The temporary name matches GITIGNORE_PATTERNS: a writer killed here leaves nothing
        # that `git add` picks up, and the next writer under the lock removes it.
        write_atomic(self.path, self.dump())

    @classmethod
    def read(cls, path: Path) -> BaselineFile:
        """Read ``path``; BaselineFileError names the file (and line) of any fault, a file cut
        short included. A load that takes more than PROGRESS_AFTER_S says so on stderr."""
        with _Progress(path) as progress:
            loaded = read_fast(path)
            if loaded is None:
                progress.careful = True
                loaded = read_careful(path)
            progress.entries = len(loaded.entries)
        return loaded


def read_fast(path: Path) -> BaselineFile | None:
    """``path`` as the fast reader reads it, or None where the file is not in the writer's
    layout (or cannot be read) and :func:`read_careful` must read it. A file cut short is a
    BaselineFileError here, whichever reader would read it."""
    try:
        with open(path, "rb") as raw:
            ends_with = _closing_line(path, raw)
            raw.seek(0)
            with io.TextIOWrapper(raw, encoding="utf-8", newline="") as handle:
                return _read_layout(path, handle, ends_with)
    except (OSError, UnicodeDecodeError, baselinescan.NotCanonical):
        return None


def read_careful(path: Path) -> BaselineFile:
    """``path`` read node by node with the safe YAML loader: slow, exact, and every error
    names its line."""
    try:
        with open(path, "rb") as raw:
            _closing_line(path, raw)
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BaselineFileError(f"{path}: cannot read the baseline file: {exc}") from None
    return _Reader(path, text).read()


def _closing_line(path: Path, raw: io.BufferedReader) -> str | None:
    """The line ``raw`` must end with (END_LINE where its header announces it), or
    BaselineFileError where the file was cut short."""
    start = raw.read(len(_HEADER) + 8).decode("utf-8", "replace").replace("\r\n", "\n")
    if not start.startswith(_HEADER):
        if start and _HEADER.startswith(start):  # the whole file is the start of a header
            raise _cut_short(path, _line_count(raw))
        return None
    size = raw.seek(0, os.SEEK_END)
    raw.seek(max(0, size - 256))
    tail = raw.read().decode("utf-8", "replace").rstrip(" \t\r\n")
    if not tail.endswith("\n" + END_LINE):
        raise _cut_short(path, _line_count(raw))
    return END_LINE


def _read_layout(path: Path, handle: io.TextIOBase, ends_with: str | None) -> BaselineFile:
    """Read ``handle`` in the writer's layout: its head (up to the ``tests:`` line) with the
    careful reader, its entries with :func:`baselinescan.read_tests`. Raises NotCanonical
    wherever the careful reader must read the file: the result is then the same, or the error
    is the careful reader's own, with its line."""
    head = []
    for line in handle:
        head.append(line)
        if line == "tests:\n":
            break
        if len(head) > _MAX_HEAD_LINES:
            raise baselinescan.NotCanonical("a long head")
    else:
        raise baselinescan.NotCanonical("no 'tests:' line")
    try:
        baseline, has_device = _Reader(path, "".join(head))._read()
    except BaselineFileError:
        raise baselinescan.NotCanonical("head") from None

    def some_entries(text: str) -> dict[str, dict[str, int]]:
        try:
            # Under a device field, so that its absence is not the error.
            return _Reader(path, f"device: d\ntests:\n{text}").read().entries
        except BaselineFileError:
            raise baselinescan.NotCanonical("an entry") from None

    baseline.entries = baselinescan.read_tests(handle, ends_with, some_entries)
    if baseline.entries and not has_device:
        raise baselinescan.NotCanonical("no device field")
    return baseline


def _line_count(raw: io.BufferedReader) -> int:
    raw.seek(0)
    lines, last = 0, b"\n"
    for block in iter(lambda: raw.read(1 << 20), b""):
        lines += block.count(b"\n")
        last = block[-1:]
    return max(1, lines + (last != b"\n"))


def _cut_short(path: Path, last_line: int) -> BaselineFileError:
    return BaselineFileError(
        f"{path}:{last_line}: baseline file cut short: a whole file ends with the line "
        f"'{END_LINE}', and entries after line {last_line} may be lost; restore it with "
        f"`git checkout -- {path}`, or delete it and record its baselines again with "
        "--vram-update-baselines"
    )


def _dump_entry(nodeid: str, figures: Mapping[str, int]) -> str:
    names = sorted(figures)
    if (
        names
        and baselinescan.is_plain_key(nodeid)
        and (len(nodeid) <= _SIMPLE_KEY_CHARS or " " not in nodeid)  # libyaml folds at spaces
        and all(_plain_name(name) and type(figures[name]) is int for name in names)
    ):
        lines = [f"    {name}: {figures[name]}\n" for name in names]
        if len(nodeid) <= _SIMPLE_KEY_CHARS:
            return f"  {nodeid}:\n" + "".join(lines)
        return f"  ? {nodeid}\n  : {lines[0][4:]}" + "".join(lines[1:])
    # Quoted, escaped or otherwise odd: as libyaml writes it under `tests:`, where it folds
    # a long key at the same columns as in the whole document.
    text = yaml.dump(
        {"tests": {nodeid: {name: figures[name] for name in names}}},
        Dumper=_SafeDumper,
        **_DUMP_STYLE,
    )
    return text[len("tests:\n") :]


@functools.lru_cache(maxsize=256)
def _plain_name(name: str) -> bool:
    return baselinescan.is_plain_key(name)


class _Progress:
    """Says on stderr that a load is slow, once it has taken PROGRESS_AFTER_S, and what it
    read when done: a big file otherwise holds up the run without a word."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: int | None = None
        self.careful = False
        self._said = False
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._timer = threading.Timer(PROGRESS_AFTER_S, self._say_loading)
        self._timer.daemon = True

    def __enter__(self) -> _Progress:
        self._started = time.monotonic()
        self._timer.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._timer.cancel()
        elapsed = time.monotonic() - self._started
        if elapsed >= PROGRESS_AFTER_S:  # the timer may not have had its turn
            self._say_loading()
        if self._said and self.entries is not None:
            how = (
                ", with the careful YAML reader: the file is not in the layout pytest-vram "
                "writes (an update rewrites it)"
                if self.careful
                else ""
            )
            entries = f"{self.entries} {'entry' if self.entries == 1 else 'entries'}"
            with self._lock:
                _say(f"pytest-vram: loaded {entries} from {self.path} in {elapsed:.1f} s{how}")

    def _say_loading(self) -> None:
        with self._lock:
            if self._said:
                return
            self._said = True
            try:
                size = f" ({format_size(self.path.stat().st_size)})"
            except OSError:
                size = ""
            _say(f"pytest-vram: loading the baselines in {self.path}{size} ...")


def _say(line: str) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed or gone: the load goes on
        pass


def stored_environment(environment: dict[str, Any]) -> dict[str, Any]:
    """An environment as a baseline file stores and reads it back: no empty fields, every
    value an int or text. Compared in this form, a rewrite of the same run changes nothing."""
    return {
        str(k): v if isinstance(v, int) else str(v) for k, v in environment.items() if v is not None
    }


class _Reader:
    """Builds a BaselineFile from the YAML node tree, where every value knows its line."""

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

    def read(self) -> BaselineFile:
        return self._read()[0]

    def _read(self) -> tuple[BaselineFile, bool]:
        """The file, and whether it has a ``device:`` field."""
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

    def _file(self, loader: Any, root: Node | None) -> tuple[BaselineFile, bool]:
        if root is None:  # an empty file
            return BaselineFile(self.path, self.path.stem), False
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
        return BaselineFile(self.path, device, environment, entries), device_node is not None

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
                # The checks of pytest_vram.figures, at the line of the name or figure.
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


class BaselineStore:
    """All baseline files of a directory, by device class.

    A device class's file is found by its name, so two spellings of one device class that
    share a file name (``NVIDIA A100-SXM4-80GB``, ``nvidia a100 sxm4 80gb``) share the file.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        #: The loaded files, by their ``device:`` field.
        self.files: dict[str, BaselineFile] = {}

    @classmethod
    def load(cls, directory: Path) -> BaselineStore:
        """Read every ``*.yaml`` file of ``directory``; BaselineFileError names a bad one."""
        store = cls(directory)
        if not directory.is_dir():
            return store
        by_name: dict[str, BaselineFile] = {}
        for path in sorted(directory.glob("*.yaml")):
            loaded = BaselineFile.read(path)
            expected = file_name_for(loaded.device)
            other = by_name.get(expected)
            if other is not None:
                raise BaselineFileError(
                    f"{other.path} and {path} both hold the baselines of device "
                    f"{loaded.device!r}: one would hide the other; merge them into {expected} "
                    "and delete the other"
                )
            by_name[expected] = loaded
        for expected, loaded in by_name.items():
            check_name(loaded, expected)
            store.files[loaded.device] = loaded
        return store

    def get(self, device: str) -> BaselineFile | None:
        """The loaded file that holds ``device``'s baselines, if any."""
        found = self.files.get(device)
        if found is not None:
            return found
        name = file_name_for(device)
        for loaded in self.files.values():
            if loaded.path.name == name:
                return loaded
        return None

    def file_for(self, device: str) -> BaselineFile:
        """``device``'s file, a new empty one where the directory has none."""
        found = self.get(device)
        if found is None:
            found = self.files[device] = BaselineFile(
                self.directory / file_name_for(device), device
            )
        return found

    def entry(self, device: str, nodeid: str) -> dict[str, int] | None:
        if not self.files:  # a run without baseline files: asked for every measured test
            return None
        baseline = self.get(device)
        return None if baseline is None else baseline.entries.get(nodeid)

    def replace(self, baseline: BaselineFile) -> None:
        """Put ``baseline`` (a fresh read of one of the store's files) in its place."""
        for device, loaded in list(self.files.items()):
            if loaded.path.name == baseline.path.name:
                del self.files[device]
        self.files[baseline.device] = baseline


def check_name(baseline: BaselineFile, expected: str | None = None) -> None:
    """A file must be named for its device: else the store would look for the device's
    figures in another file, report every test new and, on an update, write that other file."""
    expected = expected or file_name_for(baseline.device)
    if baseline.path.name != expected:
        raise BaselineFileError(
            f"{baseline.path}: its device field is {baseline.device!r}, whose baselines belong "
            f"in {expected}: rename the file to {expected}, or fix its device field"
        )


# -- writing under a lock ------------------------------------------------------------------


def lock_path_for(path: Path) -> Path:
    return path.with_name(f".{path.name}{LOCK_SUFFIX}")


def temporary_files_of(path: Path) -> list[Path]:
    """Temporary files a killed writer of ``path`` left: ours, and the mkstemp names (eight
    random characters, no suffix) of earlier versions."""
    legacy = re.compile(rf"\.{re.escape(path.name)}\.[A-Za-z0-9_]{{8}}")
    try:
        names = os.listdir(path.parent)
    except OSError:
        return []
    prefix = f".{path.name}."
    return sorted(
        path.parent / name
        for name in names
        if name.startswith(prefix)
        and (name.endswith(TEMPORARY_SUFFIX) or legacy.fullmatch(name))
        and name != lock_path_for(path).name
    )


@contextlib.contextmanager
def locked(path: Path, timeout: float = 120.0) -> Iterator[None]:
    """Hold the lock of ``path`` (a ``.NAME.lock`` file beside it) for the block; see
    :mod:`pytest_vram.locking`."""
    make_directory(path.parent)
    with held(lock_path_for(path), timeout):
        yield


def ensure_gitignore(directory: Path) -> None:
    """A ``.gitignore`` in the baseline directory that keeps lock and temporary files out of
    commits; missing patterns are appended to one the user wrote."""
    path = directory / ".gitignore"
    try:
        existing = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        existing = None
    lines = [] if existing is None else existing.splitlines()
    missing = [pattern for pattern in GITIGNORE_PATTERNS if pattern not in lines]
    if not missing:
        return
    text = "".join(f"{pattern}\n" for pattern in missing)
    if existing is None:
        text = "# pytest-vram: the baseline writer's lock and temporary files\n" + text
    elif existing and not existing.endswith("\n"):
        text = "\n" + text
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(text)


# -- comparing -------------------------------------------------------------------------------


@dataclass(frozen=True)
class FigureChange:
    """One figure of a test against the same figure in its baseline entry."""

    figure: str
    baseline: int
    current: int
    tolerance: Tolerance

    @property
    def delta(self) -> int:
        return self.current - self.baseline

    @property
    def percent(self) -> float | None:
        return None if self.baseline == 0 else 100.0 * self.delta / self.baseline

    @property
    def allowance(self) -> int:
        return self.tolerance.allowance(self.baseline)

    @property
    def larger_is_better(self) -> bool:
        return self.figure in LARGER_IS_BETTER

    @property
    def regressed(self) -> bool:
        # A count such as the largest batch that fits has no tolerance: one less is a loss.
        if self.larger_is_better:
            return self.delta < 0
        return self.delta > self.allowance

    @property
    def improved(self) -> bool:
        if self.larger_is_better:
            return self.delta > 0
        return -self.delta > self.allowance

    def describe(self) -> str:
        if self.larger_is_better:
            return (
                f"{COMPARED_FIGURES.get(self.figure, self.figure)}: "
                f"{self.baseline} -> {self.current}"
            )
        percent = "" if self.percent is None else f", {percent_text(self.percent)}"
        return (
            f"{COMPARED_FIGURES.get(self.figure, self.figure)} {format_size(self.current)} "
            f"against baseline {format_size(self.baseline)} "
            f"({format_delta(self.delta)}{percent}; tolerance {self.tolerance})"
        )


def compare_with_entry(
    current: dict[str, int], entry: dict[str, int], tolerance: Tolerance
) -> list[FigureChange]:
    """The compared figures present in both ``current`` and the baseline ``entry``, in
    COMPARED_FIGURES order."""
    return [
        FigureChange(name, entry[name], current[name], tolerance)
        for name in COMPARED_FIGURES
        if name in current and name in entry
    ]
