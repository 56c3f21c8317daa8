"""How long the main job takes: ``pytest suites --vram-report``, the reference suites measured on
the default backend (sim, shape-only on a machine without a GPU), each run in a process of its
own from the repository root.

Prints each run's wall time, the CPU time it used (on a shared machine the CPU time drifts far
less than the wall time) and the load average when it started, then the medians and the slowest
tests by their median ``--durations`` time:

    python benchmarks/bench_main_job.py [--runs 3] [--top 5] [--against DIR] [--also OPTION]

``--against DIR`` alternates the runs with runs in another checkout of the repository (an
earlier commit, made with ``git worktree add`` or ``git archive``), whose own ``pytest_vram``,
suites and baselines they use, so that both see the same machine. ``--also OPTION``
(repeatable) alternates them with runs of this tree given those pytest options too, such as
``--also=--vram-sim-host-tensors=host``.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# "12.34s call     suites/test_x.py::test_y", pytest's --durations lines.
_DURATION = re.compile(r"^\s*([\d.]+)s (call|setup|teardown)\s+(\S+)")


@dataclass
class Run:
    wall: float
    cpu: float
    load: float
    status: int
    summary: str
    durations: dict[str, float] = field(default_factory=dict)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(tree: Path, top: int, options: tuple[str, ...] = ()) -> Run:
    """One ``pytest suites --vram-report`` in ``tree``, importing that tree's pytest_vram."""
    command = [
        sys.executable, "-m", "pytest", "suites", "--vram-report", f"--durations={top}", *options
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(tree))
    load = os.getloadavg()[0]
    cpu = _children_cpu()
    start = time.perf_counter()
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    cpu = _children_cpu() - cpu
    output = done.stdout + done.stderr
    durations: dict[str, float] = defaultdict(float)
    for line in output.splitlines():
        match = _DURATION.match(line)
        if match:
            durations[match.group(3)] += float(match.group(1))
    lines = output.strip().splitlines() or ["(no output)"]
    return Run(wall, cpu, load, done.returncode, lines[-1].strip("= "), dict(durations))


def report(name: str, runs: list[Run], top: int) -> None:
    walls = [run.wall for run in runs]
    cpus = [run.cpu for run in runs]
    print(
        f"{name}: median {statistics.median(walls):.1f} s wall, "
        f"{statistics.median(cpus):.1f} s CPU over {len(runs)} runs"
    )
    tests: dict[str, list[float]] = defaultdict(list)
    for run in runs:
        for test, seconds in run.durations.items():
            tests[test].append(seconds)
    slowest = sorted(tests.items(), key=lambda item: -statistics.median(item[1]))[:top]
    for test, seconds in slowest:
        print(f"  {statistics.median(seconds):7.2f} s  {test}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each tree")
    parser.add_argument("--top", type=int, default=5, help="slowest tests to list")
    parser.add_argument("--against", type=Path, help="another checkout, run in alternation")
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="OPTION",
        help="runs of this tree with this pytest option too, in alternation (repeatable)",
    )
    args = parser.parse_args()
    trees: dict[str, tuple[Path, tuple[str, ...]]] = {"this tree": (ROOT, ())}
    if args.against is not None:
        if not (args.against / "suites").is_dir():
            sys.exit(f"--against {args.against}: no suites/ there; give a checkout of the repo")
        trees["--against"] = (args.against.resolve(), ())
    if args.also:
        trees["--also"] = (ROOT, tuple(args.also))
    runs: dict[str, list[Run]] = {name: [] for name in trees}
    failed = False
    for i in range(args.runs):
        # Alternate which goes first, so that neither always runs on a warmer machine.
        order = list(trees.items()) if i % 2 == 0 else list(trees.items())[::-1]
        for name, (tree, options) in order:
            run = run_once(tree, args.top, options)
            runs[name].append(run)
            failed |= run.status != 0
            print(
                f"{name:10} run {i + 1}: {run.wall:6.1f} s wall, {run.cpu:6.1f} s CPU, "
                f"load {run.load:.2f}, exit {run.status}  {run.summary}",
                flush=True,
            )
    for name in trees:
        report(name, runs[name], args.top)
    if failed:
        sys.exit("some runs failed: their times are not those of a passing run")


if __name__ == "__main__":
    main()
