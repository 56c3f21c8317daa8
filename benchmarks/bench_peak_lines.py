"""What the peak by source line costs: a run with ``--vram-peak-lines=failing`` (the default)
against ``--vram-peak-lines=no``, each in a fresh pytest process, the median of the rounds.

- ``passing``: 300 small gated tests on sim that all pass: no test reruns, so this is the cost
  of the hooks alone.
- ``failing``: the GPT training step of docs/attribution.md, checkpointing off against
  baselines recorded with it on: a regression, rerun once with its lines recorded.

python benchmarks/bench_peak_lines.py [--rounds 3]
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SMALL = """
import pytest
import torch


@pytest.mark.parametrize("n", range(300))
def test_small(vram, n):
    x = torch.ones(1024 + n)
    y = x * 2
    assert y.sum() > 0
"""


def _pytest(cwd: Path, *args: str, env: dict[str, str] | None = None) -> float:
    started = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
            *args,
        ],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        check=False,
    )
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from test_pr_workflow_commands import make_pull_request

    with tempfile.TemporaryDirectory() as tmp:
        small = Path(tmp) / "small"
        small.mkdir()
        (small / "test_small.py").write_text(SMALL)
        _, head = make_pull_request(Path(tmp))
        cases = {
            "passing": (small, ["--vram-backend=sim"]),
            "failing": (head, ["--vram-backend=sim"]),
        }
        for name, (cwd, extra) in cases.items():
            times: dict[str, list[float]] = {"no": [], "failing": []}
            _pytest(cwd, *extra)  # warm the file system and the import caches
            for _ in range(args.rounds):
                for mode in times:
                    times[mode].append(_pytest(cwd, *extra, f"--vram-peak-lines={mode}"))
            no, failing = (statistics.median(times[m]) for m in ("no", "failing"))
            print(
                f"{name}: --vram-peak-lines=no {no:.2f} s, failing {failing:.2f} s "
                f"({failing / no:.2f}x); rounds no {times['no']}, failing {times['failing']}"
            )
        shutil.rmtree(small)
    return 0


if __name__ == "__main__":
    sys.exit(main())
