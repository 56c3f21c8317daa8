"""Real ranks: `torchrun --nproc-per-node=2 -m pytest` with gloo on the cpu backend."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import yaml

from pytest_vram.distributed import (
    RankExchange,
    Ranks,
    entry_for_rank,
    exchange_directory,
    merge_ranks,
)
from pytest_vram.record.record import TestRecord

#: Whether FSDP2 runs on the CPU: it records events on CPU streams, which torch 2.6 cannot
#: (torch.cpu.Stream.record_event is new in 2.7).
FSDP2_ON_CPU = hasattr(torch.cpu.Stream, "record_event")

CONFTEST = """
import pytest
import torch.distributed as dist


@pytest.fixture(scope="session")
def group():
    dist.init_process_group("gloo")
    yield dist.group.WORLD
    dist.destroy_process_group()
"""

TESTS = """
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel


def test_rank_dependent(vram, group):
    x = torch.ones(1024 * (dist.get_rank() + 1))


def test_ddp_step(vram, group):
    model = DistributedDataParallel(nn.Linear(256, 256))
    optimizer = torch.optim.AdamW(model.parameters())
    vram.single_step(lambda: (model(torch.ones(8, 256)).sum().backward(), optimizer.step()))


@pytest.mark.skipif(
    not hasattr(torch.cpu.Stream, "record_event"),
    reason="torch 2.6: FSDP2 on the CPU needs torch.cpu.Stream.record_event, new in 2.7",
)
def test_fsdp2_step(vram, group):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    vram.single_step(lambda: (model(torch.ones(8, 256)).sum().backward(), optimizer.step()))
"""

LINEAR = 256 * 256 * 4 + 256 * 4  # one nn.Linear(256, 256) in fp32


def torchrun(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.run(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free port: runs at once do not meet
        "--nproc-per-node=2",
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "--vram-backend=cpu",
        "--vram-report",
        *args,
        timeout=300,
    )


@pytest.mark.slow
def test_rank_0_reports_and_stores_every_rank(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_ranks=TESTS)

    result = torchrun(
        pytester,
        "--vram-update-baselines",
        "--vram-json=vram.json",
        "--vram-markdown=vram.md",
        "--junitxml=junit.xml",
    )
    assert result.ret == 0, result.stdout.str()
    out = result.stdout.str()
    # One report, from rank 0, with each rank's peak and their maximum.
    assert out.count("vram report") == 1
    result.stdout.fnmatch_lines(
        [
            "peak allocated per rank:",
            "*test_ranks.py::test_rank_dependent: rank 0 4.00 KiB, rank 1 8.00 KiB (max 8.00 KiB)",
        ]
    )
    assert out.count(f"baselines: {3 if FSDP2_ON_CPU else 2} added") == 1

    tests = yaml.safe_load((pytester.path / "baselines" / "cpu.yaml").read_text())["tests"]
    assert tests["test_ranks.py::test_rank_dependent"] == {
        "peak_allocated": 8192,
        "peak_allocated_rank0": 4096,
        "peak_allocated_rank1": 8192,
        # What each rank's peak held, by category: the test's own tensor.
        "peak_temporaries": 8192,
        "peak_temporaries_rank0": 4096,
        "peak_temporaries_rank1": 8192,
    }
    ddp = tests["test_ranks.py::test_ddp_step"]
    fsdp = tests.get("test_ranks.py::test_fsdp2_step")
    assert (fsdp is not None) == FSDP2_ON_CPU
    for entry in filter(None, (ddp, fsdp)):
        assert entry["peak_allocated"] == max(
            entry["peak_allocated_rank0"], entry["peak_allocated_rank1"]
        )
        assert set(entry) >= {"single_step_peak_rank0", "single_step_peak_rank1"}
    # DDP holds the whole model on each rank (weights, gradients, two AdamW states); FSDP2
    # shards what persists across ranks, so its step peaks lower.
    assert ddp["peak_allocated_rank1"] >= 4 * LINEAR
    if fsdp is not None:
        assert fsdp["peak_allocated_rank1"] < ddp["peak_allocated_rank1"]

    document = json.loads((pytester.path / "vram.json").read_text())
    row = next(t for t in document["tests"] if t["nodeid"].endswith("test_rank_dependent"))
    assert [(r["rank"], r["figures"]["peak_allocated"]) for r in row["ranks"]] == [
        (0, 4096),
        (1, 8192),
    ]
    markdown = (pytester.path / "vram.md").read_text()
    assert "| Test | Rank 0 | Rank 1 | Max |" in markdown
    assert "| `test_ranks.py::test_rank_dependent` | 4.00 KiB | 8.00 KiB | 8.00 KiB |" in markdown

    case = next(
        c
        for c in ET.parse(pytester.path / "junit.xml").iter("testcase")
        if c.get("name") == "test_rank_dependent"
    )
    properties = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert properties["vram_peak_allocated"] == "8192"
    assert properties["vram_peak_allocated_rank0"] == "4096"
    assert properties["vram_peak_allocated_rank1"] == "8192"
    assert properties["vram_status_rank1"] == "ok"


@pytest.mark.slow
def test_a_regression_on_one_rank_fails_that_rank_and_shows_on_rank_0(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_ranks=TESTS.split("def test_ddp_step")[0])
    (pytester.path / "baselines").mkdir()
    # Rank 1's own figure is what it is compared with, not the maximum.
    (pytester.path / "baselines" / "cpu.yaml").write_text(
        "device: cpu\ntests:\n  test_ranks.py::test_rank_dependent:\n    peak_allocated: 8192\n"
        "    peak_allocated_rank0: 4096\n    peak_allocated_rank1: 4096\n"
    )

    result = torchrun(pytester, "--vram-json=vram.json")

    assert result.ret != 0
    row = json.loads((pytester.path / "vram.json").read_text())["tests"][0]
    assert row["status"] == "regression"
    assert [(r["rank"], r["status"]) for r in row["ranks"]] == [(0, "ok"), (1, "regression")]
    assert row["messages"][0].startswith(
        "rank 1: memory regression: peak allocated 8.00 KiB against baseline 4.00 KiB"
    )
    # Rank 1 alone does not run it again for its peak lines: its process group's set-up
    # would wait for rank 0 (it hung there).
    assert row.get("peak_lines") is None
    assert all(rank.get("peak_lines") is None for rank in row["ranks"])


def record(nodeid: str = "t.py::t", peak: int = 0, **values: object) -> TestRecord:
    return TestRecord(nodeid, "cuda", "H100", peak_allocated=peak, **values)  # type: ignore[arg-type]


def test_ranks_come_from_torchruns_variables() -> None:
    environ = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert Ranks.from_environ(environ) == Ranks(3, 4, 1, 2)
    assert Ranks.from_environ({}) is None
    assert Ranks.from_environ({"RANK": "0", "WORLD_SIZE": "1"}) is None


def test_every_rank_of_one_run_meets_in_one_directory(tmp_path: Path) -> None:
    environ = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job"}
    shared = {**environ, "PYTEST_VRAM_RANK_DIR": str(tmp_path)}
    a, b = Ranks(0, 4, 0, 2), Ranks(3, 4, 1, 2)
    assert exchange_directory(a, shared) == exchange_directory(b, shared)
    assert exchange_directory(a, shared).parent == tmp_path
    later = {**shared, "MASTER_PORT": "29501"}
    assert exchange_directory(a, later) != exchange_directory(a, shared)


def test_merged_figures_are_the_maximum_and_the_worst_status() -> None:
    ours = record(peak=100, start_allocated=10, status="ok")
    theirs = record(peak=300, start_allocated=20, status="regression", outcome="failed")
    theirs.messages = ["peak grew"]

    merged = merge_ranks({0: ours, 1: theirs}, world_size=2)

    assert (merged.peak_allocated, merged.peak_increment) == (300, 280)
    assert (merged.status, merged.outcome) == ("regression", "failed")
    assert merged.messages == ["rank 1: peak grew"]
    assert merged.figures() == {
        "peak_allocated": 300,
        "peak_allocated_rank0": 100,
        "peak_allocated_rank1": 300,
    }
    assert "ranks" not in record().to_dict()
    assert TestRecord.from_dict(merged.to_dict()).figures() == merged.figures()


def test_each_rank_is_compared_with_its_own_figures() -> None:
    entry = {"peak_allocated": 300, "peak_allocated_rank0": 100, "peak_allocated_rank1": 300}
    assert entry_for_rank(entry, 0) == {"peak_allocated": 100}
    assert entry_for_rank(entry, 1) == {"peak_allocated": 300}
    # An entry stored without ranks: every rank against it.
    assert entry_for_rank({"peak_allocated": 5}, 1) == {"peak_allocated": 5}


def test_rank_0_gives_up_on_a_rank_that_never_reports(tmp_path: Path) -> None:
    exchange = RankExchange(Ranks(0, 2, 0, 2), tmp_path, timeout=0.05)

    merged = exchange.exchange(record(peak=7))
    assert merged.peak_allocated == 7
    assert merged.messages == ["no figures from rank 1"]
    assert "waited 0 s for rank 1's record of t.py::t" in exchange.notes[0]
    # Not waited for again.
    assert exchange.exchange(record("t.py::u")).messages == ["no figures from rank 1"]
    assert len(exchange.notes) == 1


def test_a_rank_hands_its_record_to_rank_0(tmp_path: Path) -> None:
    RankExchange(Ranks(1, 2, 1, 2), tmp_path).exchange(record(peak=9))
    merged = RankExchange(Ranks(0, 2, 0, 2), tmp_path, timeout=5).exchange(record(peak=3))
    assert [r["figures"]["peak_allocated"] for r in merged.ranks or []] == [3, 9]
    assert list(tmp_path.iterdir()) == []  # rank 0 consumed the file


@pytest.mark.slow
def test_an_update_without_a_rank_keeps_the_stored_entry_and_fails(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 1's record comes late: rank 0 gives up waiting for it.
    pytester.makeconftest(
        CONFTEST
        + """
import os
import time

@pytest.fixture(autouse=True)
def late():
    yield
    if os.environ.get("RANK") == "1":
        time.sleep(4)
"""
    )
    pytester.makepyfile(test_ranks=TESTS.split("def test_ddp_step")[0])
    (pytester.path / "baselines").mkdir()
    stored = (
        "device: cpu\ntests:\n  test_ranks.py::test_rank_dependent:\n    peak_allocated: 8192\n"
        "    peak_allocated_rank0: 4096\n    peak_allocated_rank1: 8192\n"
    )
    (pytester.path / "baselines" / "cpu.yaml").write_text(stored)
    monkeypatch.setenv("PYTEST_VRAM_RANK_TIMEOUT", "1")

    result = torchrun(pytester, "--vram-update-baselines")

    assert result.ret != 0
    result.stdout.fnmatch_lines(
        [
            "pytest-vram: error: test_ranks.py::test_rank_dependent was not stored: no figures "
            "from rank 1, so its stored figures are kept; run the update again once every rank "
            "reports"
        ]
    )
    assert (pytester.path / "baselines" / "cpu.yaml").read_text() == stored


def test_a_record_without_every_rank_is_not_stored() -> None:
    merged = merge_ranks({0: record(peak=7)}, world_size=3)
    assert merged.missing_ranks == [1, 2]
    assert TestRecord.from_dict(merged.to_dict()).missing_ranks == [1, 2]
    assert "missing_ranks" not in record().to_dict()
