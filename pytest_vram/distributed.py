"""Real ranks: ``torchrun --nproc-per-node=N -m pytest ...``.

Each rank measures its own device and judges its own figures against its own baseline
figures. After each measured test every other rank hands its record to rank 0 through files
in a directory that all ranks of one torchrun run derive alike (torch.distributed may not be
initialised, or the test may have torn its process group down). Rank 0 merges them: the
test's figures become the maximum over ranks, each rank's figures ride along in
``TestRecord.ranks``, and rank 0 alone reports and writes baselines, which store the maximum
and every rank's figures (``peak_allocated_rank1``).

Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pytest_vram.atomic import write_atomic
from pytest_vram.records import TestRecord
from pytest_vram.status import rank_of

__all__ = [
    "RANK_SUFFIX",
    "RankExchange",
    "Ranks",
    "entry_for_rank",
    "local_device_index",
    "rank_figures",
    "rank_lines",
]

#: Figures where the smallest rank's is the job's: the largest size that fits.
SMALLEST_IS_WORST = frozenset({"max_size"})
#: A baseline figure of one rank: ``peak_allocated_rank1``.
RANK_SUFFIX = "_rank"
#: How long rank 0 waits for another rank's record of a test, in seconds.
DEFAULT_TIMEOUT = 300.0


@dataclass(frozen=True)
class Ranks:
    """This process's place in a multi-process run, from the variables torchrun sets."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Ranks | None:
        """None outside a run of more than one rank."""
        environ = os.environ if environ is None else environ
        try:
            world_size = int(environ.get("WORLD_SIZE", "1"))
            rank = int(environ.get("RANK", "0"))
            local_rank = int(environ.get("LOCAL_RANK", str(rank)))
            local_world_size = int(environ.get("LOCAL_WORLD_SIZE", str(world_size)))
        except ValueError:
            return None
        if world_size <= 1 or not 0 <= rank < world_size:
            return None
        return cls(rank, world_size, local_rank, local_world_size)


def local_device_index(
    environ: Mapping[str, str] | None = None, device_count: int | None = None
) -> int | None:
    """The CUDA device a rank measures; None outside torchrun.

    ``LOCAL_RANK``, or 0 where each rank sees one GPU only (``CUDA_VISIBLE_DEVICES`` set per
    rank). ``device_count`` defaults to ``torch.cuda.device_count()``, asked only under
    torchrun. Raises :class:`~pytest_vram.backends.BackendUnavailable` when LOCAL_RANK names
    no device this process sees.
    """
    ranks = Ranks.from_environ(environ)
    if ranks is None:
        return None
    if device_count is None:
        import torch  # the cuda backend is being made: torch is imported already

        device_count = torch.cuda.device_count()
    local = ranks.local_rank
    if local < device_count or device_count == 0:  # no GPU: the backend says so itself
        return local
    if device_count == 1:
        return 0
    from pytest_vram.backends.base import BackendUnavailable

    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    raise BackendUnavailable(
        f"under torchrun LOCAL_RANK={local} names CUDA device {local}, but this process sees "
        f"{device_count} devices (CUDA_VISIBLE_DEVICES="
        + (repr(visible) if visible is not None else "unset")
        + "): give each rank its own GPU, with as many visible GPUs as ranks per node "
        "(--nproc-per-node) or one visible GPU per rank"
    )


def exchange_directory(ranks: Ranks, environ: Mapping[str, str] | None = None) -> Path:
    """Where the ranks of this run meet: the same path on every rank of one torchrun run,
    another for the next run. ``$PYTEST_VRAM_RANK_DIR`` names a directory on a filesystem
    that every node shares, for a run over several nodes."""
    environ = os.environ if environ is None else environ
    shared = environ.get("PYTEST_VRAM_RANK_DIR")
    parts = [
        environ.get("TORCHELASTIC_RUN_ID", ""),
        environ.get("MASTER_ADDR", ""),
        environ.get("MASTER_PORT", ""),
        environ.get("TORCHELASTIC_RESTART_COUNT", ""),
        str(ranks.world_size),
    ]
    if not shared and ranks.local_world_size == ranks.world_size:
        # One node: all ranks are children of one torchrun agent, and no other run's are.
        parts.append(str(os.getppid()))
    key = hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]
    return Path(shared or tempfile.gettempdir()) / f"pytest-vram-ranks-{key}"


def _timeout(environ: Mapping[str, str]) -> float:
    try:
        return float(environ.get("PYTEST_VRAM_RANK_TIMEOUT", DEFAULT_TIMEOUT))
    except ValueError:
        return DEFAULT_TIMEOUT


@dataclass
class RankExchange:
    """Hands each rank's record of a test to rank 0, which merges them."""

    ranks: Ranks
    directory: Path
    timeout: float = DEFAULT_TIMEOUT
    #: Ranks whose record of some test did not come in time: not waited for again.
    missing: set[int] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> RankExchange | None:
        environ = os.environ if environ is None else environ
        ranks = Ranks.from_environ(environ)
        if ranks is None:
            return None
        return cls(ranks, exchange_directory(ranks, environ), _timeout(environ))

    @property
    def reports(self) -> bool:
        """Only rank 0 reports and writes baselines."""
        return self.ranks.rank == 0

    def _path(self, nodeid: str, rank: int) -> Path:
        digest = hashlib.sha1(nodeid.encode()).hexdigest()[:20]
        return self.directory / f"{digest}.rank{rank}.json"

    def exchange(self, record: TestRecord, entry: Mapping[str, int] | None = None) -> TestRecord:
        """On rank 0: the record with every rank's figures merged in, its baseline the whole
        ``entry`` (maximum and per-rank figures). On the others: hand the record over and
        return it unchanged."""
        if not self.reports:
            path = self._path(record.nodeid, self.ranks.rank)
            # Rank 0 sees the whole file or none, and deletes it once read: a flush to disk
            # would buy nothing. Only this user's ranks read it.
            write_atomic(path, json.dumps(record.to_dict()), mode=0o600, sync=False)
            return record
        others = {rank: self._receive(record.nodeid, rank) for rank in self._others()}
        records = {0: record}
        records.update({rank: other for rank, other in others.items() if other is not None})
        merged = merge_ranks(records, self.ranks.world_size)
        if merged.baseline is not None and entry is not None:
            merged.baseline = dict(entry)
        return merged

    def _others(self) -> list[int]:
        return [r for r in range(1, self.ranks.world_size) if r not in self.missing]

    def _receive(self, nodeid: str, rank: int) -> TestRecord | None:
        path = self._path(nodeid, rank)
        deadline = time.monotonic() + self.timeout
        pause = 0.001
        while not path.exists():
            if time.monotonic() > deadline:
                self.missing.add(rank)
                self.notes.append(
                    f"rank 0 waited {self.timeout:.0f} s for rank {rank}'s record of {nodeid} "
                    f"in {self.directory} and reports without that rank from then on (did it "
                    "fail, or run other tests? $PYTEST_VRAM_RANK_TIMEOUT sets the wait)"
                )
                return None
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        data = json.loads(path.read_text(encoding="utf-8"))
        path.unlink(missing_ok=True)
        return TestRecord.from_dict(data)

    def close(self) -> None:
        if self.reports:
            shutil.rmtree(self.directory, ignore_errors=True)


def _rank_entry(rank: int, record: TestRecord) -> dict[str, Any]:
    return {
        "rank": rank,
        "status": record.status,
        "outcome": record.outcome,
        "leftover": record.leftover,
        "figures": record.figures(),
    }


def merge_ranks(records: Mapping[int, TestRecord], world_size: int) -> TestRecord:
    """Rank 0's record of a test, its figures the maximum over ``records`` (by rank).

    The start and end allocation are those of the rank with the largest peak, so that its
    increment reads as one rank's; the status is the worst of any rank, and the outcome
    failed when any rank failed, so that no rank's failure becomes a baseline.
    """
    ours = records[0]
    merged = TestRecord.from_dict(ours.to_dict())
    merged.ranks = [_rank_entry(rank, records[rank]) for rank in sorted(records)]
    top = max(records.values(), key=lambda r: r.peak_allocated)
    merged.peak_allocated = top.peak_allocated
    merged.start_allocated = top.start_allocated
    merged.end_allocated = top.end_allocated
    for name in ("peak_reserved", "peak_device"):
        values = [getattr(r, name) for r in records.values() if getattr(r, name) is not None]
        setattr(merged, name, max(values) if values else None)
    merged.status = min((r.status for r in records.values()), key=rank_of)
    outcomes = {r.outcome for r in records.values()}
    merged.outcome = "failed" if "failed" in outcomes else ours.outcome
    for rank in sorted(records):
        if rank:
            merged.messages += [f"rank {rank}: {message}" for message in records[rank].messages]
    missing = sorted(set(range(world_size)) - set(records))
    if missing:
        merged.messages.append("no figures from rank " + ", ".join(str(rank) for rank in missing))
    return merged


def rank_figures(ranks: list[dict[str, Any]]) -> dict[str, int]:
    """A multi-rank test's baseline figures: the worst of each over the ranks (the most
    memory; the smallest ``max_size``, which every rank must fit), and each rank's own."""
    figures: dict[str, int] = {}
    for entry in ranks:
        for name, value in entry["figures"].items():
            worst = min if name in SMALLEST_IS_WORST else max
            figures[name] = worst(figures.get(name, value), value)
    for entry in ranks:
        for name, value in entry["figures"].items():
            figures[f"{name}{RANK_SUFFIX}{entry['rank']}"] = value
    return figures


def entry_for_rank(entry: Mapping[str, int] | None, rank: int) -> dict[str, int] | None:
    """The baseline figures one rank is compared with: its own where the entry has them."""
    if entry is None:
        return None
    suffix = f"{RANK_SUFFIX}{rank}"
    own = {
        name: entry.get(name + suffix, value)
        for name, value in entry.items()
        if RANK_SUFFIX not in name
    }
    return own


def rank_lines(tests: list[Mapping[str, Any]]) -> list[str]:
    """The per-rank lines of the terminal report: each multi-rank test's peak on each rank."""
    from pytest_vram.report.text import size_text

    lines = []
    for test in tests:
        ranks = test.get("ranks")
        if not ranks:
            continue
        if not lines:
            lines.append("peak allocated per rank:")
        peaks = ", ".join(
            f"rank {entry['rank']} {size_text(entry['figures'].get('peak_allocated'))}"
            for entry in ranks
        )
        lines.append(
            f"  {test.get('nodeid')}: {peaks} (max {size_text(test.get('peak_allocated'))})"
        )
    return lines


class RankPlugin:
    """On ranks other than 0: leave the JUnit file to rank 0, which writes every rank's
    figures into it; all ranks writing one path would leave whichever finished last."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if self.ranks.rank == 0:
            return
        try:
            from _pytest.junitxml import xml_key
        except ImportError:  # pragma: no cover - pytest moved it
            return
        xml = session.config.stash.get(xml_key, None)
        if xml is not None:
            del session.config.stash[xml_key]
            session.config.pluginmanager.unregister(xml)
