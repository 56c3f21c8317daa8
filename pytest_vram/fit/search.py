"""The largest integer a monotone test accepts: exponential steps up, then bisection.

Pure: it knows nothing of memory, so the search is checked against a brute-force scan without
a device (tests/test_max_size.py).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["NoAnswer", "Unbounded", "largest"]


class NoAnswer(Exception):
    """The search cannot answer honestly; the message says why, and what to change."""


class Unbounded(NoAnswer):
    """Without ``hi``, ``fits`` held up to ``size``, the ceiling: it may hold for every size."""

    def __init__(self, size: int) -> None:
        super().__init__(f"fits at every size up to {size}")
        self.size = size


def largest(
    fits: Callable[[int], bool],
    lo: int = 1,
    hi: int | None = None,
    *,
    ceiling: int | None = None,
) -> int:
    """The largest ``n`` in ``[lo, hi]`` for which ``fits(n)`` holds, or ``lo - 1`` when
    ``fits(lo)`` does not.

    ``fits`` must hold up to some value and not after it (memory grows with ``n``). It is
    called about ``2 * log2(answer / lo)`` times: ``lo``, then doubling until it fails or
    ``hi`` is reached, then halving the gap between the last value that fit and the first
    that did not. ``hi=None`` means no upper bound but ``ceiling``: the doubling goes no
    higher, and raises :class:`Unbounded` when ``fits(ceiling)`` holds.
    """
    if lo < 1:
        raise ValueError(f"lo must be at least 1, got {lo}")
    if hi is not None and hi < lo:
        raise ValueError(f"hi must be at least lo ({lo}), got {hi}")
    if not fits(lo):
        return lo - 1
    top = hi if hi is not None else ceiling
    good, bad = lo, None
    while bad is None:
        if good == hi:
            return good
        if top is not None and good >= top:
            raise Unbounded(good)
        n = 2 * good if top is None else min(2 * good, top)
        if fits(n):
            good = n
        else:
            bad = n
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good
