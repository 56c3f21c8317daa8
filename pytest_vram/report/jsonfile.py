"""``--vram-json`` documents as memory tables, so ``pytest-vram compare`` reads them too.

Each measured test becomes the row the JUnit file of the same run carries for it (its
``vram_*`` properties, see :mod:`pytest_vram.report.junit`), so either kind of report may be the
base or the head of a comparison. A document is read by the one reader of ``--vram-json``
documents (:func:`pytest_vram.baselines.shards.read_shard`), which checks every figure.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from pytest_vram.baselines.shards import ShardError, read_shard
from pytest_vram.record.record import TestRecord
from pytest_vram.report.document import record_row
from pytest_vram.report.junit import row_properties
from pytest_vram.report.junitfile import MemoryTable, read_junit

__all__ = ["is_json_report", "junit_name", "read_json_report", "read_report", "read_reports"]


def is_json_report(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a JSON document rather than XML: it starts with ``{`` or ``[``
    (a list, which is no report, but which only the JSON reader can name as such)."""
    try:
        with open(path, "rb") as stream:
            start = stream.read(512).lstrip(b"\xef\xbb\xbf \t\r\n")
    except OSError:
        return False  # the JUnit reader says what is wrong with the file
    return start[:1] in (b"{", b"[")


def read_json_report(path: str | os.PathLike[str]) -> MemoryTable:
    """The measured tests of a ``--vram-json`` document, named by node id.

    Raises :class:`pytest_vram.baselines.shards.ShardError` naming the file, the test and the
    bad value.
    """
    # First what the shard reader does not check: a document pytest-vram wrote is an object
    # that names its version, so a JSON file of another tool is not taken for a run without
    # tests. A file that is no JSON at all is left to the shard reader, which says why.
    try:
        with open(path, encoding="utf-8") as stream:
            document = json.load(stream)
    except (OSError, ValueError, RecursionError):
        document = {"pytest_vram": None}
    if not isinstance(document, dict) or "pytest_vram" not in document:
        what = (
            "no 'pytest_vram' version"
            if isinstance(document, dict)
            else f"it holds a JSON {_JSON_KINDS.get(type(document), 'value')}, not an object"
        )
        raise ShardError(
            f"{os.fspath(path)}: not a pytest-vram --vram-json document ({what}); expected a "
            "JUnit XML file or a --vram-json document"
        )
    shard = read_shard(Path(path))
    rows = [_row(record) for record in shard.records]
    return MemoryTable(
        path=os.fspath(path),
        rows=rows,
        environments=list(shard.environments.values()),
        total=len(rows),
    )


_JSON_KINDS = {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}


def read_report(path: str | os.PathLike[str]) -> MemoryTable:
    """A JSON document or a JUnit XML file, whichever ``path`` holds."""
    return read_json_report(path) if is_json_report(path) else read_junit(path)


def read_reports(
    base: str | os.PathLike[str], head: str | os.PathLike[str]
) -> tuple[MemoryTable, MemoryTable]:
    """Two reports whose tests are named alike: a JSON document's tests take the names the
    JUnit file of its run would give them when the other report is a JUnit file."""
    tables = [read_report(base), read_report(head)]
    kinds = [is_json_report(base), is_json_report(head)]
    if kinds[0] != kinds[1]:
        for table, is_json in zip(tables, kinds, strict=True):
            if is_json:
                for row in table.rows:
                    row["name"] = junit_name(row["name"])
    return tables[0], tables[1]


def junit_name(nodeid: str) -> str:
    """``classname::name`` as pytest's ``--junitxml`` spells the test ``nodeid``.

    ``suites/test_model.py::TestModel::test_forward[bf16]`` is
    ``suites.test_model.TestModel::test_forward[bf16]``.
    """
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    classname, name = ".".join(names[:-1]), names[-1]
    return f"{classname}::{name}" if classname else name


def _row(record: TestRecord) -> dict[str, Any]:
    row: dict[str, Any] = {"name": record.nodeid, "outcome": record.outcome}
    row.update(row_properties(record_row(record)))
    # The JUnit file has no budget; the comment shows the allocated budget a test crossed.
    crossed = [
        budget.limit
        for budget in record.budgets
        if not budget.passed and budget.metric == "allocated"
    ]
    if crossed:
        row["vram_budget"] = min(crossed)
    # What compare explains a change with (see pytest_vram.report.peakchange).
    breakdown = record.breakdown or {}
    categories = record.categories if record.categories is not None else breakdown.get("categories")
    if isinstance(categories, dict):
        row["vram_categories"] = categories
    modules = breakdown.get("modules")
    if isinstance(modules, list):
        row["vram_modules"] = {
            str(m.get("name")): m.get("bytes") for m in modules if isinstance(m, dict)
        }
    if record.peak_lines is not None:
        row["vram_peak_lines"] = record.peak_lines
    return row
