"""Memory figures read back from JUnit XML files, for ``pytest-vram summary`` and ``compare``.

pytest's ``--junitxml`` report carries each measured test's figures as ``vram_*`` properties
(sizes in integer bytes) and the environment as ``vram_env_*`` suite properties (see
:mod:`pytest_vram.report.junit`). They are read back here, so CI can print or compare memory
without the JSON report.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any
from xml.etree import ElementTree

from junitparser import JUnitXml, JUnitXmlError, Properties

from pytest_vram.record.figures import FigureError, figure_from_text, is_known_figure

__all__ = ["JUnitFileError", "MemoryTable", "read_junit", "read_memory_table"]

PREFIX = "vram_"
ENV_PREFIX = "vram_env_"
_INT_RE = re.compile(r"^-?\d+$")


class JUnitFileError(ValueError):
    """A file that cannot be read as a JUnit XML report."""


@dataclass
class MemoryTable:
    """The measured tests of one JUnit file."""

    path: str
    #: One dict per measured test: ``name``, ``outcome`` and its ``vram_*`` properties.
    rows: list[dict[str, Any]]
    #: Each distinct environment the suites name in ``vram_env_*`` properties, keyed
    #: ``backend``, ``device``, ``torch``, ``cuda``, ``driver`` and ``total_memory``.
    environments: list[dict[str, Any]]
    #: Test cases in the file, measured or not.
    total: int


def read_memory_table(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The measured tests of a JUnit XML file, one dict each.

    A row holds ``name`` (``classname::name`` as the JUnit file spells it), ``outcome``
    (``passed``, ``failed``, ``error`` or ``skipped``) and the test's ``vram_*`` properties, with
    integer values as ints. Tests without vram properties are left out. Raises
    :class:`JUnitFileError` for a file that is missing, empty or not JUnit XML.
    """
    return read_junit(path).rows


def read_junit(path: str | os.PathLike[str]) -> MemoryTable:
    """Like :func:`read_memory_table`, with the environments and the count of all tests."""
    xml = _parse(path)
    rows: list[dict[str, Any]] = []
    environments: list[dict[str, Any]] = []
    total = 0
    try:
        for suite in xml:
            for env in _environments(suite, path).values():
                if env not in environments:
                    environments.append(env)
            # Iterating a suite also yields the cases of suites nested in it.
            for case in suite:
                total += 1
                row = _row(case, path)
                if row is not None:
                    rows.append(row)
    except RecursionError:
        raise JUnitFileError(f"{path}: test suites are nested too deeply") from None
    return MemoryTable(path=os.fspath(path), rows=rows, environments=environments, total=total)


_ENV_KEYS = ("backend", "device", "torch", "cuda", "driver", "total_memory")


def _environments(suite: Any, path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """A suite's ``vram_env_*`` properties, per environment.

    One environment is spelt ``vram_env_device``; several ``vram_env_<name>_device``.
    """
    environments: dict[str, dict[str, Any]] = {}
    for prop in suite.properties():
        if not prop.name or not prop.name.startswith(ENV_PREFIX) or prop.value is None:
            continue
        rest = prop.name[len(ENV_PREFIX) :]
        for key in _ENV_KEYS:
            if rest == key or rest.endswith("_" + key):
                name = rest[: -len(key)].rstrip("_")
                if key == "total_memory":
                    where = f"suite {suite.name}" if suite.name else "a test suite"
                    value: int | str = _figure(prop.name, prop.value, path, where)
                else:
                    value = _value(prop.value)
                environments.setdefault(name, {})[key] = value
                break
    return environments


def _parse(path: str | os.PathLike[str]) -> JUnitXml:
    name = os.fspath(path)
    try:
        with open(path, "rb") as stream:
            data = stream.read()
    except FileNotFoundError:
        raise JUnitFileError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise JUnitFileError(f"{name}: is a directory, not a JUnit XML file") from None
    except OSError as exc:
        raise JUnitFileError(f"{name}: cannot read it: {exc.strerror or exc}") from None
    expected = "expected a JUnit XML report such as pytest --junitxml writes"
    if not data.strip():
        raise JUnitFileError(f"{name}: the file is empty; {expected}")
    try:
        return JUnitXml.fromstring(data)
    except JUnitXmlError:
        root = _root_tag(data)
        raise JUnitFileError(
            f"{name}: the root element is <{root}>, not <testsuites> or <testsuite>; {expected}"
        ) from None
    # ElementTree's and lxml's parse errors are both SyntaxErrors; a declared encoding Python
    # does not know raises LookupError, one it cannot decode ValueError.
    except (SyntaxError, ValueError, LookupError) as exc:
        raise JUnitFileError(f"{name}: cannot parse it as XML ({exc}); {expected}") from None


def _root_tag(data: bytes) -> str:
    try:
        return str(ElementTree.fromstring(data).tag)
    except Exception:  # the tag only decorates the message
        return "?"


def _row(case: Any, path: str | os.PathLike[str]) -> dict[str, Any] | None:
    properties = case.child(Properties)
    if properties is None:
        return None
    classname, name = case.classname or "", case.name or ""
    test = f"{classname}::{name}" if classname else name
    values: dict[str, Any] = {}
    for prop in properties:
        if not prop.name or not prop.name.startswith(PREFIX) or prop.value is None:
            continue
        if _holds_bytes(prop.name):
            values[prop.name] = _figure(prop.name, prop.value, path, f"test {test}")
        else:
            values[prop.name] = _value(prop.value)
    if not values:
        return None
    if case.is_error:
        outcome = "error"
    elif case.is_failure:
        outcome = "failed"
    elif case.is_skipped:
        outcome = "skipped"
    else:
        outcome = "passed"
    return {"name": test, "outcome": outcome, **values}


# The vram_* properties in bytes besides the figures a baseline stores (report/junit.py
# writes them), and those of them that are differences, negative when memory fell.
_BYTE_PROPERTIES = frozenset({"baseline", "start_allocated", "leftover", "peak_increment"})
_SIGNED_PROPERTIES = frozenset({"peak_increment", "leak_growth"})


def _holds_bytes(name: str) -> bool:
    rest = name[len(PREFIX) :]
    return rest in _BYTE_PROPERTIES or is_known_figure(rest)


def _figure(name: str, text: str, path: str | os.PathLike[str], where: str) -> int:
    """A property in bytes; a value that is not one fails the whole read, as a figure left
    out would silently pass a comparison."""
    try:
        return figure_from_text(name, text, signed=name[len(PREFIX) :] in _SIGNED_PROPERTIES)
    except FigureError as exc:
        raise JUnitFileError(f"{os.fspath(path)}: {where}: property {exc}") from None


def _value(text: str) -> int | str:
    text = text.strip()
    if _INT_RE.match(text):
        try:
            return int(text)
        except ValueError:  # more digits than Python converts: the text, as any other
            pass
    return text
