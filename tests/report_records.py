"""Records of a run on an 80 GB GPU, one of each status, for the report tests."""

from __future__ import annotations

from typing import Any

from pytest_vram.record.record import TestRecord as Record

GiB = 1024**3


def record(nodeid: str, peak: int, status: str = "ok", **kwargs: Any) -> Record:
    fields: dict[str, Any] = {
        "backend": "cuda",
        "device": "NVIDIA H100 80GB HBM3",
        "peak_allocated": peak,
        "status": status,
    }
    fields.update(kwargs)
    return Record(nodeid=nodeid, **fields)


def records() -> list[Record]:
    return [
        record("t.py::test_ok_small", 1 * GiB, baseline={"peak_allocated": 1 * GiB}),
        record("t.py::test_new", 3 * GiB, "new"),
        record("t.py::test_ok_big", 8 * GiB, baseline={"peak_allocated": 8 * GiB}),
        record("t.py::test_regressed", 2 * GiB, "regression", baseline={"peak_allocated": GiB}),
        record("t.py::test_improved", 1 * GiB, "improved", baseline={"peak_allocated": 2 * GiB}),
        record("t.py::test_oom", 80 * GiB, "oom"),
        record("t.py::test_over", 73 * GiB, "over-budget"),
        record("t.py::test_leak", 4 * GiB, "leak"),
    ]
