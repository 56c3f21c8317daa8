"""Outcome parity on third-party test suites: plain pytest against ``pytest --vram-report
--vram-gate=all``, which simulates every test, opted in or not.

Each suite is a source tree with its tests (a checkout of the project), installed in the
environment of ``--python`` together with torch and pytest-vram. The suite runs three times on a
machine without a GPU: plain (``-p no:vram``), with every test simulated and an empty pytest
cache (every test starts shape-only and the files that need values are found), and so again
(those files compute from the start). A test that fails on the simulated device and passes
without it keeps plain pytest's outcome through the plugin's backstop, and the run says so in a
``pytest-vram: NODEID: its memory was not simulated`` line: parity on the simulated device
itself means the runs print no such line. Per test, and per subtest
(``self.subTest`` in a ``unittest.TestCase``, or the ``subtests`` fixture), the outcomes are
compared; the table gives passed / failed / skipped tests and passed / failed subtests per run,
as pytest's own summary counts them, the tests and subtests whose outcome differs from plain,
the tests whose memory was not simulated (each such line is printed above the table), and each
run's wall time against plain's. With ``--rounds N`` the three runs are repeated N
times in turn, each round's first run again from an empty cache: the wall times are the medians,
and the ratios the medians of the rounds' ratios (the machine's drift from one run to the next
enters each round's ratio less than it enters two separate medians).

    python benchmarks/bench_third_party.py --python /path/to/venv/bin/python \\
        --suite vector-quantize-pytorch=/src/vector-quantize-pytorch \\
        --suite torchdiffeq=/src/torchdiffeq:tests/*_tests.py \\
        --suite schedulefree=/src/schedule_free:schedulefree -- -o addopts=

A suite's tests are ``tests`` in its tree unless ``:GLOB`` names others (relative to the tree).
``-o addopts=`` drops options a suite's configuration adds for plugins not installed, such as
coverage.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

_SIMULATED = ["--vram-report", "--vram-gate=all", "--vram-baseline-dir", "{baselines}"]
RUNS = {
    "plain": ["-p", "no:vram"],
    "vram (first run)": _SIMULATED,
    "vram (cached)": _SIMULATED,
}
LOG = "BENCH_THIRD_PARTY_LOG"
# What the run's end says of a test that kept its outcome only by running as without the plugin.
NOT_SIMULATED = ": its memory was not simulated: "


# Loaded into the suite's pytest as a plugin (``-p bench_third_party``): JUnit XML folds a test's
# subtests into one entry, so each report the terminal counts is written as a JSON line instead.
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    log = os.environ.get(LOG)
    if not log:
        return
    context = getattr(report, "context", None)  # a subtest's report
    subtest = None
    if context is not None:
        parts = [f"[{context.msg}]"] if context.msg is not None else []
        if context.kwargs:
            parts.append("(" + ", ".join(f"{k}={v}" for k, v in context.kwargs.items()) + ")")
        subtest = " ".join(parts) or "(<subtest>)"
    entry = {"test": report.nodeid, "subtest": subtest, "when": report.when}
    with open(log, "a", encoding="utf-8") as file:
        print(json.dumps({**entry, "outcome": report.outcome}), file=file)


def outcomes(log: Path) -> dict[tuple[str, str], str]:
    """Per test (node id, "") and per subtest (node id, description) its outcome in a log."""
    result: dict[tuple[str, str], str] = {}
    seen: Counter[tuple[str, str]] = Counter()
    for line in log.read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        if entry["when"] != "call" and entry["outcome"] == "passed":
            # A passed setup or teardown says nothing of the test, and no plugin counts it:
            # pytest-vram logs a subtest held back until its run stands as one.
            continue
        name = (entry["test"], entry["subtest"] or "")
        if entry["subtest"] is not None:
            seen[name] += 1
            if seen[name] > 1:  # the same description again within a test
                name = (name[0], f"{name[1]} #{seen[name]}")
        # A teardown error is a second report of the same test: the worse outcome wins.
        if result.get(name) != "failed":
            result[name] = entry["outcome"]
    return result


def run_suite(
    python: str, path: Path, tests: str, extra: list[str], timeout: int, rounds: int = 1
) -> dict[str, object] | None:
    work = Path(tempfile.mkdtemp(prefix="bench-third-party-"))
    try:
        tree = work / "suite"
        shutil.copytree(path, tree, ignore=shutil.ignore_patterns(".pytest_cache", "baselines"))
        selected = sorted(str(p.relative_to(tree)) for p in tree.glob(tests))
        if not selected:
            print(f"{path}: no tests match {tests}", file=sys.stderr)
            return None
        results: dict[str, object] = {}
        backstopped: dict[str, list[str]] = {}
        times: dict[str, list[float]] = {label: [] for label in RUNS}
        for run, label in enumerate(list(RUNS) * rounds):
            options = RUNS[label]
            if label == "vram (first run)":  # each round's first run starts from no cache
                shutil.rmtree(tree / ".pytest_cache", ignore_errors=True)
                shutil.rmtree(work / "baselines", ignore_errors=True)
            log = work / f"{label.split()[0]}-{run}.jsonl"
            command = [
                python, "-m", "pytest", *selected, "-q", "-p", "no:randomly",
                "-p", "bench_third_party",
                *(o.format(baselines=work / "baselines") for o in options), *extra,
            ]  # fmt: skip
            here = str(Path(__file__).resolve().parent)
            pythonpath = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
            start = time.perf_counter()
            completed = subprocess.run(
                command,
                cwd=tree,
                capture_output=True,
                text=True,
                timeout=timeout,
                env={
                    **os.environ,
                    "CUDA_VISIBLE_DEVICES": "",
                    "PYTHONPATH": pythonpath,
                    LOG: str(log),
                },
            )
            elapsed = time.perf_counter() - start
            if not log.exists():
                output = completed.stdout[-2000:] + completed.stderr[-2000:]
                print(f"{path}: pytest reported no test ({label}):\n{output}", file=sys.stderr)
                return None
            times[label].append(elapsed)
            if label not in results:
                results[label] = outcomes(log)
                backstopped[label] = [
                    line.strip() for line in completed.stdout.splitlines() if NOT_SIMULATED in line
                ]
        if rounds > 1:  # what the medians are of
            for label, seconds in times.items():
                print(f"  {path.name} [{label}] rounds: " + " ".join(f"{t:.1f}" for t in seconds))
        return {
            label: (
                found,
                backstopped[label],
                statistics.median(times[label]),
                statistics.median(
                    run / plain for plain, run in zip(times["plain"], times[label], strict=True)
                ),
            )
            for label, found in results.items()
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="the suites' interpreter")
    parser.add_argument(
        "--suite",
        action="append",
        required=True,
        metavar="NAME=PATH[:GLOB]",
        help="a suite to run, its tests GLOB in PATH (default: tests)",
    )
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per pytest run")
    parser.add_argument(
        "--rounds", type=int, default=1, help="rounds of the three runs (default 1)"
    )
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args()

    rows = []
    for spec in args.suite:
        name, _, path = spec.partition("=")
        path, _, tests = path.partition(":")
        results = run_suite(
            args.python, Path(path), tests or "tests", args.pytest_args, args.timeout, args.rounds
        )
        if results is None:
            continue
        plain = results["plain"][0]  # type: ignore[index]
        for label, (found, backstop, elapsed, ratio) in results.items():  # type: ignore[misc]
            counts = Counter(
                ("subtests " if subtest else "") + outcome
                for (_, subtest), outcome in found.items()
            )
            differ = sorted(t for t, o in found.items() if plain.get(t) != o)
            differ += sorted(t for t in plain if t not in found)
            lost = [t for t in differ if plain.get(t) == "passed"]
            rows.append((name, label, counts, len(differ), len(backstop), elapsed, ratio, lost))
            for line in backstop:
                print(f"  {name} [{label}] {line}")
            for test in differ:
                print(
                    f"  {name} [{label}] {' '.join(test).strip()}: "
                    f"plain {plain.get(test)}, here {found.get(test)}"
                )

    print()
    print(
        "| suite | run | passed | failed | skipped | subtests passed / failed / skipped "
        "| differ from plain | not simulated | wall time | ratio |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, label, counts, differ, backstop, elapsed, ratio, _ in rows:
        print(
            f"| {name} | {label} | {counts['passed']} | {counts['failed']} | "
            f"{counts['skipped']} | {counts['subtests passed']} / {counts['subtests failed']} / "
            f"{counts['subtests skipped']} | {differ} | {backstop} | {elapsed:.1f} s | "
            f"{ratio:.2f} |"
        )
    if any(lost for *_, lost in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
