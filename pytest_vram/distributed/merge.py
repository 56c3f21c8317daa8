"""Rank 0's record of a test, made from every rank's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_vram.record.record import TestRecord
from pytest_vram.record.status import rank_of

__all__ = ["merge_ranks"]


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
        merged.missing_ranks = missing
    return merged
