"""The end of a run, in the process that reports: the baselines updated or pruned, the warnings
about them (stale entries, another environment, the other cpu counter), the JUnit suite's
properties, the report files, and the terminal summary.

It reads the records the session collected and writes nothing before the last test has ended;
what it has to say goes to the session's notes.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest

from pytest_vram.baselines.store import BaselineStore
from pytest_vram.baselines.writer import BaselineWriter
from pytest_vram.errors import VramWarning
from pytest_vram.options import Settings
from pytest_vram.record.record import TestRecord
from pytest_vram.report import build_document, suite_properties, terminal_lines
from pytest_vram.report.outputs import write_outputs
from pytest_vram.wiring.selection import Selection
from pytest_vram.written import fail_on_errors

__all__ = ["RunEnd", "shown_path"]

# The environment fields whose change alone can change a test's figures (on the simulated
# device, the GPU model it stands for and where it keeps host tensors, too).
_ENVIRONMENT_FIELDS = (
    "torch", "cuda", "hip", "driver", "pytest_vram", "allocator", "alloc_conf", "sim_gpu",
    "sim_host_tensors",
)  # fmt: skip


class RunEnd:
    """What the run's end does with the session's ``records``; it adds to ``notes``."""

    def __init__(
        self,
        config: pytest.Config,
        settings: Settings,
        store: BaselineStore,
        selection: Selection,
        *,
        records: list[TestRecord],
        environments: dict[str, dict[str, Any]],
        notes: list[str],
        junit_properties: bool,
        ran: set[str] | None = None,
    ) -> None:
        self.config = config
        self.settings = settings
        self.store = store
        self.selection = selection
        # The session's own lists and mapping, which it keeps filling until the run ends.
        self.records = records
        self.environments = environments
        self.notes = notes
        self.junit_properties = junit_properties
        #: The node ids of the tests that ran (measured or not), filled by the session.
        self.ran = set() if ran is None else ran

    def stale_entries(self) -> list[str]:
        """Baseline entries of tests that no longer exist, or no longer opt in while only
        tests that opt in are gated."""
        return self.selection.stale(self._stored_nodeids())

    def _stored_nodeids(self) -> set[str]:
        return {n for baseline in self.store.files.values() for n in baseline.entries}

    def not_measured(self) -> tuple[int, str]:
        """How many tests ran without being measured, and why."""
        measured = {record.nodeid for record in self.records}
        count = len(self.ran - measured)
        if self.settings.simulate_all:  # only the backstop leaves a test out then
            why = (
                "they fail on the simulated device and pass without it, so their outcome is "
                "plain pytest's (the lines above name each)"
            )
        elif self.settings.measure_all:  # only the simulated device leaves tests out then
            why = (
                "they did not opt in (a vram marker or fixture), and the simulated device "
                "runs only tests that do (--vram-gate=all simulates every test)"
            )
        else:
            why = "they did not opt in (a vram marker or fixture); --vram-report measures them too"
        return count, why

    def finish(self, session: pytest.Session) -> None:
        """Warn about the baselines, update or prune them, and write the reports."""
        self._add_suite_properties()
        if not self.settings.update_baselines:
            self.notes += self._counter_changes()
            for path, message in self._environment_changes():
                self._warn_run(session, path, message)
        if self.settings.report and not self.settings.prune_baselines:
            stale = self.stale_entries() if self.selection.collected is not None else []
            unopted = set(self.selection.no_longer_opted_in(stale))
            for baseline in self.store.files.values():
                in_file = [nodeid for nodeid in stale if nodeid in baseline.entries]
                gone = [nodeid for nodeid in in_file if nodeid not in unopted]
                if gone:
                    self._warn_run(session, baseline.path, _stale_warning(gone))
                ungated = [nodeid for nodeid in in_file if nodeid in unopted]
                if ungated:
                    self._warn_run(session, baseline.path, _unopted_warning(ungated))
        writer = BaselineWriter(self.store, self.environments)
        if self.settings.update_baselines:
            writer.update(self.records)
            self._missing_ranks(session)
        if self.settings.prune_baselines:
            if self.selection.collected is None:
                self.notes.append(
                    "--vram-prune-baselines needs the collection, which this process did not "
                    "see (pytest-xdist): run it without -n"
                )
            else:
                writer.prune(self.stale_entries())
        saved = writer.save()
        if self.settings.update_baselines and not (saved.lines or saved.errors):
            stored = sum(1 for record in self.records if record.outcome == "passed")
            saved.lines.append(
                f"baselines: no change in {shown_path(self.settings.baseline_dir)} "
                f"({stored} {'test' if stored == 1 else 'tests'} measured, figures as stored)"
            )
        written = saved + write_outputs(
            lambda: build_document(self.records, self.environments, self._run_facts()),
            self.settings,
            os.environ.get("GITHUB_STEP_SUMMARY"),
        )
        self.notes += written.notes()
        fail_on_errors(session, written)

    def summary(self, terminalreporter: Any) -> None:
        """The vram report (with ``--vram-report``) and the notes, at the end of the output."""
        if self.settings.report:
            terminalreporter.write_sep("=", "vram report")
            stale = self.stale_entries()
            unopted = set(self.selection.no_longer_opted_in(stale))
            json_path = self.settings.json_path
            # One write: a line at a time costs milliseconds per thousand tests.
            lines = terminal_lines(
                self.records,
                [nodeid for nodeid in stale if nodeid not in unopted],
                no_longer_opted_in=sorted(unopted),
                not_measured=self.not_measured(),
                all_in=f"--vram-json {shown_path(json_path)}" if json_path else None,
            )
            terminalreporter.write("\n".join(lines) + "\n")
        for note in self.notes:
            terminalreporter.write_line(f"pytest-vram: {note}")

    def _run_facts(self) -> dict[str, Any]:
        """What merging this run's --vram-json into the baselines needs (see shards.py)."""
        collected = self.selection.collected is not None
        settings = self.settings
        return {
            # Whether every gated test was measured: what a merge of shards needs.
            "measured": "all" if settings.measure_all or not settings.gate_all else "marked",
            "gate": settings.gate,
            "not_measured": self.not_measured()[0],
            "stale": self.stale_entries() if collected else None,
        }

    def _missing_ranks(self, session: pytest.Session) -> None:
        """A test some rank never reported is not stored: its entry would lose that rank's
        figures and the maximum over ranks could fall. The run says so and fails."""
        for record in self.records:
            if record.missing_ranks:
                ranks = ", ".join(str(rank) for rank in record.missing_ranks)
                self.notes.append(
                    f"error: {record.nodeid} was not stored: no figures from rank {ranks}, "
                    "so its stored figures are kept; run the update again once every rank "
                    "reports"
                )
                if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
                    session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _counter_changes(self) -> list[str]:
        """Baselines measured with the other cpu counter: their peaks are not this run's kind."""
        notes = []
        for environment in self.environments.values():
            stored = self.store.files.get(environment.get("device", ""))
            then = stored.environment.get("cpu_counter") if stored is not None else None
            now = environment.get("cpu_counter")
            if then and now and then != now:
                notes.append(
                    f"the baselines in {stored.path.name} were measured with the {then} cpu "
                    f"counter and this run counts with the {now} counter: their peaks differ by "
                    "what kernels allocate for themselves (--vram-cpu-counter chooses)"
                )
        return notes

    def _environment_changes(self) -> list[tuple[Path, str]]:
        """Baselines measured under another torch, CUDA, driver, pytest-vram, allocator or
        simulated device setting: their figures may differ for that reason alone."""
        messages = []
        for environment in self.environments.values():
            stored = self.store.files.get(environment.get("device", ""))
            if stored is None or not stored.entries:
                continue
            changed = [
                f"{name} {stored.environment[name]} -> {environment[name]}"
                for name in _ENVIRONMENT_FIELDS
                if name in stored.environment
                and name in environment
                and str(stored.environment[name]) != str(environment[name])
            ]
            if changed:
                messages.append(
                    (
                        stored.path,
                        f"the baselines in {stored.path.name} were measured in another environment "
                        f"({', '.join(changed)}); update them with --vram-update-baselines once "
                        "the figures are confirmed",
                    )
                )
        return messages

    def _warn_run(self, session: pytest.Session, path: Path, message: str) -> None:
        """A warning about a baseline file, told at the file; escalated by ``-W error``, it
        fails the run."""
        try:
            warnings.warn_explicit(VramWarning(message), VramWarning, shown_path(path), 1)
        except VramWarning:
            self.notes.append(f"error: {message} (VramWarning, an error under -W)")
            if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
                session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _add_suite_properties(self) -> None:
        try:
            from _pytest.junitxml import xml_key
        except ImportError:  # pragma: no cover - pytest moved it
            return
        xml = self.config.stash.get(xml_key, None)
        if xml is None or not self.junit_properties:
            return
        for name, value in suite_properties(self.environments):
            xml.add_global_property(name, value)


def shown_path(path: Path) -> str:
    """``path`` relative to the working directory where it is under it, else whole."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _unopted_warning(nodeids: list[str]) -> str:
    entries = ("entry belongs", "entries belong")[len(nodeids) > 1]
    return (
        f"{len(nodeids)} baseline {entries} to tests that no longer opt in ({_few(nodeids)}): "
        "only tests with a vram marker or fixture are compared (--vram-gate=all compares every "
        f"test); --vram-prune-baselines removes {_them(nodeids)}"
    )


def _stale_warning(stale: list[str]) -> str:
    entries = ("entry has", "entries have")[len(stale) > 1]
    return (
        f"{len(stale)} baseline {entries} no test any more ({_few(stale)}); "
        f"--vram-prune-baselines removes {_them(stale)}"
    )


def _few(nodeids: list[str]) -> str:
    more = f" and {len(nodeids) - 3} more" if len(nodeids) > 3 else ""
    return ", ".join(nodeids[:3]) + more


def _them(nodeids: list[str]) -> str:
    return "it" if len(nodeids) == 1 else "them"
