"""``pytest-vram history`` on a synthetic history: N tests over M commits, one ``--vram-json``
document per commit as the plugin writes it (each test a full record with its category
totals and a baseline). Prints the documents' size, the CPU time of reading one document with
json.loads and with the fast reader, then the time of reading them all, of the page and of the
Markdown table, each the median of the rounds; with ``--command``, the whole
``pytest-vram history DIR --html --markdown`` in a fresh process too.

python benchmarks/bench_history.py [--tests 2000] [--commits 500] [--rounds 3] [--command]
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pytest_vram.record.record import TestRecord
from pytest_vram.report.document import build_document
from pytest_vram.report.documentscan import scan_document
from pytest_vram.report.history import read_history, steps_markdown
from pytest_vram.report.historypage import render_history_html

MiB = 1 << 20
START = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)


def write_documents(directory: Path, tests: int, commits: int, seed: int = 0) -> int:
    """One document per commit; about one test in 50 steps up once. Returns the bytes written."""
    rng = random.Random(seed)
    peaks = [rng.randint(1, 4096) * MiB for _ in range(tests)]
    steps = {rng.randrange(tests): rng.randrange(1, max(2, commits)) for _ in range(tests // 50)}
    environments = {"sim": {"backend": "sim", "device": "sim", "torch": "2.13.0+cpu"}}
    written = 0
    for commit in range(commits):
        records = []
        for index, peak in enumerate(peaks):
            if steps.get(index) == commit:
                peaks[index] = peak = peak + peak // 4
            noise = rng.randint(-peak // 200, peak // 200)
            now = peak + noise
            records.append(
                TestRecord(
                    nodeid=f"tests/test_model_{index // 20}.py::test_case[{index}]",
                    backend="sim",
                    device="sim",
                    peak_allocated=now,
                    end_allocated=0,
                    status="ok",
                    baseline={"peak_allocated": peak},
                    categories={
                        "parameters": now // 4,
                        "gradients": now // 4,
                        "optimizer": now // 4,
                        "activations": now - 3 * (now // 4),
                    },
                )
            )
        document = build_document(
            records,
            environments,
            {
                "measured": "marked",
                "commit": f"{commit:040x}",
                "commit_date": (START + datetime.timedelta(hours=commit)).isoformat(),
            },
        )
        text = json.dumps(document, indent=2) + "\n"
        (directory / f"{commit:05d}.json").write_text(text, encoding="utf-8")
        written += len(text)
    return written


def _cpu() -> float:
    """CPU seconds of this process and of its children that have ended."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tests", type=int, default=2000)
    parser.add_argument("--commits", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--command", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "history"
        directory.mkdir()
        started = time.perf_counter()
        size = write_documents(directory, args.tests, args.commits)
        print(
            f"{args.tests} tests x {args.commits} commits: {size / 1e6:.0f} MB of documents "
            f"({size / args.commits / 1e6:.2f} MB each), made in "
            f"{time.perf_counter() - started:.1f} s"
        )
        # One document, in this process: the CPU time a reader spends on it, which other jobs
        # on the machine change less than the wall-clock time.
        sample = next(iter(sorted(directory.iterdir()))).read_text(encoding="utf-8")
        for name, read in (("json.loads", json.loads), ("fast reader", scan_document)):
            spent = []
            for _ in range(20):
                started = time.process_time()
                read(sample)
                spent.append(time.process_time() - started)
            print(f"  one document, {name}: {statistics.median(spent) * 1000:.1f} ms of CPU")
        timings: dict[str, list[float]] = {"read": [], "page": [], "table": []}
        cpu: list[float] = []
        for _ in range(args.rounds):
            started, cpu_started = time.perf_counter(), _cpu()
            history = read_history(directory)
            timings["read"].append(time.perf_counter() - started)
            cpu.append(_cpu() - cpu_started)
            started = time.perf_counter()
            page = render_history_html(history)
            timings["page"].append(time.perf_counter() - started)
            started = time.perf_counter()
            steps_markdown(history)
            timings["table"].append(time.perf_counter() - started)
        print(
            f"{len(history.series)} tests, {len(history.commits)} commits, "
            f"{len(history.steps)} steps; page {len(page) / 1e6:.1f} MB"
        )
        for name, values in timings.items():
            rounds = ", ".join(f"{v:.2f}" for v in values)
            print(f"  {name:6s} median {statistics.median(values):6.2f} s  ({rounds})")
        # The CPU time of the reading, its worker processes' included: what the machine's
        # other jobs do not change.
        rounds = ", ".join(f"{v:.2f}" for v in cpu)
        print(f"  read's CPU time, all processes: median {statistics.median(cpu):.2f} s ({rounds})")
        if args.command:
            started = time.perf_counter()
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest_vram.cli",
                    "history",
                    str(directory),
                    "--html",
                    str(Path(tmp) / "history.html"),
                    "--markdown",
                    str(Path(tmp) / "steps.md"),
                ],
                check=True,
            )
            print(f"  pytest-vram history, whole command: {time.perf_counter() - started:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
