"""What attribution costs on the 32B simulated training step of ``bench_sim.py``.

The same two training steps (the repository's GPT at the Qwen2.5-32B shape, bf16, 512 tokens,
forward, backward, AdamW) run six ways, alternating within each round:

- plain: ``FakeTensorMode`` alone, the floor;
- sim: the sim backend without attribution (as every measured test ran on it before the
  category totals);
- categories: sim with the peak's category totals, as every measured test records them, taken
  at the end (timed with the steps);
- breakdown: sim with the peak's breakdown logging (``--vram-breakdown``), and the breakdown
  itself taken at the end (timed with the steps);
- snapshot: sim with the trace log of ``--vram-snapshot-on-fail`` (a Python stack per
  allocation), and the snapshot dict built at the end (timed);
- sites: sim with a leak check's site recording, as during its confirmation steps.

Reported: the median time of each and the median of its per-round ratios to plain and to sim.
Run from the repository root:

    python benchmarks/bench_attribution.py [--rounds 3] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sim import CONFIG, SEQ, STEPS, run_plain, train

from pytest_vram.attribution.breakdown import PeakBreakdown
from pytest_vram.attribution.leaks import LeakSiteRecorder
from pytest_vram.backends.sim.backend import SimBackend
from pytest_vram.backends.tracelog import TraceLog


def _on_sim(attach: Callable[[SimBackend], Callable[[], None]] | None) -> float:
    backend = SimBackend()
    backend.begin_test()
    try:
        finish = attach(backend) if attach is not None else None
        seconds = train("cuda")
        if finish is not None:
            extra = time.perf_counter()
            finish()
            seconds += time.perf_counter() - extra
        return seconds
    finally:
        backend.end_test()


def _categories(backend: SimBackend) -> Callable[[], None]:
    return _breakdown(backend, modules=False)


def _breakdown(backend: SimBackend, modules: bool = True) -> Callable[[], None]:
    breakdown = PeakBreakdown(backend.tracker, modules=modules)
    breakdown.start()

    def finish() -> None:
        result = breakdown.result(backend.peak_allocated())
        breakdown.stop()
        assert result["categories"]["parameters"] > 0

    return finish


def _snapshot(backend: SimBackend) -> Callable[[], None]:
    log = TraceLog(backend.segments)
    backend.segments.segment_listener = log.segment_event
    backend.tracker.add_listener(log)

    def finish() -> None:
        backend.tracker.flush()
        snapshot = log.snapshot()
        backend.tracker.remove_listener(log)
        backend.segments.segment_listener = None
        assert snapshot["device_traces"][0]

    return finish


def _sites(backend: SimBackend) -> Callable[[], None]:
    recorder = LeakSiteRecorder(backend)
    recorder.start()
    recorder.next_step()
    return recorder.stop


VARIANTS: dict[str, Callable[[], float]] = {
    "plain": run_plain,
    "sim": lambda: _on_sim(None),
    "categories": lambda: _on_sim(_categories),
    "breakdown": lambda: _on_sim(_breakdown),
    "snapshot": lambda: _on_sim(_snapshot),
    "sites": lambda: _on_sim(_sites),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of every variant")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    print(f"{STEPS} training steps of a {CONFIG.num_layers}-layer, 32.8B-parameter GPT, bf16, "
          f"{SEQ} tokens; {args.rounds} rounds")  # fmt: skip
    for run in VARIANTS.values():  # warm-up
        run()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for i in range(args.rounds):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            times[name].append(VARIANTS[name]())
        print(
            f"  round {i + 1}: " + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in names),
            flush=True,
        )
    figures = {}
    for name in names:
        pairs = list(zip(times[name], times["plain"], times["sim"], strict=True))
        to_plain = statistics.median(t / p for t, p, _ in pairs)
        to_sim = statistics.median(t / s for t, _, s in pairs)
        figures[name] = {
            "median_s": statistics.median(times[name]),
            "ratio_to_plain": to_plain,
            "ratio_to_sim": to_sim,
        }
        print(
            f"{name:>10}: {figures[name]['median_s']:6.2f} s  {to_plain:.3f}x plain  "
            f"{to_sim:.3f}x sim"
        )
    if args.json:
        args.json.write_text(json.dumps({"rounds": args.rounds, "figures": figures}, indent=2))


if __name__ == "__main__":
    main()
