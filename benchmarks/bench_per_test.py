"""Where a measured test's extra time goes, on the cpu backend, measured inside one session.

Runs a pytest session of small torch tests (the ones ``bench_overhead.py`` uses) in blocks of
100, where the tests of every other block are measured (``vram_backend("cpu")``) and the others
are not. Both kinds share the session, so the machine's drift between runs does not enter the
comparison. Prints the median time per test of each kind, split into the test function itself
(where the counter sees each allocation, or each op) and the rest of pytest's protocol (where
the plugin starts, judges and finishes the measurement).

Sessions: the cpu backend with its default counter (inside PyTorch's CPU allocator), the same
without seeding the random generators (``--vram-seed=off``: what seeding costs), with the
dispatch counter (a ``TorchDispatchMode``), and, without the plugin, a pass-through
``TorchDispatchMode`` around the test functions of every other block: what PyTorch charges for
handing each op to Python, the floor under the dispatch counter.

    python benchmarks/bench_per_test.py [--tests 4000] [--runs 3] [--against DIR]

``--against DIR`` adds the allocator-counter session with the ``pytest_vram`` package of
another checkout (``git worktree add DIR COMMIT``) put first on ``sys.path``: the extra time
of two versions, side by side in the same runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from small_tests import PASS_THROUGH_MODE, TEST_FUNCTION

TEST_FILE = (
    """
import pytest
import torch

MEASURED = pytest.mark.vram_backend("cpu")


@pytest.mark.parametrize(
    "n", [pytest.param(i, marks=MEASURED) if i // 100 % 2 == 0 else i for i in range({count})]
)"""
    + TEST_FUNCTION
)

CONFTEST = (
    """
import json
import os
import statistics
import time

import pytest
import torch  # noqa: F401
"""
    + PASS_THROUGH_MODE
    + """
TIMES = {kind: {"protocol": [], "function": []} for kind in ("measured", "unmeasured")}
PASS_THROUGH = bool(os.environ.get("BENCH_PASS_THROUGH_MODE"))


def kind(item):
    return "measured" if item.callspec.params["n"] // 100 % 2 == 0 else "unmeasured"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    started = time.perf_counter()
    try:
        return (yield)
    finally:
        TIMES[kind(item)]["protocol"].append(time.perf_counter() - started)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    started = time.perf_counter()
    try:
        if PASS_THROUGH and kind(pyfuncitem) == "measured":
            with PassThrough():
                return (yield)
        return (yield)
    finally:
        TIMES[kind(pyfuncitem)]["function"].append(time.perf_counter() - started)


def pytest_unconfigure(config):
    medians = {
        name: {part: statistics.median(values) * 1e6 for part, values in parts.items()}
        for name, parts in TIMES.items()
    }
    with open(os.environ["BENCH_PER_TEST_OUT"], "w") as out:
        json.dump(medians, out)
"""
)

SESSIONS = {
    "cpu backend, allocator counter, on every other block": (["--vram-cpu-counter=allocator"], {}),
    "the same, --vram-seed=off (no generator seeded)": (
        ["--vram-cpu-counter=allocator", "--vram-seed=off"],
        {},
    ),
    "cpu backend, dispatch counter, on every other block": (["--vram-cpu-counter=dispatch"], {}),
    "pass-through mode on every other block, no plugin": (
        ["-p", "no:vram"],
        {"BENCH_PASS_THROUGH_MODE": "1"},
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=4000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--against", type=Path, help="a checkout of another version")
    args = parser.parse_args()
    sessions = dict(SESSIONS)
    if args.against is not None:
        sessions[f"the same, pytest_vram of {args.against}"] = (
            ["--vram-cpu-counter=allocator"],
            {"PYTHONPATH": str(args.against.resolve())},
        )
    runs: dict[str, list[dict]] = {name: [] for name in sessions}
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "test_blocks.py").write_text(TEST_FILE.format(count=args.tests))
        (root / "pytest.ini").write_text("[pytest]\n")
        (root / "conftest.py").write_text(CONFTEST)
        out = root / "medians.json"
        for _ in range(args.runs):
            for name, (extra, env) in sessions.items():
                subprocess.run(
                    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra],
                    cwd=root,
                    capture_output=True,
                    check=True,
                    env={**os.environ, **env, "BENCH_PER_TEST_OUT": str(out)},
                )
                runs[name].append(json.loads(out.read_text()))
    print(f"{args.tests} tests in blocks of 100; medians per test, median of {args.runs} runs")
    for name in sessions:
        print(f"{name}:")
        print(f"  {'':<12} {'per test':>10} {'function':>10} {'the rest':>10}")
        rows = {}
        for kind in ("unmeasured", "measured"):
            protocol = statistics.median(run[kind]["protocol"] for run in runs[name])
            function = statistics.median(run[kind]["function"] for run in runs[name])
            rows[kind] = (protocol, function)
            rest = protocol - function
            print(f"  {kind:<12} {protocol:7.1f} us {function:7.1f} us {rest:7.1f} us")
        (protocol, function), (base, base_function) = rows["measured"], rows["unmeasured"]
        rest = (protocol - function) - (base - base_function)
        print(
            f"  {'extra':<12} {protocol - base:7.1f} us {function - base_function:7.1f} us "
            f"{rest:7.1f} us   ratio {protocol / base:.3f}x"
        )


if __name__ == "__main__":
    main()
