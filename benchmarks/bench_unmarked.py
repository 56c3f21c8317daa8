"""What ``--vram-report`` costs a suite of tests that did not opt in: 1000 pure-Python tests.

Runs the same project as whole pytest processes, alternating the variants in each round: plain
pytest (the plugin installed, nothing asked of it), ``--vram-report`` on the default backend
(the simulated device here: the tests run as without the plugin and are counted as not
measured), ``--vram-report`` on the cpu backend (every test measured and reported, none gated)
and ``--vram-report --vram-gate=all`` on the simulated device (every test simulated and gated).
Also times ``python -c "import torch"``, which every variant with a backend pays once. Prints
each variant's median wall time, its median per-round ratio to plain pytest, and the cost per
test beyond plain pytest and the torch import:

    python benchmarks/bench_unmarked.py [--tests 1000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {
    "plain": [],
    "report (sim)": ["--vram-report"],
    "report (cpu)": ["--vram-report", "--vram-backend=cpu"],
    "report, gate all (sim)": ["--vram-report", "--vram-gate=all"],
}


def write_project(directory: Path, tests: int) -> None:
    body = "\n".join(f"def test_{i}():\n    assert {i} + 1 > {i}\n" for i in range(tests))
    (directory / "test_pure.py").write_text(body, encoding="utf-8")
    (directory / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")


def run(directory: Path, args: list[str]) -> float:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider"]
    start = time.perf_counter()
    done = subprocess.run(
        [*command, *args], cwd=directory, capture_output=True, text=True, check=False
    )
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"pytest {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return elapsed


def import_torch() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        write_project(directory, options.tests)
        names = list(VARIANTS)
        for variant in names:  # warm-up: the file system cache, the cpu counter's library
            run(directory, VARIANTS[variant])
        times: dict[str, list[float]] = {variant: [] for variant in names}
        imports = []
        for round_ in range(options.rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for variant in order:
                times[variant].append(run(directory, VARIANTS[variant]))
            imports.append(import_torch())
    plain = times["plain"]
    torch_import = statistics.median(imports)
    print(f"{options.tests} pure-Python tests, {options.rounds} rounds, median wall time")
    print(f"  import torch alone: {torch_import:.2f} s")
    for variant in names:
        median = statistics.median(times[variant])
        ratio = statistics.median(t / p for t, p in zip(times[variant], plain, strict=True))
        line = f"  {variant:24} {median:6.2f} s  x{ratio:.2f} plain"
        if variant != "plain":
            per_test = (median - statistics.median(plain) - torch_import) / options.tests
            line += f"  ({per_test * 1000:+.2f} ms a test beyond plain and the torch import)"
        print(line)


if __name__ == "__main__":
    main()
