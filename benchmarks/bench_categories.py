"""What taking a small test's category totals costs on the cpu allocator counter, per test.

Outside pytest, in one process: a loop of small "tests" (a 64-element tensor doubled and
summed, and the record of its figures), alternating blocks with and without the category
totals that every measured sim and cpu test takes (:class:`Attribution` begin, result and
stop), so that the two are timed under the same load. Run from the repository root:

    python benchmarks/bench_categories.py [--tests 2000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pytest_vram.attribution.recorder import Attribution
from pytest_vram.backends.cpu.backend import CpuBackend
from pytest_vram.record.record import TestRecord


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    backend = CpuBackend("allocator")
    backend.begin_test()
    attribution = Attribution()

    def small_test() -> TestRecord:
        x = torch.ones(64)
        assert float((x * 2).sum()) == 128.0
        record = TestRecord("t.py::t", "cpu", "cpu", peak_allocated=backend.peak_allocated())
        record.figures()
        return record

    def with_categories() -> None:
        attribution.begin(backend)
        record = small_test()
        attribution.finish_call(record)
        assert record.categories is not None

    def block(test) -> float:  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        for _ in range(args.tests):
            test()
        return (time.perf_counter() - start) / args.tests * 1e6

    block(with_categories)  # warm up
    block(small_test)
    plain, taken = [], []
    for _ in range(args.rounds):
        plain.append(block(small_test))
        taken.append(block(with_categories))
    attribution.close()
    bare, full = statistics.median(plain), statistics.median(taken)
    print(f"{args.tests} small tests per block, median of {args.rounds} blocks each:")
    print(f"  without category totals   {bare:6.1f} us a test")
    print(f"  with category totals      {full:6.1f} us a test  (+{full - bare:.1f} us)")


if __name__ == "__main__":
    main()
