"""Outcome parity on third-party test suites: plain pytest against ``pytest --vram-report``.

Each suite is a source tree with its tests (a checkout of the project), installed in the
environment of ``--python`` together with torch and pytest-vram. The suite runs three times on a
machine without a GPU: plain (``-p no:vram``), under ``--vram-report`` with an empty pytest
cache (every test starts shape-only and the files that need values are found), and under
``--vram-report`` again (those files compute from the start). Per test the outcomes are
compared; the table gives passed / failed / skipped per run, the tests whose outcome differs
from plain, and each run's wall time against plain's. With ``--rounds N`` the three runs are
repeated N times in turn, each round's first run again from an empty cache: the wall times are
the medians, and the ratios the medians of the rounds' ratios (the machine's drift from one run
to the next enters each round's ratio less than it enters two separate medians).

    python benchmarks/bench_third_party.py --python /path/to/venv/bin/python \\
        --suite vector-quantize-pytorch=/src/vector-quantize-pytorch \\
        --suite pytorch_optimizer=/src/pytorch_optimizer \
        --suite x-transformers=/src/x-transformers -- -o addopts=

(``-o addopts=`` drops options a suite's configuration adds for plugins not installed, such as
coverage.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

RUNS = {
    "plain": ["-p", "no:vram"],
    "vram (first run)": ["--vram-report", "--vram-baseline-dir", "{baselines}"],
    "vram (cached)": ["--vram-report", "--vram-baseline-dir", "{baselines}"],
}


def outcomes(junit: Path) -> dict[str, str]:
    """Per test (class and name) its outcome in a JUnit XML file."""
    result: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        # A teardown error is a second entry of the same test: the worse outcome wins.
        if result.get(name) != "failed":
            result[name] = outcome
    return result


def run_suite(
    python: str, path: Path, extra: list[str], timeout: int, rounds: int = 1
) -> dict[str, object] | None:
    work = Path(tempfile.mkdtemp(prefix="bench-third-party-"))
    try:
        tree = work / "suite"
        shutil.copytree(path, tree, ignore=shutil.ignore_patterns(".pytest_cache", "baselines"))
        results: dict[str, object] = {}
        times: dict[str, list[float]] = {label: [] for label in RUNS}
        for run, label in enumerate(list(RUNS) * rounds):
            options = RUNS[label]
            if label == "vram (first run)":  # each round's first run starts from no cache
                shutil.rmtree(tree / ".pytest_cache", ignore_errors=True)
                shutil.rmtree(work / "baselines", ignore_errors=True)
            junit = work / f"{label.split()[0]}-{run}.xml"
            command = [
                python, "-m", "pytest", "tests", "-q", "-p", "no:randomly",
                f"--junitxml={junit}",
                *(o.format(baselines=work / "baselines") for o in options), *extra,
            ]  # fmt: skip
            start = time.perf_counter()
            completed = subprocess.run(
                command,
                cwd=tree,
                capture_output=True,
                text=True,
                timeout=timeout,
                env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
            )
            elapsed = time.perf_counter() - start
            if not junit.exists():
                output = completed.stdout[-2000:] + completed.stderr[-2000:]
                print(f"{path}: pytest wrote no report ({label}):\n{output}", file=sys.stderr)
                return None
            times[label].append(elapsed)
            if label not in results:
                results[label] = outcomes(junit)
        if rounds > 1:  # what the medians are of
            for label, seconds in times.items():
                print(f"  {path.name} [{label}] rounds: " + " ".join(f"{t:.1f}" for t in seconds))
        return {
            label: (
                found,
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
        "--suite", action="append", required=True, metavar="NAME=PATH", help="a suite to run"
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
        results = run_suite(args.python, Path(path), args.pytest_args, args.timeout, args.rounds)
        if results is None:
            continue
        plain = results["plain"][0]  # type: ignore[index]
        for label, (found, elapsed, ratio) in results.items():  # type: ignore[misc]
            counts = {o: sum(1 for v in found.values() if v == o) for o in ("passed", "failed")}
            counts["skipped"] = sum(1 for v in found.values() if v == "skipped")
            differ = sorted(t for t, o in found.items() if plain.get(t) != o)
            lost = sorted(t for t in differ if plain.get(t) == "passed")
            rows.append((name, label, counts, len(differ), elapsed, ratio, lost))
            for test in differ:
                print(f"  {name} [{label}] {test}: plain {plain.get(test)}, here {found.get(test)}")

    print()
    print("| suite | run | passed | failed | skipped | differ from plain | wall time | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, label, counts, differ, elapsed, ratio, _ in rows:
        print(
            f"| {name} | {label} | {counts['passed']} | {counts['failed']} | "
            f"{counts['skipped']} | {differ} | {elapsed:.1f} s | {ratio:.2f} |"
        )
    if any(lost for *_, lost in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
