"""One attempt of a step at one size, under a capacity, on each backend.

Every attempt starts from the same state: what the attempt before it left is collected, the
allocator's cache released and the peak reset, as a fresh process of the same test would find
the device. What the step keeps after its first attempt (gradients left on the test's model)
is state every attempt then starts from, and the first attempt runs again from it; memory that
grows attempt after attempt (a list the step appends to) gives no honest answer, and
:class:`~pytest_vram.fit.search.NoAnswer` names what each attempt left.

What "fits" means depends on what the backend can tell. On any of them an allocation that was
refused (an out-of-memory error, even one the step caught) or a size whose byte count
overflows torch's storage size means the size does not fit.

- sim (a backend with ``own_segments``): the test's own segments (its reserved memory, laid
  out as the CUDA caching allocator lays it out) get the capacity for the attempt, so an
  allocation raises ``torch.OutOfMemoryError`` exactly where a GPU of that size would, after
  the allocator's retry that frees its cache. The capacity asked for is the one searched,
  whatever the simulated device's own (``--vram-sim-gpu``, ``--vram-sim-capacity``). It fits
  when no allocation was refused.
- cuda (``is_cuda_device``): ``torch.cuda.set_per_process_memory_fraction`` caps the caching
  allocator at the capacity (or the whole device, when it is smaller), and the step runs for
  real.
- any other backend (cpu): it fits when the peak allocated stays within the capacity.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pytest_vram.fit.search import NoAnswer
from pytest_vram.garbage import collect_garbage
from pytest_vram.units import format_size

__all__ = ["Attempt", "CudaTrials", "PeakTrials", "SimTrials", "trials_for"]

# torch's error for a tensor whose byte count does not fit in 64 bits: no device holds it.
_OVERFLOW = "Storage size calculation overflowed"


@dataclass
class Attempt:
    """What running the step at ``size`` gave."""

    size: int
    fits: bool
    #: The peak over the attempt (reserved where the backend models segments, else allocated);
    #: after an out-of-memory error, the most it held before the error.
    peak: int
    #: Whether the device refused the step memory (an out-of-memory error, caught or not, or
    #: a size past what torch can count): its peak is not the whole step's then.
    cut_short: bool = False
    #: After an out-of-memory error, what the device would have needed at least: what it held
    #: then and what the failed allocation asked for (cuda); None otherwise.
    asked: int | None = None
    #: What the attempt allocated, by category, at its peak (sim, when broken down).
    categories: dict[str, int] | None = None


class PeakTrials:
    """Any backend: the step runs whole; it fits when its peak is within the capacity."""

    #: The figure compared with the capacity.
    metric = "allocated"
    #: Whether a step can run past the capacity, to measure the next size whole.
    measures_beyond = True

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        #: What each attempt starts from: allocated before the search, and what the step
        #: kept after its first attempt.
        self.floor = backend.allocated()
        self._kept_state = False

    def attempt(
        self, step: Callable[[int], Any], size: int, capacity: int | None, *, breakdown: bool
    ) -> Attempt:
        """Run ``step(size)`` under ``capacity`` (None: none), from the same state as every
        other attempt."""
        self.settle()
        result = self.run(step, size, capacity, breakdown=breakdown)
        left = self.settle()
        if result.cut_short:
            # What a step stopped by an error left (the gradients of a backward that did not
            # finish) tells nothing of what it keeps when it runs to its end.
            return result
        if left > 0 and not self._kept_state:
            # State the step keeps (gradients on the test's model): every attempt starts
            # from it, this one too.
            self._kept_state = True
            self.floor += left
            result = self.run(step, size, capacity, breakdown=breakdown)
            left = self.settle()
        if left > 0:
            raise NoAnswer(
                f"step({size}) left {format_size(left)} more allocated each time it ran, so "
                "each attempt would start from more than the one before it and the answer "
                "would depend on how many ran. Build what the step needs inside it, and keep "
                "nothing it makes once it returns (a list it appends to, a cache)"
            )
        return result

    def run(
        self, step: Callable[[int], Any], size: int, capacity: int | None, *, breakdown: bool
    ) -> Attempt:
        """One run of ``step(size)``, from a settled device."""
        import torch

        asked = None
        refused = self.refused()
        try:
            step(size)
        except torch.OutOfMemoryError as exc:
            _reraise_host(exc)
            fits, asked = False, _asked(exc, self.held())
        except RuntimeError as exc:
            _reraise_unless_overflow(exc)
            fits = False
        else:
            fits = self.refused() == refused
        cut_short = not fits
        peak = self.peak()
        if capacity is not None and peak > capacity:
            fits = False
        return Attempt(size, fits, peak, cut_short, asked)

    def settle(self) -> int:
        """Back to what was allocated before the search, with an empty cache and a new peak;
        the bytes still allocated above that."""
        collect_garbage(self.backend, self.floor)
        self.backend.release_cache()
        self.backend.reset_peak()
        return self.backend.allocated() - self.floor

    def refused(self) -> int:
        """How many allocations the device refused so far (out-of-memory errors)."""
        return int(self.backend.counters().get("num_ooms", 0))

    def peak(self) -> int:
        return int(self.backend.peak_allocated())

    def held(self) -> int:
        return int(self.backend.allocated())


class SimTrials(PeakTrials):
    """The simulated device: the test's own segments raise at the capacity."""

    metric = "reserved"

    def run(
        self, step: Callable[[int], Any], size: int, capacity: int | None, *, breakdown: bool
    ) -> Attempt:
        import torch

        own, device = self.backend.own_segments.model, self.backend.segments
        models = [device] if own is None else [device, own]
        saved = [model.capacity for model in models]
        # The capacity asked for alone decides: the simulated card's does not cap the search.
        for model in models:
            model.capacity = None
        models[-1].capacity = capacity
        refused = self.refused()
        recorder = self._breakdown() if breakdown else None
        fits = True
        try:
            step(size)
        except torch.OutOfMemoryError as exc:
            _reraise_host(exc)
            fits = False
        except RuntimeError as exc:
            _reraise_unless_overflow(exc)
            fits = False
        finally:
            for model, capacity_before in zip(models, saved, strict=True):
                model.capacity = capacity_before
            categories = self._categories(recorder)
        # An allocation refused counts, even where the step caught the error.
        fits = fits and self.refused() == refused
        cut_short = not fits
        peak = self.peak()
        # Computing on the op counter, the test's segments do not see every allocation.
        if capacity is not None and peak > capacity:
            fits = False
        return Attempt(size, fits, peak, cut_short, categories=categories)

    def refused(self) -> int:
        own = self.backend.own_segments.model
        return self.backend.segments.num_ooms + (own.num_ooms if own is not None else 0)

    def peak(self) -> int:
        return int(self.backend.own_peak_reserved() or 0)

    def held(self) -> int:
        return int(self.backend.own_reserved() or 0)

    def _breakdown(self) -> Any:
        from pytest_vram.attribution.breakdown import PeakBreakdown

        recorder = PeakBreakdown(self.backend.tracker)
        recorder.start()
        return recorder

    def _categories(self, recorder: Any) -> dict[str, int] | None:
        if recorder is None:
            return None
        try:
            return dict(recorder.result()["categories"])
        finally:
            recorder.stop()


class CudaTrials(PeakTrials):
    """A real GPU: the caching allocator is capped at the capacity, and raises there."""

    metric = "reserved"
    # Past the capacity may be past the device: the failed allocation says what it asked for.
    measures_beyond = False

    def run(
        self, step: Callable[[int], Any], size: int, capacity: int | None, *, breakdown: bool
    ) -> Attempt:
        import torch

        index = self.backend.index
        if capacity is not None:
            total = torch.cuda.get_device_properties(index).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, capacity / total), index)
        asked = None
        refused = self.refused()
        try:
            step(size)
        except torch.OutOfMemoryError as exc:
            fits, asked = False, _asked(exc, self.held())
        except RuntimeError as exc:
            _reraise_unless_overflow(exc)
            fits = False
        else:
            fits = self.refused() == refused
        finally:
            if capacity is not None:
                torch.cuda.set_per_process_memory_fraction(1.0, index)
        peak = self.peak()
        return Attempt(size, fits, peak, not fits, asked)

    def peak(self) -> int:
        return int(self.backend.peak_reserved() or self.backend.peak_allocated())

    def held(self) -> int:
        return int(self.backend.reserved() or self.backend.allocated())


def trials_for(backend: Any) -> PeakTrials:
    """The attempts ``backend`` (or the test's view of it) can make: on its own segments where
    it models them, under the allocator's cap on a CUDA device, else by the peak."""
    device = backend.device_backend  # the attempts reset and read the whole device
    if device.own_segments is not None:
        return SimTrials(device)
    if device.is_cuda_device:
        return CudaTrials(device)
    return PeakTrials(device)


def _reraise_host(exc: BaseException) -> None:
    """The simulated device ran out of host memory computing values: no answer for the GPU."""
    from pytest_vram.backends.sim.backend import HostMemoryExceeded

    if isinstance(exc, HostMemoryExceeded):
        raise exc


def _reraise_unless_overflow(exc: RuntimeError) -> None:
    """A size whose bytes overflow torch's storage size fits no device; any other error is
    the step's own."""
    if _OVERFLOW not in str(exc):
        raise exc


_TRIED = re.compile(r"Tried to allocate ([0-9.]+) (bytes|KiB|MiB|GiB|TiB)")
_UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def _asked(exc: BaseException, held: int) -> int | None:
    """What held memory and the failed allocation add up to, read from PyTorch's message."""
    match = _TRIED.search(str(exc))
    if match is None:
        return None
    return held + round(float(match.group(1)) * _UNITS[match.group(2)])
