"""The GPU check's out-of-memory stage: a test that fills the device, and one after it.

    python scripts/gpu_check_oom.py --backend cuda --workdir DIR [--sim-capacity 1GiB]

The first test allocates eighths of the device's total memory until the allocator refuses
(twice the device, were it never to); the plugin must report it as an out-of-memory failure.
The second test must then start with nothing allocated, the first test's blocks released with
its frames, and pass, measured. On sim the device is ``--sim-capacity`` large. Exit status 1,
with what went wrong, when either test did not end as it should.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from pytest_vram.units import format_size

RECOVERY_BYTES = 64 * 1024 * 1024

TEST = f"""
import torch


def test_fills_the_device(vram):
    free, total = torch.cuda.mem_get_info()
    chunk = total // 8
    held = []
    for _ in range(16):
        held.append(torch.empty(chunk, dtype=torch.uint8, device=vram.device))
    raise AssertionError(f"{{len(held)}} blocks of {{chunk}} bytes fit a {{total}}-byte device")


def test_after_the_oom(vram):
    assert torch.cuda.memory_allocated() == 0
    block = torch.ones({RECOVERY_BYTES}, dtype=torch.uint8, device=vram.device)
    assert block.numel() == {RECOVERY_BYTES}
"""
OOM_TEST = "test_oom.py::test_fills_the_device"
AFTER_TEST = "test_oom.py::test_after_the_oom"


def check(tests: dict[str, dict[str, Any]]) -> list[str]:
    """What is wrong with the two tests' records; empty when the OOM and the recovery are right."""
    problems = []
    oom, after = tests.get(OOM_TEST), tests.get(AFTER_TEST)
    if oom is None or after is None:
        missing = [name for name in (OOM_TEST, AFTER_TEST) if name not in tests]
        return [f"no record of {', '.join(missing)}"]
    if oom.get("status") != "oom":
        problems.append(f"{OOM_TEST}: status {oom.get('status')!r}, expected 'oom'")
    if after.get("outcome") != "passed":
        problems.append(f"{AFTER_TEST}: {after.get('outcome')}, expected passed")
    if after.get("start_allocated") != 0:
        problems.append(f"{AFTER_TEST}: started with {after.get('start_allocated')} bytes")
    if (after.get("peak_allocated") or 0) < RECOVERY_BYTES:
        problems.append(f"{AFTER_TEST}: peak {after.get('peak_allocated')} bytes, not its block")
    return problems


def describe(test: dict[str, Any]) -> str:
    counters = test.get("counters") or {}
    figures = [
        f"{name} {format_size(test[key])}"
        for name, key in (("peak", "peak_allocated"), ("reserved", "peak_reserved"))
        if isinstance(test.get(key), int)
    ]
    if counters.get("num_ooms"):
        figures.append(f"out-of-memory errors counted by the allocator: {counters['num_ooms']}")
    return f"{test['nodeid']}: {test.get('status')} ({', '.join(figures)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--sim-capacity", default="1GiB", help="the simulated device's size")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    (args.workdir / "test_oom.py").write_text(TEST, encoding="utf-8")
    command = [
        sys.executable, "-m", "pytest", "test_oom.py", "-v", "--tb=short", "-p", "no:cacheprovider",
        "-p", "no:randomly", f"--vram-backend={args.backend}", "--vram-report",
        "--vram-json=oom.json",
    ]  # fmt: skip
    if args.backend == "sim":
        command.append(f"--vram-sim-capacity={args.sim_capacity}")
    print("$", " ".join(command[2:]))
    done = subprocess.run(command, cwd=args.workdir, capture_output=True, text=True, check=False)
    print(done.stdout.rstrip())
    if done.stderr.strip():
        print(done.stderr.rstrip())
    report = args.workdir / "oom.json"
    try:
        tests = {test["nodeid"]: test for test in json.loads(report.read_text())["tests"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"oom: {report}: no readable report ({exc})", file=sys.stderr)
        return 1
    for name in (OOM_TEST, AFTER_TEST):
        if name in tests:
            print(describe(tests[name]))
    problems = check(tests)
    for problem in problems:
        print(f"oom: {problem}", file=sys.stderr)
    if not problems:
        print("out of memory reported as OOM; the next test started at 0 B and passed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
