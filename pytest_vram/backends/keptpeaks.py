"""The peaks a test's own code reset, kept for the plugin's figures.

Training and profiling code calls ``torch.cuda.reset_peak_memory_stats()`` to read the peak of
one phase. For that code the peaks start again, as torch's do; but the test's figures must
still see the spike before the reset, or a test that allocates 100 MiB, frees it and resets
would pass a 10 MiB budget. A backend whose peaks a test can reset (cuda, sim) folds its peaks
here before the reset runs, and answers the higher of what it kept and what it reads, until the
plugin starts a peak of its own (``reset_peak``).
"""

from __future__ import annotations

__all__ = ["KeptPeaks"]


class KeptPeaks:
    """The highest allocated, reserved and own-reserved bytes before a test's own resets."""

    __slots__ = ("allocated", "own_reserved", "reserved")

    def __init__(self) -> None:
        self.allocated = 0
        self.reserved = 0
        self.own_reserved = 0

    def clear(self) -> None:
        """The plugin started a new peak: nothing from before counts."""
        self.allocated = self.reserved = self.own_reserved = 0

    def keep(self, allocated: int, reserved: int | None, own_reserved: int | None = None) -> None:
        """The backend's peaks right before a test's code resets them (already the higher of
        what was kept and what it read)."""
        self.allocated = allocated
        self.reserved = reserved or 0
        self.own_reserved = own_reserved or 0

    # Spelled out, without max(): these run at every read of a peak.

    def peak_allocated(self, read: int) -> int:
        return read if read > self.allocated else self.allocated

    def peak_reserved(self, read: int | None) -> int | None:
        if read is None:
            return None
        return read if read > self.reserved else self.reserved

    def own_peak_reserved(self, read: int | None) -> int | None:
        if read is None:
            return None
        return read if read > self.own_reserved else self.own_reserved
