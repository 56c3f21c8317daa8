"""The simulated device against a real GPU, per test, from two --vram-json files.

    python scripts/sim_vs_cuda.py SIM.json CUDA.json [--backend cuda]

Prints two tables. The first holds, for each test that ran on the GPU in CUDA.json and on the
simulated device in SIM.json, the sim/cuda ratio of its allocated peak and of its reserved
peak: the tests that ran on the backend the command line chose ("cuda-pinned"), not those a
``vram_backend`` marker pins to one backend in both runs. The second puts the GPU's peaks side
by side: the caching allocator's (allocated, reserved) and NVML's (device: the whole GPU's
used memory, with the CUDA context and library workspaces), and what NVML saw beyond the
allocator's reserve. ``--backend`` names the backend CUDA.json's tests ran on (the GPU check's
dry run compares two simulated runs). Exit status 1 when no test ran on both; 2, with a
message naming the file, when a file cannot be read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_vram.units import format_size

Tests = Mapping[str, Mapping[str, Any]]
NOT_MEASURED = "-"


class ReportError(Exception):
    """A --vram-json file that cannot be compared: the message names it."""


def load_tests(path: str) -> dict[str, dict[str, Any]]:
    """The tests of a --vram-json file by node id."""
    try:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
    except OSError as exc:
        raise ReportError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: not JSON: {exc}") from None
    tests = document.get("tests") if isinstance(document, dict) else None
    if not isinstance(tests, list):
        raise ReportError(f"{path}: no 'tests' list: not a --vram-json report")
    found: dict[str, dict[str, Any]] = {}
    for index, test in enumerate(tests):
        if not isinstance(test, dict) or not isinstance(test.get("nodeid"), str):
            raise ReportError(f"{path}: tests[{index}] has no node id: {test!r:.80}")
        found[test["nodeid"]] = test
    return found


def _figure(test: Mapping[str, Any], name: str) -> int | None:
    value = test.get(name)
    # bool is an int too, and never a figure.
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def ratio(simulated: int | None, real: int | None) -> float | None:
    """sim/cuda, or None where either figure is missing or the real one is zero."""
    if simulated is None or not real:
        return None
    return simulated / real


@dataclass(frozen=True)
class Comparison:
    """One test's peaks on the simulated device and on the GPU."""

    nodeid: str
    sim_allocated: int | None
    cuda_allocated: int | None
    sim_reserved: int | None
    cuda_reserved: int | None

    @property
    def allocated_ratio(self) -> float | None:
        return ratio(self.sim_allocated, self.cuda_allocated)

    @property
    def reserved_ratio(self) -> float | None:
        return ratio(self.sim_reserved, self.cuda_reserved)


def compare(sim: Tests, cuda: Tests, backend: str = "cuda") -> list[Comparison]:
    """The tests that ran on ``backend`` in ``cuda`` and on sim in ``sim``, by node id."""
    rows = []
    for nodeid in sorted(set(sim) & set(cuda)):
        real, simulated = cuda[nodeid], sim[nodeid]
        if real.get("backend") != backend or simulated.get("backend") != "sim":
            continue
        rows.append(
            Comparison(
                nodeid,
                _figure(simulated, "peak_allocated"),
                _figure(real, "peak_allocated"),
                _figure(simulated, "peak_reserved"),
                _figure(real, "peak_reserved"),
            )
        )
    return rows


def _size(nbytes: int | None) -> str:
    return NOT_MEASURED if nbytes is None else format_size(nbytes)


def _ratio(value: float | None) -> str:
    return NOT_MEASURED if value is None else f"{value:.4f}"


def _spread(name: str, ratios: Sequence[float | None]) -> str:
    known = [value for value in ratios if value is not None]
    if not known:
        return f"{name}: no test with both figures"
    worst = max(known, key=lambda value: abs(value - 1))
    return (
        f"{name}: median {statistics.median(known):.4f}, from {min(known):.4f} to "
        f"{max(known):.4f}, largest deviation {worst - 1:+.2%} "
        f"({len(known)} test{'s' if len(known) > 1 else ''})"
    )


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned first column, the others right-aligned, two spaces apart."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        rest = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([cells[0].ljust(widths[0]), *rest]).rstrip()

    return [line(header), *(line(row) for row in rows)]


def ratio_table(rows: Sequence[Comparison], backend: str = "cuda") -> list[str]:
    """The sim/cuda table, then one line each on the allocated and the reserved ratios."""
    if not rows:
        return [f"no test ran both on {backend} and on sim"]
    header = [
        "test", "allocated sim", backend, "sim/" + backend, "reserved sim", backend,
        "sim/" + backend,
    ]  # fmt: skip
    cells = [
        [
            row.nodeid,
            _size(row.sim_allocated),
            _size(row.cuda_allocated),
            _ratio(row.allocated_ratio),
            _size(row.sim_reserved),
            _size(row.cuda_reserved),
            _ratio(row.reserved_ratio),
        ]
        for row in rows
    ]
    return [
        *_table(header, cells),
        f"{len(rows)} tests on both {backend} and sim",
        _spread("allocated sim/" + backend, [row.allocated_ratio for row in rows]),
        _spread("reserved sim/" + backend, [row.reserved_ratio for row in rows]),
    ]


def device_table(cuda: Tests, backend: str = "cuda") -> list[str]:
    """Per test on ``backend``: allocator peaks beside NVML's device peak."""
    tests = [(nodeid, cuda[nodeid]) for nodeid in sorted(cuda)]
    tests = [(nodeid, test) for nodeid, test in tests if test.get("backend") == backend]
    if not tests:
        return [f"no test ran on {backend}"]
    cells = []
    for nodeid, test in tests:
        reserved, device = _figure(test, "peak_reserved"), _figure(test, "peak_device")
        beyond = None if device is None or reserved is None else device - reserved
        cells.append(
            [
                nodeid,
                _size(_figure(test, "peak_allocated")),
                _size(reserved),
                _size(device),
                _size(beyond),
            ]
        )
    lines = _table(["test", "allocated", "reserved", "device (NVML)", "device - reserved"], cells)
    if all(_figure(test, "peak_device") is None for _, test in tests):
        lines.append("NVML measured no device peak (no NVML here, or no sample)")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sim", metavar="SIM.json", help="--vram-json of the run on sim")
    parser.add_argument("cuda", metavar="CUDA.json", help="--vram-json of the run on the GPU")
    parser.add_argument(
        "--backend", default="cuda", help="the backend CUDA.json's tests ran on (default: cuda)"
    )
    args = parser.parse_args(argv)
    try:
        sim, cuda = load_tests(args.sim), load_tests(args.cuda)
    except ReportError as exc:
        print(f"sim_vs_cuda: {exc}", file=sys.stderr)
        return 2
    rows = compare(sim, cuda, args.backend)
    print(f"sim/{args.backend} per test (allocator peaks)")
    print("\n".join(ratio_table(rows, args.backend)))
    print()
    print(f"{args.backend}: allocator peaks beside the device's (NVML)")
    print("\n".join(device_table(cuda, args.backend)))
    # Nothing to compare is a failed comparison, not a clean one.
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
