"""Overhead of ``--vram-report`` on 1000 small torch tests (cpu backend) against plain pytest.

Runs whole pytest sessions of the same 1000 tests, one after another in this one process (torch
and the test module are imported once, before the first), alternating the variants in each round
and starting each round with another one. Prints each variant's median session time (collection,
the tests and the report), the median of its per-round ratios to plain pytest, and the ratio of
the median times:

    python benchmarks/bench_overhead.py [--tests 1000] [--rounds 30]

Every measured test on a backend with a tracker of its own (sim, the cpu dispatch counter)
records its peak's category totals; a variant of each cpu counter turns that off, and the median
of the per-round ratios of the two is printed as what the category totals cost.

The cpu backend counts inside PyTorch's CPU allocator by default; one variant runs it with the
dispatch counter (a ``TorchDispatchMode`` that sees every op) instead, and one pushes a
pass-through ``TorchDispatchMode`` for the whole session without the plugin: what PyTorch charges
for handing every op to Python, the floor under the dispatch counter.

Sessions in one process, seconds apart, share the machine's state: on a shared machine whose
speed drifts over minutes, separate processes make the comparison much noisier.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import pytest
import torch  # noqa: F401  (imported before the first session, as in every later one)
from small_tests import PASS_THROUGH_MODE, TEST_FILE

CONFTEST = (
    """
import json
import os
import time

import torch
"""
    + PASS_THROUGH_MODE
    + """
_MODE = []
_TIMES = {}


def pytest_sessionstart(session):
    _TIMES.clear()
    _TIMES["start"] = time.perf_counter()
    if os.environ.get("BENCH_PASS_THROUGH_MODE"):
        _MODE.append(PassThrough())
        _MODE[-1].__enter__()
    if os.environ.get("BENCH_NO_CATEGORIES"):
        from pytest_vram.attribution.recorder import Attribution

        Attribution.categories_by_default = False


def pytest_runtest_logstart(nodeid, location):
    _TIMES.setdefault("first", time.perf_counter())


def pytest_runtest_logfinish(nodeid, location):
    _TIMES["last"] = time.perf_counter()


def pytest_unconfigure(config):
    if os.environ.get("BENCH_NO_CATEGORIES"):
        from pytest_vram.attribution.recorder import Attribution

        Attribution.categories_by_default = True
    while _MODE:
        _MODE.pop().__exit__(None, None, None)
    end = time.perf_counter()
    phases = {
        "collection": _TIMES["first"] - _TIMES["start"],
        "tests": _TIMES["last"] - _TIMES["first"],
        "summary": end - _TIMES["last"],
    }
    with open(os.environ["BENCH_PHASES_OUT"], "w") as out:
        json.dump(phases, out)
"""
)

PLAIN = "plain pytest (-p no:vram)"
MEASURED = "--vram-report --vram-backend=cpu"
# The measured tests without the category totals every sim and cpu test records by default.
NO_CATEGORIES = "  the same, no category totals"
DISPATCH = "  the same, --vram-cpu-counter=dispatch"
DISPATCH_NO_CATEGORIES = "    and no category totals"
VARIANTS: dict[str, tuple[list[str], dict[str, str]]] = {
    PLAIN: (["-p", "no:vram"], {}),
    "plugin loaded, nothing measured": ([], {}),
    "pass-through dispatch mode, no plugin": (["-p", "no:vram"], {"BENCH_PASS_THROUGH_MODE": "1"}),
    MEASURED: (["--vram-report", "--vram-backend=cpu"], {}),
    NO_CATEGORIES: (["--vram-report", "--vram-backend=cpu"], {"BENCH_NO_CATEGORIES": "1"}),
    DISPATCH: (["--vram-report", "--vram-backend=cpu", "--vram-cpu-counter=dispatch"], {}),
    DISPATCH_NO_CATEGORIES: (
        ["--vram-report", "--vram-backend=cpu", "--vram-cpu-counter=dispatch"],
        {"BENCH_NO_CATEGORIES": "1"},
    ),
}


PHASES = ("collection", "tests", "summary")


def run_session(args: list[str], env: dict[str, str]) -> float:
    """Seconds for one pytest session in this process; its output is discarded, the seconds of
    its phases go to the file $BENCH_PHASES_OUT names."""
    os.environ.update(env)
    output = io.StringIO()
    try:
        started = time.perf_counter()
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            code = pytest.main(["-q", "-p", "no:cacheprovider", *args])
        seconds = time.perf_counter() - started
    finally:
        for name in env:
            del os.environ[name]
    if code != 0:
        raise RuntimeError(f"pytest {' '.join(args)} exited {code}:\n{output.getvalue()[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "test_many.py").write_text(TEST_FILE.format(count=args.tests))
        (root / "pytest.ini").write_text("[pytest]\n")
        (root / "conftest.py").write_text(CONFTEST)
        os.chdir(root)
        os.environ["BENCH_PHASES_OUT"] = str(root / "phases.json")
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        phases: dict[str, dict[str, list[float]]] = {
            name: {phase: [] for phase in PHASES} for name in VARIANTS
        }
        names = list(VARIANTS)
        for name in names:  # imports the tests, the plugin's modules, and builds what it builds
            run_session(*VARIANTS[name])
        for round_ in range(args.rounds):
            # Each round starts with another variant.
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                times[name].append(run_session(*VARIANTS[name]))
                for phase, seconds in json.loads((root / "phases.json").read_text()).items():
                    phases[name][phase].append(seconds)
    print(f"{args.tests} tests, {args.rounds} rounds of sessions in one process: median session")
    print("time; the median of the per-round ratios to plain pytest; the ratio of the medians")
    for name in VARIANTS:
        ratio = statistics.median(a / b for a, b in zip(times[name], times[PLAIN], strict=True))
        session = statistics.median(times[name])
        of_medians = session / statistics.median(times[PLAIN])
        print(f"  {name:<40} {session:6.3f} s  ratio {ratio:.3f}x  of medians {of_medians:.3f}x")
    for measured, without in ((MEASURED, NO_CATEGORIES), (DISPATCH, DISPATCH_NO_CATEGORIES)):
        ratio = statistics.median(
            a / b for a, b in zip(times[measured], times[without], strict=True)
        )
        print(f"category totals, {measured.strip()}: {ratio:.3f}x the same without (median of")
        print("  the per-round ratios)")
    print("median milliseconds per phase: collection, the tests, the summary after the last test")
    for name in VARIANTS:
        cells = "".join(f"{statistics.median(phases[name][p]) * 1e3:10.1f}" for p in PHASES)
        print(f"  {name:<40}{cells}")


if __name__ == "__main__":
    main()
