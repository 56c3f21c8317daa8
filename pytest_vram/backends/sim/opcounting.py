"""The op counter as one of the simulated device's ways to count a computing test.

Computing, a test's op outputs are counted inside PyTorch's CPU allocator by an
:class:`~pytest_vram.backends.cpu.allocator.OpCounter` where it can be built; it replays its
blocks on a segment model of its own. Its counts go on across the tests it counts, beside the
tracker's: :class:`OpCounting` adds them to the simulated device's figures, and is the one
place that knows whether the running test counts there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from pytest_vram.backends.cpu import allocator as cpu_allocator
from pytest_vram.backends.segments import SegmentFigures
from pytest_vram.backends.sim.oplog import OpCounterLog

__all__ = ["OpCounting"]


class OpCounting:
    """The op counter, made for the first computing test that can count there."""

    def __init__(self, workspace_size: int = 0) -> None:
        #: The op counter (None until made, or where it cannot be built: the tracker counts).
        self.counter: cpu_allocator.OpCounter | None = None
        #: The bytes of a cuBLAS workspace, which each thread's first matrix multiply allocates.
        self._workspace_size = workspace_size
        self._unavailable: str | None = None
        #: Whether the running test counts with the op counter.
        self.active = False
        #: Whether the op counter's segments are the running test's own: they were empty when
        #: it started counting there.
        self.own = False
        self._log: OpCounterLog | None = None

    def can_build(self) -> bool:
        """Whether the op counter is made, or can be now."""
        if self.counter is None and self._unavailable is None:
            try:
                self.counter = cpu_allocator.OpCounter()
            except cpu_allocator.CounterUnavailable as exc:
                self._unavailable = str(exc)
            else:
                self.counter.workspace_size(self._workspace_size)
        return self.counter is not None

    def can_start(
        self, held: list[torch.Tensor], counted_elsewhere: Callable[[torch.Tensor], bool]
    ) -> bool:
        """Whether the next test, whose fixtures hold ``held`` (a tensor per storage), can count
        here: none of those is counted elsewhere (``counted_elsewhere``: by the tracker, whose
        storages cannot be laid out here). If so, the test's own segments start with them, laid
        out anew as :meth:`~pytest_vram.backends.segments.OwnSegments.start` lays them out, and
        any other block still counted (memory an earlier test left) is the device's, not the
        test's."""
        if not self.can_build():
            return False
        pointers = []
        for tensor in held:
            if self.counts(tensor):
                pointers.append(tensor.untyped_storage().data_ptr())
            elif counted_elsewhere(tensor):
                return False
        counter = self.counter
        assert counter is not None
        if pointers or counter.blocks() or counter.segments().reserved:
            counter.start_own(pointers)
        return True

    def start(self) -> None:
        """The running test counts here (:attr:`active` is set before, for its limit)."""
        assert self.counter is not None
        self.counter.watch()

    def stop(self) -> None:
        """The running test counts here no more."""
        if self.active:
            assert self.counter is not None
            self.counter.unwatch()
            self.active = False

    def log(self) -> OpCounterLog | None:
        """The op counter's log, which a breakdown of a test that counts here listens to."""
        if self._log is None and self.counter is not None:
            self._log = OpCounterLog(self.counter)
        return self._log

    def hand_over(self, tracker: Any, workspaces: Any) -> None:
        """The running test, stopped here, goes on counting on ``tracker``: what is still
        counted here counts beside it (its peak is of the sum), each thread keeps the cuBLAS
        workspace it has here (``workspaces``, the tracker's, make none for it) and the log
        hears what the tracker counts. Undone by setting both attributes back to None."""
        counter = self.counter
        assert counter is not None
        tracker.beside = counter.read_current
        tracker.reset_peak()
        workspaces.held_elsewhere = counter.has_workspace
        if self._log is not None:
            self._log.count_from(tracker)

    def lift_limit(self) -> None:
        if self.counter is not None:
            self.counter.limit(None)

    def uncounted(self) -> contextlib.AbstractContextManager[None]:
        """While the running test counts here, what the block makes is not counted."""
        return self._while_active(cpu_allocator.OpCounter.uncounted)

    def as_one_op(self) -> contextlib.AbstractContextManager[None]:
        """While the running test counts here, the block's allocations count as one op's."""
        return self._while_active(cpu_allocator.OpCounter.as_one_op)

    @contextlib.contextmanager
    def _while_active(
        self, context: Callable[[cpu_allocator.OpCounter], contextlib.AbstractContextManager[Any]]
    ) -> Iterator[None]:
        if not self.active:
            yield
            return
        assert self.counter is not None
        with context(self.counter):
            yield

    def counts(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage is one the op counter counts."""
        ops = self.counter
        if ops is None or isinstance(tensor, FakeTensor) or not tensor.is_cpu:
            return False
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError, ValueError):  # no storage, or not yet one
            return False
        data = storage.data_ptr()
        # An empty storage allocates nothing, on the device as anywhere.
        return ops.counts(data) if data != 0 else storage.nbytes() == 0

    def forget(self, tensor: torch.Tensor) -> bool:
        """Count ``tensor``'s storage no more (its bytes are counted elsewhere now); whether
        the op counter counted it."""
        ops = self.counter
        if ops is None or isinstance(tensor, FakeTensor) or not tensor.is_cpu:
            return False
        try:
            data = tensor.untyped_storage().data_ptr()
        except (NotImplementedError, RuntimeError, ValueError):
            return False
        return data != 0 and ops.forget(data)

    # What the op counter adds to the simulated device's figures (nothing until it is made).

    @property
    def current(self) -> int:
        return self.counter.current if self.counter is not None else 0

    @property
    def peak(self) -> int:
        return self.counter.peak if self.counter is not None else 0

    def with_segments(self, figures: SegmentFigures, own: bool = False) -> SegmentFigures:
        """``figures`` with the op counter's segments added (it replays its blocks on a segment
        model of its own); unless ``own``, its background model's too, where the blocks are that
        the running test found and its fixtures do not hold."""
        if self.counter is None:
            return figures
        parts = [figures, self.counter.segments()]
        if not own:
            parts.append(self.counter.segments(background=True))
        return SegmentFigures(*map(sum, zip(*parts, strict=True)))

    def inactive_split_bytes(self) -> int:
        return self.counter.inactive_split_bytes() if self.counter is not None else 0

    def reset_peak(self) -> None:
        if self.counter is not None:
            self.counter.reset_peak()
            self.counter.reset_segment_peaks()

    def empty_cache(self) -> None:
        if self.counter is not None:
            self.counter.empty_cache()

    def relayout(self) -> None:
        """While the running test counts here: lay what is live out anew on fresh segments,
        as :meth:`~pytest_vram.backends.segments.OwnSegments.restart` does."""
        if self.active and self.own:
            assert self.counter is not None
            self.counter.relayout()

    def clear_workspaces(self) -> None:
        if self.counter is not None:
            self.counter.clear_workspaces()
