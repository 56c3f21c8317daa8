"""Runs that update one baseline directory at once: each merges its changes into the file as
it is when it writes, under the file's lock, so that no run's entries are lost."""

from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pytest_vram.baselines.file import BaselineFile
from pytest_vram.baselines.locks import locked
from pytest_vram.baselines.store import BaselineStore
from pytest_vram.baselines.writer import BaselineWriter
from pytest_vram.record.record import TestRecord

WRITERS = 4
ROUNDS = 6
SEEDS = {f"seed.py::s{n}": {"peak_allocated": n} for n in range(WRITERS)}


def hammer(directory: str, index: int, barrier: multiprocessing.synchronize.Barrier) -> None:
    """One writer: each round it loads the store, waits until every writer has loaded it (so
    each holds a copy the others are about to change), then adds its own entries, changes a
    shared one, and prunes its seed entry."""
    for round_ in range(ROUNDS):
        store = BaselineStore.load(Path(directory))
        barrier.wait()
        writer = BaselineWriter(store, {"sim": {"torch": "2.13.0", "writer": str(index)}})
        writer.update(
            [
                TestRecord(
                    nodeid=f"w{index}.py::r{round_}",
                    backend="sim",
                    device="sim",
                    peak_allocated=1000 * index + round_,
                ),
                TestRecord(
                    nodeid="shared.py::t",
                    backend="sim",
                    device="sim",
                    peak_allocated=1000 * index + round_,
                ),
            ]
        )
        if round_ == ROUNDS - 1:
            writer.prune([f"seed.py::s{index}"])
        written = writer.save()
        assert written.errors == [], written.errors
        barrier.wait()


@pytest.mark.slow
def test_concurrent_writers_lose_no_entry(tmp_path: Path) -> None:
    path = tmp_path / "sim.yaml"
    BaselineFile(path, "sim", {}, {**SEEDS, "kept.py::k": {"peak_allocated": 7}}).write()
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(WRITERS)
    processes = [
        context.Process(target=hammer, args=(str(tmp_path), index, barrier))
        for index in range(WRITERS)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=240)
    assert [process.exitcode for process in processes] == [0] * WRITERS

    stored = BaselineFile.read(path)
    expected = {
        f"w{index}.py::r{round_}": {"peak_allocated": 1000 * index + round_}
        for index in range(WRITERS)
        for round_ in range(ROUNDS)
    }
    shared = stored.entries.pop("shared.py::t")
    assert shared["peak_allocated"] in {1000 * index + ROUNDS - 1 for index in range(WRITERS)}
    assert stored.entries == {**expected, "kept.py::k": {"peak_allocated": 7}}
    assert stored.environment["writer"] in {str(index) for index in range(WRITERS)}
    # The file is the one a single writer would write: sorted, stable.
    assert path.read_text() == BaselineFile.read(path).dump()
    assert list(yaml.safe_load(path.read_text())["tests"]) == sorted(
        [*expected, "kept.py::k", "shared.py::t"]
    )
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_the_lock_excludes_another_process(tmp_path: Path) -> None:
    path = tmp_path / "sim.yaml"
    probe = (
        "import sys\nfrom pathlib import Path\nfrom pytest_vram.baselines.locks import locked\n"
        "try:\n    with locked(Path(sys.argv[1]), timeout=0.2):\n        pass\n"
        "except TimeoutError as exc:\n    print(exc)\n    sys.exit(3)\n"
    )
    with locked(path):
        held = subprocess.run(
            [sys.executable, "-c", probe, str(path)], capture_output=True, text=True
        )
    assert held.returncode == 3
    assert ".sim.yaml.lock is held by another run" in held.stdout
    free = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True)
    assert free.returncode == 0


# -- two pytest runs at once -----------------------------------------------------------------

# Each run's test waits until the other run has started its tests too: by then both have loaded
# the baselines, and each writes into a file the other has changed since.
SHARD = """
import os, time
from pathlib import Path

def test_{name}_{n}(vram):
    Path("started-{name}").touch()
    deadline = time.monotonic() + 120
    while not Path("started-{other}").exists():
        assert time.monotonic() < deadline, "the other run never started"
        time.sleep(0.05)
"""


@pytest.mark.slow
def test_two_update_runs_at_once_keep_both_runs_entries(pytester: pytest.Pytester) -> None:
    for name, other in (("a", "b"), ("b", "a")):
        pytester.makepyfile(
            **{
                f"test_{name}": "\n".join(
                    SHARD.format(name=name, other=other, n=n) for n in range(2)
                )
            }
        )
    (pytester.path / "baselines").mkdir()
    BaselineFile(
        pytester.path / "baselines" / "cpu.yaml",
        "cpu",
        {},
        {"test_gone.py::kept": {"peak_allocated": 1}},
    ).write()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    runs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pytest",
                "--vram-backend=cpu",
                "--vram-update-baselines",
                "-p",
                "no:cacheprovider",
                f"test_{name}.py",
            ],
            cwd=pytester.path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in ("a", "b")
    ]
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    for output in outputs:
        assert "baselines: 2 added, 0 updated, 0 removed in baselines/cpu.yaml" in output
    entries = yaml.safe_load((pytester.path / "baselines" / "cpu.yaml").read_text())["tests"]
    assert sorted(entries) == [
        "test_a.py::test_a_0",
        "test_a.py::test_a_1",
        "test_b.py::test_b_0",
        "test_b.py::test_b_1",
        "test_gone.py::kept",
    ]
    # One run wrote first; the other found its entries on disk and kept them.
    counts = sorted(re.search(r"cpu\.yaml \((\d+) entries", output)[1] for output in outputs)
    assert counts == ["3", "5"]
