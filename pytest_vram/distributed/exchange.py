"""How each rank's record of a test reaches rank 0: through files in a directory that all ranks
of one torchrun run derive alike (torch.distributed may not be initialised, or the test may have
torn its process group down)."""

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

from pytest_vram.atomic import write_atomic
from pytest_vram.distributed.merge import merge_ranks
from pytest_vram.distributed.ranks import Ranks
from pytest_vram.record.record import TestRecord

__all__ = ["DEFAULT_TIMEOUT", "RankExchange", "exchange_directory"]

#: How long rank 0 waits for another rank's record of a test, in seconds.
DEFAULT_TIMEOUT = 300.0


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
