"""``pytest-vram update-baselines SHARD.json...``: one baseline update from a sharded run.

A suite split across CI jobs (pytest-xdist, ``-k``, a shard plugin, several hosts) writes one
``--vram-json`` document per job. Merging them stores exactly what one unsharded
``pytest --vram-update-baselines`` would: each record's figures as
:meth:`TestRecord.figures` makes them, the environment of the shard that measured it, and no
test whose memory check failed; entries of tests that ran in no shard are kept.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_vram.baselines.errors import BaselineFileError
from pytest_vram.baselines.store import BaselineStore
from pytest_vram.baselines.writer import BaselineWriter
from pytest_vram.record.figures import MAX_FIGURE, FigureError
from pytest_vram.record.record import TestRecord, read_record

__all__ = ["Shard", "ShardError", "add_cli_parser", "merge_shards", "read_shard"]


class ShardError(Exception):
    """A shard document that cannot be merged, or baselines that cannot be written."""


@dataclass
class Shard:
    """One job's ``--vram-json`` document, as the baseline writer needs it."""

    path: Path
    records: list[TestRecord]
    #: Per backend name, the environment that job measured in.
    environments: dict[str, dict[str, Any]]
    #: Whether the job measured every test (``--vram-report`` or ``--vram-update-baselines``);
    #: None when the document does not say.
    measured_all: bool | None = None
    #: Baseline entries the job found without a test; None when it could not tell.
    stale: list[str] | None = None


@dataclass
class Merged:
    lines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def read_shard(path: Path) -> Shard:
    """Read one ``--vram-json`` document; ShardError names the file and what is wrong."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ShardError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ShardError(f"{path}: not a JSON file: {exc}") from None
    except ValueError:  # json.loads passes on int()'s refusal of a number thousands of digits long
        raise ShardError(
            f"{path}: a number in it has more digits than Python reads; a figure has at most "
            f"{len(str(MAX_FIGURE))}"
        ) from None
    if not isinstance(document, dict) or not isinstance(document.get("tests"), list):
        raise ShardError(f"{path}: not a pytest-vram --vram-json document (no 'tests' list)")
    environments = document.get("environments") or {}
    if not isinstance(environments, dict):
        raise ShardError(f"{path}: 'environments' must map backend names to environments")
    records = []
    for index, row in enumerate(document["tests"]):
        try:
            records.append(read_record(row))
        except FigureError as exc:
            nodeid = row.get("nodeid") if isinstance(row, dict) else None
            test = f"test {index} ({nodeid})" if isinstance(nodeid, str) else f"test {index}"
            raise ShardError(f"{path}: {test}: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ShardError(f"{path}: test {index} is not a pytest-vram record: {exc}") from None
    run = document.get("run") if isinstance(document.get("run"), Mapping) else {}
    measured = run.get("measured")
    stale = run.get("stale")
    return Shard(
        path,
        records,
        {str(name): dict(env) for name, env in environments.items() if isinstance(env, dict)},
        None if measured is None else measured == "all",
        [str(nodeid) for nodeid in stale] if isinstance(stale, list) else None,
    )


def merge_shards(shards: list[Shard], baseline_dir: Path, prune: bool = False) -> Merged:
    """Write the baselines the shards measured into ``baseline_dir``, as one run would."""
    merged = Merged()
    for shard in shards:
        if shard.measured_all is False:
            raise ShardError(
                f"{shard.path}: that run gated every test (--vram-gate=all) but measured only "
                "the tests with a vram marker or fixture, while --vram-update-baselines would "
                "store every test: run each shard with --vram-report (or "
                "--vram-update-baselines) as well as --vram-json"
            )
    _check_duplicates(shards)
    try:
        store = BaselineStore.load(baseline_dir)
    except BaselineFileError as exc:
        raise ShardError(str(exc)) from None
    writer = BaselineWriter(store, {})
    for shard in shards:
        for record in shard.records:
            # A shard run that compared (--vram-report) failed the tests that grew; an update
            # run does not compare, and stores them. A regression is found only on a test
            # that passed every other check.
            if record.status == "regression":
                record.outcome = "passed"
    seen: dict[str, tuple[Path, dict[str, Any]]] = {}
    for shard in shards:
        # Each record with its own job's environment: shards may run on different hosts.
        writer.environments = shard.environments
        writer.update(shard.records)
        for environment in shard.environments.values():
            device = str(environment.get("device", ""))
            earlier = seen.setdefault(device, (shard.path, environment))
            if earlier[1] != environment:
                fields = sorted(
                    key
                    for key in set(environment) | set(earlier[1])
                    if environment.get(key) != earlier[1].get(key)
                )
                merged.notes.append(
                    f"{shard.path} and {earlier[0]} measured {device} in different environments "
                    f"({', '.join(fields)} differ); the baselines keep the last one given"
                )
    if prune:
        told = [shard for shard in shards if shard.stale is not None]
        for shard in shards:
            if shard.stale is None:
                merged.notes.append(
                    f"--prune: {shard.path} cannot tell which tests no longer exist (a "
                    "pytest-xdist run cannot); the other shards prune"
                )
        writer.prune(sorted({nodeid for shard in told for nodeid in shard.stale or ()}))
    written = writer.save()
    if written.errors:
        raise ShardError("; ".join(written.errors))
    merged.lines = written.lines or [f"baselines: no change in {_shown(baseline_dir)}"]
    return merged


def _check_duplicates(shards: list[Shard]) -> None:
    """A test measured by two shards on one device class: the merge would silently pick one."""
    first: dict[tuple[str, str], tuple[Path, dict[str, int]]] = {}
    for shard in shards:
        for record in shard.records:
            key = (record.device, record.nodeid)
            figures = record.figures()
            if key in first and first[key][1] != figures:
                raise ShardError(
                    f"{record.nodeid} ran on {record.device} in both {first[key][0]} and "
                    f"{shard.path}, with different figures: give each test to one shard"
                )
            first.setdefault(key, (shard.path, figures))


def add_cli_parser(subcommands: Any) -> None:
    """Add ``update-baselines`` to the ``pytest-vram`` command."""
    parser = subcommands.add_parser(
        "update-baselines",
        help="merge the --vram-json files of a sharded run into the baselines",
        description=(
            "Store the figures of a suite run in shards (one --vram-json file each, written "
            "with --vram-report) as one `pytest --vram-update-baselines` run would."
        ),
    )
    parser.add_argument(
        "shards", metavar="SHARD.json", nargs="+", type=Path, help="a --vram-json file"
    )
    parser.add_argument(
        "--baseline-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=(
            "the baseline directory (default: the one pytest would use here: ini "
            "vram_baseline_dir, or baselines/ under pytest's rootdir)"
        ),
    )
    parser.add_argument(
        "--prune",
        action="store_true",
        help="also remove the entries of tests that no longer exist, as --vram-prune-baselines",
    )
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    directory = args.baseline_dir or pytest_baseline_dir(Path.cwd())
    merged = merge_shards([read_shard(path) for path in args.shards], directory, args.prune)
    for line in merged.lines:
        print(line)
    for note in merged.notes:
        print(f"note: {note}")
    return 0


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def pytest_baseline_dir(invocation_dir: Path) -> Path:
    """The baseline directory a ``pytest`` run started in ``invocation_dir`` would use: the ini
    file's ``vram_baseline_dir`` (relative to the rootdir), else ``baselines`` under it."""
    rootdir, inicfg = _pytest_setup(invocation_dir)
    value = inicfg.get("vram_baseline_dir")
    value = getattr(value, "value", value)  # pytest 9 wraps ini values
    directory = Path(str(value)) if value else Path("baselines")
    return directory if directory.is_absolute() else rootdir / directory


def _pytest_setup(invocation_dir: Path) -> tuple[Path, dict[str, Any]]:
    """pytest's own rootdir and ini lookup, whose signature changed between its versions."""
    from _pytest.config.findpaths import determine_setup

    try:
        found = determine_setup(
            inifile=None,
            override_ini=None,
            args=[str(invocation_dir)],
            rootdir_cmd_arg=None,
            invocation_dir=invocation_dir,
        )
    except TypeError:
        try:  # pytest 8
            found = determine_setup(
                inifile=None,
                args=[str(invocation_dir)],
                rootdir_cmd_arg=None,
                invocation_dir=invocation_dir,
            )
        except TypeError:  # pytest 7
            found = determine_setup(None, [str(invocation_dir)])
    return Path(found[0]), dict(found[2])
