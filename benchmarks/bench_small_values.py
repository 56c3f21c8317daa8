"""Many small value-reading tests on the simulated device: plain pytest against the plugin.

The suite is ``benchmarks/small_values/``: 436 kornia-like tests of colour conversions,
filters, warps, enhancements and losses on images of at most 3x32x32, each opted in with
``@max_vram`` and each reading values (``torch.testing.assert_close``, ``bool(...)``), so that
on the sim backend every one computes. Each round runs it in a copy of the folder, in turn:
plain (``-p no:vram``), under ``--vram-report`` from an empty pytest cache (the first file's
first test starts shape-only, the files after a file that computed compute on a guess), and
under ``--vram-report`` again (every file computes from the start). It prints each run's wall
time and CPU time (user and system, of the pytest process and its children), their medians,
and the medians of the rounds' ratios to plain (on a shared machine the ratios of one round
drift less than two separate medians).

    python benchmarks/bench_small_values.py [--rounds 7] [--against DIR]

``--against DIR`` adds the two plugin runs with the ``pytest_vram`` package of another checkout
(``git worktree add DIR COMMIT``) first on ``sys.path``, in the same rounds.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUITE = Path(__file__).resolve().parent / "small_values"
RUNS = {
    "plain": ["-p", "no:vram"],
    "vram (first run)": ["--vram-report", "--cache-clear"],
    "vram (cached)": ["--vram-report"],
}


def run(folder: Path, options: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds of one pytest run in ``folder``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", *options],
        cwd=folder,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if completed.returncode != 0:
        sys.exit(f"pytest {' '.join(options)} failed:\n{completed.stdout[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--against", type=Path, help="a checkout of another version")
    args = parser.parse_args()
    variants: dict[str, tuple[list[str], dict[str, str]]] = {
        label: (options, {}) for label, options in RUNS.items()
    }
    if args.against is not None:
        env = {"PYTHONPATH": str(args.against.resolve())}
        for label in ("vram (first run)", "vram (cached)"):
            variants[f"{label}, {args.against}"] = (RUNS[label], env)
    times: dict[str, list[tuple[float, float]]] = {label: [] for label in variants}
    with tempfile.TemporaryDirectory() as work:
        folders = {}
        for n, label in enumerate(variants):
            folders[label] = Path(work) / str(n)
            shutil.copytree(SUITE, folders[label], ignore=shutil.ignore_patterns("__pycache__"))
            (folders[label] / "pytest.ini").write_text("[pytest]\nmarkers = max_vram\n")
        for label, (options, env) in variants.items():  # a cache for the cached runs
            run(folders[label], options, env)
        for round_ in range(args.rounds):
            for label, (options, env) in variants.items():
                times[label].append(run(folders[label], options, env))
            line = "  ".join(f"{w:.1f}/{c:.1f}" for w, c in (t[round_] for t in times.values()))
            print(f"round {round_ + 1}: wall/cpu s {line}", flush=True)
    plain = times["plain"]
    print(f"{len(plain)} rounds; medians, and the medians of the rounds' ratios to plain")
    for label, measured in times.items():
        wall = statistics.median(w for w, _ in measured)
        cpu = statistics.median(c for _, c in measured)
        wall_ratio = statistics.median(
            w / p for (w, _), (p, _) in zip(measured, plain, strict=True)
        )
        cpu_ratio = statistics.median(c / p for (_, c), (_, p) in zip(measured, plain, strict=True))
        print(
            f"  {label:<40} wall {wall:6.2f} s  ratio {wall_ratio:.2f}x   "
            f"cpu {cpu:6.2f} s  ratio {cpu_ratio:.2f}x"
        )


if __name__ == "__main__":
    main()
