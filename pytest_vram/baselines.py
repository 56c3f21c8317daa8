"""The baseline store: one YAML file per device class, entries keyed by test node id.

Files are data: they are read with a safe loader and checked, so a malformed or hand-broken file
is an error that names the file and line. Writes go to a temporary file renamed over the old
one, so an interrupted run never leaves half a file.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pytest_vram.units import Tolerance, format_delta, format_size

__all__ = [
    "COMPARED_FIGURES",
    "BaselineFile",
    "BaselineFileError",
    "BaselineStore",
    "FigureChange",
    "compare_with_entry",
    "file_name_for",
]

# The figures a regression is judged on, with the words messages use for them.
COMPARED_FIGURES = {
    "peak_allocated": "peak allocated",
    "single_step_peak": "single-step peak",
    "idle": "idle allocated",
    "leak_growth": "leak-check growth",
}

# libyaml's safe loader and dumper where PyYAML was built with it: ten times faster.
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_SafeDumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

_HEADER = (
    "# pytest-vram baselines: peak memory per test, in bytes, for one device class.\n"
    "# Update after an intended change with: pytest --vram-update-baselines\n"
)


class BaselineFileError(Exception):
    """A baseline file that cannot be read; the message names the file and line."""


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
        document = {
            "device": self.device,
            "environment": {
                str(k): v if isinstance(v, int) else str(v)
                for k, v in sorted(self.environment.items())
                if v is not None
            },
            "tests": {
                nodeid: dict(sorted(self.entries[nodeid].items()))
                for nodeid in sorted(self.entries)
            },
        }
        body = yaml.dump(
            document, Dumper=_SafeDumper, sort_keys=False, default_flow_style=False, width=1000
        )
        return _HEADER + body

    def write(self) -> None:
        """Replace the file atomically: a reader sees the old file or the new one, never half."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            # mkstemp makes the file private; keep the old file's mode, or the umask's default.
            os.chmod(tmp, _mode_for(self.path))
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(self.dump())
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def read(cls, path: Path) -> BaselineFile:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise BaselineFileError(f"{path}: cannot read the baseline file: {exc}") from None
        try:
            data = yaml.load(text, Loader=_SafeLoader)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
            where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
            problem = getattr(exc, "problem", None) or str(exc)
            raise BaselineFileError(
                f"{where}: malformed baseline file: {problem}; fix or delete the file, "
                "then run with --vram-update-baselines"
            ) from None
        return cls._from_data(path, text, data)

    @classmethod
    def _from_data(cls, path: Path, text: str, data: object) -> BaselineFile:
        def fail(what: str, key: str | None = None) -> BaselineFileError:
            line = _line_of(text, key) if key is not None else None
            where = f"{path}:{line}" if line else str(path)
            return BaselineFileError(f"{where}: malformed baseline file: {what}")

        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise fail("expected a mapping with 'device' and 'tests' at the top")
        tests = data.get("tests") or {}
        if not isinstance(tests, dict):
            raise fail("'tests' must map test node ids to figures", "tests")
        entries: dict[str, dict[str, int]] = {}
        for nodeid, figures in tests.items():
            if not isinstance(figures, dict):
                raise fail(f"the entry of {nodeid!r} must map figure names to bytes", str(nodeid))
            for name, value in figures.items():
                if isinstance(value, bool) or not isinstance(value, int):
                    raise fail(
                        f"{nodeid!r}: {name} must be an integer number of bytes, got {value!r}",
                        str(nodeid),
                    )
            entries[str(nodeid)] = {str(k): int(v) for k, v in figures.items()}
        environment = data.get("environment") or {}
        if not isinstance(environment, dict):
            raise fail("'environment' must be a mapping", "environment")
        return cls(path, str(data.get("device") or path.stem), environment, entries)


def _mode_for(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _line_of(text: str, key: str) -> int | None:
    """The line where ``key`` is a mapping key, plain or quoted."""
    starts = (f"{key}:", f"'{key}':", f'"{key}":')
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip().startswith(starts):
            return number
    return None


class BaselineStore:
    """All baseline files of a directory, by device class."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.files: dict[str, BaselineFile] = {}

    @classmethod
    def load(cls, directory: Path) -> BaselineStore:
        store = cls(directory)
        if directory.is_dir():
            for path in sorted(directory.glob("*.yaml")):
                loaded = BaselineFile.read(path)
                store.files[loaded.device] = loaded
        return store

    def file_for(self, device: str) -> BaselineFile:
        if device not in self.files:
            self.files[device] = BaselineFile(self.directory / file_name_for(device), device)
        return self.files[device]

    def entry(self, device: str, nodeid: str) -> dict[str, int] | None:
        baseline = self.files.get(device)
        return None if baseline is None else baseline.entries.get(nodeid)


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
    def regressed(self) -> bool:
        return self.delta > self.allowance

    @property
    def improved(self) -> bool:
        return -self.delta > self.allowance

    def describe(self) -> str:
        percent = "" if self.percent is None else f", {self.percent:+.1f}%"
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
