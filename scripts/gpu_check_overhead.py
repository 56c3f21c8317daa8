"""The GPU check's overhead stage: what measuring costs per test, plain against --vram-report.

    python scripts/gpu_check_overhead.py --backend cuda --device cuda --workdir DIR [--tests 200]

Writes a file of small tests (a 64-element tensor on ``--device``, a product and a sum) and
runs it twice: plain, where no test is measured, and with ``--vram-report``, where each is.
A conftest times each test's whole protocol (setup, call, teardown and the plugin's hooks
around them) inside the session, so interpreter start, imports and collection are left out.
Prints the median time per test of each run, their difference (the overhead per measured
test) and their ratio. Exit status 1 when a run fails or times no test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

TESTS = """
import os

import pytest
import torch

DEVICE = os.environ["GPU_CHECK_DEVICE"]


@pytest.mark.parametrize("n", range({count}))
def test_small(n):
    x = torch.ones(64, device=DEVICE) * n
    assert x.sum().item() == 64 * n
"""

CONFTEST = """
import json
import os
import time

import pytest

TIMES = []


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    started = time.perf_counter()
    try:
        return (yield)
    finally:
        TIMES.append(time.perf_counter() - started)


def pytest_sessionfinish(session):
    with open(os.environ["GPU_CHECK_TIMES"], "w", encoding="utf-8") as handle:
        json.dump(TIMES, handle)
"""


@dataclass(frozen=True)
class Overhead:
    """Per-test medians of a plain run and a measured run, in seconds."""

    plain: float
    measured: float

    @property
    def per_test(self) -> float:
        return self.measured - self.plain

    @property
    def ratio(self) -> float:
        return self.measured / self.plain


def overhead(plain: Sequence[float], measured: Sequence[float]) -> Overhead:
    """The medians of two runs' per-test times; the first test of each is left out, since it
    also pays for starting the backend (CUDA context, NVML) once."""
    if len(plain) < 2 or len(measured) < 2:
        raise ValueError(f"too few timed tests: {len(plain)} plain, {len(measured)} measured")
    return Overhead(statistics.median(plain[1:]), statistics.median(measured[1:]))


def describe(result: Overhead, count: int) -> list[str]:
    return [
        f"{count} small tests, median per test: plain {result.plain * 1e3:.3f} ms, "
        f"--vram-report {result.measured * 1e3:.3f} ms",
        f"overhead per measured test: {result.per_test * 1e3:+.3f} ms "
        f"(--vram-report / plain: {result.ratio:.2f}x)",
    ]


def timed_run(
    workdir: Path, name: str, options: Sequence[str], device: str
) -> tuple[list[float], float]:
    """One session's per-test times and its first test's time."""
    times = workdir / f"{name}.json"
    command = [sys.executable, "-m", "pytest", "test_small.py", "-q", "-p", "no:cacheprovider",
               "-p", "no:randomly", *options]  # fmt: skip
    print(f"$ pytest test_small.py {' '.join(options)}  # {name}")
    env = {**os.environ, "GPU_CHECK_DEVICE": device, "GPU_CHECK_TIMES": str(times)}
    done = subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, check=False
    )
    last = done.stdout.strip().splitlines()[-1:] or [done.stderr.strip()]
    print("  ", last[0])
    if done.returncode != 0 or not times.exists():
        print(done.stdout + done.stderr)
        raise RuntimeError(f"{workdir / 'test_small.py'} ({name}): pytest exited {done.returncode}")
    values = json.loads(times.read_text(encoding="utf-8"))
    return values, values[0] if values else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--device", default="cuda", help="where the small tests put tensors")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--tests", type=int, default=200)
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    (args.workdir / "test_small.py").write_text(TESTS.format(count=args.tests), encoding="utf-8")
    (args.workdir / "conftest.py").write_text(CONFTEST, encoding="utf-8")
    backend = f"--vram-backend={args.backend}"
    try:
        plain, plain_first = timed_run(args.workdir, "plain", [backend], args.device)
        measured, measured_first = timed_run(
            args.workdir, "measured", [backend, "--vram-report"], args.device
        )
        result = overhead(plain, measured)
    except (RuntimeError, ValueError) as exc:
        print(f"overhead: {exc}", file=sys.stderr)
        return 1
    print("\n".join(describe(result, args.tests)))
    print(
        f"first test (pays for starting the backend): plain {plain_first * 1e3:.1f} ms, "
        f"--vram-report {measured_first * 1e3:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
