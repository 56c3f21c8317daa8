"""What the simulated device adds to each operation of a test that computes its values.

Runs a loop of small tensor operations (an optimizer-like update on a 4x4 tensor: six
operations an iteration) plain on the CPU, then computing on the simulated device as a test
simulated only because of ``--vram-gate=all`` runs (op outputs counted by the op counter in
C++, ``device="cuda"`` answered below Python), the same with its peak broken down by category
as the plugin breaks down every test's (the op counter's log, and the global module and
optimizer hooks), as an opted-in test runs (the op counter, and a function mode that sees every
call, for where each tensor is), and then through Python hooks (the function mode and a
dispatch mode that counts each output, as where the counting library cannot be built).
Prints the median time per operation of each, over rounds that alternate them. With
``--backward`` the loop is a training step of a two-layer network on 4x4 tensors instead
(forward, ``backward()`` and an SGD update: an autograd node for each forward operation).

    python benchmarks/bench_sim_ops.py [--iterations 20000] [--rounds 7] [--backward]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from pytest_vram.attribution.recorder import Attribution
from pytest_vram.backends.sim import cudaremap, fakecuda
from pytest_vram.backends.sim.backend import SimBackend

OPS_PER_ITERATION = 6
# Forward (mm, tanh, mm, square, mean: six ops with a detach), backward (16, a detach of each
# gradient the leaves keep among them) and two updates of two ops, as a pass-through dispatch
# mode counts them.
OPS_PER_BACKWARD_ITERATION = 26


def update_loop(iterations: int, device: str) -> float:
    """Seconds per operation of a loop of small in-place and out-of-place updates."""
    param = torch.randn(4, 4, device=device)
    grad = torch.randn(4, 4, device=device)
    momentum = torch.zeros_like(param)
    started = time.perf_counter()
    with torch.no_grad():
        for _ in range(iterations):
            momentum.mul_(0.9).add_(grad, alpha=0.1)
            step = momentum / (momentum.abs() + 1e-8)
            param.sub_(step * 0.01)
    return (time.perf_counter() - started) / (iterations * OPS_PER_ITERATION)


def backward_loop(iterations: int, device: str) -> float:
    """Seconds per operation of a loop of small training steps with ``backward()``."""
    first = torch.randn(4, 4, device=device, requires_grad=True)
    second = torch.randn(4, 4, device=device, requires_grad=True)
    inputs = torch.randn(4, 4, device=device)
    started = time.perf_counter()
    for _ in range(iterations):
        loss = (torch.tanh(inputs @ first) @ second).square().mean()
        loss.backward()
        with torch.no_grad():
            for weight in (first, second):
                weight.sub_(weight.grad * 0.01)
                weight.grad = None
    return (time.perf_counter() - started) / (iterations * OPS_PER_BACKWARD_ITERATION)


class Simulated(AbstractContextManager):
    """One computing test on the simulated device; ``hooks``: through the Python hooks;
    ``cuda_shown``: an opted-in test, which sees CUDA; ``categories``: its peak broken down by
    category, as the plugin breaks down every test's."""

    def __init__(self, hooks: bool, cuda_shown: bool = True, categories: bool = False) -> None:
        # Made as the plugin makes it, with cuBLAS workspaces. A capacity makes the tracker
        # count (its out-of-memory comes at the allocation), and without the below-Python
        # remapping the function mode answers device="cuda".
        self.backend = SimBackend(capacity="1TB" if hooks else None, workspaces=True)
        self.backend.use_values(True)
        self.backend.show_cuda(cuda_shown)
        self._hooks = hooks
        self._attribution = Attribution() if categories else None
        self._available: Callable[[], bool] = cudaremap.available

    def __enter__(self) -> Simulated:
        if self._hooks:
            fakecuda.cudaremap.available = lambda: False  # type: ignore[attr-defined]
        self.backend.begin_test()
        if self._attribution is not None:
            self._attribution.begin(self.backend)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._attribution is not None:
            self._attribution.close()
        self.backend.end_test()
        fakecuda.cudaremap.available = self._available  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--backward", action="store_true", help="training steps with backward()")
    args = parser.parse_args()
    loop, ops = (
        (backward_loop, OPS_PER_BACKWARD_ITERATION)
        if args.backward
        else (update_loop, OPS_PER_ITERATION)
    )

    variants: dict[str, Callable[[], AbstractContextManager]] = {
        "plain, on the CPU": nullcontext,
        "sim computing, gated only": lambda: Simulated(hooks=False, cuda_shown=False),
        "sim computing, by category": lambda: Simulated(
            hooks=False, cuda_shown=False, categories=True
        ),
        "sim computing, opted in": lambda: Simulated(hooks=False),
        "sim computing, Python hooks": lambda: Simulated(hooks=True),
    }
    devices = {"plain, on the CPU": "cpu"}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, context in variants.items():
            with context():
                device = devices.get(name, "cuda")
                loop(200, device)  # warm up
                times[name].append(loop(args.iterations, device))
    plain = statistics.median(times["plain, on the CPU"])
    what = "training steps" if args.backward else "iterations"
    print(f"{args.iterations} {what} of {ops} ops on 4x4 tensors, median of {args.rounds} rounds")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(
            f"  {name:30} {median * 1e6:6.2f} us/op  extra {(median - plain) * 1e6:5.2f} us/op"
            f"  ratio {median / plain:.2f}x"
        )


if __name__ == "__main__":
    main()
